"""Decode tokens/s of several kernel choices on one set of synthetic full-size weights (MXFP4
experts, or bf16 with --dtype bfloat16), one process, one GPU: each variant a `Generator` of its own, compiled and run once, then
timed as the median of 3 greedy generations of 32 tokens after a 128-token prompt; beside each rate,
the kernels its decode step launches (bench/step_kernels.py). Prints a table last. (docs/benchmarks.md, "Decode over MXFP4 experts: what "auto" picks".)

    python bench/decode_variants.py --preset gpt-oss-20b --batches 1,4,8,16 \\
        auto= triton=moe=triton "mosaic@4/8=moe=mosaic_pair"

A variant is NAME[@B1/B2...]=FIELD=VALUE;FIELD=VALUE...: a name for the table, the batches it runs
at (all of --batches if none), and `Kernels` fields (values as in bench/generate_20b.py --kernels),
or `steps`: the decode steps per jitted call (`Generator(decode_steps=)`, 8 unless given).
Greedy tokens are not compared across variants: with synthetic weights in bfloat16 the logits of
two kernels' rounding part at the first near-tie (tests/test_gpu.py checks each kernel against the
jnp path instead).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing


def variant(spec: str):
    import gptoss_jax as gj
    from generate_20b import _field

    name, _, fields = spec.partition("=")
    name, _, only = name.partition("@")
    batches = {int(b) for b in only.split("/")} if only else None
    settings = dict(f.split("=", 1) for f in fields.split(";") if f)
    steps = int(settings.pop("steps", 8))
    kernels = gj.Kernels(**{k: _field(v) for k, v in settings.items()})
    return name, batches, kernels, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="model preset (gpt-oss-20b, gpt-oss-120b)")
    ap.add_argument("--batches", default="1,8", help="comma-separated decode batch sizes")
    ap.add_argument("--dtype", default="mxfp4", choices=["mxfp4", "bfloat16"],
                    help="the weights: bfloat16 with MXFP4-packed experts (mxfp4), or all bfloat16")
    ap.add_argument("variants", nargs="+", help="NAME[@B1/B2]=FIELD=VALUE;... (see above)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.decoding.generator import Generator, batch_timings
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params_on_device
    from step_kernels import kernels_per_step

    variants = [variant(v) for v in args.variants]
    batches = [int(b) for b in args.batches.split(",")]
    config = gj.ModelConfig.preset(args.preset)
    start = time.perf_counter()
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.dtype))
    print(f"{args.preset} ({args.dtype}): weights in {time.perf_counter() - start:.0f} s on {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}", flush=True)
    greedy = Sampling(temperature=0)
    rng = np.random.default_rng(0)
    rates: dict[tuple[int, str], float | str] = {}
    launches: dict[tuple[int, str], int | None] = {}
    for b in batches:
        prompts = [rng.integers(0, config.vocab_size, 128).tolist() for _ in range(b)]
        for name, only, kernels, steps in variants:
            if only and b not in only:
                continue
            gen = Generator(config, params, max_len=128 + 32 + 16, kernels=kernels, decode_steps=steps)
            try:
                gen.generate(prompts, max_new_tokens=32, sampling=greedy)  # compiles
                launches[b, name] = kernels_per_step(gen.executables)
                runs = sorted(batch_timings(gen.generate(prompts, max_new_tokens=32, sampling=greedy))
                              ["decode_tokens_per_s"] for _ in range(3))
                rates[b, name] = runs[1]
                print(f"batch {b} {name}: {runs[1]:.1f} tokens/s (runs {[round(float(r), 1) for r in runs]}), "
                      f"{launches[b, name]} kernels a step", flush=True)
            except jax.errors.JaxRuntimeError as e:
                rates[b, name] = f"failed: {str(e)[:200]}"
                print(f"batch {b} {name}: {rates[b, name]}", flush=True)
            finally:
                del gen
    names = [name for name, *_ in variants]
    print(f"\n| {args.preset}, batch | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for b in batches:
        cells = [rates.get((b, n), "-") for n in names]
        print(f"| {b} | " + " | ".join(f"{c:,.1f}" if isinstance(c, float) else c for c in cells) + " |")
    print("\n| kernels a decode step, batch | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names))
    for b in batches:
        print(f"| {b} | " + " | ".join(str(launches.get((b, n), "-")) for n in names) + " |")
    print(json.dumps({f"b{b}_{n}": r for (b, n), r in rates.items()}))
    print(json.dumps({f"kernels_b{b}_{n}": k for (b, n), k in launches.items()}))


if __name__ == "__main__":
    main()
