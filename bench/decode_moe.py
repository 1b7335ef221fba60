"""GPU time of the decode MoE over MXFP4 experts, kernel by kernel: L layers' MoE blocks chained
(x = x + moe(x), as in the model), each variant profiled, its kernels' times summed per pass.

    python bench/decode_moe.py [--preset gpt-oss-20b] [--layers 8] [--tokens 1,8]
        [--settings '{"up": {"num_warps": 8}}' ...]

Variants: the per-pair path (kernels/triton/mxfp4.py's matvec with XLA's router, bias and SwiGLU
between) and the fused kernels (kernels/triton/decode_moe.py) with their defaults, then each --settings
(a JSON object of keyword arguments for `route`, `up` and `down`). Each variant's output is
compared with the per-pair path's (relative to its largest value). Host-timed medians of a jitted
call hide what matters here (launch costs equal kernel times at batch 1), hence the profiler.
`--preset tiny --interpret` is a dry run on CPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", default="1,8", help="tokens per step (batch), comma-separated")
    ap.add_argument("--settings", action="append", default=[], metavar="JSON",
                    help='a variant of the fused kernels\' settings, e.g. \'{"down": {"block_f": 4}}\'')
    ap.add_argument("--passes", type=int, default=10, help="profiled passes per variant")
    ap.add_argument("--interpret", action="store_true", help="Pallas interpret mode (a dry run on CPU)")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.kernels.triton import decode_moe
    from gptoss_jax.model.moe import MLPBlock
    from gptoss_jax.testing import random_params_on_device
    from profile_summary import gpu_kernels, load

    config = gj.ModelConfig.preset(args.preset)
    params = random_params_on_device(config.replace(num_hidden_layers=args.layers), seed=0, dtype="mxfp4")
    mlps = [params[f"block_{i}"]["mlp"] for i in range(args.layers)]
    variants = [("per-pair path", None), ("fused, defaults", {})]
    variants += [(f"fused, {s}", json.loads(s)) for s in args.settings]
    class PerPair(gj.Kernels):  # the Triton per-pair products, the fused block turned off
        def fused_moe(self, *args, **kwargs):
            return None

    per_pair = PerPair(moe="triton", interpret=args.interpret)

    def chain(settings):
        def run(ps, x):  # x [1, N, D]
            for p in ps:
                if settings is None:
                    x = x + MLPBlock(config, kernels=per_pair).apply({"params": p}, x)
                else:
                    y = decode_moe.moe(x[0], p["norm"]["scale"], p, k=config.experts_per_token,
                                       eps=config.rms_norm_eps, alpha=config.swiglu_alpha,
                                       limit=config.swiglu_limit, interpret=args.interpret, settings=settings)
                    x = x + y.astype(x.dtype)[None]
            return x
        return jax.jit(run)

    rows = []
    for n in (int(t) for t in args.tokens.split(",")):
        x = jax.random.normal(jax.random.key(n), (1, n, config.hidden_size), jnp.float32).astype(jnp.bfloat16)
        reference = None
        for name, settings in variants:
            f = chain(settings)
            out = np.asarray(jax.block_until_ready(f(mlps, x)), np.float32)
            reference = out if reference is None else reference
            diff = float(np.abs(out - reference).max() / np.abs(reference).max())
            times = collections.Counter()
            if jax.default_backend() == "gpu":
                with tempfile.TemporaryDirectory() as folder:
                    with jax.profiler.trace(folder, create_perfetto_trace=True):
                        for _ in range(args.passes):
                            jax.block_until_ready(f(mlps, x))
                    for e in gpu_kernels(load(folder)):
                        kind = e["name"] if e["name"].startswith("gptoss_") else "XLA kernels"
                        times[kind] += e["dur"] / 1e3 / args.passes
            rows.append((n, name, sum(times.values()), diff, times))
            print(rows[-1][:4], flush=True)
    print(f"\n{args.layers} layers of {args.preset}'s MoE, chained; GPU time per pass (ms):\n")
    print("| tokens | variant | GPU ms | vs per-pair path | kernels (ms) |\n|---:|---|---:|---:|---|")
    for n, name, total, diff, times in rows:
        detail = ", ".join(f"{k} {v:.3f}" for k, v in times.most_common())
        print(f"| {n} | {name} | {total:.3f} | {diff:.1e} | {detail} |")


if __name__ == "__main__":
    main()
