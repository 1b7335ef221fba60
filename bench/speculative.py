"""Speculative decoding on one GPU, synthetic full-size weights: what verifying costs, the oracle
draft's speed, and the speedups that published acceptance lengths would give. Prints tables last.

1. Verify cost: one checked step over k + 1 positions (decoding/checked.py, drafts given: the model,
   the greedy acceptance and the cache's roll-back) against the same step over one position (a decode
   step), at each of --batches, for k in --ks, with 128 tokens cached (in a cache of the same length
   for every k of a batch): milliseconds per call, the median of --calls. Every cell is compiled
   first, --compile-threads at a time (ahead of time; compilation is not timed).
2. The oracle draft at each of --batches: the model's own greedy reply, computed first, proposed back (k =
   --oracle-k, drafted on the devices): decode tokens/s against plain decoding (8 steps a call), the median of
   --repeats generations (batch 1's rate varies from one generation to the next). Random weights put
   near-ties in every step's logits, so a pass over k + 1 positions picks otherwise than one
   position at a time and the reply parts from the oracle's at its first step (none accepted
   after). The oracle therefore runs over `conditioned` weights: the same shapes, kernels and costs,
   with the embedding scaled up and the unembedding a permutation of it, so that each greedy token
   follows from the last by a wide margin (the accepted share is printed beside it). Prompt lookup (the draft that needs no
   weights) on the same random prompt is timed too: what it costs where it rarely finds a draft.
   --peer: Hugging Face transformers on the same GPU in a process of its own, first (alone on the
   GPU, before this process starts JAX), the same preset with random bf16 weights: greedy batch-1
   decode plainly and with its prompt lookup (`prompt_lookup_num_tokens` = --oracle-k) on a random
   prompt of the same length.
   --eagle3: an EAGLE-3 head too, random, of the published gpt-oss heads' shape, run as it would be
   (its cache filled at the prefill, k drafts a step from the captured states), proposing the
   oracle's tokens in its place (`steered_head`): the machinery's speed with the head's cost paid.
3. Projection: at a mean acceptance length tau (tokens a step gives, the bonus token included, as
   EAGLE and SGLang count it; --tau), speedup = tau x decode step / (verify step at k + draft cost):
   from the oracle's step, without a draft's cost (the machinery's ceiling), and with --eagle3 from
   the steered head's measured step (the head's cost in it: the projection for a real head). An
   EAGLE-3 head of gpt-oss's published shape reads about 566 MB a pass (a 17,280-wide dense MLP and
   a 32,000-token LM head), so it costs far more than a layer of the target, which reads 4 experts.

    python bench/speculative.py --preset gpt-oss-20b --batches 1,8,64 --ks 1,2,3,4,5,6,7,8 --peer
"""

from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

