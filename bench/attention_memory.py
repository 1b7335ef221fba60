"""Peak temporary memory of the two attention kernels versus prompt length, at gpt-oss-20b's sizes.

XLA's buffer assignment of the compiled function is read (`compiled.memory_analysis()`), so nothing
of size T x T is ever allocated and a 32k-token reference attention can be "measured" on a laptop.

    python bench/attention_memory.py [--lengths 1024,2048,...] [--block 512]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import gptoss_jax as gj
from gptoss_jax.model.attention import attention_blockwise, attention_reference


def temp_mib(fn, T: int, config: gj.ModelConfig) -> float:
    K, G, H = config.num_key_value_heads, config.q_per_kv, config.head_dim
    q = jax.ShapeDtypeStruct((1, T, K, G, H), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.bfloat16)
    sinks = jax.ShapeDtypeStruct((K, G), jnp.bfloat16)
    return jax.jit(fn).lower(q, kv, kv, sinks).compile().memory_analysis().temp_size_in_bytes / 2**20


def _reference(T: int, window: int | None):
    pos = jnp.arange(T)[None]
    return lambda q, k, v, s: attention_reference(q, k, v, s, pos, pos, window=window)


def _blockwise(window: int | None, block: int):
    return lambda q, k, v, s: attention_blockwise(q, k, v, s, window=window, q_block=block, kv_block=block)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768",
                        help="comma-separated prompt lengths (default: %(default)s)")
    parser.add_argument("--block", type=int, default=512, help="blockwise query/key block size (default: %(default)s)")
    args = parser.parse_args()
    config = gj.ModelConfig.gpt_oss_20b()
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; one attention layer of gpt-oss-20b "
          f"(64 query heads, 8 KV heads, head dim 64), bfloat16, batch 1; temporary memory in MiB")
    print("| prompt tokens | reference, full | blockwise, full | reference, sliding 128 | blockwise, sliding 128 |")
    print("|---:|---:|---:|---:|---:|")
    for T in (int(x) for x in args.lengths.split(",")):
        row = [temp_mib(fn, T, config) for window in (None, config.sliding_window)
               for fn in (_reference(T, window), _blockwise(window, args.block))]
        ref_full, blk_full, ref_slide, blk_slide = row
        print(f"| {T} | {ref_full:,.0f} | {blk_full:,.0f} | {ref_slide:,.0f} | {blk_slide:,.0f} |")


if __name__ == "__main__":
    main()
