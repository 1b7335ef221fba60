"""The decoding core's speed at two commits, on one GPU in one run: the command line's `Generator`
(decode at batches 1, 8 and 64, a 4k prompt's time to first token) and the serving engine (every
request of a 1k/1k workload at once), each commit in a process of its own, one after the other.

    python bench/one_core.py --base DIR [--part generator|engine|both] [--experts mxfp4] [--json FILE]

DIR holds the other commit's package (`git archive COMMIT gptoss_jax | tar -x -C DIR`). Each
process builds full-size synthetic weights (gptoss_jax.testing), compiles outside the timings, and
measures:
- generator: decode tokens/s (tokens after each sequence's first / the time they took, summed over
  the batch) of --prompt-token prompts and --new tokens, the median of --runs generations after an
  untimed one; the time to first token of one --prefill-token prompt, the best of --runs;
- engine: --requests requests of --prompt-1k tokens asking for --new-1k each, all at once into an
  engine of as many slots (prompts prefilled 8 at a time in chunks of 512): output tokens/s over the
  run (first arrival to last token), the best of --engine-runs after a warm-up request.
The last lines are a table: each figure at both commits and the change.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure(args) -> dict:
    """This process's figures, for the package found first on sys.path."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")  # 256 slots' pool beside the weights
    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.serving import Engine, Settings
    from gptoss_jax.testing import random_params_on_device
    try:  # the package's layout at either commit
        from gptoss_jax.decoding.generator import Generator
        from gptoss_jax.serving import EngineConfig

        def engine_of(config, params, **options):
            return Engine(config, params, EngineConfig(**options))
    except ImportError:
        from gptoss_jax.generate import Generator

        def engine_of(config, params, **options):
            return Engine(config, params, **options)

    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(
        config, seed=0, dtype="mxfp4" if args.experts == "mxfp4" else "bfloat16"))
    greedy = Sampling(temperature=0.0)
    rng = np.random.default_rng(0)
    out = {"package": os.path.dirname(gj.__file__), "device": jax.devices()[0].device_kind, "jax": jax.__version__}

    if args.part in ("generator", "both"):
        gen = Generator(config, params, max_len=max(args.prompt + args.new, args.prefill + 1))
        for B in map(int, args.batches.split(",")):
            prompts = [rng.integers(0, config.vocab_size, args.prompt).tolist() for _ in range(B)]
            gen.generate(prompts, max_new_tokens=args.new, sampling=greedy)  # compiles
            rates = [sum(r.timings["decode_tokens_per_s"] for r in gen.generate(prompts, max_new_tokens=args.new,
                                                                                sampling=greedy))
                     for _ in range(args.runs)]
            out[f"decode tok/s, batch {B}"] = statistics.median(rates)
            print(out, file=sys.stderr, flush=True)
        prompt = [rng.integers(0, config.vocab_size, args.prefill).tolist()]
        gen.generate(prompt, max_new_tokens=1, sampling=greedy)
        out[f"TTFT ms, {args.prefill}-token prompt"] = min(
            1e3 * gen.generate(prompt, max_new_tokens=1, sampling=greedy)[0].timings["time_to_first_token_s"]
            for _ in range(args.runs))
        del gen

    if args.part in ("engine", "both"):
        c = args.requests
        engine = engine_of(config, params, slots=c, max_len=args.prompt_1k + args.new_1k, prefill_chunk=512,
                           prefill_rows=8, max_waiting=c, prefix_reuse=False)
        engine.warm_up()
        engine.submit(list(range(16)), Settings(max_new_tokens=4))
        engine.run_until_idle()
        engine.start()
        rates = []
        for _ in range(args.engine_runs):
            prompts = [rng.integers(0, config.vocab_size, args.prompt_1k).tolist() for _ in range(c)]
            start = time.perf_counter()
            requests = [engine.submit(p, Settings(max_new_tokens=args.new_1k, sampling=greedy)) for p in prompts]
            for r in requests:
                r.result()
            last = max(r.token_times[-1] for r in requests)
            rates.append(sum(len(r.output_ids) for r in requests) / (last - start))
            print(rates, file=sys.stderr, flush=True)
        engine.stop()
        out[f"engine output tok/s, {c} x {args.prompt_1k}/{args.new_1k}"] = max(rates)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the other commit's package folder (holding gptoss_jax/)")
    p.add_argument("--part", default="both", choices=("generator", "engine", "both"))
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--experts", default="mxfp4", choices=("bf16", "mxfp4"))
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--prefill", type=int, default=4096)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-1k", type=int, default=1024)
    p.add_argument("--new-1k", type=int, default=1024)
    p.add_argument("--engine-runs", type=int, default=2)
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--only", action="store_true", help=argparse.SUPPRESS)  # a child: measure, print JSON
    args = p.parse_args()
    if args.only:
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
             if name not in ("base", "json", "only")]
    rows = {}
    for name, tree in (("base", args.base), ("this", ROOT)):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.path.abspath(tree),
                                                                          os.environ.get("PYTHONPATH")]))}
        run = subprocess.run([sys.executable, os.path.abspath(__file__), *flags, "--only"], env=env, cwd=tree,
                             stdout=subprocess.PIPE, text=True, check=True)
        rows[name] = json.loads(next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))[7:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{rows['this']['device']}, {args.preset}, {args.experts} experts, jax {rows['this']['jax']}")
    print("| figure | base | this | change |")
    print("|---|---:|---:|---:|")
    for key in [k for k in rows["this"] if k not in ("package", "device", "jax")]:
        a, b = rows["base"][key], rows["this"][key]
        print(f"| {key} | {a:,.1f} | {b:,.1f} | {100 * (b / a - 1):+.1f}% |")


if __name__ == "__main__":
    main()
