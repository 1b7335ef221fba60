"""Attention with grouped KV heads, learned sinks and the optional sliding window.

Attention is softmax([q.k * scale, sink]) @ v with the sink column dropped:
- `attention_reference`: the plain [T, S] score matrix, kept as the readable definition for tests.
- `attention_blockwise`: the same, blockwise (online softmax, memory linear in T).
  (Both are the kernel layer's jnp code, kernels/attention/xla.py, named here as the model's definition.)
- `AttentionBlock` asks the kernel layer for the call's attention operations (`Kernels.attention_ops`:
  sink-free attention over each set of keys, with its softmax statistics) and folds the sinks in
  exactly (`fold_sinks`, kernels/combine.py): one part without a cache; with one, the cache's earlier positions
  (or the sliding ring) and the new tokens.

Legend: B = batch, T = query positions, S = key positions, D = embed, N = query heads,
K = KV heads, G = query heads per KV head (N = K * G, head n reads KV head n // G), H = head dim.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..config import ModelConfig
from ..kernels import Kernels, attention_blockwise, attention_reference, fold_sinks
from ..weight import Weight, declare, low_rank
from .cache import layout_of
from .layers import RMSNorm, apply_rope, rope_tables

__all__ = ["AttentionBlock", "attention_blockwise", "attention_reference"]

# Tokens per call from which the q, k and v products are kept apart (prompts; see __call__).
SEPARATE_PROJECTIONS_FROM = 256


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
        ops = self.kernels.attention_ops(T, q.dtype, mesh=self.mesh)
        if layer_cache is not None:
            # The cache's earlier positions (the contiguous cache's or the pool's, cache.layout_of) and
            # the new tokens among themselves (padding follows the real tokens, so causality hides it),
            # two parts combined with the sinks.
            k, v = k.astype(layer_cache["k"].dtype), v.astype(layer_cache["v"].dtype)
            before, new_cache = layout_of(layer_cache).attend(ops, q, k, v, layer_cache, positions, lengths, valid,
                                                              window, self.mesh)
            o = fold_sinks([before, ops.causal(q, k, v, window)], sinks, q.dtype)
        else:
            o, new_cache = ops.whole(q, k, v, sinks, positions, window), None
            if o is None:
                o = fold_sinks([ops.causal(q, k, v, window)], sinks, q.dtype)
        o = o.reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
        out = jnp.einsum("btnh,nhd->btd", o, w["out_weight"]) + w["out_bias"]
        out = out + low_rank(self, "out_weight", o, "btnh,nhr->btr", "btr,rd->btd")
        return out if layer_cache is None else (out, new_cache)
