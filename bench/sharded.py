"""gpt-oss-120b across the GPUs of one host, and gpt-oss-20b on one GPU against several, with
Hugging Face transformers (`device_map="auto"`) on the same GPUs in the same run as the peer.

    python bench/sharded.py --part jax-120b   # 120b, synthetic bf16 weights made sharded on the GPUs
    python bench/sharded.py --part jax-20b    # 20b: 1 GPU, then every GPU (tensor, then expert)
    python bench/sharded.py --part peer       # transformers, device_map="auto", the 120b
    python bench/sharded.py --part table --results DIR   # the table from the parts' JSON files

Each part writes its figures as JSON (--results, default bench-results/) and fits in a few minutes,
so the parts can run as separate commands. Rates: prefill = prompt tokens / time to first token of
a batch-1 prompt; decode = tokens produced after the first / their time, the whole batch's. Every
figure follows a warm-up run of the same shapes: compilation is excluded for both frameworks.
On a machine with no GPU, `--big tiny --small tiny` with JAX_NUM_CPU_DEVICES=2 is a dry run.
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
from accelerate import dispatch_model, infer_auto_device_map, init_empty_weights
from accelerate.utils import set_module_tensor_to_device
from transformers import GptOssConfig, GptOssForCausalLM
sys.path.insert(0, ".")
from gptoss_jax import ModelConfig
args = json.loads(sys.argv[1])
cfg = GptOssConfig(**ModelConfig.preset(args["preset"]).to_hf_json(mxfp4=False))
gpus = torch.cuda.device_count()
sync = torch.cuda.synchronize if gpus else (lambda: None)
out = {"peer": f"transformers {__import__('transformers').__version__}, torch {torch.__version__}, "
               f"device_map='auto' over {gpus or 1} {'GPUs' if gpus else 'CPU'}"}
try:
    # What from_pretrained(device_map="auto") does, with random weights made on each GPU in place.
    torch.set_default_dtype(torch.bfloat16)  # else the empty model is float32 and every weight is cast up
    with init_empty_weights():
        model = GptOssForCausalLM(cfg).eval()
    memory = {i: torch.cuda.mem_get_info(i)[0] - (16 << 30) for i in range(gpus)} or {"cpu": 64 << 30}
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=model._no_split_modules,
                                       dtype=torch.bfloat16)
    out["device_map"] = sorted({str(v) for v in device_map.values()})
    def where(name):
        best = max((k for k in device_map if k == "" or name == k or name.startswith(k + ".")), key=len)
        d = device_map[best]
        return f"cuda:{d}" if isinstance(d, int) else d
    g = torch.Generator().manual_seed(0)
    for name, p in list(model.named_parameters()):
        dev = where(name)
        value = torch.empty(p.shape, dtype=torch.bfloat16, device=dev)
        if name.endswith("norm.weight"):
            value.fill_(1.0)
        elif name.endswith("bias"):
            value.zero_()
        else:
            value.normal_(0.0, 0.02)
        set_module_tensor_to_device(model, name, dev, value=value, dtype=torch.bfloat16)
    model = dispatch_model(model, device_map=device_map)
    first = "cuda:0" if gpus else "cpu"
    def timed(fn):
        sync(); t = time.perf_counter(); fn(); sync(); return time.perf_counter() - t
    prompt = torch.randint(0, cfg.vocab_size, (1, args["prefill"]), device=first, generator=None)
    with torch.no_grad():
        timed(lambda: model(prompt))
        out["prefill_tokens_per_s"] = args["prefill"] / min(timed(lambda: model(prompt)) for _ in range(2))
        for b in args["batches"]:
            ids = torch.randint(0, cfg.vocab_size, (b, 128), device=first)
            gen = lambda n: model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            timed(lambda: gen(2))
            t1, tn = timed(lambda: gen(1)), timed(lambda: gen(args["decode"]))
            out[f"decode_b{b}_tokens_per_s"] = b * (args["decode"] - 1) / (tn - t1)
    out["peak_gib_per_gpu"] = max(torch.cuda.max_memory_allocated(i) for i in range(gpus)) / 2**30 if gpus else 0.0
except Exception as e:
    out["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
print("RESULT " + json.dumps(out))
'''


def _peak_gib() -> float:
    import jax

    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) for d in jax.local_devices()]
    return max(peaks) / 2**30


def run_jax(preset: str, axis: str | None, prefill: int, decode: int, batches: list[int], partial: str) -> dict:
    """One model on every visible device, all of them on `axis` (None: the default layout).

    The figures so far are written to `partial` after each stage, so a run cut short keeps them."""
    import jax
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax import sharding as sh
    from gptoss_jax.decoding.generator import Generator, batch_timings
    from gptoss_jax.layout import default_sizes
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(preset)
    n = jax.device_count()
    sizes = {axis: n} if axis else default_sizes(config, n, jax.local_device_count())
    mesh = gj.make_mesh(**sizes) if n > 1 else None
    out = {"model": preset, "jax": f"jax {jax.__version__}", "device": jax.devices()[0].device_kind,
           "devices": n, "mesh": sh.describe(mesh) if mesh else "one device"}
    t = time.perf_counter()
    params = jax.block_until_ready(random_params_on_device(config, seed=0, mesh=mesh))
    out["init_s"] = time.perf_counter() - t

    def keep():
        with open(partial, "w") as f:
            json.dump(out, f)
    held = sh.bytes_per_device(params)
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    out["param_gb_total"] = total / 1e9
    out["param_gb_per_device"] = [round(v / 1e9, 2) for v in held.values()]
    out["largest_param_gb_on_one_device"] = max(
        max(s.data.nbytes for s in x.addressable_shards) for x in jax.tree.leaves(params)) / 1e9
    keep()
    gen = Generator(config, params, max_len=max(prefill, 128 + decode) + 16)
    rng = np.random.default_rng(0)
    greedy = Sampling(temperature=0)
    compile_s = 0.0
    if prefill:
        prompt = [rng.integers(0, config.vocab_size, prefill).tolist()]
        for _ in range(2):
            r = gen.generate(prompt, max_new_tokens=2, sampling=greedy)[0]
            compile_s += r.timings["compile_s"]
        out["prefill_tokens_per_s"] = r.timings["prefill_tokens_per_s"]
        out["peak_gib_per_device"] = _peak_gib()
        keep()
    for b in batches:
        prompts = [rng.integers(0, config.vocab_size, 128).tolist() for _ in range(b)]
        for _ in range(2):
            results = gen.generate(prompts, max_new_tokens=decode, sampling=greedy)
            compile_s += results[0].timings["compile_s"]
        out[f"decode_b{b}_tokens_per_s"] = batch_timings(results)["decode_tokens_per_s"]
        out["compile_s"], out["peak_gib_per_device"] = compile_s, _peak_gib()
        keep()
        print(f"{preset} {out['mesh']} batch {b}: {out[f'decode_b{b}_tokens_per_s']:.1f} tokens/s", file=sys.stderr,
              flush=True)
    out["compile_s"] = compile_s
    out["peak_gib_per_device"] = _peak_gib()
    if mesh is not None:
        decode_steps = [v for k, v in gen.executables.items() if k[0] == "_decode"]
        found = sh.collectives(decode_steps[-1].as_text())
        out["largest_collective_in_decode"] = f"{found[0][0]} {found[0][2]} ({found[0][1] / 1e6:.3f} MB)" if found \
            else "none"
    return out


def _one_jax_run(spec: dict, partial: str, env: dict | None = None) -> dict:
    """run_jax in its own process (so that each run has the GPUs to itself); what it measured
    before an error or a timeout is kept, with the error."""
    spec = dict(spec, partial=partial)
    if os.path.exists(partial):
        os.remove(partial)
    run = subprocess.run([sys.executable, __file__, "--part", "table", "--one", json.dumps(spec)],
                         capture_output=True, text=True, env=env)
    sys.stderr.write(run.stderr[-4000:])
    if run.returncode == 0 and "RESULT " in run.stdout:
        return json.loads(run.stdout.split("RESULT ")[-1])
    out = json.load(open(partial)) if os.path.exists(partial) else {}
    out["error"] = (run.stderr.strip().splitlines() or ["no output"])[-1]
    return out


def _save(results_dir: str, name: str, record) -> None:
    os.makedirs(results_dir, exist_ok=True)
    with open(os.path.join(results_dir, name + ".json"), "w") as f:
        json.dump(record, f, indent=1)
    print(json.dumps(record, indent=1), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["jax-120b", "jax-20b", "peer", "table"], required=True)
    parser.add_argument("--big", default="gpt-oss-120b", help="the model spread over the GPUs")
    parser.add_argument("--small", default="gpt-oss-20b", help="the model run on one GPU and on all")
    parser.add_argument("--prefill", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--results", default="bench-results")
    parser.add_argument("--axis", choices=["expert", "tensor"], help="jax-120b: every GPU on this mesh axis "
                        "(default: the default layout)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: JSON arguments of one JAX run
    args = parser.parse_args()
    os.makedirs(args.results, exist_ok=True)
    if args.one:
        spec = json.loads(args.one)
        print("RESULT " + json.dumps(run_jax(**spec)), flush=True)
        return
    if args.part == "jax-120b":
        spec = dict(preset=args.big, axis=args.axis, prefill=args.prefill, decode=args.decode, batches=[1, 8])
        name = "jax-120b" + (f"-{args.axis}" if args.axis else "")
        _save(args.results, name, _one_jax_run(spec, os.path.join(args.results, "partial.json")))
    elif args.part == "jax-20b":
        runs = {}
        for name, axis in (("1 device", None), ("tensor", "tensor"), ("expert", "expert")):
            env = dict(os.environ)
            if axis is None:
                env["CUDA_VISIBLE_DEVICES"] = "0"
                env["JAX_NUM_CPU_DEVICES"] = "1"
            spec = dict(preset=args.small, axis=axis, prefill=0, decode=args.decode, batches=[1, 32])
            runs[name] = _one_jax_run(spec, os.path.join(args.results, "partial.json"), env)
            _save(args.results, "jax-20b", runs)
    elif args.part == "peer":
        spec = dict(preset=args.big, prefill=args.prefill, decode=args.decode, batches=[1, 8])
        run = subprocess.run([sys.executable, "-c", HF_SCRIPT, json.dumps(spec)], capture_output=True, text=True,
                             cwd=ROOT)
        sys.stderr.write(run.stderr[-4000:])
        record = json.loads(run.stdout.split("RESULT ")[-1]) if "RESULT " in run.stdout else {
            "error": (run.stderr.strip().splitlines() or ["no output"])[-1]}
        _save(args.results, "peer-120b", record)
    else:
        print_table(args.results)


def print_table(results_dir: str) -> None:
    def load(name):
        path = os.path.join(results_dir, name + ".json")
        return json.load(open(path)) if os.path.exists(path) else {}

    def cell(r, key, fmt="{:,.1f}"):
        return fmt.format(r[key]) if r.get(key) is not None else r.get("error", "not run")[:60]

    print("| 120b | prefill 4k, tokens/s | decode b1, tokens/s | decode b8, tokens/s | peak memory per GPU |")
    print("|---|---:|---:|---:|---:|")
    rows = [(f"gptoss-jax, {load(n).get('mesh', n)}", load(n), "peak_gib_per_device")
            for n in ("jax-120b", "jax-120b-tensor", "jax-120b-expert") if load(n)]
    for name, r, peak in rows + [("transformers, device_map='auto'", load("peer-120b"), "peak_gib_per_gpu")]:
        print(f"| {name} | {cell(r, 'prefill_tokens_per_s')} | {cell(r, 'decode_b1_tokens_per_s')} | "
              f"{cell(r, 'decode_b8_tokens_per_s')} | {cell(r, peak, '{:.1f} GiB')} |")
    small = load("jax-20b")
    print("\n| 20b | decode b1, tokens/s | decode b32, tokens/s | peak memory per GPU |")
    print("|---|---:|---:|---:|")
    for name, r in small.items():
        print(f"| {r.get('mesh', name)} | {cell(r, 'decode_b1_tokens_per_s')} | {cell(r, 'decode_b32_tokens_per_s')} | "
              f"{cell(r, 'peak_gib_per_device', '{:.1f} GiB')} |")


if __name__ == "__main__":
    main()
