"""Serving full-size gpt-oss-20b (synthetic weights) on one GPU under traffic shaped like real use, on
the paged KV cache: multi-turn agents that resend a shared system prompt and their whole history,
long and mixed contexts at the model's full context, and 1k/1k at high concurrency.

    python bench/traffic_20b.py [--experts bf16] [--parts agents,long,uniform] [--uniform 256,512,1024]
        [--long 64,256] [--conversations 64] [--turns 8] [--system 2000] [--page-size 64] [--json FILE]
    python bench/traffic_20b.py --peer [--conversations 64] ...   # the agents on transformers, alone

- agents: `--conversations` conversations arriving as a Poisson process over `--window` seconds, all
  starting with the same `--system`-token system prompt (an agent's instructions and tool
  definitions); `--turns` turns each: a user message of 100-300 tokens, a reply of exactly 200-400
  tokens (greedy, no stop), each turn sending the whole conversation so far. Run with prefix reuse
  on and off (Engine(prefix_reuse=...)): output tokens/s, time to first token p50/p99 over every
  turn, and the share of prompt tokens found in the cache.
- long: at max context 131,072, c requests at once with prompt lengths log-normal (median 2,000,
  capped at 100,000) and replies of 200-1,000 tokens: output tokens/s and the sequences running at
  once (sampled every 50 ms), against the same engine allowed only the sequences a static cache of
  [slots, 131,072] would hold in the same memory (the pool's positions / 131,072).
- uniform: c requests of 1,024 random prompt tokens and 1,024 new tokens each, all at once (and, with
  `--logprobs-share`, again with that share of them asking for log-probabilities; with
  `--constrained-share`, again with that share of them constrained to the server's grammar for a JSON
  schema's answer, then one request alone without and with that grammar: the time per token at
  concurrency 1). A constrained request ends where its grammar does (stopping at <|return|>).
- `--peer`: the agents workload (the same requests) on transformers' continuous batching with its
  paged cache and prefix block sharing, in a process of its own (bench/peer.py's model).

Token ids are random (the same for every run, by seed); every figure comes from the engine's own
request timings (Request.token_times). One process, one GPU; each engine is warmed up first.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_20b import summary, workload  # noqa: E402  (the 1k/1k bench's prompts, rates and percentiles)

def agents_workload(vocab: int, args):
    """(system prompt, per conversation: arrival time, [(user message, reply length)] per turn)."""
    rng = np.random.default_rng(7)
    system = rng.integers(0, vocab, args.system).tolist()
    gaps = rng.exponential(args.window / args.conversations, args.conversations)
    arrivals = np.cumsum(gaps) - gaps[0]
    turns = [[(rng.integers(0, vocab, int(rng.integers(100, 301))).tolist(), int(rng.integers(200, 401)))
              for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, arrivals, turns


def run_agents(engine, config, args, Settings, greedy) -> dict:
    system, arrivals, turns = agents_workload(config.vocab_size, args)
    done = []  # (prompt length, submitted, token times)
    lock = threading.Lock()
    t0 = time.perf_counter()

    def conversation(i):
        time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        history = list(system)
        for user, reply in turns[i]:
            history += user
            submitted = time.perf_counter()
            request = engine.submit(history, Settings(max_new_tokens=reply, sampling=greedy))
            request.result()
            with lock:
                done.append((len(history), submitted, request.token_times))
            history += request.output_ids

    before = engine.stats()
    threads = [threading.Thread(target=conversation, args=(i,)) for i in range(len(turns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = engine.stats()
    s = summary([d[0] for d in done], [d[1] for d in done], [d[2] for d in done])
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_prompt_tokens"] - before["cached_prompt_tokens"]
    s.update(prompt_tokens=prompt, cached_share=cached / prompt,
             preemptions=after["preemptions"] - before["preemptions"])
    return s


def run_agents_peer(args) -> dict:
    """The agents workload on the peer: transformers' continuous batching (its paged cache shares
    blocks of a common prefix between requests, `allow_block_sharing`), in a process of its own."""
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    from peer import build

    model, cfg, dev, sync = build(args.preset)
    model.eval()
    system, arrivals, turns = agents_workload(cfg.vocab_size, args)
    longest = args.system + args.turns * (300 + 400)
    gen_config = GenerationConfig(max_new_tokens=400, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(max_blocks_per_request=-(-longest // 256), max_batch_tokens=args.peer_batch_tokens,
                                  max_memory_percent=args.peer_memory)
    done, lock, futures = [], threading.Lock(), {}
    out = {"framework": f"transformers {transformers.__version__} continuous batching, torch {torch.__version__}",
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "runs": {}}
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb, block=True, timeout=30) as manager:
        stop = threading.Event()

        def collect():  # every finished result to the conversation that waits for it
            while not stop.is_set():
                r = manager.get_result(timeout=1)
                if r is not None and r.is_finished():
                    futures[r.request_id].set_result(r)
                if not manager.is_running():  # its loop died (out of memory, ...): fail, don't wait
                    for f in list(futures.values()):
                        if not f.done():
                            f.set_exception(RuntimeError("transformers' continuous batching stopped"))
                    return

        def conversation(i):
            time.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
            history = list(system)
            for turn, (user, reply) in enumerate(turns[i]):
                history += user
                key = f"{i}-{turn}"
                with lock:
                    futures[key] = Future()
                submitted = time.perf_counter()
                manager.add_request(list(history), request_id=key, max_new_tokens=reply, record_timestamps=True)
                r = futures[key].result(timeout=1800)
                if r.error:
                    raise RuntimeError(r.error)
                assert len(r.generated_tokens) == reply, (len(r.generated_tokens), reply)
                with lock:
                    done.append((len(history), submitted, r.timestamps))
                history += list(r.generated_tokens)

        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        try:
            futures["warm"] = Future()  # the first steps' paths, untimed
            manager.add_request(list(range(16)), request_id="warm", max_new_tokens=4)
            futures["warm"].result(timeout=600)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(turns)) as pool:
                list(pool.map(conversation, range(len(turns))))
        finally:
            stop.set()
            collector.join()
    s = summary([d[0] for d in done], [d[1] for d in done], [d[2] for d in done])
    s.update(prompt_tokens=sum(d[0] for d in done))
    out["runs"]["agents, transformers continuous batching"] = s
    return out


def long_workload(vocab: int, c: int, context: int):
    rng = np.random.default_rng(100 + c)
    replies = rng.integers(200, 1001, c)
    lengths = np.minimum(rng.lognormal(np.log(2000), 1.0, c).astype(int) + 1, min(100_000, context - 1_000))
    return [rng.integers(0, vocab, n).tolist() for n in lengths], [int(r) for r in replies]


# The answer's schema of the constrained requests: the server's grammar for it (structured.py) leaves the
# reasoning free (at most a quarter of the reply), then forces the final channel and compact JSON.
SCHEMA = {"type": "object", "properties": {"notes": {"type": "string"}}, "required": ["notes"],
          "additionalProperties": False}
RETURN, CALL = 200002, 200012  # <|return|>, <|call|>: where the server stops a reply


def every(share: float, i: int) -> bool:
    """Whether request i is among `share` of them, evenly spread."""
    return int((i + 1) * share) > int(i * share)


def run_batch(engine, prompts, replies, Settings, greedy, logprobs_share: float = 0.0,
              constrained_share: float = 0.0) -> dict:
    """Every request at once; the sequences running at once sampled every 50 ms. `logprobs_share`: that
    share of the requests (evenly spread) ask for log-probabilities with 5 alternatives;
    `constrained_share`: that share follow the server's grammar for SCHEMA's answer."""
    running, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.05):
            running.append(engine.stats()["running"])

    sampler = threading.Thread(target=sample)
    sampler.start()
    submitted, requests = [], []
    grammar = None
    if constrained_share:
        from gptoss_jax.server.structured import reply_grammar
        grammar = reply_grammar(answer=SCHEMA, tools=[], budget=max(replies))
    constrained = [every(constrained_share, i) for i in range(len(prompts))]
    for i, (p, n) in enumerate(zip(prompts, replies)):
        submitted.append(time.perf_counter())
        requests.append(engine.submit(p, Settings(
            max_new_tokens=n, sampling=greedy, logprobs=5 if every(logprobs_share, i) else None,
            **(dict(grammar=grammar, stop_ids=(RETURN, CALL)) if constrained[i] else {}))))
    for r in requests:
        r.result()
    stop.set()
    sampler.join()
    assert all(len(r.output_ids) == n or c for r, n, c in zip(requests, replies, constrained))
    assert all(r.finish_reason in ("length", "stop") for r in requests), {r.finish_reason for r in requests}
    s = summary([len(p) for p in prompts], submitted, [r.token_times for r in requests])
    s.update(running_max=max(running, default=0), running_mean=float(np.mean(running)) if running else 0.0,
             preemptions=engine.stats()["preemptions"])
    if any(constrained):
        mine = [i for i, c in enumerate(constrained) if c]
        c = summary([len(prompts[i]) for i in mine], [submitted[i] for i in mine], [requests[i].token_times
                                                                                      for i in mine])
        s.update(constrained=len(mine), constrained_tokens=sum(len(requests[i].output_ids) for i in mine),
                 constrained_itl_p50_ms=c["itl_p50_ms"], constrained_itl_p99_ms=c["itl_p99_ms"],
                 constrained_finished={r: sum(requests[i].finish_reason == r for i in mine) for r in ("length", "stop")})
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--experts", default="bf16", choices=("bf16", "mxfp4"))
    parser.add_argument("--parts", default="agents,long,uniform")
    parser.add_argument("--conversations", type=int, default=64)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--system", type=int, default=2000, help="shared system prompt tokens (agents)")
    parser.add_argument("--window", type=float, default=20.0, help="agents: conversations arrive over this many s")
    parser.add_argument("--reuse", default="on,off", help="agents: prefix reuse on, off or both")
    parser.add_argument("--agent-slots", type=int, default=64, help="agents: the engine's slots")
    parser.add_argument("--long", default="64,256", help="long: concurrencies")
    parser.add_argument("--uniform", default="256,512,1024",
                        help="uniform 1k/1k: concurrencies; 'default': the slots the engine takes by default from "
                             "its pool's size (as gptoss-serve without --slots), that many requests")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-dtype", default="bf16",
                        help="the KV cache's storage, bf16 or fp8, or both (bf16,fp8): every part run with each, in turn")
    parser.add_argument("--logprobs-share", type=float, default=0.0,
                        help="uniform: also run each concurrency with this share of the requests asking for "
                             "log-probabilities (5 alternatives), on the same engine")
    parser.add_argument("--constrained-share", type=float, default=0.0,
                        help="uniform: also run each concurrency with this share of the requests constrained to "
                             "a JSON schema's grammar, and one request alone without and with it (the time per "
                             "constrained token at concurrency 1); needs llguidance and the tokenizer")
    parser.add_argument("--prefill", default="8x512", help="ROWSxCHUNK: prompts prefilled together x tokens each")
    parser.add_argument("--one-decode-size", action="store_true",
                        help="compile the decode step for all the slots only (a shorter warm-up; fewer slots in "
                             "use then decode in a step of every slot)")
    parser.add_argument("--peer", action="store_true",
                        help="run the agents workload on the peer (transformers' continuous batching) instead, "
                             "alone in this process (run it after the engine's, not beside it: each takes the GPU)")
    parser.add_argument("--peer-batch-tokens", type=int, default=1024, help="transformers' max_batch_tokens")
    parser.add_argument("--peer-memory", type=float, default=0.6, help="transformers' max_memory_percent (its cache)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    rows, chunk = (int(x) for x in args.prefill.split("x"))
    parts = args.parts.split(",")

    if args.peer:
        out = run_agents_peer(args)
        print_results(out, args)
        return
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    import jax

    import gptoss_jax as gj
    from gptoss_jax import fp8
    from gptoss_jax.model.paged_cache import pool_pages
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.serving import Engine, EngineConfig, Settings
    from gptoss_jax.serving.scheduler import slots_for
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(
        config, seed=0, dtype="mxfp4" if args.experts == "mxfp4" else "bfloat16"))
    kernels = gj.Kernels()
    greedy = Sampling(temperature=0.0)
    out = {"framework": f"gptoss-jax ({args.experts} experts), jax {jax.__version__}",
           "device": jax.devices()[0].device_kind, "kernels": kernels.describe(packed=args.experts == "mxfp4"),
           "runs": {}}

    tokenizer = None
    if args.constrained_share:
        from gptoss_jax.tokenizer import load_tokenizer
        tokenizer = load_tokenizer()

    def engine_for(slots, max_len, sizes=(), **kw):
        """An engine of `slots` sequences; None: as many as it takes by default from its pool's size
        (as gptoss-serve without --slots), found here as the engine finds them (engine.py), since the
        compiled decode sizes name them."""
        t = time.perf_counter()
        if slots is None:
            dtype = fp8.cache_dtype(kv_dtype, params["embedding"].dtype)
            slots = slots_for(pool_pages(config, args.page_size, dtype, None) * args.page_size)
        engine = Engine(config, params,
                        EngineConfig(slots=slots, max_len=max_len, prefill_chunk=chunk, prefill_rows=min(rows, slots),
                                     max_waiting=100_000, page_size=args.page_size, kv_dtype=kv_dtype,
                                     decode_sizes=(*sizes, slots) if args.one_decode_size else None, **kw),
                        tokenizer=tokenizer, kernels=kernels)
        engine.warm_up()
        engine.submit(list(range(16)), Settings(max_new_tokens=4))  # the first steps' host paths, untimed
        engine.run_until_idle()
        engine.start()
        print(f"engine: {slots} slots, {engine.scheduler.pages.count} pages ({engine.pool_tokens:,} positions) "
              f"in {kv_dtype}, "
              f"warm-up {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return engine

    def close(engine):
        engine.stop()
        engine.device.release()  # the pool's memory back before the next engine sizes its own
        gc.collect()

    def record(name, s):
        name = f"{name}, {kv_dtype} cache" if "," in args.kv_dtype else name
        out["runs"][name] = s
        print(f"{name}: {json.dumps(s)}", file=sys.stderr, flush=True)

    for kv_dtype in args.kv_dtype.split(","):
        if "agents" in parts:
            for reuse in (r == "on" for r in args.reuse.split(",")):
                engine = engine_for(args.agent_slots, min(32_768, config.max_context_length), prefix_reuse=reuse)
                record(f"agents, reuse {'on' if reuse else 'off'}", run_agents(engine, config, args, Settings, greedy))
                close(engine)
        if "uniform" in parts:
            for given in (None if x == "default" else int(x) for x in args.uniform.split(",")):
                engine = engine_for(given, 2048, sizes=(1,) if args.constrained_share else ())
                c = engine.slots
                prompts = workload(config.vocab_size, c, "all", argparse.Namespace(prompt=1024))[0]  # serve_20b.py's

                def fresh(k):  # the prompts of the engine's k-th run: none of them in its cache from the runs before
                    return [[(t + k) % config.vocab_size for t in p] for p in prompts]

                record(f"uniform 1k/1k, c={c}{'' if given else ' (the default slots)'}",
                       run_batch(engine, prompts, [1024] * c, Settings, greedy))
                if args.logprobs_share:
                    record(f"uniform 1k/1k, c={c}, {args.logprobs_share:.0%} with logprobs",
                           run_batch(engine, fresh(1), [1024] * c, Settings, greedy, args.logprobs_share))
                if args.constrained_share:
                    record(f"uniform 1k/1k, c={c}, {args.constrained_share:.0%} constrained",
                           run_batch(engine, fresh(2), [1024] * c, Settings, greedy, constrained_share=args.constrained_share))
                    for k, share in ((3, 0.0), (4, 1.0)):  # one request alone: time per token without and with the grammar
                        record(f"1k/1k alone{', constrained' if share else ''}",
                               run_batch(engine, fresh(k)[:1], [1024], Settings, greedy, constrained_share=share))
                close(engine)
        context = config.max_context_length  # 131,072 for gpt-oss
        if "long" in parts:
            for c in (int(x) for x in args.long.split(",")):
                prompts, replies = long_workload(config.vocab_size, c, context)
                engine = engine_for(c, context)
                record(f"long, c={c}, paged", run_batch(engine, prompts, replies, Settings, greedy))
                static = max(1, engine.pool_tokens // context)  # what [slots, 131072] holds in the same memory
                close(engine)
                engine = engine_for(static, context)
                record(f"long, c={c}, {static} sequences (a static cache's)", run_batch(engine, prompts, replies, Settings,
                                                                                         greedy))
                close(engine)
    out["peak_gib"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30
    print_results(out, args)


def print_results(out: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    f = lambda x, d=0: "-" if x is None else f"{x:,.{d}f}"  # noqa: E731
    print("| run | output tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | cached share | running max / mean | "
          "preemptions |\n|---|---:|---:|---:|---:|---:|---:|")
    for name, s in out["runs"].items():
        print(f"| {name} | {f(s['output_tokens_per_s'])} | {f(s['ttft_p50_ms'])} / {f(s['ttft_p99_ms'])} | "
              f"{f(s['itl_p50_ms'], 2)} / {f(s['itl_p99_ms'], 2)} | {f(s.get('cached_share'), 3)} | "
              f"{s.get('running_max', '-')} / {f(s.get('running_mean'), 1)} | {s.get('preemptions', 0)} |")
    for name, s in out["runs"].items():
        if s.get("constrained"):
            print(f"{name}: {s['constrained']} constrained requests, {s['constrained_tokens']:,} tokens "
                  f"(finished {s['constrained_finished']}), ITL p50 / p99 {f(s['constrained_itl_p50_ms'], 2)} / "
                  f"{f(s['constrained_itl_p99_ms'], 2)} ms")


if __name__ == "__main__":
    main()
