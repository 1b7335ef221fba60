"""Attention with grouped KV heads, learned sinks and the optional sliding window.

Two interchangeable kernels compute softmax([q.k * scale, sink]) @ v with the sink column dropped:
- `attention_reference`: the plain [T, S] score matrix, kept as the readable definition for tests.
- `attention_blockwise`: online softmax over key blocks (flash-attention style), never holding
  more than [q_block, kv_block] scores per head; on sliding layers it only visits the key blocks
  that overlap the window. Memory grows linearly with the prompt length.

Legend: B = batch, T = query positions, S = key positions, D = embed, N = query heads,
K = KV heads, G = query heads per KV head (N = K * G, head n reads KV head n // G), H = head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .cache import ring_positions
from .config import ModelConfig
from .layers import RMSNorm, apply_rope, rope_tables
from .params import Weight, declare
from .sharding import CACHE_AXES, constrain

_MASKED = -1e30  # finite, so a fully masked block gives exp(-huge) = 0 rather than NaN


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """[..., T, S] mask: causal, inside the window (i - window < j <= i) when given, keys with position >= 0."""
    q = q_pos[..., :, None]
    k = k_pos[..., None, :]
    keep = (k <= q) & (k >= 0)
    if window is not None:
        keep &= k > q - window
    return keep


def key_block_range(first_q, last_q, kv_block: int, num_keys: int, window: int | None):
    """(lo, hi), inclusive: the key blocks holding any key visible to queries at positions [first_q, last_q].

    Causality bounds hi; on sliding layers the window bounds lo, so blocks wholly before the window
    are never visited. Key j sits at position j.
    """
    lo = 0 if window is None else jnp.maximum(first_q - window + 1, 0) // kv_block
    hi = jnp.minimum(last_q, num_keys - 1) // kv_block
    return lo, hi


def attention_reference(q, k, v, sinks, q_pos, k_pos, *, window: int | None) -> jax.Array:
    """q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G], positions [B, T] and [B, S] -> [B, T, K, G, H].

    Scores and softmax in float32; probabilities are cast to v's dtype for the value product, as the
    references do.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = _visible(q_pos, k_pos, window)[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, _MASKED)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]  # drop the sink column
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def attention_blockwise(q, k, v, sinks, *, window: int | None, q_pos=None, kv_len=None,
                        q_block: int = 512, kv_block: int = 512) -> jax.Array:
    """Same contract as `attention_reference`, for keys at positions [0, S) (key j at position j).

    q_pos [B, T]: query positions, non-decreasing along T (default 0..T-1); kv_len [B]: keys at or
    past it are invisible (default S), as in a KV cache holding kv_len positions.

    Queries are processed a block at a time (lax.map), each visiting only the key blocks that can be
    visible to it (a dynamic-bound loop), with a running max m, denominator denom and accumulator acc.
    The sink is folded in exactly by starting every row at m = sink, denom = 1, acc = 0.
    """
    B, T, K, G, H = q.shape
    S = k.shape[1]
    scale = 1.0 / math.sqrt(H)
    bq, bk = min(q_block, T), min(kv_block, S)
    nq = -(-T // bq)
    if q_pos is None:
        q_pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    kv_len = jnp.full((B,), S) if kv_len is None else kv_len
    q = jnp.pad(q, ((0, 0), (0, nq * bq - T), (0, 0), (0, 0), (0, 0)))
    q_pos = jnp.pad(q_pos, ((0, 0), (0, nq * bq - T)), mode="edge")  # padding rows repeat the last query
    # Keys are not padded (that would copy a whole KV cache every step): the last block starts at
    # S - bk instead, and its keys before j * bk, which the previous block already counted, are masked.
    q_blocks = q.reshape(B, nq, bq, K, G, H).swapaxes(0, 1)  # [nq, B, bq, K, G, H]
    pos_blocks = q_pos.reshape(B, nq, bq).swapaxes(0, 1)  # [nq, B, bq]
    sink = sinks.astype(jnp.float32)[None, :, :, None]  # [1, K, G, 1]

    def one_query_block(args):
        q_blk, pos_blk = args
        lo, hi = key_block_range(pos_blk[:, 0].min(), pos_blk[:, -1].max(), bk, S, window)

        def visit(j, carry):
            m, denom, acc = carry
            first = jnp.minimum(j * bk, S - bk)
            k_blk = jax.lax.dynamic_slice_in_dim(k, first, bk, axis=1)  # [B, bk, K, H]
            v_blk = jax.lax.dynamic_slice_in_dim(v, first, bk, axis=1)
            k_pos = first + jnp.arange(bk)
            seen = (k_pos[None] < kv_len[:, None]) & (k_pos[None] >= j * bk)
            k_pos = jnp.where(seen, k_pos[None], -1)  # [B, bk]; -1 never visible
            s = jnp.einsum("bqkgh,bskh->bkgqs", q_blk, k_blk, preferred_element_type=jnp.float32) * scale
            s = jnp.where(_visible(pos_blk, k_pos, window)[:, None, None], s, _MASKED)
            m_new = jnp.maximum(m, s.max(axis=-1))
            alpha = jnp.exp(m - m_new)
            p = jnp.exp(s - m_new[..., None])
            denom = denom * alpha + p.sum(axis=-1)
            pv = jnp.einsum("bkgqs,bskh->bkgqh", p.astype(v.dtype), v_blk, preferred_element_type=jnp.float32)
            return m_new, denom, acc * alpha[..., None] + pv

        m0 = jnp.broadcast_to(sink, (B, K, G, bq))
        carry = (m0, jnp.ones_like(m0), jnp.zeros((B, K, G, bq, H), jnp.float32))
        _, denom, acc = jax.lax.fori_loop(lo, hi + 1, visit, carry)
        return (acc / denom[..., None]).transpose(0, 3, 1, 2, 4)  # [B, bq, K, G, H]

    out = jax.lax.map(one_query_block, (q_blocks, pos_blocks))  # [nq, B, bq, K, G, H]
    out = out.swapaxes(0, 1).reshape(B, nq * bq, K, G, H)[:, :T]
    return out.astype(q.dtype)


class AttentionBlock(nn.Module):
    """norm -> q, k, v projections -> RoPE -> attention with sinks -> output projection (no residual)."""

    config: ModelConfig
    layer: int
    param_dtype: jnp.dtype = jnp.bfloat16
    impl: str = "blockwise"  # "blockwise" or "reference"
    block_size: int = 512
    mesh: Mesh | None = None
    WEIGHTS: ClassVar = {
        "q_weight": Weight(("embed", "q_heads", "head_dim")),
        "q_bias": Weight(("q_heads", "head_dim"), init="zeros"),
        "k_weight": Weight(("embed", "kv_heads", "head_dim")),
        "k_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "v_weight": Weight(("embed", "kv_heads", "head_dim")),
        "v_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "sinks": Weight(("q_heads",)),
        "out_weight": Weight(("q_heads", "head_dim", "embed")),
        "out_bias": Weight(("embed",), init="zeros"),
    }

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, layer_cache=None, lengths=None, valid=None):
        """x [B, T, D], positions [B, T] -> [B, T, D].

        With a cache: the T new tokens of each sequence continue it (positions = lengths + 0..T-1,
        valid [B, T] marks real tokens, a prefix of each row); returns (out, updated layer cache).
        """
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        t = RMSNorm(cfg, name="norm")(x)
        q = jnp.einsum("btd,dnh->btnh", t, w["q_weight"]) + w["q_bias"]
        k = jnp.einsum("btd,dkh->btkh", t, w["k_weight"]) + w["k_bias"]
        v = jnp.einsum("btd,dkh->btkh", t, w["v_weight"]) + w["v_bias"]
        cos, sin = rope_tables(cfg, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        B, T = x.shape[:2]
        q = q.reshape(B, T, cfg.num_key_value_heads, cfg.q_per_kv, cfg.head_dim)  # [B, T, K, G, H]
        sinks = w["sinks"].reshape(cfg.num_key_value_heads, cfg.q_per_kv)  # [K, G]
        window = cfg.sliding_window if cfg.is_sliding(self.layer) else None
        new_cache = None
        if layer_cache is not None:
            o, new_cache = self._cached(q, k, v, sinks, positions, layer_cache, lengths, valid, window)
        elif self.impl == "reference":
            o = attention_reference(q, k, v, sinks, positions, positions, window=window)
        elif self.impl == "blockwise":
            o = attention_blockwise(q, k, v, sinks, window=window, q_pos=positions,
                                    q_block=self.block_size, kv_block=self.block_size)
        else:
            raise ValueError(f"unknown attention implementation {self.impl!r}")
        o = o.reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
        out = jnp.einsum("btnh,nhd->btd", o, w["out_weight"]) + w["out_bias"]
        return out if layer_cache is None else (out, new_cache)

    def _cached(self, q, k, v, sinks, positions, layer_cache, lengths, valid, window):
        cache_k, cache_v = layer_cache["k"], layer_cache["v"]  # [B, S, K, H]
        B, S = cache_k.shape[:2]
        T = k.shape[1]
        new_lengths = lengths + valid.sum(axis=1)
        if window is None:
            # Full attention: write the new keys at their positions (padding is dropped), then
            # attend over the cache up to each sequence's new length.
            rows = jnp.arange(B)[:, None]
            at = jnp.where(valid, positions, S)  # out of range -> dropped
            cache_k = cache_k.at[rows, at].set(k.astype(cache_k.dtype), mode="drop")
            cache_v = cache_v.at[rows, at].set(v.astype(cache_v.dtype), mode="drop")
            o = attention_blockwise(q, cache_k, cache_v, sinks, window=None, q_pos=positions, kv_len=new_lengths,
                                    q_block=self.block_size, kv_block=self.block_size)
            return o, self._pin({"k": cache_k, "v": cache_v})
        # Sliding window: the ring holds the last S positions before the new tokens; attend over
        # ring + new tokens (at most S + T keys), then keep the last S positions in the ring.
        ring_pos = ring_positions(lengths, S)
        keys = jnp.concatenate([cache_k, k.astype(cache_k.dtype)], axis=1)
        values = jnp.concatenate([cache_v, v.astype(cache_v.dtype)], axis=1)
        key_pos = jnp.concatenate([ring_pos, jnp.where(valid, positions, -1)], axis=1)
        o = attention_reference(q, keys, values, sinks, positions, key_pos, window=window)
        new_pos = ring_positions(new_lengths, S)  # [B, S]
        from_new = new_pos >= lengths[:, None]
        index = jnp.clip(new_pos - lengths[:, None], 0, T - 1)[..., None, None]  # [B, S, 1, 1]
        ring_k = jnp.where(from_new[..., None, None], jnp.take_along_axis(k, index, axis=1), cache_k)
        ring_v = jnp.where(from_new[..., None, None], jnp.take_along_axis(v, index, axis=1), cache_v)
        return o, self._pin({"k": ring_k.astype(cache_k.dtype), "v": ring_v.astype(cache_v.dtype)})

    def _pin(self, layer_cache: dict) -> dict:
        """Keep the updated cache in the layout it came in, so that donating it reuses its buffers."""
        return {name: constrain(a, CACHE_AXES, self.mesh) for name, a in layer_cache.items()}
