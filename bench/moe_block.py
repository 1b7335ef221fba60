"""Time of gpt-oss's MoE block (norm, router, experts) over MXFP4 experts by `Kernels` variant, for a
few tokens: the block of one layer (full size, synthetic weights) chained 24 times in one jitted
call (x = x + 0.01 moe(x), so each block routes anew), host-timed, the median of 15 calls divided
by 24. Each variant's output for the first block is compared with the first variant's (largest
difference relative to the largest value). Prints a table last.

    python bench/moe_block.py --preset gpt-oss-20b --tokens 1,2,4,8 \\
        triton=moe=triton pair64=moe=mosaic_pair,moe_pair_max_pairs=64 slots=moe=mosaic_slots

A variant is NAME=FIELD=VALUE,FIELD=VALUE (values as in bench/generate_20b.py --kernels). A
speculative step's check of k = 3 drafted tokens for one sequence is 4 tokens.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--tokens", default="1,2,4,8")
    ap.add_argument("variants", nargs="+", help="NAME=FIELD=VALUE,FIELD=VALUE ...")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from generate_20b import kernels_from

    import gptoss_jax as gj
    from gptoss_jax.model.moe import MLPBlock
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset).replace(num_hidden_layers=1)
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype="mxfp4"))["block_0"]["mlp"]
    variants = {name: kernels_from(fields) for name, _, fields in (spec.partition("=") for spec in args.variants)}
    print(f"{args.preset} MoE block on {jax.devices()[0].device_kind}, jax {jax.__version__}", flush=True)
    rows = []
    for n in [int(t) for t in args.tokens.split(",")]:
        x = jax.random.normal(jax.random.key(n), (n, 1, config.hidden_size), jnp.bfloat16)
        first = None
        for name, kernels in variants.items():
            block = MLPBlock(config, jnp.bfloat16, kernels)
            one = jax.jit(lambda p, x, block=block: block.apply({"params": p}, x))
            chained = jax.jit(lambda p, x, block=block: jax.lax.fori_loop(
                0, 24, lambda i, x: (x + 0.01 * block.apply({"params": p}, x)).astype(x.dtype), x))
            y = np.asarray(one(params, x), np.float32)
            first = y if first is None else first
            diff = float(np.abs(y - first).max() / np.abs(first).max())
            jax.block_until_ready(chained(params, x))
            times = []
            for _ in range(15):
                t = time.perf_counter()
                jax.block_until_ready(chained(params, x))
                times.append(time.perf_counter() - t)
            rows.append((n, name, 1e6 * float(np.median(times)) / 24, diff))
            print(f"{n} tokens, {name}: {rows[-1][2]:.1f} us a block, difference {diff:.2e}", flush=True)
    print("\n| tokens | variant | us a block | difference from the first |\n|---:|---|---:|---:|")
    for n, name, us, diff in rows:
        print(f"| {n} | {name} | {us:.1f} | {diff:.1e} |")


if __name__ == "__main__":
    main()
