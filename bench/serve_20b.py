"""Serving speed of full-size gpt-oss-20b (synthetic weights) on one GPU: the continuous-batching
engine (gptoss_jax.serving.Engine) against Hugging Face transformers' continuous batching
(ContinuousBatchingManager) on the same GPU in the same run, on the same requests.

    python bench/serve_20b.py [--experts bf16,mxfp4] [--concurrency 1,16,64,256] [--arrivals all,poisson]
        [--prompt 1024] [--new 1024] [--prefill 8x512] [--skip-peer] [--skip-jax] [--profile DIR]

For each concurrency c: c requests of `--prompt` random token ids each (the same ids for both), each
asking for exactly `--new` tokens (greedy, no stop token), into an engine of c slots;
- all: every request arrives at once;
- poisson: arrivals as a Poisson process of c / `--window` requests a second (the first at 0).
Per run: output tokens/s and total (prompt + output) tokens/s over the run (first arrival to last
token), time to first token (arrival to first token) and inter-token latency (the gaps between a
request's successive tokens as its client gets them), p50 and p99 over all requests. Peak memory:
the process's peak on the GPU so far. Each configuration is warmed up first (compilation, CUDA
graphs) outside the timed runs. The engine's "CLI batch 1" row is `Generator` (what the command
line runs) decoding one request of the same shape: the reference for the inter-token latency at
concurrency 1. `--prefill ROWSxCHUNK,...` runs the engine once per prompt-prefill shape (prompts
prefilled together x tokens of each per step).

Each framework runs in a process of its own, one after the other, each alone on the GPU.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import weakref

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing
sys.path.insert(0, os.path.join(ROOT, "bench"))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # server_util: the app on a free port, on a thread


def workload(vocab: int, c: int, arrivals: str, args) -> tuple[list[list[int]], np.ndarray]:
    """The c prompts and their arrival times in seconds (the same for every framework)."""
    rng = np.random.default_rng(1000 + c)
    prompts = [rng.integers(0, vocab, args.prompt).tolist() for _ in range(c)]
    if arrivals == "all":
        return prompts, np.zeros(c)
    gaps = np.random.default_rng(2000 + c).exponential(args.window / c, c)
    return prompts, np.cumsum(gaps) - gaps[0]


def summary(prompt_lens, submitted, token_times) -> dict:
    """Rates and latency percentiles of one run from each request's submit time and token times."""
    start = min(submitted)
    end = max(t[-1] for t in token_times)
    output = sum(len(t) for t in token_times)
    ttft = np.array([t[0] - s for s, t in zip(submitted, token_times)])
    itl = np.concatenate([np.diff(t) for t in token_times if len(t) > 1] or [np.zeros(0)])
    p = lambda x, q: float(np.percentile(x, q) * 1e3) if len(x) else None  # noqa: E731
    return {"requests": len(token_times), "seconds": end - start, "output_tokens": output,
            "output_tokens_per_s": output / (end - start),
            "total_tokens_per_s": (output + sum(prompt_lens)) / (end - start),
            "ttft_p50_ms": p(ttft, 50), "ttft_p99_ms": p(ttft, 99), "itl_p50_ms": p(itl, 50), "itl_p99_ms": p(itl, 99),
            "itl_mean_ms": float(itl.mean() * 1e3) if len(itl) else None}


