"""The mixture-of-experts block: a float32 top-k router and dropless experts with a clamped SwiGLU.

Two dispatch paths compute exactly the selected (token, expert) pairs, never every expert for
every token (`jax.lax.ragged_dot` is not used: on CPU and on CUDA GPUs in jaxlib 0.10 it lowers to a
dense product over all experts):
- "gather": gathers each pair's expert weights and contracts them with an einsum. Its temporary
  memory grows with the number of pairs (one expert's matrices per pair), so it serves decode-sized
  inputs: `auto` picks it when tokens * experts_per_token <= `gather_max_pairs`.
- "grouped": sorts the pairs by expert, pads each expert's group to a multiple of `block` rows and
  loops over the blocks, one [block, D] x [D, F] product with that block's expert each; blocks past
  the last used one are skipped. Work is the selected pairs plus at most `block - 1` padding rows
  per expert. `auto` picks it for prefill-sized inputs.

Legend: N = tokens, D = embed, E = experts, A = active experts per token, F = intermediate,
P = (token, expert) pairs = N * A.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from .config import ModelConfig
from .layers import RMSNorm
from .params import Weight, declare


def route(x: jax.Array, weight: jax.Array, bias: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """x [N, D] -> (weights [N, A] float32, expert indices [N, A] int32).

    Logits (bias included) in float32 at full precision, so that near-ties pick the same experts as a
    float32 reference; top-k of the logits, softmax over the k selected logits only.
    """
    logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), weight.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST) + bias.astype(jnp.float32)
    top, idx = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), idx


def swiglu(h: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """[..., 2F] -> [..., F]. Gate and linear halves are INTERLEAVED (gate = h[..., ::2]).

    The gate is clamped from above only, the linear half on both sides, and the linear half gets +1.
    """
    h = h.reshape(h.shape[:-1] + (h.shape[-1] // 2, 2))  # [..., F, 2]: (gate, linear) pairs
    gate = jnp.minimum(h[..., 0], limit)
    linear = jnp.clip(h[..., 1], -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (linear + 1)


def _experts_gather(x, idx, w, act):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D]."""
    h = jnp.einsum("nd,nafd->naf", x, w["mlp1_weight"][idx]) + w["mlp1_bias"][idx]
    a = act(h)
    return jnp.einsum("naf,nadf->nad", a, w["mlp2_weight"][idx]) + w["mlp2_bias"][idx]


def group_by_expert(idx: jax.Array, num_experts: int, block: int):
    """Lay the pairs of idx [N, A] out in blocks of `block` rows, each block holding one expert's pairs.

    Returns (order [P]: pairs sorted by expert, dest [P]: padded row of each sorted pair,
    block_expert [num_blocks], used_blocks: how many leading blocks hold pairs). num_blocks is the
    static bound ceil((P + E * (block - 1)) / block); only the first used_blocks are computed.
    """
    P = idx.size
    flat_expert = idx.reshape(P)
    order = jnp.argsort(flat_expert, stable=True)
    sorted_expert = flat_expert[order]
    counts = jnp.bincount(flat_expert, length=num_experts)  # [E]
    padded = (counts + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    # Padded row of each sorted pair: its expert's padded start + its rank within the expert.
    dest = padded_start[sorted_expert] + jnp.arange(P) - start[sorted_expert]
    num_blocks = -(-(P + num_experts * (block - 1)) // block)
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)
    return order, dest, block_expert, padded_end[-1] // block


def _experts_grouped(x, idx, w, act, *, num_experts: int, block: int):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D], one expert per `block` rows."""
    N, A = idx.shape
    D = x.shape[-1]
    order, dest, block_expert, used_blocks = group_by_expert(idx, num_experts, block)
    num_blocks = block_expert.shape[0]
    rows = jnp.zeros((num_blocks * block, D), x.dtype).at[dest].set(x[order // A])
    rows = rows.reshape(num_blocks, block, D)

    def one_block(args):
        b, xb = args
        e = block_expert[b]

        def compute(xb):
            h = jnp.einsum("bd,fd->bf", xb, w["mlp1_weight"][e]) + w["mlp1_bias"][e]  # [block, 2F]
            return jnp.einsum("bf,df->bd", act(h), w["mlp2_weight"][e]) + w["mlp2_bias"][e]  # [block, D]

        return jax.lax.cond(b < used_blocks, compute, jnp.zeros_like, xb)

    out = jax.lax.map(one_block, (jnp.arange(num_blocks), rows)).reshape(num_blocks * block, D)
    per_pair = jnp.zeros((N * A, D), out.dtype).at[order].set(out[dest])
    return per_pair.reshape(N, A, D)


class MLPBlock(nn.Module):
    """norm -> router -> selected experts -> weighted sum (no residual)."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.bfloat16
    impl: str = "auto"  # "auto", "gather" or "grouped"
    gather_max_pairs: int = 64
    block: int = 64
    WEIGHTS: ClassVar = {
        "router_weight": Weight(("embed", "experts")),
        "router_bias": Weight(("experts",)),
        # Expert matrices are [E, out, in], as published, unlike the other matrices ([in, out]):
        # MXFP4 packs along `in`, so packed experts decode in place, with no transposition.
        "mlp1_weight": Weight(("experts", "mlp_fused", "embed")),
        "mlp1_bias": Weight(("experts", "mlp_fused"), init="zeros"),
        "mlp2_weight": Weight(("experts", "embed", "mlp")),
        "mlp2_bias": Weight(("experts", "embed"), init="zeros"),
    }

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        B, T, D = x.shape
        t = RMSNorm(cfg, name="norm")(x).reshape(B * T, D)
        weights, idx = route(t, w["router_weight"], w["router_bias"], cfg.experts_per_token)

        def act(h):
            return swiglu(h, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit)

        impl = self.impl
        if impl == "auto":
            impl = "gather" if idx.size <= self.gather_max_pairs else "grouped"
        if impl == "gather":
            y = _experts_gather(t, idx, w, act)
        elif impl == "grouped":
            y = _experts_grouped(t, idx, w, act, num_experts=cfg.num_experts, block=self.block)
        else:
            raise ValueError(f"unknown MoE implementation {self.impl!r}")
        out = jnp.einsum("nad,na->nd", y.astype(jnp.float32), weights)
        return out.astype(x.dtype).reshape(B, T, D)
