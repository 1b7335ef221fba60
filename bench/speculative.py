"""Speculative decoding on one GPU, synthetic full-size weights: what verifying costs, the oracle
draft's speed, and the speedups that published acceptance lengths would give. Prints tables last.

1. Verify cost: one checked step over k + 1 positions (speculative.check_step: the model, the
   greedy acceptance and the cache's roll-back) against the same step over one position (a decode
   step), at each of --batches, for k in --ks, with 128 tokens cached (in a cache of the same length
   for every k of a batch): milliseconds per call, the median of --calls. Every cell is compiled
   first, --compile-threads at a time (ahead of time; compilation is not timed).
2. The oracle draft at batch 1: the model's own greedy reply, computed first, proposed back (k =
   --oracle-k): decode tokens/s against plain decoding (8 steps a call). Synthetic bf16 weights
   put near-ties in the logits, so a pass over k + 1 positions can pick otherwise than one position
   at a time: the accepted share is printed beside it. Prompt lookup (the draft that needs no
   weights) on the same random prompt is timed too: what it costs where it rarely finds a draft.
   --peer: Hugging Face transformers on the same GPU in a process of its own, the same preset with
   random bf16 weights: greedy batch-1 decode plainly and with its prompt lookup
   (`prompt_lookup_num_tokens` = --oracle-k) on a random prompt of the same length.
3. Projection: at a mean acceptance length tau (tokens a step gives, the bonus token included, as
   EAGLE and SGLang count it; --tau), speedup = tau x decode step / (verify step at k + draft cost),
   the draft cost estimated as k one-layer steps (an EAGLE-3 head is one decoder layer): k x decode
   step / layers.

    python bench/speculative.py --preset gpt-oss-20b --batches 1,8,64 --ks 1,2,3,4,5,6,7,8 --peer
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="model preset (gpt-oss-20b, gpt-oss-120b; tiny to try)")
    ap.add_argument("--dtype", default="mxfp4", choices=["mxfp4", "bfloat16", "float32"])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes for the verify cost")
    ap.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated drafted tokens per step")
    ap.add_argument("--oracle-k", type=int, default=3, help="drafted tokens per step with the oracle draft")
    ap.add_argument("--tau", default="2.3,2.4,3.2", help="acceptance lengths to project the speedup at")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per verify-cost cell (median)")
    ap.add_argument("--compile-threads", type=int, default=8, help="cells compiled at a time before the timings")
    ap.add_argument("--new", type=int, default=128, help="new tokens per batch-1 generation")
    ap.add_argument("--peer", action="store_true", help="also time transformers' batch-1 decode (see above)")
    ap.add_argument("--only-peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only_peer:
        return run_peer(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.cache import init_cache
    from gptoss_jax.generate import Generator
    from gptoss_jax.model import extend
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.speculative import PromptLookup, check_step
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
    cells, compiled = [(b, k) for b in batches for k in [0] + ks], {}
    prompts, inputs = {}, {}

    def prefilled(b):  # 128 tokens cached, room for every call of every k
        return extend(config, params, prompts[b], init_cache(config, b, 128 + (args.calls + 2) * (max(ks) + 1), dtype),
                      kernels=kernels)[1]

    shapes = {}
    for b in batches:
        prompts[b] = rng.integers(0, config.vocab_size, (b, 128))
        shapes[b] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), prefilled(b))
        for k in [0] + ks:
            inputs[b, k] = (jnp.asarray(rng.integers(0, config.vocab_size, (b, k + 1)), jnp.int32),
                            jnp.ones((b, k + 1), bool))

    def compile_cell(cell):
        b, k = cell
        return cell, check_step.lower(config, kernels, None, greedy, params, *inputs[cell], shapes[b], jnp.int32(0),
                                      jnp.int32(0)).compile()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = dict(pool.map(compile_cell, cells))
    print(f"compiled {len(cells)} cells in {time.perf_counter() - start:.0f} s", flush=True)
    for b, k in cells:
        cache, times = prefilled(b), []
        for i in range(args.calls + 1):  # the first warms up
            start = time.perf_counter()
            out = compiled[b, k](params, *inputs[b, k], cache, jnp.int32(0), jnp.int32(i))
            cache = jax.block_until_ready(out)[2]
            times.append(time.perf_counter() - start)
        cost[b, k] = 1e3 * statistics.median(times[1:])
        print(f"batch {b}, k {k}: {cost[b, k]:.2f} ms a step", flush=True)
    del cache, compiled

    # The oracle draft at batch 1.
    new = args.new
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
    lookup = PromptLookup()
    gen.generate([prompt], max_new_tokens=new, sampling=greedy, draft=lookup, draft_tokens=args.oracle_k)  # compiles
    looked = gen.generate([prompt], max_new_tokens=new, sampling=greedy, draft=lookup, draft_tokens=args.oracle_k)[0]
    lookup_rate = looked.timings["decode_tokens_per_s"]
    peer = None
    if args.peer:
        del gen, params
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only-peer"], capture_output=True, text=True,
                              cwd=ROOT)
        peer = (json.loads(proc.stdout.split("RESULT ")[-1]) if proc.returncode == 0
                else f"exit {proc.returncode}: {proc.stderr[-600:]}")

    print(f"\n{args.preset} ({args.dtype}), {device}: verify cost, ms a step (k = 0: a decode step)")
    print("| batch | " + " | ".join(f"k = {k}" for k in [0] + ks) + " |\n|---|" + "---:|" * (len(ks) + 1))
    for b in batches:
        print(f"| {b} | " + " | ".join(f"{cost[b, k]:.2f} ({cost[b, k] / cost[b, 0]:.2f}x)" for k in [0] + ks) + " |")
    print(f"\noracle draft, batch 1, k = {args.oracle_k}: {oracle_rate:.1f} tokens/s against {plain_rate:.1f} plain "
          f"({oracle_rate / plain_rate:.2f}x); {share:.0%} of drafted tokens accepted")
    print(f"prompt lookup, batch 1, k = {args.oracle_k}, random prompt: {lookup_rate:.1f} tokens/s "
          f"({lookup_rate / plain_rate:.2f}x plain); {looked.timings['accepted_tokens']} of "
          f"{looked.timings['drafted_tokens']} drafted tokens accepted")
    if peer is not None:
        print(f"peer: {json.dumps(peer)}")
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
                      "oracle": oracle_rate, "accepted_share": share, "prompt_lookup": lookup_rate,
                      "lookup_accepted": [looked.timings["accepted_tokens"], looked.timings["drafted_tokens"]],
                      "projections": projections, "peer": peer}))


def run_peer(args) -> None:
    """transformers' batch-1 greedy decode, plain and with its prompt lookup; prints RESULT {json}."""
    import torch
    from peer import build

    model, cfg, dev, sync = build(args.preset)
    model.eval()
    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (1, 128), device=dev, generator=g)
    out = {"peer": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}"}

    def rate(n, **kw):  # tokens after the first a second, as gptoss-jax's decode rate counts them
        def run(m):
            sync()
            t = time.perf_counter()
            model.generate(ids, max_new_tokens=m, min_new_tokens=m, do_sample=False, **kw)
            sync()
            return time.perf_counter() - t
        run(4)
        return (n - 1) / (run(n) - run(1))

    with torch.no_grad():
        out["plain_tokens_per_s"] = rate(args.new)
        out["prompt_lookup_tokens_per_s"] = rate(args.new, prompt_lookup_num_tokens=args.oracle_k)
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