def drive(submit, prompts, at) -> list[float]:
    """Call submit(i) for each request at its arrival time (seconds after now); -> submit times."""
    t0 = time.perf_counter()
    submitted = [0.0] * len(prompts)
    for i in np.argsort(at, kind="stable"):
        delay = t0 + at[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submitted[i] = time.perf_counter()
        submit(i)
    return submitted


def run_jax(args) -> dict:
    # The KV cache of 256 slots and the bf16 weights take more than JAX's default 75% of the GPU.
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.94")
    import jax

    import gptoss_jax as gj
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.serving import Engine, EngineConfig, Settings
    from gptoss_jax.drafts.prompt_lookup import PromptLookup
    from gptoss_jax.testing import KnownReplies, random_params_on_device

    config = gj.ModelConfig.preset(args.preset)
    dtype = "mxfp4" if args.experts == "mxfp4" else "bfloat16"
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=dtype))
    if args.conditioned:
        from speculative import conditioned
        params = conditioned(params)
    kernels = gj.Kernels()
    out = {"framework": f"gptoss-jax ({args.experts} experts), jax {jax.__version__}",
           "device": jax.devices()[0].device_kind, "kernels": kernels.describe(packed=dtype == "mxfp4"), "runs": {}}
    peak = lambda: (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30  # noqa: E731
    max_len = args.prompt + args.new

    # The command line's batch-1 decode on the same request shape.
    prompt = workload(config.vocab_size, 1, "all", args)[0]
    gen = Generator(config, params, max_len=max_len)
    greedy = Sampling(temperature=0.0)
    gen.generate(prompt, max_new_tokens=args.new, sampling=greedy)
    r = gen.generate(prompt, max_new_tokens=args.new, sampling=greedy)[0]
    out["cli_batch1"] = {"itl_mean_ms": 1e3 / r.timings["decode_tokens_per_s"],
                         "ttft_ms": 1e3 * r.timings["time_to_first_token_s"]}
    cli_tokens = r.output_ids
    del gen
    # The same with the prompt prefilled in the engine's chunks: where the greedy tokens part from
    # the command line's, is it the chunking's rounding (then these agree with the engine's)?
    gen = Generator(config, params, max_len=max_len, prefill_chunk=args.prefill[0][1])
    chunked_tokens = gen.generate(prompt, max_new_tokens=args.new, sampling=greedy)[0].output_ids
    out["cli_chunked_tokens_equal_to_cli"] = _agree(cli_tokens, chunked_tokens)
    del gen
    print(f"CLI batch 1: {out['cli_batch1']}", file=sys.stderr, flush=True)

    for c, shape in [(c, shape) for c in args.concurrency for shape in args.prefill]:
        rows, chunk = min(shape[0], c), shape[1]
        replies = {}  # the oracle draft's: each prompt's greedy reply without speculation
        # Drafted on the devices; the oracle's replies are an argument of its steps: these stand in (of
        # their shape) for the warm-up, the run without speculation's replace them.
        drafts = {"oracle": KnownReplies([[0] * args.prompt] * c, [[0] * args.new] * c, config.vocab_size,
                                         by_position=True),
                  "prompt-lookup": PromptLookup()}
        speculating = [d for d in args.draft if d != "none"]

        def source(draft):  # NAME@host: the same source as a plain callable, so drafted on the host
            base = drafts[draft.removesuffix("@host")]
            return (lambda context, k: base(context, k)) if draft.endswith("@host") else base
        reuse = len(args.draft) == 1  # several runs send the same prompts: a later one would find them cached
        engine = Engine(config, params,
                        EngineConfig(slots=c, max_len=max_len, prefill_chunk=chunk, prefill_rows=rows, max_waiting=c,
                                     draft_tokens=args.draft_tokens, speculate_rows=args.speculate_rows or c,
                                     speculate_steps=args.speculate_steps, prefix_reuse=reuse,
                                     kv_memory=int(args.kv_gib * 2 ** 30) if args.kv_gib else None),
                        kernels=kernels, draft=source(speculating[0]) if speculating else None)
        speculation = engine.speculation
        t = time.perf_counter()
        engine.warm_up()
        for draft in speculating[1:]:  # each draft's checked steps (the first's are the engine's)
            speculation.use(source(draft))
            speculation.warm_up(engine)
        warm = time.perf_counter() - t
        # One request end to end, outside the timings (the first steps' host paths).
        engine.submit(prompt[0], Settings(max_new_tokens=4))
        engine.run_until_idle()
        engine.start()
        for arrivals, draft in [(a, d) for a in args.arrivals for d in args.draft]:
            # Speculation is switched per run over one engine (compiled once): off, or this draft.
            engine.speculation = None if draft == "none" else speculation
            if draft != "none":
                speculation.use(source(draft))
            before = engine.metrics.snapshot()
            prompts, at = workload(config.vocab_size, c, arrivals, args)
            requests = [None] * c
            settings = Settings(max_new_tokens=args.new, sampling=greedy)

            def submit(i, engine=engine):
                requests[i] = engine.submit(prompts[i], settings)

            name = f"{arrivals}_c{c}_{rows}x{chunk}" + ("" if draft == "none" else f"_{draft}")
            folder = args.profile and os.path.join(args.profile, f"{args.experts}_{name}")
            with jax.profiler.trace(folder, create_perfetto_trace=True) if folder else contextlib.nullcontext():
                submitted = drive(submit, prompts, at)
                for r in requests:
                    r.result()
            assert all(len(r.output_ids) == args.new for r in requests)
            if draft == "none":
                replies.update((tuple(p), list(r.output_ids)) for p, r in zip(prompts, requests))
                drafts["oracle"] = KnownReplies(prompts, [r.output_ids for r in requests], config.vocab_size,
                                                by_position=True)
            elif "none" in args.draft:  # greedy: the same tokens, but for bf16 near-ties over k + 1 positions
                outs = [replies[tuple(p)] for p in prompts]
                agree = [_agree(o, r.output_ids) for o, r in zip(outs, requests)]
                out[f"{arrivals}_c{c}_{draft}_leading_tokens_equal_to_off"] = [min(agree), float(np.mean(agree))]
            if c == 1 and draft == "none":  # the same prompt as the command line's: how far the greedy tokens agree
                # (bf16 synthetic weights: other chunkings of the prompt round differently, so they may part)
                out[f"{arrivals}_c1_tokens_equal_to_cli"] = _agree(cli_tokens, requests[0].output_ids)
                out[f"{arrivals}_c1_tokens_equal_to_cli_chunked"] = _agree(chunked_tokens, requests[0].output_ids)
            s = summary([len(p) for p in prompts], submitted, [r.token_times for r in requests])
            s.update(peak_gib=peak(), warm_up_s=warm, prefill=f"{rows}x{chunk}", draft=draft,
                     speculate_steps=speculation.most if speculation and speculation.on_devices else 0,
                     prefix_reuse=reuse, profile=folder)
            after = engine.metrics.snapshot()
            for key in ("draft_tokens", "accepted_draft_tokens", "speculative_steps", "drafting_steps"):
                s[key] = after.get(key, 0) - before.get(key, 0)
            out["runs"][name] = s
            print(f"c={c} {arrivals} draft {draft}: {json.dumps(s)}", file=sys.stderr, flush=True)
        engine.speculation = speculation
        if args.http:
            for arrivals in args.arrivals:
                for interval in args.switch_interval:
                    sys.setswitchinterval(interval)
                    s = run_http(engine, config, c, arrivals, args)
                    s.update(peak_gib=peak(), warm_up_s=warm, prefill=f"{rows}x{chunk}", switch_interval=interval)
                    out["runs"][f"{arrivals}_c{c}_{rows}x{chunk}_si{interval}_http"] = s
                    print(f"c={c} {arrivals} over HTTP (switch interval {interval}): {json.dumps(s)}", file=sys.stderr,
                          flush=True)
            sys.setswitchinterval(0.005)
        engine.stop()
        # Nothing may keep this engine (its pool takes most of the free memory) into the next one's sizing.
        kept = weakref.ref(engine)
        del engine, submit, speculation, drafts
        gc.collect()
        assert kept() is None, "an engine outlived its run (its pool would shrink the next one's)"
    return out


def run_http(engine, config, c: int, arrivals: str, args) -> dict:
    """The same workload through the OpenAI-compatible server over this engine (uvicorn on a thread of
    this process), driven by the openai client in `--http-clients` processes of their own: streamed
    /v1/completions of the prompt ids, greedy, `ignore_eos`. Token times are the clients' chunk
    arrivals; the "engine side" figures are the same requests' times in the engine."""
    from gptoss_jax import tokenizer as tk
    from gptoss_jax.server.app import Server, create_app
    from server_util import serving

    vocab = tk.find_vocab(args.vocab)
    server = Server(engine, tk.load_tokenizer(vocab), vocab, model_name="bench")
    server.ready.set()
    requests, submit = [], engine.submit

    def recorded(*a, **kw):
        requests.append(submit(*a, **kw))
        return requests[-1]

    engine.submit = recorded
    k = min(args.http_clients, c)
    try:
        with serving(create_app(server)) as url:
            start = time.perf_counter() + 5.0  # every client process starts its arrivals then, warmed up
            procs = [subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--only", "http-client", "--url", url,
                                       "--concurrency", str(c), "--arrivals", arrivals, "--vocab-size",
                                       str(config.vocab_size), "--client-part", f"{i}/{k}", "--start-at", str(start)],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
                     for i in range(k)]
            outs = [(p.communicate(), p.returncode) for p in procs]
    finally:
        engine.submit = submit
    for (out, err), code in outs:
        if code:
            raise RuntimeError(f"an HTTP client failed: {err[-2000:]}")
    parts = [json.loads(out.split("RESULT ")[-1]) for (out, _), _ in outs]
    submitted, times, counts = ([x for part in parts for x in part[key]] for key in ("submitted", "times", "counts"))
    assert all(n == args.new for n in counts), counts
    lens = [args.prompt] * c
    s = summary(lens, submitted, times)
    s["output_tokens"] = sum(counts)  # chunks may carry several tokens: rates from the usage counts
    s["output_tokens_per_s"] = sum(counts) / s["seconds"]
    s["total_tokens_per_s"] = (sum(counts) + sum(lens)) / s["seconds"]
    s["chunks_per_token"] = sum(len(t) for t in times) / sum(counts)
    s["clients"] = k
    mine = requests[-c:]  # the timed ones (each client's warm-up requests come first)
    side = summary(lens, [r.submitted_at for r in mine], [r.token_times for r in mine])
    s["engine_side"] = {key: side[key] for key in ("output_tokens_per_s", "ttft_p50_ms", "itl_p50_ms", "itl_p99_ms")}
    return s