from gptoss_jax.drafts.base import DeviceDraft, Proposal  # noqa: E402  (the checkout's package, above)
sys.path.insert(0, os.path.join(ROOT, "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="gpt-oss-20b", help="model preset (gpt-oss-20b, gpt-oss-120b; tiny to try)")
    ap.add_argument("--dtype", default="mxfp4", choices=["mxfp4", "bfloat16", "float32"])
    ap.add_argument("--batches", default="1,8,64", help="comma-separated batch sizes for the verify cost")
    ap.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated drafted tokens per step")
    ap.add_argument("--oracle-k", default="3", help="comma-separated drafted tokens per step with the oracle draft "
                                                     "and prompt lookup")
    ap.add_argument("--skip-verify", action="store_true", help="no verify-cost table")
    ap.add_argument("--tau", default="2.3,2.4,3.2", help="acceptance lengths to project the speedup at")
    ap.add_argument("--calls", type=int, default=20, help="timed calls per verify-cost cell (median)")
    ap.add_argument("--compile-threads", type=int, default=8, help="cells compiled at a time before the timings")
    ap.add_argument("--new", type=int, default=128, help="new tokens per batch-1 generation")
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per line (their median)")
    ap.add_argument("--eagle3", action="store_true", help="also the steered EAGLE-3 head (see above)")
    ap.add_argument("--peer", action="store_true", help="also time transformers' batch-1 decode (see above)")
    ap.add_argument("--kernels", default="",
                    help="gj.Kernels fields, e.g. moe=mosaic_pair,moe_pair_max_pairs=64 (as generate_20b.py's)")
    ap.add_argument("--moe-settings", default="",
                    help="a JSON object of settings for the fused Triton decode MoE (kernels/triton/decode_moe.py's moe, "
                         "as bench/decode_moe.py's --settings), in place of its defaults")
    ap.add_argument("--drafts", default="oracle,prompt-lookup", help="the drafts timed beside plain decoding: "
                                                                     "oracle, and prompt-lookup (--eagle3 adds the head)")
    ap.add_argument("--only-peer", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.only_peer:
        return run_peer(args)
    wanted = args.drafts.split(",")
    if "oracle" not in wanted or not set(wanted) <= {"oracle", "prompt-lookup"}:
        ap.error(f"--drafts takes oracle and optionally prompt-lookup (the projections need the oracle), not "
                 f"{args.drafts!r}")
    peer = None
    if args.peer:  # first, alone on the GPU, and so measured even where a time limit stops the run later
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--only-peer"], capture_output=True, text=True,
                              cwd=ROOT)
        peer = (json.loads(proc.stdout.split("RESULT ")[-1]) if proc.returncode == 0
                else f"exit {proc.returncode}: {proc.stderr[-600:]}")
        print(f"peer: {json.dumps(peer)}", flush=True)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.model.cache import init_cache
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.model.transformer import extend
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.decoding.checked import CheckedSteps, Plan, checked_steps, row_settings
    from gptoss_jax.decoding.steps import Model
    from gptoss_jax.drafts.base import GIVEN
    from gptoss_jax.drafts.prompt_lookup import PromptLookup
    from gptoss_jax.testing import random_params_on_device

    if args.moe_settings:  # the fused block's settings for every call that traces it in this process
        import functools

        from gptoss_jax.kernels.triton import decode_moe
        decode_moe.moe = functools.partial(decode_moe.moe, settings=json.loads(args.moe_settings))
    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.dtype))
    dtype = params["embedding"].dtype
    from generate_20b import kernels_from

    kernels, greedy = kernels_from(args.kernels), Sampling(temperature=0)
    device = jax.devices()[0].device_kind
    print(f"{args.preset} ({args.dtype}) on {device}, jax {jax.__version__}"
          + (f", fused decode MoE settings {args.moe_settings}" if args.moe_settings else ""), flush=True)
    batches, ks = [int(b) for b in args.batches.split(",")], [int(k) for k in args.ks.split(",")]
    rng = np.random.default_rng(0)

    cost: dict[tuple[int, int], float] = {}  # (batch, k) -> ms per call; k = 0: the decode step
    cells, compiled = [] if args.skip_verify else [(b, k) for b in batches for k in [0] + ks], {}
    prompts, inputs = {}, {}

    def prefilled(b):  # 128 tokens cached, room for every call of every k
        return extend(config, params, prompts[b], init_cache(config, b, 128 + (args.calls + 2) * (max(ks) + 1), dtype),
                      kernels=kernels)[1]

    shapes = {}
    for b in [] if args.skip_verify else batches:
        prompts[b] = rng.integers(0, config.vocab_size, (b, 128))
        shapes[b] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), prefilled(b))
        for k in [0] + ks:  # (the step's arguments but the cache: plan, drafts, its latest tokens)
            plan = np.stack([np.arange(b), np.full(b, 128), np.full(b, 2**30), np.zeros(b), np.zeros(b), np.zeros(b)])
            inputs[b, k] = (jnp.zeros(b, jnp.int32),
                            Plan(jnp.asarray(plan, jnp.int32), jnp.asarray([1, 0, 0], jnp.int32),
                                 tuple(map(jnp.asarray, row_settings(greedy, 0, b)))),
                            {"drafts": jnp.asarray(rng.integers(0, config.vocab_size, (b, k)), jnp.int32),
                             "counts": jnp.full((b,), k, jnp.int32)})

    def compile_cell(cell):
        b, k = cell
        last, plan, drafts = inputs[cell]
        spec = CheckedSteps(Model(config, kernels), GIVEN, k, most=1)
        return cell, checked_steps.lower(spec, params, shapes[b], None, last, plan, drafts).compile()

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(args.compile_threads) as pool:
        compiled = dict(pool.map(compile_cell, cells))
    print(f"compiled {len(cells)} cells in {time.perf_counter() - start:.0f} s", flush=True)
    for b, k in cells:
        cache, times = prefilled(b), []
        for i in range(args.calls + 1):  # the first warms up
            last, plan, drafts = inputs[b, k]
            plan = jax.block_until_ready(plan._replace(rows=plan.rows.at[1].set(cache["lengths"])))
            start = time.perf_counter()
            out = compiled[b, k](params, cache, None, last, plan, drafts)
            cache = jax.block_until_ready(out)[1]
            times.append(time.perf_counter() - start)
        cost[b, k] = 1e3 * statistics.median(times[1:])
        print(f"batch {b}, k {k}: {cost[b, k]:.2f} ms a step", flush=True)
    compiled.clear()

    # The oracle and prompt lookup at each batch, over conditioned weights (see above), drafted on the
    # devices (several checked steps a call, as plain decoding runs several steps a call).
    new, params = args.new, conditioned(params)
    oracle_ks = [int(k) for k in args.oracle_k.split(",")]
    rates: dict = {}  # (batch, draft, k) -> decode tokens/s over the batch; (batch, "plain", 0) without drafts
    accepted: dict = {}
    for b in batches:
        prompts = [rng.integers(0, config.vocab_size, 128).tolist() for _ in range(b)]
        gen = Generator(config, params, max_len=128 + new + 16, kernels=kernels)

        def run(gen=gen, **kw):  # the median of --repeats generations, after one that compiles
            gen.generate(prompts, max_new_tokens=new, sampling=greedy, **kw)
            runs = [gen.generate(prompts, max_new_tokens=new, sampling=greedy, **kw) for _ in range(args.repeats)]
            each = [sum(r.timings["decode_tokens_per_s"] for r in results) for results in runs]
            return runs[each.index(statistics.median_high(each))], statistics.median_high(each)

        plain, rates[b, "plain", 0] = run()
        full = tuple(tuple(p + r.output_ids) for p, r in zip(prompts, plain))
        drafts = [(name, draft) for name, draft in (("oracle", Replies(full)), ("prompt lookup", PromptLookup()))
                  if name.replace(" ", "-") in wanted]
        if args.eagle3:
            drafts.append(("EAGLE-3 steered", steered_head(config, dtype, full)))
        for k in oracle_ks:
            for name, draft in drafts:
                results, rates[b, name, k] = run(draft=draft, draft_tokens=k)
                accepted[b, name, k] = (sum(r.timings["accepted_tokens"] for r in results),
                                        sum(r.timings["drafted_tokens"] for r in results))
                print(f"batch {b}, {name}, k {k}: {rates[b, name, k]:.1f} tokens/s ({rates[b, 'plain', 0]:.1f} plain), "
                      f"{accepted[b, name, k][0]} of {accepted[b, name, k][1]} drafted tokens accepted", flush=True)
        del gen

    if cost:
        print(f"\n{args.preset} ({args.dtype}), {device}: verify cost, ms a call waited for (k = 0: one position)")
        print("| batch | " + " | ".join(f"k = {k}" for k in [0] + ks) + " |\n|---|" + "---:|" * (len(ks) + 1))
        for b in batches:
            print(f"| {b} | " + " | ".join(f"{cost[b, k]:.2f} ({cost[b, k] / cost[b, 0]:.2f}x)" for k in [0] + ks) + " |")
    print(f"\n{args.preset} ({args.dtype}), {device}: decode tokens/s over the batch, {new} new tokens, drafts on the "
          "devices (accepted of drafted)")
    names = [n for n in ("oracle", "prompt lookup", "EAGLE-3 steered") if (batches[0], n, oracle_ks[0]) in rates]
    print("| batch | plain | " + " | ".join(f"{n}, k = {k}" for k in oracle_ks for n in names)
          + " |\n|---|---:|" + "---:|" * len(names) * len(oracle_ks))
    for b in batches:
        cells = [f"{rates[b, n, k]:.1f} ({rates[b, n, k] / rates[b, 'plain', 0]:.2f}x; {accepted[b, n, k][0]} of "
                 f"{accepted[b, n, k][1]})" for k in oracle_ks for n in names]
        print(f"| {b} | {rates[b, 'plain', 0]:.1f} | " + " | ".join(cells) + " |")
    if peer is not None:
        print(f"peer: {json.dumps(peer)}")
    # A step of the oracle at k, every draft accepted, gives k + 1 tokens a sequence: its cost is
    # batch x (k + 1) / rate. At a mean acceptance length tau, a step gives tau tokens, so the speedup
    # is tau x (plain decode step) / (the step + the draft's cost): without a draft's cost (the
    # oracle's step), the machinery's ceiling; with the steered head's step, the head's cost in it.
    taus = [float(t) for t in args.tau.split(",")]
    print("\nceiling of the speedup at acceptance length tau (the oracle's step: no draft cost), best k per cell")
    print("| batch | " + " | ".join(f"tau {t}" for t in taus) + " |\n|---|" + "---:|" * len(taus))
    projections = {}
    for b in batches:
        decode = b / rates[b, "plain", 0]
        cells = []
        for t in taus:
            best = max(((t * decode / (b * (k + 1) / rates[b, "oracle", k]), k)
                        for k in oracle_ks if k + 1 >= t), default=(float("nan"), 0))
            projections[f"b{b}_tau{t}"] = best
            cells.append(f"{best[0]:.2f}x (k = {best[1]})")
        print(f"| {b} | " + " | ".join(cells) + " |")
    if args.eagle3:  # the step's cost measured with the head's own steps in it
        print("\nprojected speedup at acceptance length tau (from the steered EAGLE-3 head's step cost), best k per cell")
        print("| batch | " + " | ".join(f"tau {t}" for t in taus) + " |\n|---|" + "---:|" * len(taus))
        for b in batches:
            decode, cells = b / rates[b, "plain", 0], []
            for t in taus:
                best = max(((t * decode / (b * (k + 1) / rates[b, "EAGLE-3 steered", k]), k)
                            for k in oracle_ks if k + 1 >= t), default=(float("nan"), 0))
                projections[f"b{b}_tau{t}_eagle3"] = best
                cells.append(f"{best[0]:.2f}x (k = {best[1]})")
            print(f"| {b} | " + " | ".join(cells) + " |")
    print(json.dumps({"cost_ms": {f"b{b}_k{k}": v for (b, k), v in cost.items()},
                      "rates": {f"b{b}_{n}_k{k}": v for (b, n, k), v in rates.items()},
                      "accepted": {f"b{b}_{n}_k{k}": v for (b, n, k), v in accepted.items()},
                      "projections": projections, "peer": peer}))


