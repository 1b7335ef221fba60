"""Full-size gpt-oss-20b forward on an accelerator with synthetic bf16 weights: does it compile, fit
and agree across kernel choices? Prints compile and run times per prompt length.

    python bench/forward_smoke.py [--preset gpt-oss-20b] [--lengths 128,4096]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import gptoss_jax as gj


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--lengths", default="16,4096")
    args = parser.parse_args()
    config = gj.ModelConfig.preset(args.preset)
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, preset {args.preset}")
    t0 = time.perf_counter()
    params = gj.init_params(config, jax.random.key(0), dtype=jnp.bfloat16)
    jax.block_until_ready(params)
    print(f"init {time.perf_counter() - t0:.1f} s, {gj.param_count(params) / 1e9:.2f} B params")
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        tokens = np.random.default_rng(T).integers(0, config.vocab_size, size=(1, T)).astype(np.int32)
        other = ("gather", gj.Kernels(moe="gather")) if T <= 16 else ("grouped-128", gj.Kernels(moe_block=128))
        for name, kernels in (("auto", gj.Kernels()), other):
            t0 = time.perf_counter()
            logits = jax.block_until_ready(gj.forward(config, params, tokens, kernels=kernels))
            first = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                jax.block_until_ready(gj.forward(config, params, tokens, kernels=kernels))
                times.append(time.perf_counter() - t0)
            run = float(np.median(times))
            rows.append((T, name, first, run, T / run, np.asarray(logits[0, -1], np.float32)))
    ref = {T: last for T, name, *_, last in rows if name == "auto"}
    print("| tokens | kernels | first call s | median s | tokens/s | rel diff vs auto |")
    print("|---:|---|---:|---:|---:|---:|")
    for T, name, first, run, tps, last in rows:
        diff = np.abs(last - ref[T]).max() / np.abs(ref[T]).max()
        print(f"| {T} | {name} | {first:.1f} | {run:.3f} | {tps:,.0f} | {diff:.2e} |")
    print("peak device memory (GiB):", jax.devices()[0].memory_stats().get("peak_bytes_in_use", 0) / 2**30)


if __name__ == "__main__":
    main()
