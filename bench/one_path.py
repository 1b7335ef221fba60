"""What the command line would cost on the serving engine's paged steps: the same prompts generated
by `Generator` (its static cache, the command line's path) and by `Engine` (the paged cache, slots =
the batch, every prompt at once), one after the other in one process, on one GPU.

    python bench/one_path.py [--preset gpt-oss-20b] [--experts bf16] [--batches 1,8,64] [--prompt 128]
        [--new 64] [--prefill 4096] [--runs 3] [--json FILE]

For each batch size B: decode tokens/s (tokens after each sequence's first / the time they took,
summed over the batch; the median of --runs generations after one untimed), and the time to first
token of one --prefill-token prompt (the best of --runs). The greedy tokens of both paths are
compared (how many leading tokens agree: bf16 noise may part them on synthetic weights).
Random token ids, synthetic weights (gptoss_jax.testing), bf16 or MXFP4 experts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--experts", default="bf16", choices=("bf16", "mxfp4"))
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens of the decode runs")
    parser.add_argument("--new", type=int, default=64, help="new tokens of the decode runs")
    parser.add_argument("--prefill", type=int, default=4096, help="prompt tokens of the prefill run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.serving import Engine, EngineConfig, Settings
    from gptoss_jax.serving.scheduler import sliding_most
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(
        config, seed=0, dtype="mxfp4" if args.experts == "mxfp4" else "bfloat16"))
    greedy = Sampling(temperature=0.0)
    rng = np.random.default_rng(0)
    max_len = max(args.prompt + args.new, args.prefill + 1)
    out = {"device": jax.devices()[0].device_kind, "experts": args.experts, "jax": jax.__version__, "rows": []}

    def by_generator(prompts, new):  # -> (outputs, decode tokens/s, ttft s)
        gen = Generator(config, params, max_len=max_len)
        gen.generate(prompts, max_new_tokens=new, sampling=greedy)  # compiles
        runs = []
        for _ in range(args.runs):
            results = gen.generate(prompts, max_new_tokens=new, sampling=greedy)
            t = results[0].timings
            rate = sum(r.timings["decode_tokens_per_s"] or 0.0 for r in results)
            runs.append(([r.output_ids for r in results], rate, t["time_to_first_token_s"] - t["compile_s"]))
        return runs

    def by_engine(prompts, new):
        B = len(prompts)
        chunk = min(4096, len(prompts[0]))  # the case's prompts in one chunk each, as Generator takes them
        # What the case needs (the default pool takes most of the free memory, and the next case's
        # Generator would find none): each sequence's full-attention pages and its sliding ones.
        pages = B * (-(-max_len // args.page_size) + sliding_most(config, args.page_size, chunk))
        engine = Engine(config, params,
                        EngineConfig(slots=B, max_len=max_len, prefill_chunk=chunk, prefill_rows=min(B, 8), max_waiting=B,
                                     page_size=args.page_size, decode_sizes=(B,), pages=pages))
        engine.warm_up()
        engine.start()
        runs = []
        try:
            for _ in range(args.runs + 1):  # the first untimed
                submitted = time.perf_counter()
                requests = [engine.submit(p, Settings(max_new_tokens=new, sampling=greedy)) for p in prompts]
                for r in requests:
                    r.result()
                rate = sum((len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])
                           for r in requests if len(r.token_times) > 1)
                first = min(r.token_times[0] for r in requests)
                runs.append(([r.output_ids for r in requests], rate, first - submitted))
        finally:
            engine.stop()
            engine.device.release()  # its memory back for the next case
            gc.collect()
        return runs[1:]

    def agree(a, b):
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    cases = [(int(b), args.prompt, args.new, f"decode, batch {b}") for b in args.batches.split(",")]
    cases.append((1, args.prefill, 1, f"prefill, {args.prefill}-token prompt"))
    for B, prompt, new, name in cases:
        prompts = [rng.integers(0, config.vocab_size, prompt).tolist() for _ in range(B)]
        row = {"case": name}
        for path, run in (("generator", by_generator), ("engine", by_engine)):
            runs = run(prompts, new)
            row[path] = {"decode_tokens_per_s": statistics.median(r[1] for r in runs),
                         "ttft_ms": min(r[2] for r in runs) * 1e3, "outputs": runs[0][0]}
        row["tokens_agreeing"] = sum(agree(a, b) for a, b in zip(row["generator"].pop("outputs"),
                                                                 row["engine"].pop("outputs")))
        row["tokens"] = B * new
        out["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    print(f"{out['device']}, {args.preset}, {args.experts} experts, jax {out['jax']}")
    print("| case | Generator decode tok/s | engine decode tok/s | Generator TTFT ms | engine TTFT ms | "
          "greedy tokens agreeing |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        g, e = r["generator"], r["engine"]
        rate = lambda x: f"{x:,.1f}" if r["tokens"] > 1 else "-"  # noqa: E731  (a prefill row decodes nothing)
        print(f"| {r['case']} | {rate(g['decode_tokens_per_s'])} | {rate(e['decode_tokens_per_s'])} | "
              f"{g['ttft_ms']:,.1f} | {e['ttft_ms']:,.1f} | {r['tokens_agreeing']} of {r['tokens']} |")


if __name__ == "__main__":
    main()