def run_http_client(args) -> dict:
    """One client process: its share of the requests (`--client-part i/k`: every k-th from i), each
    submitted at its arrival time after `--start-at` (a time.perf_counter() instant, the same clock in
    every process) -> each request's submit time, chunk arrival times and token count."""
    import asyncio

    import openai

    c, arrivals = args.concurrency[0], args.arrivals[0]
    part, parts = (int(x) for x in args.client_part.split("/"))
    prompts, at = workload(args.vocab_size, c, arrivals, args)
    mine = list(range(part, c, parts))
    client = openai.AsyncOpenAI(base_url=args.url, api_key="unused", max_retries=0, timeout=3600)
    submitted, times, counts = {}, {i: [] for i in mine}, {}

    async def one(i):
        await asyncio.sleep(max(0.0, args.start_at + at[i] - time.perf_counter()))
        submitted[i] = time.perf_counter()
        # The ids go in extra_body, sent as they are: the client checks a `prompt` list element by element
        # in Python before sending it (13 ms for 1,024 ids on a CPU here), which is the client's time,
        # not the server's.
        stream = await client.completions.create(model="bench", prompt="", max_tokens=args.new, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True, "prompt": prompts[i]})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                times[i].append(time.perf_counter())
            if chunk.usage:
                counts[i] = chunk.usage.completion_tokens

    async def main():
        # Small requests first: the connection and the client's first-call paths, outside the timings.
        for _ in range(2):
            async for _ in await client.completions.create(model="bench", prompt=prompts[0][:8], max_tokens=2,
                                                           temperature=0, stream=True):
                pass
        await asyncio.gather(*(one(i) for i in mine))

    asyncio.run(main())
    return {"submitted": [submitted[i] for i in mine], "times": [times[i] for i in mine],
            "counts": [counts.get(i, 0) for i in mine]}


