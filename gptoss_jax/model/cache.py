"""The KV cache: a pytree of static shapes, so the decode step compiles once and can donate it.

    {"lengths": int32 [B],                       positions held per sequence (prompts may differ)
     "block_N": {"k": [B, S, K, H], "v": [B, S, K, H]}, ...}
Full-attention layers hold S = max_len positions rounded up to a multiple of 128, key j at position
j. Sliding-window layers hold a ring of S = min(window, max_len) slots, never more: slot s holds the
latest position p < length with p % S == s. For gpt-oss-20b at 131072 positions that is 3 GiB per
sequence in bf16 (12 full layers), the 12 sliding layers adding 3 MiB.

Legend: B = batch, S = cache slots, K = KV heads, H = head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..sharding import cache_shardings, zeros_on_devices


ALIGN = 128  # full layers' slots are a multiple of this, so fused kernels tile the cache without padding a copy


def slots(config: ModelConfig, layer: int, max_len: int) -> int:
    if config.is_sliding(layer):
        return min(config.sliding_window, max_len)
    return -(-max_len // ALIGN) * ALIGN


def cache_shapes(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """The cache's `jax.ShapeDtypeStruct`s (nothing allocated)."""
    cache: dict = {"lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    for n in range(config.num_hidden_layers):
        shape = (batch, slots(config, n, max_len), config.num_key_value_heads, config.head_dim)
        cache[f"block_{n}"] = {"k": jax.ShapeDtypeStruct(shape, dtype), "v": jax.ShapeDtypeStruct(shape, dtype)}
    return cache


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16, *, mesh=None) -> dict:
    """An empty cache for `batch` sequences of up to `max_len` positions each, made on the devices.

    With a mesh, it is made in place on its devices: sequences on `data`, KV heads on `tensor`
    (each where they divide; see sharding.py).
    """
    return zeros_on_devices(*_layout(config, batch, max_len, jnp.dtype(dtype), mesh))


@functools.lru_cache(maxsize=32)
def _layout(config: ModelConfig, batch: int, max_len: int, dtype, mesh) -> tuple:
    """(shapes, shardings or None): kept, since building them takes the host about 0.5 ms, and every
    generation makes a cache."""
    shapes = cache_shapes(config, batch, max_len, dtype)
    return shapes, None if mesh is None else cache_shardings(shapes, mesh)


def cache_bytes(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> int:
    per_slot = 2 * config.num_key_value_heads * config.head_dim * jnp.dtype(dtype).itemsize
    return batch * per_slot * sum(slots(config, n, max_len) for n in range(config.num_hidden_layers))


def ring_positions(lengths: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position each ring slot holds for sequences of the given lengths (-1: empty)."""
    s = jnp.arange(size)[None]
    back = lengths[:, None] - 1 - s  # >= 0 when some position < length maps to slot s
    return jnp.where(back >= 0, s + size * (back // size), -1)


def max_positions(cache: dict) -> int:
    """The max_len the cache was made for (the largest layer's slot count)."""
    return max(int(np.shape(layer["k"])[1]) for name, layer in cache.items() if name != "lengths")


def roll_back(config: ModelConfig, before: dict, written: dict, valid: jax.Array, kept: jax.Array) -> dict:
    """The cache after a step that wrote the `valid` [B, T] positions from `before`'s lengths on
    (`written`), keeping only the first `kept` [B] of them (a checked step's rejected drafts dropped): full layers' other positions zeroed, the
    sliding layers' ring slots they took given back their earlier positions (`before`'s)."""
    lengths = before["lengths"]
    new_lengths = lengths + kept
    T = valid.shape[1]
    dropped = valid & (jnp.arange(T)[None] >= kept[:, None])  # [B, T]
    out = {"lengths": new_lengths}
    for name, layer in written.items():
        if name == "lengths":
            continue
        B, S = layer["k"].shape[:2]
        if config.is_sliding(int(name.split("_")[1])):
            # A slot whose position (for the kept length) is from this step holds it in `written`
            # (T <= S, so no later position of the step took the slot); any other, in `before`.
            from_step = (ring_positions(new_lengths, S) >= lengths[:, None])[..., None, None]  # [B, S, 1, 1]
            out[name] = {x: jnp.where(from_step, layer[x], before[name][x]) for x in ("k", "v")}
        else:
            at = jnp.where(dropped, lengths[:, None] + jnp.arange(T)[None], S)  # out of range -> dropped
            rows = jnp.arange(B)[:, None]
            out[name] = {x: layer[x].at[rows, at].set(0, mode="drop") for x in ("k", "v")}
    return out
