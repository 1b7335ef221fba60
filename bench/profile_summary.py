"""Where a profiled run's GPU time goes: kernels summed by name and by kind, from the Perfetto
traces that `bench/generate_20b.py --profile DIR` (or `bench/serve_20b.py --profile DIR`) writes.

    python bench/profile_summary.py DIR/decode_b1 [--steps 63] [--top 15] [--after flash_attention]
        [--gaps 5] [--timeline 40]

Prints the GPU's busy time against the traced wall time (the difference is time the GPU waited on
the host: dispatch, host round trips), then a table by kind and one by kernel, per step when
--steps is given, then the GPU's largest idle times by the kernels around them; --timeline lists
the GPU's copies and idle stretches with the host's long events in time order (what it waited for).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os

# Kinds of kernels, by a piece of their name (first match wins).
KINDS = (
    ("experts, decode (Triton matvec, fused decode MoE)", ("gptoss_pair_matvec", "gptoss_decode")),
    ("attention, decode (Triton, cache)", ("gptoss_cache_attention",)),
    ("attention, prompts (flash)", ("flash", "attention", "splash")),  # before "mosaic_gpu": tokamax's is one too
    ("experts, grouped (ragged dot, MXFP4 grouped matmul)", ("ragged", "gmm", "mosaic_gpu", "gptoss_grouped")),
    ("dense matmuls (cuBLAS / XLA gemm)", ("gemm", "cublas", "nvjet", "xmma", "cutlass", "dot")),
    ("sort, top-k, scatter, gather", ("sort", "topk", "top_k", "scatter", "gather")),
    ("other XLA fusions", ("fusion", "loop", "input", "reduce", "copy", "transpose", "concatenate", "slice")),
    ("memory copies", ("memcpy", "memset")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other"


def load(folder: str) -> list[dict]:
    paths = glob.glob(os.path.join(folder, "**", "*.trace.json.gz"), recursive=True) + \
        glob.glob(os.path.join(folder, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise SystemExit(f"{folder}: no *.trace.json.gz or perfetto_trace.json.gz under it")
    with gzip.open(sorted(paths)[-1], "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def gpu_kernels(events: list[dict]) -> list[dict]:
    """The complete events on the GPU's streams (not the host's threads, not per-op summary lines)."""
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    out = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        p, t = process.get(e["pid"], ""), thread.get((e["pid"], e.get("tid")), "")
        if "gpu" in p.lower() and "stream" in t.lower():
            out.append(e)
    return out


def timeline(events: list[dict], kernels: list[dict], lines: int) -> None:
    """The GPU's copies and idle stretches, and the host's longest events, in time order (ms from the
    first GPU kernel): what the GPU waited for."""
    t0 = min(e["ts"] for e in kernels)
    rows = []
    ordered = sorted(kernels, key=lambda e: e["ts"])
    for before, after in zip(ordered, ordered[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle > 100 or "memcpy" in after["name"].lower():
            rows.append((before["ts"] + before["dur"], f"GPU idle {idle / 1e3:.3f} ms, then {after['name'][:50]}"))
    gpu = {id(e) for e in kernels}
    for e in events:
        if e.get("ph") == "X" and id(e) not in gpu and e.get("dur", 0) > 300:
            rows.append((e["ts"], f"host {e['name'][:60]} {e['dur'] / 1e3:.3f} ms"))
    print("\n| ms | event |\n|---:|---|")
    for ts, text in sorted(rows)[:lines]:
        print(f"| {(ts - t0) / 1e3:.3f} | {text} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder")
    ap.add_argument("--steps", type=int, default=1, help="divide times by this many steps")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--timeline", type=int, default=0, metavar="LINES", help="also list the GPU's copies and idle "
                    "stretches and the host's long events in time order")
    ap.add_argument("--gaps", type=int, default=5, help="list the GPU's largest idle times, by the kernels around them")
    ap.add_argument("--after", metavar="NAME", help="count only kernels that start after the last one whose name "
                    "holds NAME (e.g. flash_attention: the decode steps after a prefill)")
    args = ap.parse_args()
    events = load(args.folder)
    kernels = gpu_kernels(events)
    if args.after:
        marks = [e["ts"] + e["dur"] for e in kernels if args.after in e["name"]]
        kernels = [e for e in kernels if not marks or e["ts"] >= max(marks)]
    if not kernels:
        raise SystemExit(f"{args.folder}: no GPU kernel events in the trace")
    busy = sum(e["dur"] for e in kernels) / 1e3  # ms
    wall = (max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)) / 1e3
    n = args.steps
    print(f"GPU busy {busy / n:.3f} ms per step of {wall / n:.3f} ms traced ({100 * busy / wall:.0f}% busy; "
          f"the rest: the GPU waiting on the host)")
    by_kind, by_name, count = collections.Counter(), collections.Counter(), collections.Counter()
    for e in kernels:
        by_kind[kind_of(e["name"])] += e["dur"] / 1e3
        by_name[e["name"]] += e["dur"] / 1e3
        count[e["name"]] += 1
    print("\n| kind | ms per step | share of busy |\n|---|---:|---:|")
    for kind, ms in by_kind.most_common():
        print(f"| {kind} | {ms / n:.3f} | {100 * ms / busy:.1f}% |")
    print("\n| kernel | calls per step | ms per step | share of busy |\n|---|---:|---:|---:|")
    for name, ms in by_name.most_common(args.top):
        print(f"| {name[:80]} | {count[name] / n:.1f} | {ms / n:.3f} | {100 * ms / busy:.1f}% |")
    if args.timeline:
        timeline(events, kernels, args.timeline)
    ordered = sorted(kernels, key=lambda e: e["ts"])
    gaps = collections.Counter()  # idle time before each kernel, summed by the kernel that waited
    for before, after in zip(ordered, ordered[1:]):
        idle = after["ts"] - (before["ts"] + before["dur"])
        if idle > 0:
            gaps[f"{before['name'][:40]} -> {after['name'][:40]}"] += idle / 1e3
    print("\n| idle GPU between kernels (largest sums) | ms per step |\n|---|---:|")
    for pair, ms in gaps.most_common(args.gaps):
        print(f"| {pair} | {ms / n:.3f} |")


if __name__ == "__main__":
    main()
