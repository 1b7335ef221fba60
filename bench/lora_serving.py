"""Serving many LoRA adapters over full-size gpt-oss-20b (synthetic weights, MXFP4 experts) on one GPU:
the engine's output tokens/s with requests spread over a table of served adapters, beside the same
engine's base model alone, in one process.

    python bench/lora_serving.py [--preset gpt-oss-20b] [--concurrency 64,256] [--adapters 8] [--rank 16]
        [--prompt 1024] [--new 1024] [--experts-new 256] [--experts-concurrency 64] [--json FILE]

Configurations, each an engine of max(--concurrency) slots (compiled and warmed up first, then one
request end to end outside the timings):
- base: no table of adapters;
- attention: a table of --adapters adapters of rank --rank on the attention's q, k, v and output
  projections, request i under adapter i mod --adapters;
- experts: the same adapters also on both expert matrices (the experts then run on the jnp paths),
  at --experts-concurrency with --experts-new new tokens (that path is much slower);
then base again (drift). Every concurrency c: c requests of --prompt random token ids, all at once,
each asking for exactly --new tokens (greedy, no stop). The adapters' weights are random (their
values do not change the work). A table ends with each row's figure against the base's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from serve_20b import summary, workload  # noqa: E402  (the 1k/1k bench's prompts and rates)


def random_table(params, key):
    """Every table of served adapters in params filled with small random values."""
    import jax

    out, n = dict(params), 0
    for layer, modules in params.items():
        if not isinstance(modules, dict):
            continue
        for module, weights in modules.items():
            if not isinstance(weights, dict):
                continue
            for name, held in weights.items():
                if name.endswith("_lora"):
                    n += 1
                    out[layer] = dict(out[layer])
                    out[layer][module] = dict(out[layer][module], **{name: {
                        part: (0.01 * jax.random.normal(jax.random.fold_in(key, 2 * n + i), x.shape)).astype(x.dtype)
                        for i, (part, x) in enumerate(held.items())}})
    return out


def run(args) -> dict:
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    import jax

    import gptoss_jax as gj
    from gptoss_jax.serving import Engine, EngineConfig, Settings
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params_on_device
    from gptoss_jax.training.lora import empty_table

    config = gj.ModelConfig.preset(args.preset)
    base = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.dtype))
    greedy = Sampling(temperature=0.0)
    slots = max(args.concurrency + args.experts_concurrency)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "prompt": args.prompt, "runs": []}
    wide = [(c, args.new) for c in args.concurrency]
    narrow = [(c, args.experts_new) for c in args.experts_concurrency]
    plans = [("base", None, wide + narrow), ("attention", ("attention",), wide),
             ("experts", ("attention", "experts"), narrow), ("base again", None, wide)]
    for name, targets, shapes in plans:
        if not shapes:
            continue
        params = base if targets is None else random_table(
            empty_table(config, base, args.adapters, args.rank, targets), jax.random.key(1))
        engine = Engine(config, params, EngineConfig(slots=slots, max_len=args.prompt + max(args.new, args.experts_new),
                                                     max_waiting=slots, prefix_reuse=False,
                                                     kv_memory=int(args.kv_gib * 2**30)))
        t = time.perf_counter()
        engine.warm_up()
        warm = time.perf_counter() - t
        engine.submit(workload(config.vocab_size, 1, "all", args)[0][0], Settings(max_new_tokens=4))
        engine.run_until_idle()
        engine.start()
        for c, new in shapes:
            prompts, _ = workload(config.vocab_size, c, "all", args)
            submitted, requests = [], []
            for i, p in enumerate(prompts):
                adapter = None if targets is None else i % args.adapters
                submitted.append(time.perf_counter())
                requests.append(engine.submit(p, Settings(max_new_tokens=new, sampling=greedy, adapter=adapter)))
            for r in requests:
                r.result(timeout=3600)
            s = summary([len(p) for p in prompts], submitted, [r.token_times for r in requests])
            row = {"config": name, "concurrency": c, "new": new, "warm_up_s": warm, **s}
            results["runs"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        engine.stop()
        del engine, params
        gc.collect()
    return results


def table(results: dict) -> str:
    base = {(r["concurrency"], r["new"]): r["output_tokens_per_s"] for r in results["runs"] if r["config"] == "base"}
    # (each row against the first base run of its shape; "base again" shows the drift over the run)
    lines = [f"{results['device']}, jax {results['jax']}",
             "| config | requests | prompt/new | output tok/s | of base | TTFT p50 ms | ITL p50 ms |", "|---|---|---|---|---|---|---|"]
    for r in results["runs"]:
        ref = base.get((r["concurrency"], r["new"]))
        share = f"{r['output_tokens_per_s'] / ref:.0%}" if ref else "-"
        lines.append(f"| {r['config']} | {r['concurrency']} | {results['prompt']}/{r['new']} | {r['output_tokens_per_s']:,.0f} | "
                     f"{share} | {r['ttft_p50_ms']:,.0f} | {r['itl_p50_ms']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--dtype", default="mxfp4", help="mxfp4 (experts packed, as published) or bfloat16")
    p.add_argument("--concurrency", default="64,256", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--experts-concurrency", default="64", type=lambda s: [int(x) for x in s.split(",") if x])
    p.add_argument("--adapters", type=int, default=8)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new", type=int, default=1024)
    p.add_argument("--experts-new", type=int, default=256)
    p.add_argument("--kv-gib", type=float, default=40.0)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(table(results))


if __name__ == "__main__":
    main()
