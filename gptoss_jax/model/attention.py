"""Attention with grouped KV heads, learned sinks and the optional sliding window.

Attention is softmax([q.k * scale, sink]) @ v with the sink column dropped:
- `attention_reference`: the plain [T, S] score matrix, kept as the readable definition for tests.
- `attention_blockwise`: the same, blockwise (online softmax, memory linear in T).
  (Both are the kernel layer's jnp code, kernels/attention/xla.py, named here as the model's definition.)
- `AttentionBlock` asks the kernel layer for the call's attention operations (`Kernels.attention_ops`:
  sink-free attention over each set of keys, with its softmax statistics) and folds the sinks in
  exactly (`fold_sinks`, kernels/combine.py): one part without a cache; with one, the cache's earlier positions
  (or the sliding ring) and the new tokens.

q, k and v are one weight [D, K, G + 2, H] (`WEIGHTS["qkv_weight"]`; `formats.qkv_part` takes it
apart): one product, where three products of 4,096, 512 and 512 columns each start and end on
their own: at decode the three cost more than reading their weights (docs/benchmarks.md, "q, k and v
as one weight"). Checkpoints hold the three apart, as published (stored.py).

Legend: B = batch, T = query positions, S = key positions, D = embed, N = query heads,
K = KV heads, G = query heads per KV head (N = K * G, head n reads KV head n // G), H = head dim.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .. import fp8
from ..config import ModelConfig
from ..formats import qkv_part
from ..kernels import Kernels, attention_blockwise, attention_reference, fold_sinks
from ..weight import Weight, declare, low_rank
from .cache import layout_of
from .layers import RMSNorm, apply_rope, rope_tables

__all__ = ["AttentionBlock", "attention_blockwise", "attention_reference", "with_qkv_part"]


def _projection(t: jax.Array, weight: jax.Array, mesh: Mesh | None) -> jax.Array:
    """t [B, T, D] times the fused weight [D, K, G + 2, H] -> [B, T, K, G + 2, H].

    A single row (batch-1 decode) goes in twice where a device holds under 10M of the weight's
    elements (a mesh's share): XLA's GPU compiler rewrites a one-row product with smaller operands
    into an elementwise product written out in full and a reduction, 6 times the weight's bytes; two
    rows keep it a matrix product. The barriers keep the simplifier from taking the second row back out.
    """
    shards = 1 if mesh is None else mesh.shape.get("tensor", 1)
    if t.shape[0] * t.shape[1] != 1 or weight.size // shards >= 10_000_000:
        return jnp.einsum("btd,dkch->btkch", t, weight)
    two = jax.lax.optimization_barrier(jnp.concatenate([t, t], axis=1))  # [1, 2, D]
    return jax.lax.optimization_barrier(jnp.einsum("btd,dkch->btkch", two, weight))[:, :1]


def with_qkv_part(fused: jax.Array, name: str, part: jax.Array) -> jax.Array:
    """`fused` (JAX) with its q, k or v part (as `formats.qkv_part` gives it) replaced by `part`."""
    K, G = fused.shape[-3], fused.shape[-2] - 2
    if name[0] == "q":
        return fused.at[..., :G, :].set(part.reshape(*fused.shape[:-3], K, G, fused.shape[-1]))
    return fused.at[..., G if name[0] == "k" else G + 1, :].set(part)


class AttentionBlock(nn.Module):
    """norm -> q, k, v projections -> RoPE -> attention with sinks -> output projection (no residual)."""

    config: ModelConfig
    layer: int
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()
    mesh: Mesh | None = None
    WEIGHTS: ClassVar = {
        # q, k and v as one product: for each KV head, its query heads, its key, its value.
        "qkv_weight": Weight(("embed", "kv_heads", "qkv", "head_dim")),
        "qkv_bias": Weight(("kv_heads", "qkv", "head_dim"), init="zeros"),
        "sinks": Weight(("q_heads",)),
        "out_weight": Weight(("q_heads", "head_dim", "embed"), inputs=("q_heads", "head_dim")),
        "out_bias": Weight(("embed",), init="zeros"),
    }
    # The parts of qkv_weight that low-rank adapters adapt one by one (as peft's q_proj, k_proj and
    # v_proj), each laid out as if declared alone (`formats.qkv_part`).
    PARTS: ClassVar = {
        "q_weight": Weight(("embed", "q_heads", "head_dim"), inputs=("embed",)),
        "k_weight": Weight(("embed", "kv_heads", "head_dim"), inputs=("embed",)),
        "v_weight": Weight(("embed", "kv_heads", "head_dim"), inputs=("embed",)),
    }
    PARTS_OF: ClassVar = "qkv_weight"
    part = staticmethod(qkv_part)
    with_part = staticmethod(with_qkv_part)

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, layer_cache=None, lengths=None, valid=None,
                 adapters=None):
        """x [B, T, D], positions [B, T] -> [B, T, D].

        With a cache: the T new tokens of each sequence continue it (positions = lengths + 0..T-1,
        valid [B, T] marks real tokens, a prefix of each row); returns (out, updated layer cache).
        Without one, positions are 0..T-1. adapters [B] int32: each row's served adapter (weight.low_rank).
        """
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        t = RMSNorm(cfg, name="norm")(x)
        B, T = x.shape[:2]
        K, G = cfg.num_key_value_heads, cfg.q_per_kv
        y = _projection(t, w["qkv_weight"], self.mesh) + w["qkv_bias"]  # [B, T, K, G + 2, H]
        q, k, v = y[:, :, :, :G], y[:, :, :, G], y[:, :, :, G + 1]
        # Low-rank adapters, where training added them (params.adapter): 0 otherwise.
        q_lora = low_rank(self, "q_weight", t, "btd,dr->btr", "btr,rnh->btnh", adapters)  # [B, T, N, H]
        q = (q.reshape(B, T, K * G, -1) + q_lora).reshape(q.shape)
        k = k + low_rank(self, "k_weight", t, "btd,dr->btr", "btr,rkh->btkh", adapters)
        v = v + low_rank(self, "v_weight", t, "btd,dr->btr", "btr,rkh->btkh", adapters)
        cos, sin = rope_tables(cfg, positions)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # q [B, T, K, G, H], k [B, T, K, H]
        sinks = w["sinks"].reshape(cfg.num_key_value_heads, cfg.q_per_kv)  # [K, G]
        window = cfg.sliding_window if cfg.is_sliding(self.layer) else None
        ops = self.kernels.attention_ops(T, q.dtype, mesh=self.mesh)
        if layer_cache is not None:
            # The cache's earlier positions (the contiguous cache's or the pool's, cache.layout_of) and
            # the new tokens among themselves (padding follows the real tokens, so causality hides it),
            # two parts combined with the sinks.
            k, v = fp8.rounded(layer_cache["k"], k), fp8.rounded(layer_cache["v"], v)  # as the cache keeps them
            before, new_cache = layout_of(layer_cache).attend(ops, q, k, v, layer_cache, positions, lengths, valid,
                                                              window, self.mesh)
            o = fold_sinks([before, ops.causal(q, k, v, window)], sinks, q.dtype)
        else:
            o, new_cache = ops.whole(q, k, v, sinks, positions, window), None
            if o is None:
                o = fold_sinks([ops.causal(q, k, v, window)], sinks, q.dtype)
        o = o.reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
        out = jnp.einsum("btnh,nhd->btd", o, w["out_weight"]) + w["out_bias"]
        out = out + low_rank(self, "out_weight", o, "btnh,nhr->btr", "btr,rd->btd", adapters)
        return out if layer_cache is None else (out, new_cache)
