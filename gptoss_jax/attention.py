"""Attention with grouped KV heads, learned sinks and the optional sliding window.

Attention is softmax([q.k * scale, sink]) @ v with the sink column dropped:
- `attention_reference`: the plain [T, S] score matrix, kept as the readable definition for tests.
- `attention_blockwise`: the same, blockwise (online softmax, memory linear in T; kernels/xla.py).
- `AttentionBlock` asks the kernel layer (kernels/) for sink-free attention over each set of keys,
  with its softmax statistics, and folds the sinks in exactly (kernels/combine.py): one part without
  a cache; with one, the cache's earlier positions (or the sliding ring) and the new tokens.

Legend: B = batch, T = query positions, S = key positions, D = embed, N = query heads,
K = KV heads, G = query heads per KV head (N = K * G, head n reads KV head n // G), H = head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .cache import ring_positions
from .config import ModelConfig
from .kernels import Kernels, gpu, mosaic_attention, paged, tpu, triton, xla
from .kernels.attention_vjp import causal_attention
from .kernels.combine import combine
from .kernels.xla import MASKED, visible
from .layers import RMSNorm, apply_rope, rope_tables
from .paged_cache import POOL_AXES, window_pages
from .sharding import CACHE_AXES, constrain, spec
from .weight import Weight, declare, low_rank

# Tokens per call from which the q, k and v products are kept apart (prompts; see __call__).
SEPARATE_PROJECTIONS_FROM = 256
# Positions (sequences x table width x page) up to which a prompt chunk's cached prefix is gathered
# out of the paged cache for the flash kernel at once (about 0.5 GiB of keys and values at gpt-oss's
# 8 KV heads); longer tables are gathered a piece of columns at a time (kernels/paged.in_pieces).
GATHER_FOR_FLASH = 262_144


def attention_reference(q, k, v, sinks, q_pos, k_pos, *, window: int | None) -> jax.Array:
    """q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G], positions [B, T] and [B, S] -> [B, T, K, G, H].

    The readable definition: scores and softmax in float32 over [scores, sink] with the sink column
    dropped; probabilities are cast to v's dtype for the value product, as the references do.
    """
    scale = 1.0 / math.sqrt(q.shape[-1])
    s = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32) * scale
    mask = visible(q_pos, k_pos, window)[:, None, None]  # [B, 1, 1, T, S]
    s = jnp.where(mask, s, MASKED)
    sink = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None, None], s.shape[:-1] + (1,))
    p = jax.nn.softmax(jnp.concatenate([s, sink], axis=-1), axis=-1)[..., :-1]  # drop the sink column
    out = jnp.einsum("bkgts,bskh->btkgh", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def attention_blockwise(q, k, v, sinks, *, window: int | None, q_pos=None, kv_len=None,
                        q_block: int = 512, kv_block: int = 512) -> jax.Array:
    """Same contract as `attention_reference`, for keys at positions [0, S) (key j at position j),
    computed blockwise (kernels/xla.py): every row starts from its sink (m = sink, denominator 1).

    q_pos [B, T]: query positions, non-decreasing along T (default 0..T-1); kv_len [B]: keys at or
    past it are invisible (default S).
    """
    K, G = sinks.shape
    o, _ = xla.blockwise(q, k, v, window=window, q_pos=q_pos, kv_len=kv_len, q_block=q_block, kv_block=kv_block,
                         start=(sinks, jnp.ones((K, G), jnp.float32)))
    return o.astype(q.dtype)


def _product(t: jax.Array, weight: jax.Array) -> jax.Array:
    """t [B, T, D] times a k or v weight [D, K, H] -> [B, T, K, H].

    A single row (batch-1 decode) goes in twice: XLA's GPU compiler rewrites a one-row product whose
    operands hold fewer than 10M elements (k and v: 2880 x 512) into an elementwise product written
    out in full and a reduction, 6 times the weight's bytes; two rows keep it a matrix product. The
    barriers keep the simplifier from taking the second row back out.
    """
    if t.shape[0] * t.shape[1] != 1:
        return jnp.einsum("btd,dkh->btkh", t, weight)
    two = jax.lax.optimization_barrier(jnp.concatenate([t, t], axis=1))  # [1, 2, D]
    return jax.lax.optimization_barrier(jnp.einsum("btd,dkh->btkh", two, weight))[:, :1]


class AttentionBlock(nn.Module):
    """norm -> q, k, v projections -> RoPE -> attention with sinks -> output projection (no residual)."""

    config: ModelConfig
    layer: int
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()
    mesh: Mesh | None = None
    WEIGHTS: ClassVar = {
        "q_weight": Weight(("embed", "q_heads", "head_dim"), inputs=("embed",)),
        "q_bias": Weight(("q_heads", "head_dim"), init="zeros"),
        "k_weight": Weight(("embed", "kv_heads", "head_dim"), inputs=("embed",)),
        "k_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "v_weight": Weight(("embed", "kv_heads", "head_dim"), inputs=("embed",)),
        "v_bias": Weight(("kv_heads", "head_dim"), init="zeros"),
        "sinks": Weight(("q_heads",)),
        "out_weight": Weight(("q_heads", "head_dim", "embed"), inputs=("q_heads", "head_dim")),
        "out_bias": Weight(("embed",), init="zeros"),
    }

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, layer_cache=None, lengths=None, valid=None):
        """x [B, T, D], positions [B, T] -> [B, T, D].

        With a cache: the T new tokens of each sequence continue it (positions = lengths + 0..T-1,
        valid [B, T] marks real tokens, a prefix of each row); returns (out, updated layer cache).
        Without one, positions are 0..T-1.
        """
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        t = RMSNorm(cfg, name="norm")(x)
        tq = tk = tv = t
        if x.shape[0] * x.shape[1] >= SEPARATE_PROJECTIONS_FROM:
            # XLA's GPU compiler merges the three products of one input into one, concatenating
            # their weights (30 MB a layer) on every call; three distinct inputs keep them apart.
            tq, tk, tv = jax.lax.optimization_barrier((t, t, t))
        q = jnp.einsum("btd,dnh->btnh", tq, w["q_weight"]) + w["q_bias"]
        k = _product(tk, w["k_weight"]) + w["k_bias"]
        v = _product(tv, w["v_weight"]) + w["v_bias"]
        # Low-rank adapters, where training added them (params.adapter): 0 otherwise.
        q = q + low_rank(self, "q_weight", tq, "btd,dr->btr", "btr,rnh->btnh")
        k = k + low_rank(self, "k_weight", tk, "btd,dr->btr", "btr,rkh->btkh")
        v = v + low_rank(self, "v_weight", tv, "btd,dr->btr", "btr,rkh->btkh")
        cos, sin = rope_tables(cfg, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        B, T = x.shape[:2]
        q = q.reshape(B, T, cfg.num_key_value_heads, cfg.q_per_kv, cfg.head_dim)  # [B, T, K, G, H]
        sinks = w["sinks"].reshape(cfg.num_key_value_heads, cfg.q_per_kv)  # [K, G]
        window = cfg.sliding_window if cfg.is_sliding(self.layer) else None
        impl = self.kernels.attention_for(T, q.dtype)
        new_cache = None
        if layer_cache is not None:
            o, new_cache = self._cached(impl, q, k, v, sinks, positions, layer_cache, lengths, valid, window)
        elif impl == "reference":
            o = attention_reference(q, k, v, sinks, positions, positions, window=window)
        elif impl == "blockwise" and T > 16:
            # The sinks inside the blockwise attention's own backward pass (training).
            o = causal_attention(q, k, v, window, self.kernels.attention_block, sinks)[0].astype(q.dtype)
        else:
            o = combine([self._causal(impl, q, k, v, window)], sinks, q.dtype)
        o = o.reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
        out = jnp.einsum("btnh,nhd->btd", o, w["out_weight"]) + w["out_bias"]
        out = out + low_rank(self, "out_weight", o, "btnh,nhr->btr", "btr,rd->btd")
        return out if layer_cache is None else (out, new_cache)

    def _per_device(self, impl, fn, q, k, v, *rest):
        """fn(q, k, v, *rest) -> (o, lse), run on each device's sequences and KV heads when a fused
        kernel (which sees only local shapes) runs on a mesh; rest: per-sequence arrays [B]."""
        if self.mesh is None or impl in ("blockwise", "reference"):
            return fn(q, k, v, *rest)
        kv = spec(CACHE_AXES, k.shape, self.mesh)  # sequences on data, KV heads on tensor, where they divide
        q_spec, lse_spec = PartitionSpec(kv[0], None, kv[2], None, None), PartitionSpec(kv[0], None, kv[2], None)
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(q_spec, kv, kv) + (PartitionSpec(kv[0]),) * len(rest),
                             out_specs=(q_spec, lse_spec), check_vma=False)(q, k, v, *rest)

    def _causal(self, impl, q, k, v, window):
        """Attention among the same T positions (a prompt, a chunk, a decode step's own token) -> (o, lse)."""
        return self._per_device(impl, lambda q, k, v: self._causal_local(impl, q, k, v, window), q, k, v)

    def _prefix(self, impl, q, cache_k, cache_v, lengths):
        """Attention to each sequence's cached positions [0, lengths) -> (o, lse)."""
        return self._per_device(impl, lambda q, k, v, n: self._prefix_local(impl, q, k, v, n), q, cache_k, cache_v,
                                lengths)

    def _causal_local(self, impl, q, k, v, window):
        if impl == "tokamax":
            return gpu.causal(q, k, v, window=window)
        if impl == "splash":
            return tpu.causal(q, k, v, window=window, interpret=self.kernels.interpret)
        dense_max = q.shape[1] if impl == "reference" else 16
        return xla.causal(q, k, v, window=window, block=self.kernels.attention_block, dense_max=dense_max)

    def _prefix_local(self, impl, q, cache_k, cache_v, lengths):
        if impl == "tokamax":
            return gpu.prefix(q, cache_k, cache_v, lengths)
        if impl == "mosaic" and mosaic_attention.fits(q.shape, cache_k.shape[1], q.dtype):  # decode-sized
            return mosaic_attention.cache_attention(q, cache_k, cache_v, lengths, interpret=self.kernels.interpret)
        if impl == "triton" and q.shape[1] * q.shape[3] <= 128:  # decode-sized: rows of one program
            return triton.cache_attention(q, cache_k, cache_v, lengths, interpret=self.kernels.interpret)
        dense_max = q.shape[1] if impl == "reference" else 16
        return xla.prefix(q, cache_k, cache_v, lengths, block=self.kernels.attention_block, dense_max=dense_max)

    def _cached(self, impl, q, k, v, sinks, positions, layer_cache, lengths, valid, window):
        """Attention over (the cache's earlier positions) and (the new tokens), two parts combined with
        the sinks; the cache is written after it is read, so donating it updates it in place."""
        if "table" in layer_cache:
            return self._paged(impl, q, k, v, positions, layer_cache, lengths, valid, window, sinks)
        cache_k, cache_v = layer_cache["k"], layer_cache["v"]  # [B, S, K, H]
        B, S = cache_k.shape[:2]
        T = k.shape[1]
        k, v = k.astype(cache_k.dtype), v.astype(cache_v.dtype)
        # The new tokens among themselves: padding follows the real tokens, so causality hides it.
        own = self._causal(impl, q, k, v, window)
        if window is None:
            # Full attention: the cache's first `lengths` positions, then write the new keys at
            # their positions (padding is dropped).
            o = combine([self._prefix(impl, q, cache_k, cache_v, lengths), own], sinks, q.dtype)
            rows = jnp.arange(B)[:, None]
            at = jnp.where(valid, positions, S)  # out of range -> dropped
            cache_k = cache_k.at[rows, at].set(k, mode="drop")
            cache_v = cache_v.at[rows, at].set(v, mode="drop")
            return o, self._pin({"k": cache_k, "v": cache_v})
        # Sliding window: the ring holds the last S positions before the new tokens (at most
        # window of them are visible to any new token), then keeps the last S positions.
        ring_pos = ring_positions(lengths, S)  # [B, S]
        o = combine([self._ring(q, cache_k, cache_v, ring_pos, positions, window), own], sinks, q.dtype)
        new_pos = ring_positions(lengths + valid.sum(axis=1), S)  # [B, S]
        from_new = new_pos >= lengths[:, None]
        index = jnp.clip(new_pos - lengths[:, None], 0, T - 1)[..., None, None]  # [B, S, 1, 1]
        ring_k = jnp.where(from_new[..., None, None], jnp.take_along_axis(k, index, axis=1), cache_k)
        ring_v = jnp.where(from_new[..., None, None], jnp.take_along_axis(v, index, axis=1), cache_v)
        return o, self._pin({"k": ring_k, "v": ring_v})

    def _paged(self, impl, q, k, v, positions, layer_cache, lengths, valid, window, sinks):
        """As `_cached`, over a paged cache (paged_cache.py): the layer's storage [N, P, K, H] and its
        group's table [B, W]; the new keys and values are written at their positions after the read."""
        pool_k, pool_v, table = layer_cache["k"], layer_cache["v"], layer_cache["table"]
        k, v = k.astype(pool_k.dtype), v.astype(pool_v.dtype)
        own = self._causal(impl, q, k, v, window)
        mosaic = impl == "mosaic" and self.mesh is None and mosaic_attention.takes_pages(pool_k.shape[1])
        if window is None and mosaic and mosaic_attention.fits(
                q.shape, table.shape[1] * pool_k.shape[1], q.dtype):  # decode-sized, on one device
            before = mosaic_attention.cache_attention(q, pool_k, pool_v, lengths, table=table,
                                                      interpret=self.kernels.interpret)
        elif window is None and impl == "tokamax" and self.mesh is None:
            # A prompt chunk after its cached prefix: the flash kernel over the prefix's keys gathered
            # out of the pages, the whole table where it is short (one NVIDIA H200, 256 prompts of 1k
            # in chunks of 512, with the sliding layers' decode kernel below: first tokens at 2.6 s
            # p50, not 3.2 in jnp blocks), else a piece of columns at a time.
            before = self._flash_prefix(q, pool_k, pool_v, table, lengths)
        elif window is None:
            before = paged.prefix(q, pool_k, pool_v, table, lengths, block=self.kernels.attention_block,
                                  dense_max=q.shape[1] if impl == "reference" else 16)
        elif mosaic and mosaic_attention.fits(
                q.shape, window_pages(self.config, pool_k.shape[1]) * pool_k.shape[1], q.dtype):
            before = self._window_kernel(q, pool_k, pool_v, table, lengths, window)
        else:
            before = paged.window(q, pool_k, pool_v, table, lengths, positions, window=window,
                                  pages=window_pages(self.config, pool_k.shape[1]))
        o = combine([before, own], sinks, q.dtype)
        pool_k = paged.write(pool_k, table, positions, valid, k)
        pool_v = paged.write(pool_v, table, positions, valid, v)
        return o, {name: constrain(a, POOL_AXES, self.mesh) for name, a in (("k", pool_k), ("v", pool_v))}

    @staticmethod
    def _flash_prefix(q, pool_k, pool_v, table, lengths):
        """Full layers' cached prefix by the flash kernel: the table gathered whole when sequences x
        width x page <= GATHER_FOR_FLASH, else pieces of a power of two columns under that bound."""
        B, W, P = q.shape[0], table.shape[1], pool_k.shape[1]
        if B * W * P <= GATHER_FOR_FLASH:
            return gpu.prefix(q, paged.gather(pool_k, table), paged.gather(pool_v, table), lengths)
        pages = 1 << max(0, (GATHER_FOR_FLASH // (B * P)).bit_length() - 1)
        return paged.in_pieces(q, pool_k, pool_v, table, lengths, gpu.prefix, pages=pages)

    def _window_kernel(self, q, pool_k, pool_v, table, lengths, window):
        """A sliding layer's decode by the Mosaic GPU cache attention over the pages of its window
        (as `paged.window`): the table's columns from the page holding the window's first position,
        positions counted from that page."""
        P = pool_k.shape[1]
        first, ids = paged.window_table(table, lengths, window=window, pages=window_pages(self.config, P),
                                        page_size=P)
        return mosaic_attention.cache_attention(q, pool_k, pool_v, lengths - first * P, table=ids,
                                                start=lengths - window + 1 - first * P, block_k=max(64, P),
                                                interpret=self.kernels.interpret)

    @staticmethod
    def _ring(q, ring_k, ring_v, ring_pos, positions, window):
        """Attention of the new tokens to a sliding layer's ring (positions before them) -> (o, lse).

        New token t sits at position lengths + t and every ring position is below lengths, so only
        tokens t < window - 1 can see any of the ring: the scores are computed for the first `window`
        tokens alone, and the rest see none of its keys (lse -inf). A 4096-token prompt chunk then
        scores 128 queries against the ring, not 4096.
        """
        T = q.shape[1]
        seeing = min(T, window)
        q, positions = q[:, :seeing], positions[:, :seeing]
        in_window = (ring_pos[:, None, :] >= 0) & (ring_pos[:, None, :] > positions[:, :, None] - window)
        o, lse = xla.dense(q, ring_k, ring_v, in_window)
        if seeing < T:
            o = jnp.pad(o, ((0, 0), (0, T - seeing), (0, 0), (0, 0), (0, 0)))
            lse = jnp.pad(lse, ((0, 0), (0, T - seeing), (0, 0), (0, 0)), constant_values=-jnp.inf)
        return o, lse

    def _pin(self, layer_cache: dict) -> dict:
        """Keep the updated cache in the layout it came in, so that donating it reuses its buffers."""
        return {name: constrain(a, CACHE_AXES, self.mesh) for name, a in layer_cache.items()}
