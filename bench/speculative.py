"""Speculative decoding on one GPU, synthetic full-size weights: what verifying costs, the oracle
draft's speed, and the speedups that published acceptance lengths would give. Prints tables last.

1. Verify cost: one checked step over k + 1 positions (speculative.check_step: the model, the
   greedy acceptance and the cache's roll-back) against the same step over one position (a decode
   step), at each of --batches, for k in --ks, with 128 tokens cached: milliseconds per call.
2. The oracle draft at batch 1: the model's own greedy reply, computed first, proposed back (k =
   --oracle-k): decode tokens/s against plain decoding (8 steps a call). Synthetic bf16 weights
   put near-ties in the logits, so a pass over k + 1 positions can pick otherwise than one position
   at a time: the accepted share is printed beside it.
3. Projection: at a mean acceptance length tau (tokens a step gives, the bonus token included, as
   EAGLE and SGLang count it; --tau), speedup = tau x decode step / (verify step at k + draft cost),
   the draft cost estimated as k one-layer steps (an EAGLE-3 head is one decoder layer): k x decode
   step / layers.

    python bench/speculative.py --preset gpt-oss-20b --batches 1,8,64 --ks 1,2,3,4,6,8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="model preset (gpt-oss-20b, gpt-oss-120b; tiny to try)")
    ap.add_argument("--dtype", default="mxfp4", choices=["mxfp4", "bfloat16", "float32"])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes for the verify cost")
    ap.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated drafted tokens per step")
    ap.add_argument("--oracle-k", type=int, default=3, help="drafted tokens per step with the oracle draft")
    ap.add_argument("--tau", default="2.3,2.4,3.2", help="acceptance lengths to project the speedup at")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per verify-cost cell (median)")
    args = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.cache import init_cache
    from gptoss_jax.generate import Generator
    from gptoss_jax.model import extend
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.speculative import check_step
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.dtype))
    dtype = params["embedding"].dtype
    kernels, greedy = gj.Kernels(), Sampling(temperature=0)
    device = jax.devices()[0].device_kind
    print(f"{args.preset} ({args.dtype}) on {device}, jax {jax.__version__}", flush=True)
    batches, ks = [int(b) for b in args.batches.split(",")], [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)

    cost: dict[tuple[int, int], float] = {}  # (batch, k) -> ms per call; k = 0: the decode step
    for b in batches:
        prompt = rng.integers(0, config.vocab_size, (b, 128))
        for k in [0] + ks:
            _, cache = extend(config, params, prompt, init_cache(config, b, 128 + (args.calls + 2) * (k + 1), dtype),
                              kernels=kernels)
            tokens = jnp.asarray(rng.integers(0, config.vocab_size, (b, k + 1)), jnp.int32)
            valid = jnp.ones((b, k + 1), bool)
            times = []
            for i in range(args.calls + 1):  # the first compiles
                start = time.perf_counter()
                out = check_step(config, kernels, None, greedy, (), params, tokens, valid, cache, jnp.int32(0), jnp.int32(i))
                cache = jax.block_until_ready(out)[2]
                times.append(time.perf_counter() - start)
            cost[b, k] = 1e3 * statistics.median(times[1:])
            print(f"batch {b}, k {k}: {cost[b, k]:.2f} ms a step", flush=True)
            del cache

    # The oracle draft at batch 1.
    new = 128
    prompt = rng.integers(0, config.vocab_size, 128).tolist()
    gen = Generator(config, params, max_len=128 + new + 16, kernels=kernels)
    gen.generate([prompt], max_new_tokens=new, sampling=greedy)  # compiles
    plain = gen.generate([prompt], max_new_tokens=new, sampling=greedy)[0]
    reply = plain.output_ids

    def oracle(context, k):
        return reply[len(context) - len(prompt):][:k]

    gen.generate([prompt], max_new_tokens=new, sampling=greedy, draft=oracle, draft_tokens=args.oracle_k)  # compiles
    drafted = gen.generate([prompt], max_new_tokens=new, sampling=greedy, draft=oracle, draft_tokens=args.oracle_k)[0]
    plain_rate, oracle_rate = plain.timings["decode_tokens_per_s"], drafted.timings["decode_tokens_per_s"]
    share = drafted.timings["accepted_tokens"] / max(drafted.timings["drafted_tokens"], 1)

    print(f"\n{args.preset} ({args.dtype}), {device}: verify cost, ms a step (k = 0: a decode step)")
    print("| batch | " + " | ".join(f"k = {k}" for k in [0] + ks) + " |\n|---|" + "---:|" * (len(ks) + 1))
    for b in batches:
        print(f"| {b} | " + " | ".join(f"{cost[b, k]:.2f} ({cost[b, k] / cost[b, 0]:.2f}x)" for k in [0] + ks) + " |")
    print(f"\noracle draft, batch 1, k = {args.oracle_k}: {oracle_rate:.1f} tokens/s against {plain_rate:.1f} plain "
          f"({oracle_rate / plain_rate:.2f}x); {share:.0%} of drafted tokens accepted")
    taus = [float(t) for t in args.tau.split(",")]
    print("\nprojected speedup (tau x decode / (verify at k + k one-layer draft steps)), best k per cell")
    print("| batch | " + " | ".join(f"tau {t}" for t in taus) + " |\n|---|" + "---:|" * len(taus))
    projections = {}
    for b in batches:
        cells = []
        for t in taus:
            best = max(((t * cost[b, 0] / (cost[b, k] + k * cost[b, 0] / config.num_hidden_layers), k)
                        for k in ks if k + 1 >= t), default=(float("nan"), 0))
            projections[f"b{b}_tau{t}"] = best
            cells.append(f"{best[0]:.2f}x (k = {best[1]})")
        print(f"| {b} | " + " | ".join(cells) + " |")
    print(json.dumps({"cost_ms": {f"b{b}_k{k}": v for (b, k), v in cost.items()}, "plain": plain_rate,
                      "oracle": oracle_rate, "accepted_share": share, "projections": projections}))


if __name__ == "__main__":
    main()
