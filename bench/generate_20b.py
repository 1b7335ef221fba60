"""Generation speed of full-size gpt-oss-20b (synthetic bf16 weights) on one GPU, with Hugging Face
transformers measured in the same run on the same GPU (one after the other, each alone on it).

    python bench/generate_20b.py [--prefill 4096] [--decode 64] [--batches 1,8] [--long 64x4096]
        [--prefill-long 32768] [--fit 4096:256,288] [--profile DIR] [--host-profile]
    python bench/generate_20b.py --startup DIR   (cold start, then second start with the cache in DIR)

Rates: prefill = prompt tokens / time to first token of a batch-1 prompt (the best of --prefill-runs,
3; the median is listed too);
decode = tokens produced after the first / the time they took (batch B produces B tokens per step),
the median of --decode-runs generations (3; on one H100 80GB, single batch-1 runs of one process
ranged from 284 to 321 tokens/s). Each measurement follows a warm-up run of the same shapes, so
compilation is excluded for both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # run from a checkout without installing

HF_SCRIPT = r'''
import json, sys, time, torch
sys.path.insert(0, "bench")
from peer import build
args = json.loads(sys.argv[1])
model, cfg, dev, sync = build(args["preset"])
model.eval()
g = torch.Generator(device=dev).manual_seed(0)
def timed(fn):
    sync(); t = time.perf_counter(); fn(); sync(); return time.perf_counter() - t
out = {"peer": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}",
       "attn": model.config._attn_implementation}
prompt = torch.randint(0, cfg.vocab_size, (1, args["prefill"]), device=dev, generator=g)
with torch.no_grad():
    timed(lambda: model(prompt))
    out["prefill_tokens_per_s"] = args["prefill"] / min(timed(lambda: model(prompt)) for _ in range(args["prefill_runs"]))
    for n in args["prefill_long"]:
        try:
            long = torch.randint(0, cfg.vocab_size, (1, n), device=dev, generator=g)
            out[f"prefill_{n}_tokens_per_s"] = n / timed(lambda: model(long, logits_to_keep=1))
        except torch.OutOfMemoryError:
            out[f"prefill_{n}_tokens_per_s"] = "out of memory"
        torch.cuda.empty_cache() if dev == "cuda" else None
    cases = [(b, args["decode_prompt"], f"decode_b{b}") for b in args["batches"]]
    cases += [(b, p, f"decode_b{b}_prompt{p}") for b, p in args["long"]]
    for b, p, name in cases:
        try:
            ids = torch.randint(0, cfg.vocab_size, (b, p), device=dev, generator=g)
            gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            timed(lambda: gen(2))
            rates = sorted(b * (args["decode"] - 1) / (timed(lambda: gen(args["decode"])) - timed(lambda: gen(1)))
                           for _ in range(args["decode_runs"]))
            out[f"{name}_tokens_per_s"], out[f"{name}_runs"] = rates[len(rates) // 2], [round(r, 1) for r in rates]
        except torch.OutOfMemoryError:
            out[f"{name}_tokens_per_s"] = "out of memory"
        torch.cuda.empty_cache() if dev == "cuda" else None
out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else 0.0
print("RESULT " + json.dumps(out))
'''


def run_jax(args) -> dict:
    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.decoding.generator import Generator, batch_timings
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset)
    kernels = kernels_from(args.kernels)
    t = time.perf_counter()
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.experts or "bfloat16"))
    init_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    greedy = Sampling(temperature=0)
    out = {"jax": f"jax {jax.__version__}", "device": jax.devices()[0].device_kind, "init_s": init_s,
           "kernels": kernels.describe(packed=args.experts == "mxfp4")}

    def peak():
        return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2**30

    gen = Generator(config, params, max_len=args.prefill + 16, kernels=kernels)
    prompt = [rng.integers(0, config.vocab_size, args.prefill).tolist()]
    t = time.perf_counter()
    r = gen.generate(prompt, max_new_tokens=2, sampling=greedy)[0]
    out["first_run_s"], out["first_run_compile_s"] = time.perf_counter() - t, r.timings["compile_s"]
    runs = _prefill_runs(gen, prompt, args.prefill_runs)
    out["prefill_tokens_per_s"], out["prefill_runs_ms"] = args.prefill / min(runs), [round(1e3 * s, 1) for s in runs]
    out["prefill_median_tokens_per_s"] = args.prefill / sorted(runs)[len(runs) // 2]
    if args.profile:
        with jax.profiler.trace(os.path.join(args.profile, "prefill"), create_perfetto_trace=True):
            gen.generate(prompt, max_new_tokens=1, sampling=greedy)
    print(f"prefill {args.prefill}: {out['prefill_tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    del gen
    for n in args.prefill_long:
        gen = Generator(config, params, max_len=n + 16, kernels=kernels)
        prompt = [rng.integers(0, config.vocab_size, n).tolist()]
        gen.generate(prompt, max_new_tokens=1, sampling=greedy)  # compiles
        runs = _prefill_runs(gen, prompt, args.prefill_runs)
        del gen
        out[f"prefill_{n}_tokens_per_s"] = n / min(runs)
        print(f"prefill {n}: {out[f'prefill_{n}_tokens_per_s']:.0f} tokens/s", file=sys.stderr, flush=True)
    cases = [(b, args.decode_prompt, f"decode_b{b}") for b in args.batches]
    cases += [(b, p, f"decode_b{b}_prompt{p}") for b, p in args.long]
    for b, p, name in cases:
        gen = Generator(config, params, max_len=p + args.decode + 16, kernels=kernels)
        prompts = [rng.integers(0, config.vocab_size, p).tolist() for _ in range(b)]
        try:
            gen.generate(prompts, max_new_tokens=args.decode, sampling=greedy)  # compiles
            if args.profile:
                folder = os.path.join(args.profile, name)
                with jax.profiler.trace(folder, create_perfetto_trace=True):
                    gen.generate(prompts, max_new_tokens=args.decode, sampling=greedy)
                out[f"{name}_profile"] = folder
            timings = sorted((batch_timings(gen.generate(prompts, max_new_tokens=args.decode, sampling=greedy))
                              for _ in range(args.decode_runs)), key=lambda t: t["decode_tokens_per_s"])
        except jax.errors.JaxRuntimeError as e:
            out[f"{name}_tokens_per_s"] = _failure(e)
            continue
        finally:
            del gen  # its compiled steps, before the next case's
        timing = timings[len(timings) // 2]  # the median run
        out[f"{name}_runs"] = [round(t["decode_tokens_per_s"], 1) for t in timings]
        out[f"{name}_tokens_per_s"] = timing["decode_tokens_per_s"]  # the whole batch's
        out[f"{name}_step_ms"] = 1e3 * timing["decode_s"] / (args.decode - 1)
        out[f"peak_gib_after_{name}"] = peak()
        print(f"{name}: {out[f'{name}_tokens_per_s']:.1f} tokens/s", file=sys.stderr, flush=True)
    if args.host_profile:  # where the host's time goes in a batch-1 decode (the GPU is idle when it lags)
        import cProfile
        import io
        import pstats

        gen = Generator(config, params, max_len=args.decode_prompt + args.decode + 16, kernels=kernels)
        prompts = [rng.integers(0, config.vocab_size, args.decode_prompt).tolist()]
        gen.generate(prompts, max_new_tokens=args.decode, sampling=greedy)
        profiler = cProfile.Profile()
        profiler.runcall(gen.generate, prompts, max_new_tokens=args.decode, sampling=greedy)
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(12)
        print(text.getvalue()[-3500:], file=sys.stderr, flush=True)
        del gen
    for context, batches in args.fit:
        for b in batches:  # prefill of `context` tokens each, then 8 tokens
            gen = Generator(config, params, max_len=context + 24, kernels=kernels)
            prompts = [rng.integers(0, config.vocab_size, context).tolist() for _ in range(b)]
            try:
                gen.generate(prompts, max_new_tokens=8, sampling=greedy)
                fits = f"fits, peak {peak():.1f} GiB"
            except jax.errors.JaxRuntimeError as e:
                fits = _failure(e)
            del gen
            out[f"fit_b{b}_context{context}"] = fits
            print(f"batch {b} at {context}: {fits}", file=sys.stderr, flush=True)
    out["peak_gib"] = peak()
    return out


def _prefill_runs(gen, prompt, runs: int = 3) -> list[float]:
    """Seconds to the first token of `runs` greedy generations of the prompt (compiled already)."""
    from gptoss_jax.sampling import Sampling

    return [gen.generate(prompt, max_new_tokens=1, sampling=Sampling(temperature=0))[0].timings["prefill_s"]
            for _ in range(runs)]


def _failure(e: Exception) -> str:
    return "out of memory" if "RESOURCE_EXHAUSTED" in str(e) else str(e)[:200]


def run_startup(args) -> dict:
    """Time to first token of a process whose weights are already on the device, with the persistent
    compilation cache in args.startup (cold: empty; second start: filled by the first)."""
    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.cli.devices import use_compile_cache
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params_on_device

    use_compile_cache(args.startup)
    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype=args.experts or "bfloat16"))
    prompt = [np.random.default_rng(0).integers(0, config.vocab_size, args.prefill).tolist()]
    t = time.perf_counter()
    gen = Generator(config, params, max_len=args.prefill + args.decode + 16)
    r = gen.generate(prompt, max_new_tokens=1, sampling=Sampling(temperature=0))[0]
    return {"to_first_token_s": time.perf_counter() - t, "compile_s": r.timings["compile_s"]}


def _field(value: str):
    """A --kernels value: true/false, an integer, or a name."""
    return {"true": True, "false": False}.get(value.lower(), int(value) if value.isdigit() else value)


def kernels_from(spec: str):
    """gj.Kernels from a --kernels value, FIELD=VALUE,FIELD=VALUE (e.g. moe=gather,moe_block=32)."""
    import gptoss_jax as gj

    return gj.Kernels(**{k: _field(v) for k, v in (kv.split("=") for kv in spec.split(",") if kv)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--decode-prompt", type=int, default=128, help="prompt length of the decode runs")
    parser.add_argument("--prefill-runs", type=int, default=3,
                        help="timed prefills of the prompt; the best is reported, the median listed (default 3)")
    parser.add_argument("--decode-runs", type=int, default=3,
                        help="generations timed per decode case; the median is reported (default 3)")
    parser.add_argument("--long", default="", help="decode runs with long prompts, e.g. 64x4096 (batch x prompt)")
    parser.add_argument("--prefill-long", default="", help="further prefill lengths, e.g. 32768")
    parser.add_argument("--kernels", default="", help="gj.Kernels fields, e.g. moe=gather,attention=blockwise,moe_block=32")
    parser.add_argument("--experts", default="bf16",
                        help="bf16, mxfp4 (gptoss-jax's experts kept packed on the GPU; the peer stays bf16) or "
                        "both, e.g. bf16,mxfp4: one gptoss-jax process each, in this run")
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--skip-jax", action="store_true", help="the peer alone (a run longer than one sitting)")
    parser.add_argument("--profile", metavar="DIR", help="trace the prefill and each decode run into DIR "
                        "(Perfetto traces; bench/profile_summary.py sums them by kernel)")
    parser.add_argument("--host-profile", action="store_true", help="also: the host's time in a batch-1 decode, "
                        "by Python function (cProfile)")
    parser.add_argument("--fit", action="append", default=[], metavar="CONTEXT:B1,B2",
                        help="try these batch sizes with prompts of CONTEXT tokens (out of memory or not)")
    parser.add_argument("--startup", metavar="DIR", help="instead: time to first token of two fresh processes "
                        "sharing the persistent compilation cache DIR (emptied first): cold, then second start")
    parser.add_argument("--only-jax", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only-startup", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.fit = [(int(c), [int(b) for b in bs.split(",")]) for c, bs in (f.split(":") for f in args.fit)]
    forms = args.experts.split(",")
    if not forms or any(f not in ("bf16", "mxfp4") for f in forms):
        parser.error(f"--experts takes bf16, mxfp4 or both (comma-separated), not {args.experts!r}")
    args.experts = forms[0] if forms[0] == "mxfp4" else None  # in a gptoss-jax process: one form
    if args.only_startup:
        print("RESULT " + json.dumps(run_startup(args)), flush=True)
        return
    if args.startup:
        import shutil

        shutil.rmtree(args.startup, ignore_errors=True)
        runs = {}
        for name in ("cold_start", "second_start"):
            r = subprocess.run([sys.executable, __file__, "--only-startup"] + sys.argv[1:], capture_output=True,
                               text=True)
            runs[name] = json.loads(r.stdout.split("RESULT ")[-1]) if r.returncode == 0 else r.stderr[-2000:]
        print(json.dumps(runs, indent=1))
        return
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.long = [tuple(int(x) for x in case.split("x")) for case in args.long.split(",") if case]
    args.prefill_long = [int(n) for n in args.prefill_long.split(",") if n]
    if args.only_jax:
        print("RESULT " + json.dumps(run_jax(args)), flush=True)
        return
    results = {}
    # Each framework in its own process, so each has the GPU to itself.
    for form in ([] if args.skip_jax else forms):
        jax_run = subprocess.run([sys.executable, __file__, "--only-jax"] + sys.argv[1:] + ["--experts", form],
                                 capture_output=True, text=True)
        print(jax_run.stderr[-3000:], file=sys.stderr)
        name = "gptoss-jax" if forms == ["bf16"] else f"gptoss-jax ({form} experts)"
        results[name] = json.loads(jax_run.stdout.split("RESULT ")[-1]) if jax_run.returncode == 0 else None
    if not args.skip_peer:
        hf = subprocess.run([sys.executable, "-c", HF_SCRIPT, json.dumps(vars(args))], capture_output=True,
                            text=True, cwd=ROOT)
        print(hf.stderr[-3000:], file=sys.stderr)
        results["transformers"] = json.loads(hf.stdout.split("RESULT ")[-1]) if hf.returncode == 0 else None
    print(json.dumps(results, indent=1))
    keys = (["prefill_tokens_per_s"] + [f"prefill_{n}_tokens_per_s" for n in args.prefill_long]
            + [f"decode_b{b}_tokens_per_s" for b in args.batches]
            + [f"decode_b{b}_prompt{p}_tokens_per_s" for b, p in args.long] + ["peak_gib"])
    print("| | " + " | ".join(keys) + " |")
    print("|---|" + "---:|" * len(keys))
    for name, r in results.items():
        cells = [(f"{r[k]:,.1f}" if isinstance(r[k], float) else str(r[k])) if r and r.get(k) is not None
                 else "failed" for k in keys]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