@dataclasses.dataclass(frozen=True)
class Replies(DeviceDraft):
    """The oracle draft: what follows in each sequence's `full` (its prompt and greedy reply, computed
    first) at the context's length; proposed on the devices (`propose`)."""

    full: tuple  # of tuples of token ids, one a sequence

    def __call__(self, context, k):  # the host form (a row found by its prompt)
        row = next(f for f in self.full if list(f[:len(context)]) == list(context))
        return list(row[len(context):len(context) + k])

    def propose(self, context, k):
        import jax.numpy as jnp

        lengths = context.lengths
        width = max(map(len, self.full))
        full = jnp.asarray([list(f) + [0] * (width - len(f)) for f in self.full], jnp.int32)
        at = jnp.clip(lengths[:, None] + jnp.arange(k)[None], 0, width - 1)
        ends = jnp.asarray([len(f) for f in self.full])
        return Proposal(jnp.take_along_axis(full, at, axis=1), jnp.clip(ends - lengths, 0, k))


def steered_head(config, dtype, full: tuple):
    """A random EAGLE-3 head of the published gpt-oss heads' shape (for presets other than the gpt-oss
    ones, one scaled to the model), run as it would be (its cache filled at the prefill, k drafts a
    step, the committed pairs), but proposing the oracle's tokens (`full`, as `Replies`) in place of
    its own: every draft accepted, the head's whole cost paid."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from gptoss_jax.model.eagle3 import Eagle3Head, init_head_cache
    from gptoss_jax.eagle3_config import Eagle3Config
    from gptoss_jax.drafts.eagle3 import Eagle3Draft

    L, D = config.num_hidden_layers, config.hidden_size
    shape = {} if D == 2880 else dict(hidden_size=D, intermediate_size=3 * D, head_dim=config.head_dim,
                                      num_attention_heads=config.num_attention_heads,
                                      num_key_value_heads=config.num_key_value_heads)
    head = Eagle3Config(**shape, vocab_size=config.vocab_size, draft_vocab_size=min(32000, config.vocab_size),
                        target_hidden_size=D, aux_layers=(1, L // 2 - 1, L - 4) if L > 4 else (0, 1, 2))
    states = jnp.zeros((1, 1, len(head.aux_layers) * D), dtype)
    params = Eagle3Head(head, param_dtype=dtype).init(jax.random.key(1), jnp.zeros((1, 1, D), dtype), states,
                                                      init_head_cache(head, 1, 8, dtype), jnp.ones((1, 1), bool))
    hot = jnp.asarray(np.sort(np.random.default_rng(1).choice(config.vocab_size, head.draft_vocab_size, replace=False)))
    oracle = Replies(full)

    @dataclasses.dataclass(frozen=True, eq=False)
    class Steered(Eagle3Draft):
        def propose(self, context, k):
            own, n, after = super().propose(context, k)
            drafts = oracle.propose(context, k).drafts  # (context.lengths: the tokens x_0 .. x_n)
            return Proposal(jnp.where(own >= 0, drafts, own), n, after)  # (the head's drafts are computed)

    return Steered(head, params, hot)


def conditioned(params: dict, seed: int = 0) -> dict:
    """The same weights with the embedding scaled by 50 and the unembedding a permutation of it:
    the residual stream is then the last token's embedding, nearly, and the greedy token is the
    permutation's image of the last by a wide margin, whatever rounding the path takes. Same
    shapes and dtypes, so the same kernels and costs."""
    import jax.numpy as jnp
    import numpy as np

    embedding = params["embedding"]
    perm = jnp.asarray(np.random.default_rng(seed).permutation(embedding.shape[0]))
    return dict(params, embedding=(embedding.astype(jnp.float32) * 50).astype(embedding.dtype),
                unembedding=embedding[perm].T.astype(params["unembedding"].dtype))


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
        out["prompt_lookup_tokens_per_s"] = rate(args.new, prompt_lookup_num_tokens=int(args.oracle_k.split(",")[0]))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
