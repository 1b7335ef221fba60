"""gpt-oss's MoE block (norm, router, experts) for a few tokens, by `Kernels` variant: its time and
the rate at which it reads what it must (each expert in use once, with its scales and biases, and
the router), against the GPU's copy bandwidth measured in the same run.

`--layers` distinct layers of full-size synthetic weights (each its own arrays) are chained in one jitted call (x = x +
0.01 moe(x), so each block routes anew), so that no layer's experts are still in the L2 cache when
the next block reads its own; the call is timed on the host, the median of `--runs` calls divided
by the layers. The bytes a block must read come from the routing of the same chain (experts in use
counted per layer). Each variant's output for the first layer is compared with the first
variant's (largest difference relative to the largest value): make the first the jnp path.

    python bench/moe_block.py --preset gpt-oss-20b --dtype mxfp4,bfloat16 --tokens 1,2,4,8,16,64 \\
        jnp=moe=gather auto= triton=moe=triton

A variant is NAME=FIELD=VALUE,FIELD=VALUE (values as in bench/generate_20b.py --kernels; NAME= alone:
"auto"). A variant the registry refuses for a dtype or machine (an MXFP4-only kernel over bf16
experts, a Hopper kernel elsewhere) is reported as such and skipped, its row in the table saying so.
A speculative step's check of k = 3 drafted tokens for one sequence is 4 tokens.
With --profile DIR, each variant's chain at the --profile-tokens sizes is traced once more
(DIR/<dtype>_<tokens>_<variant>) and its kernels are listed last, per block (bench/profile_summary.py).
The copy bandwidth: bytes read and written by x + 1 over a 4 GiB array, the best of 10.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def copy_bandwidth(gib: float = 4.0, runs: int = 10) -> float:
    """Bytes a second that x + 1 reads and writes over a `gib` GiB uint32 array (the best of `runs`;
    4-byte elements: over bytes, XLA's elementwise kernel reads far below the memory's rate)."""
    import jax
    import jax.numpy as jnp

    x = jnp.zeros((int(gib * 2**30) // 4,), jnp.uint32)
    step = jax.jit(lambda x: x + 1, donate_argnums=0)
    x = jax.block_until_ready(step(x))
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        x = jax.block_until_ready(step(x))
        best = min(best, time.perf_counter() - t)
    return 2 * x.nbytes / best


def expert_bytes(layer) -> tuple[int, int]:
    """(bytes of one expert's weights, scales and biases; bytes of the router) of one layer's MoE
    parameters."""
    import jax

    def size(x):
        return sum(leaf.nbytes for leaf in jax.tree.leaves(x))

    E = layer["router_bias"].shape[0]
    experts = sum(size(layer[name]) for name in ("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias"))
    return experts // E, size(layer["router_weight"]) + size(layer["router_bias"]) + size(layer["norm"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="gpt-oss-20b")
    ap.add_argument("--dtype", default="mxfp4", help="experts' dtypes, comma-separated: mxfp4, bfloat16")
    ap.add_argument("--tokens", default="1,2,4,8,16,64")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers chained in a call (default 8)")
    ap.add_argument("--runs", type=int, default=15, help="timed calls; the median is reported (default 15)")
    ap.add_argument("--copy-gib", type=float, default=4.0, help="array size of the copy-bandwidth measurement")
    ap.add_argument("--profile", metavar="DIR", help="trace each variant's chain and list its kernels per block")
    ap.add_argument("--profile-tokens", default="1,8", help="the sizes --profile traces (default 1,8)")
    ap.add_argument("--top", type=int, default=8, help="kernels listed per profiled variant (default 8)")
    ap.add_argument("variants", nargs="+", help="NAME=FIELD=VALUE,FIELD=VALUE ...")
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from generate_20b import kernels_from
    from profile_summary import gpu_kernels, load

    import gptoss_jax as gj
    from gptoss_jax.model.moe import MLPBlock, route
    from gptoss_jax.model.layers import RMSNorm
    from gptoss_jax.testing import random_params_on_device

    config = gj.ModelConfig.preset(args.preset).replace(num_hidden_layers=args.layers)
    variants = {name: kernels_from(fields) for name, _, fields in (spec.partition("=") for spec in args.variants)}
    device = jax.devices()[0].device_kind
    copy = copy_bandwidth(args.copy_gib)
    print(f"{args.preset} MoE block on {device}, jax {jax.__version__}; copy bandwidth {copy / 1e12:.2f} TB/s "
          f"(70%: {0.7 * copy / 1e12:.2f})", flush=True)
    rows, profiles = [], []
    for dtype in args.dtype.split(","):
        params = random_params_on_device(config, seed=0, dtype=dtype)
        # Each layer's weights their own arrays, as in the model (slices of one stacked array would
        # be copied out for the kernels each call).
        layers = [params[f"block_{i}"]["mlp"] for i in range(args.layers)]
        del params
        per_expert, router = expert_bytes(layers[0])

        def used_experts(layers, x):
            """Experts in use per layer [L] along the chain (the auto variant's outputs feed it)."""
            block = MLPBlock(config, jnp.bfloat16, gj.Kernels())

            counts = []
            for p in layers:
                t = RMSNorm(config).apply({"params": p["norm"]}, x).reshape(-1, config.hidden_size)
                _, idx = route(t, p["router_weight"], p["router_bias"], config.experts_per_token)
                counts.append(jnp.zeros((config.num_experts,), bool).at[idx.reshape(-1)].set(True).sum())
                x = (x + 0.01 * block.apply({"params": p}, x)).astype(x.dtype)
            return jnp.stack(counts)

        for n in [int(t) for t in args.tokens.split(",")]:
            x = jax.random.normal(jax.random.key(n), (n, 1, config.hidden_size), jnp.bfloat16)
            used = np.asarray(jax.jit(used_experts)(layers, x))
            must_read = float(np.mean(used) * per_expert + router)
            first = None
            for name, kernels in variants.items():
                block = MLPBlock(config, jnp.bfloat16, kernels)
                def chain(layers, x, block=block):
                    for p in layers:
                        x = (x + 0.01 * block.apply({"params": p}, x)).astype(x.dtype)
                    return x

                one = jax.jit(lambda layers, x, block=block: block.apply({"params": layers[0]}, x))
                chained = jax.jit(chain)
                try:
                    y = np.asarray(one(layers, x), np.float32)
                except ValueError as e:  # the registry's refusal: a variant that cannot run these experts here
                    print(f"{dtype}, {n} tokens, {name}: skipped ({str(e).splitlines()[0]})", flush=True)
                    rows.append((dtype, n, name, None, float(np.mean(used)), None, None))
                    continue
                first = y if first is None else first
                diff = float(np.abs(y - first).max() / np.abs(first).max())
                jax.block_until_ready(chained(layers, x))
                times = []
                for _ in range(args.runs):
                    t = time.perf_counter()
                    jax.block_until_ready(chained(layers, x))
                    times.append(time.perf_counter() - t)
                seconds = float(np.median(times)) / args.layers
                rows.append((dtype, n, name, 1e6 * seconds, float(np.mean(used)), must_read / seconds, diff))
                if args.profile and str(n) in args.profile_tokens.split(","):
                    folder = os.path.join(args.profile, f"{dtype}_{n}_{name}")
                    with jax.profiler.trace(folder, create_perfetto_trace=True):
                        for _ in range(3):
                            jax.block_until_ready(chained(layers, x))
                    profiles.append((f"{dtype}, {n} tokens, {name}", folder, 3 * args.layers))
                print(f"{dtype}, {n} tokens, {name}: {1e6 * seconds:.1f} us a block, {must_read / 2**20:.1f} MiB "
                      f"to read, {must_read / seconds / 1e12:.2f} TB/s, difference {diff:.2e}", flush=True)
        del layers
    for title, folder, blocks in profiles:
        kernels = gpu_kernels(load(folder))
        by_name, count = collections.Counter(), collections.Counter()
        for e in kernels:
            by_name[e["name"]] += e["dur"]
            count[e["name"]] += 1
        busy = sum(by_name.values())
        print(f"\n{title}: GPU busy {busy / blocks:.1f} us a block\n| kernel | calls a block | us a block |\n|---|---:|---:|")
        for kernel, us in by_name.most_common(args.top):
            print(f"| {kernel[:90]} | {count[kernel] / blocks:.1f} | {us / blocks:.1f} |")
    print(f"\n{args.preset} MoE block, {device}: copy bandwidth {copy / 1e12:.2f} TB/s")
    print("\n| experts | tokens | variant | us a block | experts read | TB/s | of copy | difference |\n"
          "|---|---:|---|---:|---:|---:|---:|---:|")
    for dtype, n, name, us, used, rate, diff in rows:
        if us is None:
            print(f"| {dtype} | {n} | {name} | skipped: cannot run here | {used:.1f} | | | |")
            continue
        print(f"| {dtype} | {n} | {name} | {us:.1f} | {used:.1f} | {rate / 1e12:.2f} | {rate / copy:.0%} "
              f"| {diff:.1e} |")


if __name__ == "__main__":
    main()
