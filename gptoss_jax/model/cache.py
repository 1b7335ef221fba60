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

from .. import fp8
from ..config import ModelConfig
from ..kernels import ring
from ..sharding import CACHE_AXES, cache_shardings, constrain, zeros_on_devices
from .paged_cache import Paged


ALIGN = 128  # full layers' slots are a multiple of this, so fused kernels tile the cache without padding a copy


def slots(config: ModelConfig, layer: int, max_len: int) -> int:
    if config.is_sliding(layer):
        return min(config.sliding_window, max_len)
    return -(-max_len // ALIGN) * ALIGN


def cache_shapes(config: ModelConfig, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """The cache's `jax.ShapeDtypeStruct`s (nothing allocated); float8_e4m3fn: FP8 storage (fp8.py)."""
    cache: dict = {"lengths": jax.ShapeDtypeStruct((batch,), jnp.int32)}
    for n in range(config.num_hidden_layers):
        shape = (batch, slots(config, n, max_len), config.num_key_value_heads, config.head_dim)
        cache[f"block_{n}"] = {x: fp8.storage_shapes(shape, dtype) for x in ("k", "v")}
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
    per_slot = 2 * config.num_key_value_heads * fp8.vector_bytes(config.head_dim, dtype)
    return batch * per_slot * sum(slots(config, n, max_len) for n in range(config.num_hidden_layers))


def ring_positions(lengths: jax.Array, size: int) -> jax.Array:
    """[B, size]: the position each ring slot holds for sequences of the given lengths (-1: empty)."""
    s = jnp.arange(size)[None]
    back = lengths[:, None] - 1 - s  # >= 0 when some position < length maps to slot s
    return jnp.where(back >= 0, s + size * (back // size), -1)


class Contiguous:
    """The contiguous layout's side of the cache contract (attention.py reads and writes a layer
    through `layout_of(layer_cache)`; paged_cache.Paged is the other side): row b of the cache is
    row b of the call."""

    @staticmethod
    def attend(ops, q, k, v, layer_cache: dict, positions, lengths, valid, window: int | None, mesh=None):
        """The new tokens' queries q [B, T, K, G, H] over the layer's earlier positions -> ((o, lse),
        the layer cache with the new keys and values k, v [B, T, K, H] written; read before the write,
        so donating it updates it in place). Full layers: the first `lengths` positions, the new ones
        written at `positions` (valid [B, T]; padding dropped). Sliding layers: the ring holds the last
        S positions before the new tokens (at most `window` of them are visible to any new token),
        then keeps the last S positions."""
        cache_k, cache_v = layer_cache["k"], layer_cache["v"]  # [B, S, K, H]
        B, S = cache_k.shape[:2]
        T = k.shape[1]
        new = {"k": fp8.like(cache_k, k), "v": fp8.like(cache_v, v)}
        if window is None:
            before = ops.prefix(q, cache_k, cache_v, jnp.minimum(lengths, S))
            at = jnp.where(valid, positions, S)  # out of range -> dropped
            rows = jnp.arange(B)[:, None]
            write = lambda a, x: a.at[rows, at].set(x, mode="drop")  # noqa: E731
        else:
            before = ring(q, cache_k, cache_v, ring_positions(lengths, S), positions, window)
            new_pos = ring_positions(lengths + valid.sum(axis=1), S)  # [B, S]
            from_new = new_pos >= lengths[:, None]
            index = jnp.clip(new_pos - lengths[:, None], 0, T - 1)  # [B, S]
            write = lambda a, x: jnp.where(_lead(from_new, a), jnp.take_along_axis(x, _lead(index, x), axis=1), a)  # noqa: E731
        written = {name: fp8.scatter(layer_cache[name], write, new[name]) for name in ("k", "v")}
        # Kept in the layout it came in, so that donating it reuses its buffers.
        return before, {name: constrain(a, CACHE_AXES, mesh) for name, a in written.items()}

    @staticmethod
    def keep(config: ModelConfig, cache: dict, before: dict, written: dict, valid: jax.Array,
             kept: jax.Array) -> dict:
        """The cache after a step that wrote the `valid` [B, T] positions from `before`'s lengths on
        (`written`), keeping only the first `kept` [B] of them (a checked step's rejected drafts
        dropped): full layers' other positions zeroed, the sliding layers' ring slots they took given
        back their earlier positions (`before`'s). Over one position there is nothing to take back."""
        if valid.shape[1] == 1:
            return written
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
                from_step = ring_positions(new_lengths, S) >= lengths[:, None]  # [B, S]
                keep = lambda a, b: jnp.where(_lead(from_step, a), a, b)  # noqa: E731
                out[name] = {x: fp8.scatter(layer[x], keep, before[name][x]) for x in ("k", "v")}
            else:
                at = jnp.where(dropped, lengths[:, None] + jnp.arange(T)[None], S)  # out of range -> dropped
                rows = jnp.arange(B)[:, None]
                out[name] = {x: fp8.apply(lambda a: a.at[rows, at].set(0, mode="drop"), layer[x]) for x in ("k", "v")}
        return out


def _lead(x: jax.Array, like: jax.Array) -> jax.Array:
    """x [B, S] with trailing axes of 1 to broadcast against `like` [B, S, ...] (keys, or FP8 exponents)."""
    return x.reshape(x.shape + (1,) * (like.ndim - x.ndim))


def layout_of(cache: dict):
    """The side of the cache contract a cache, or a layer's view of it, is on: `Paged` where it has
    page tables, else `Contiguous`."""
    return Paged if "tables" in cache or "table" in cache else Contiguous