def _agree(a: list[int], b: list[int]) -> int:
    """How many leading tokens two replies share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_peer(args) -> dict:
    import torch
    import transformers
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from peer import build

    model, cfg, dev, sync = build(args.preset)
    model.eval()
    out = {"framework": f"transformers {transformers.__version__} continuous batching, torch {torch.__version__}",
           "runs": {}}
    max_len = args.prompt + args.new
    for c in args.concurrency:
        gen_config = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        hints = WorkloadHints(max_prompt_length=args.prompt, max_generated_length=args.new, num_requests=c)
        # Its eager paged attention holds [heads, batch tokens, cache tokens] scores: with its default
        # sizes (90% of the free memory for the cache) the 256-request runs ran out of memory.
        cb = ContinuousBatchingConfig(max_blocks_per_request=-(-max_len // 256), max_batch_tokens=args.peer_batch_tokens,
                                      max_memory_percent=args.peer_memory)
        t = time.perf_counter()
        with torch.no_grad(), model.continuous_batching_context_manager(
                generation_config=gen_config, continuous_batching_config=cb, workload_hints=hints, block=True,
                timeout=30) as manager:
            warm = time.perf_counter() - t
            out["attention"] = model.config._attn_implementation
            manager.add_request(list(range(16)), request_id="warm", max_new_tokens=4)
            while (r := manager.get_result(timeout=60)) is None or not r.is_finished():
                pass
            for arrivals in args.arrivals:
                prompts, at = workload(cfg.vocab_size, c, arrivals, args)
                ids = [f"{arrivals}-{c}-{i}" for i in range(c)]

                def submit(i):
                    manager.add_request(prompts[i], request_id=ids[i], max_new_tokens=args.new,
                                        record_timestamps=True)

                results, box = {}, {}
                driver = threading.Thread(target=lambda: box.setdefault("submitted", drive(submit, prompts, at)))
                driver.start()
                while len(results) < c:
                    r = manager.get_result(timeout=600)
                    if r is None:
                        raise RuntimeError(f"transformers gave no result in 600 s ({len(results)} of {c} done)")
                    if r.is_finished():
                        if r.error:
                            raise RuntimeError(r.error)
                        results[r.request_id] = r
                driver.join()
                times = [results[i].timestamps for i in ids]
                assert all(len(t) == args.new for t in times), [len(t) for t in times]
                s = summary([len(p) for p in prompts], box["submitted"], times)
                s.update(peak_gib=torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0, warm_up_s=warm)
                out["runs"][f"{arrivals}_c{c}"] = s
                print(f"peer c={c} {arrivals}: {json.dumps(s)}", file=sys.stderr, flush=True)
        if dev == "cuda":
            torch.cuda.empty_cache()
    return out


def table(results: dict, args) -> str:
    lines = ["| framework | arrivals | concurrency | prefill | output tok/s | total tok/s | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms | peak GiB |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    f = lambda x, d=1: "-" if x is None else f"{x:,.{d}f}"  # noqa: E731
    for name, r in results.items():
        if not isinstance(r, dict):
            lines.append(f"| {name} | failed: {str(r)[-300:]} | | | | | | | |")
            continue
        for key, s in r["runs"].items():
            arrivals, c = key.split("_")[:2]
            draft = f", draft {s['draft']}" if s.get("draft", "none") != "none" else ""
            lines.append(f"| {name}{' over HTTP' * key.endswith('_http')}{draft} | {arrivals} | {c[1:]} | {s.get('prefill', '-')} | {f(s['output_tokens_per_s'], 0)} | "
                         f"{f(s['total_tokens_per_s'], 0)} | {f(s['ttft_p50_ms'], 0)} / {f(s['ttft_p99_ms'], 0)}"
                         f" | {f(s['itl_p50_ms'], 2)} / {f(s['itl_p99_ms'], 2)} | {f(s['peak_gib'])} |")
        if "cli_batch1" in r:
            lines.append(f"| {name}: command line, batch 1 | | 1 | | {f(1e3 / r['cli_batch1']['itl_mean_ms'], 0)} | | "
                         f"{f(r['cli_batch1']['ttft_ms'], 0)} | mean {f(r['cli_batch1']['itl_mean_ms'], 2)} | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--experts", default="bf16,mxfp4", help="gptoss-jax's expert formats, one process each")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--arrivals", default="all,poisson", help="all (at once), poisson, or both")
    parser.add_argument("--prompt", type=int, default=1024, help="prompt tokens per request")
    parser.add_argument("--new", type=int, default=1024, help="new tokens per request")
    parser.add_argument("--window", type=float, default=10.0,
                        help="poisson: c requests arrive at c / WINDOW a second (seconds)")
    parser.add_argument("--prefill", default="8x512",
                        help="the engine's prompt prefill shapes, ROWSxCHUNK: prompts prefilled together x tokens of "
                             "each per step; several (comma-separated) run one after the other")
    parser.add_argument("--draft", default="none",
                        help="speculative decoding, one run each over the same engine: none, oracle (each prompt's "
                             "reply without speculation, proposed back: needs none first), prompt-lookup; NAME@host "
                             "drafts on the host where --speculate-steps puts NAME on the device; with "
                             "several, prefix reuse is off (each run sends the same prompts: a later run would find "
                             "them in the cache and prefill less)")
    parser.add_argument("--conditioned", action="store_true",
                        help="weights whose greedy tokens have wide margins (speculative.py's `conditioned`): random "
                             "weights' near-ties part a speculated reply from the plain one at its first step")
    parser.add_argument("--draft-tokens", type=int, default=3, help="drafted tokens a step")
    parser.add_argument("--speculate-steps", type=int, default=0,
                        help="checked steps a call at most, drafted on the device (0: drafted on the host, a step at "
                             "a time, the engine's default)")
    parser.add_argument("--kv-gib", type=float, default=0,
                        help="the engine's pool of KV pages in GiB (0: the engine's default share of the free memory)")
    parser.add_argument("--speculate-rows", type=int, default=0,
                        help="speculate in steps of at most this many decoding sequences (0: every step, up to c)")
    parser.add_argument("--peer-batch-tokens", type=int, default=1024, help="transformers' max_batch_tokens")
    parser.add_argument("--peer-memory", type=float, default=0.6, help="transformers' max_memory_percent (its cache)")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-jax", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--profile", metavar="DIR",
                        help="trace each engine run into DIR/<run> (bench/profile_summary.py reads it; with few "
                             "--new tokens: a trace of 1k/1k is large)")
    parser.add_argument("--http", action="store_true",
                        help="also run each workload through the OpenAI-compatible server (gptoss-serve's app) over "
                             "the same engine, with the openai client in another process")
    parser.add_argument("--vocab", help="o200k_base.tiktoken for --http (default: $TIKTOKEN_ENCODINGS_BASE)")
    parser.add_argument("--only", choices=("jax", "peer", "http-client"), help=argparse.SUPPRESS)
    parser.add_argument("--http-clients", type=int, default=4,
                        help="--http: client processes sharing the requests (default: %(default)s)")
    parser.add_argument("--switch-interval", default="0.005",
                        help="--http: the server process's sys.setswitchinterval, seconds (how long a thread waits for "
                             "the interpreter lock); several (comma-separated) run one after the other "
                             "(default: Python's, %(default)s)")
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--client-part", help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.arrivals = args.arrivals.split(",")
    args.draft = args.draft.split(",")
    known = ("none", "oracle", "prompt-lookup", "oracle@host", "prompt-lookup@host")
    if any(d not in known for d in args.draft) or (
            any(d.startswith("oracle") for d in args.draft) and args.draft[0] != "none"):
        parser.error(f"--draft takes none, oracle, prompt-lookup, each but none also as NAME@host (oracle after "
                     f"none), not {','.join(args.draft)!r}")
    args.switch_interval = [float(x) for x in args.switch_interval.split(",")]
    if args.profile:  # the children run from the repository's root
        args.profile = os.path.abspath(args.profile)
    try:
        args.prefill = [tuple(int(n) for n in shape.split("x")) for shape in args.prefill.split(",")]
        assert all(len(shape) == 2 and min(shape) > 0 for shape in args.prefill)
    except (ValueError, AssertionError):
        parser.error(f"--prefill takes ROWSxCHUNK shapes such as 8x512,16x1024, not {args.prefill!r}")
    if any(a not in ("all", "poisson") for a in args.arrivals):
        parser.error(f"--arrivals takes all, poisson or both, not {','.join(args.arrivals)!r}")
    if args.only:
        run = {"jax": run_jax, "peer": run_peer, "http-client": run_http_client}[args.only]
        print("RESULT " + json.dumps(run(args)), flush=True)
        return
    runs = [] if args.skip_jax else [("jax", form) for form in args.experts.split(",")]
    runs += [] if args.skip_peer else [("peer", "bf16")]
    results = {}
    for only, form in runs:
        # The child's progress lines pass straight through (a run cut by a time limit keeps them).
        with tempfile.TemporaryFile("w+") as result:
            proc = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--only", only, "--experts", form],
                                    stdout=result, stderr=subprocess.PIPE, text=True, cwd=ROOT)
            tail = collections.deque(maxlen=20)
            try:
                for line in proc.stderr:
                    print(line, end="", file=sys.stderr, flush=True)
                    tail.append(line)
                proc.wait()
            finally:  # stopped here (a signal, an error): the child must not keep the GPU
                if proc.poll() is None:
                    proc.kill()
            result.seek(0)
            stdout = result.read()
        name = f"gptoss-jax, {form} experts" if only == "jax" else "transformers (bf16)"
        results[name] = (json.loads(stdout.split("RESULT ")[-1]) if proc.returncode == 0
                         else f"exit {proc.returncode}: {''.join(tail)[-300:]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    print(table(results, args))


if __name__ == "__main__":
    main()
