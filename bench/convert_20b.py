"""Convert a full-size synthetic gpt-oss-20b checkpoint (original layout, ~13 GB) and report wall time
and peak RSS, for the default (experts kept MXFP4) and for --dtype bfloat16; with --load, also load
each output (`gj.load_checkpoint`, experts packed for the MXFP4 output) and report the loading
process's peak RSS against the bytes of the weights and of the largest layer.

    python bench/convert_20b.py --workdir /tmp/gptoss-bench [--keep] [--load [--whole-items]]

The loader's host memory is its process's peak RSS while loading (the peak is reset once the backend
has started) less the RSS it had before loading (the Python and JAX runtime, and on a GPU the CUDA
context); on a CPU the loaded weights live in host memory too, so their bytes are subtracted as well.

The synthetic source is written once (streamed, a tensor at a time) and reused. Each conversion runs
as its own process through `python -m gptoss_jax.convert`; its peak RSS is the high-water mark of that
process and its worker (the largest of them).
Needs ~13 GB + ~13 GB + ~42 GB of disk (each output is deleted after it is measured unless --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import gptoss_jax as gj
from gptoss_jax.testing import write_synthetic_checkpoint

_MEASURE = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
            "code = subprocess.run(sys.argv[1:]).returncode; wall = time.perf_counter() - t; "
            "print({'code': code, 'wall_s': wall, "
            "'peak_rss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss})")

_LOAD = """
import json, sys, time
if sys.argv[3] == "chunks, 2 arenas":  # as the command line sets it, before JAX starts
    from gptoss_jax.hostmem import limit_allocator_arenas
    assert limit_allocator_arenas()
import jax
import gptoss_jax as gj
def status_kib(field):  # VmRSS: now; VmHWM: the peak since the last reset
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
jax.block_until_ready(jax.numpy.zeros(1))  # the backend started: its own host memory is not the loader's
before = status_kib("VmRSS")
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (start-up may have passed it)
    f.write("5")
if sys.argv[3] == "whole-items":  # the loader before chunked reads: Orbax restores each item whole
    import gptoss_jax.checkpoint
    gptoss_jax.checkpoint._chunked = lambda layout, keep_packed: False
t = time.perf_counter()
config, params = gj.load_checkpoint(sys.argv[1], dtype=sys.argv[2])
jax.block_until_ready(params)
nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree))
print(json.dumps({"load_s": time.perf_counter() - t, "peak_rss_kib": status_kib("VmHWM"),
                  "rss_before_kib": before, "weights_bytes": nbytes(params),
                  "largest_layer_bytes": max(nbytes(params[f"block_{i}"]) for i in range(config.num_hidden_layers)),
                  "device": jax.devices()[0].device_kind, "platform": jax.devices()[0].platform}))
"""


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True, help="scratch folder for the source and outputs")
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--dtypes", default="mxfp4,bfloat16")
    parser.add_argument("--keep", action="store_true", help="keep the converted outputs")
    parser.add_argument("--load", action="store_true", help="also load each output and measure the loader")
    parser.add_argument("--whole-items", action="store_true", help="with --load: also load each output with "
                        "every item restored whole by Orbax (the loader before chunked reads), to compare")
    # --load loads each output as the library does ("chunks") and as the command line does, with two
    # allocator arenas ("chunks, 2 arenas"; gptoss_jax/hostmem.py).
    args = parser.parse_args()
    config = gj.ModelConfig.preset(args.preset)
    source = os.path.join(args.workdir, f"{args.preset}-original")
    if not os.path.isfile(os.path.join(source, "model.safetensors")):
        t = time.perf_counter()
        write_synthetic_checkpoint(config, source + ".tmp", "original", seed=0)
        os.replace(source + ".tmp", source)
        print(f"wrote synthetic source in {time.perf_counter() - t:.0f} s", flush=True)
    print(f"source: {source}, {_du(source) / 1e9:.2f} GB; {os.cpu_count()} CPUs", flush=True)
    rows, loads = [], []
    for dtype in args.dtypes.split(","):
        output = os.path.join(args.workdir, f"out-{dtype}")
        shutil.rmtree(output, ignore_errors=True)
        cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "gptoss_jax.convert", source, output, "--dtype", dtype]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
        print(result.stderr[-2000:], flush=True)
        stats = eval(result.stdout.strip().splitlines()[-1])  # the dict printed by _MEASURE
        rows.append((dtype, stats["code"], stats["wall_s"], stats["peak_rss_kib"] / 2**20, _du(output) / 1e9))
        if args.load:
            for mode in ("chunks", "chunks, 2 arenas") + (("whole-items",) if args.whole_items else ()):
                load = subprocess.run([sys.executable, "-c", _LOAD, output, "mxfp4" if dtype == "mxfp4" else dtype, mode],
                                      capture_output=True, text=True, check=True)
                loads.append((dtype, mode, json.loads(load.stdout.strip().splitlines()[-1])))
        if not args.keep:
            shutil.rmtree(output, ignore_errors=True)
    print(json.dumps(rows))
    print("| --dtype | exit | wall time | peak RSS | output size |")
    print("|---|---:|---:|---:|---:|")
    for dtype, code, wall, rss, size in rows:
        print(f"| {dtype} | {code} | {wall / 60:.1f} min ({wall:.0f} s) | {rss:.2f} GiB | {size:.1f} GB |")
    if loads:
        print(json.dumps(loads))
        print("| loaded as | reads | device | load time | RSS before loading | peak RSS | weights | largest layer | "
              "loader's host memory |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|")
        for dtype, mode, r in loads:
            rss, before = r["peak_rss_kib"] / 2**20, r["rss_before_kib"] / 2**20
            weights, layer = r["weights_bytes"] / 2**30, r["largest_layer_bytes"] / 2**30
            # On a CPU the loaded weights are host memory too.
            own = rss - before - (weights if r["platform"] == "cpu" else 0)
            print(f"| {'mxfp4' if dtype == 'mxfp4' else dtype} | {mode} | {r['device']} | {r['load_s']:.0f} s | {before:.2f} GiB | "
                  f"{rss:.2f} GiB | {weights:.2f} GiB | {layer:.2f} GiB | {own:.2f} GiB |")

if __name__ == "__main__":
    main()
