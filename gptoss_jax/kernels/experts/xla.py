"""The experts' readable paths in jnp, which run anywhere and take low-rank adapters (training):

- `gather`: gathers each pair's expert weights and contracts them with an einsum; its temporary
  memory is one expert's matrices per pair, so it serves decode-sized calls.
- `grouped`: sorts the pairs by expert, pads each expert's group to a multiple of `block` rows and
  loops over the blocks, one [block, D] x [D, F] product with that block's expert each. Work is the
  selected pairs plus at most `block - 1` padding rows per expert.

MXFP4-packed experts are decoded inside the jitted step: `gather` only the selected experts'
(`expert_rows`), `grouped` one expert block at a time. Every other variant is checked against these.

Both take x [N, D] and idx [N, A] (the pairs' local experts; negative: held by another device, or
dropped) and return the pairs' outputs [N, A, D] (a dropped pair's row holds whatever its path
computes, expert 0's product or zero: its routing weight is zeroed by the caller). Legend: N = tokens, D = embed, E = experts, A = active experts per
token, F = intermediate.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...mxfp4 import decode, packed
from ..loops import late_map
from ..pairs import num_experts, to_blocks


def expert_rows(weight, idx, dtype) -> jax.Array:
    """weight[idx] for an expert weight [E, out, in], or for its MXFP4-packed form decoded right here
    (inside the jitted step: only the experts idx selects are decoded)."""
    if packed(weight):
        return decode(weight.blocks[idx], weight.scales[idx], dtype)
    return weight[idx]


def _pair_low_rank(x, w, name, e, pairs: str, pick=None):
    """The expert adapter of weight `name` (w[name + "_lora"]: a [E, in, r], b [E, r, out]) on x
    [..., in] for experts e, `pairs` the einsum letters of x's leading axes; 0 without one.

    A table of L served adapters (a [L, E, in, r], b [L, E, r, out]) is read with `pick` [..., L],
    x's rows' adapters one-hot (zeros: none): every adapter's product, each row keeping its own."""
    held = w.get(f"{name}_lora")
    if held is None:
        return 0.0
    lead = pairs[: e.ndim]  # the axes e indexes
    if pick is None:
        a, b = held["a"][e].astype(x.dtype), held["b"][e].astype(x.dtype)
        low = jnp.einsum(f"{pairs}i,{lead}ir->{pairs}r", x, a)
        return jnp.einsum(f"{pairs}r,{lead}ro->{pairs}o", low, b)
    a, b = held["a"][:, e].astype(x.dtype), held["b"][:, e].astype(x.dtype)  # [L, *e, in, r], [L, *e, r, out]
    low = jnp.einsum(f"{pairs}i,l{lead}ir->{pairs}lr", x, a) * pick[..., None]
    return jnp.einsum(f"{pairs}lr,l{lead}ro->{pairs}o", low, b)


def gather(x, idx, w, act, *, kernels=None, pick=None):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D]; pick [N, L]: the tokens' served
    adapters, one-hot (`_pair_low_rank`)."""
    idx = jnp.maximum(idx, 0)  # a pair held elsewhere reads expert 0; its weight is zero
    pick = None if pick is None else jnp.broadcast_to(pick[:, None], idx.shape + pick.shape[-1:])  # [N, A, L]
    h = jnp.einsum("nd,nafd->naf", x, expert_rows(w["mlp1_weight"], idx, x.dtype)) + w["mlp1_bias"][idx]
    h = h + _pair_low_rank(jnp.broadcast_to(x[:, None], idx.shape + x.shape[-1:]), w, "mlp1_weight", idx, "na", pick)
    a = act(h)
    y = jnp.einsum("naf,nadf->nad", a, expert_rows(w["mlp2_weight"], idx, x.dtype)) + w["mlp2_bias"][idx]
    return y + _pair_low_rank(a, w, "mlp2_weight", idx, "na", pick)


def grouped(x, idx, w, act, *, kernels=None, block: int | None = None, pick=None):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D] (zero for dropped pairs), one expert per
    `block` rows (default: the kernels' `moe_block`); pick [N, L]: the tokens' served adapters,
    one-hot (`_pair_low_rank`), laid out in blocks as the rows are."""
    block = block or (kernels.moe_block if kernels is not None else 64)
    D = x.shape[-1]
    # Every block of the static bound is computed (blocks past the used ones hold zero rows): a
    # lax.cond skipping them would cost a host round trip per block on a GPU.
    rows, undo, block_expert, _ = to_blocks(x, idx, num_experts(w["mlp1_weight"]), block)
    num_blocks = block_expert.shape[0]
    rows = rows.reshape(num_blocks, block, D)
    picks = None if pick is None else to_blocks(pick, idx, num_experts(w["mlp1_weight"]), block)[0].reshape(
        num_blocks, block, -1)

    # Recomputed in the backward pass rather than kept: the saved residuals would otherwise include
    # each block's expert matrices (a [2F, D] and a [D, F] copy per block).
    @jax.checkpoint
    def one_block(args):
        b, xb = args
        e = block_expert[b]
        pb = None if picks is None else picks[b]

        h = jnp.einsum("bd,fd->bf", xb, expert_rows(w["mlp1_weight"], e, x.dtype)) + w["mlp1_bias"][e]  # [block, 2F]
        a = act(h + _pair_low_rank(xb, w, "mlp1_weight", e, "b", pb))
        y = jnp.einsum("bf,df->bd", a, expert_rows(w["mlp2_weight"], e, x.dtype)) + w["mlp2_bias"][e]
        return y + _pair_low_rank(a, w, "mlp2_weight", e, "b", pb)

    return undo(late_map(one_block, (jnp.arange(num_blocks), rows), anchor=rows).reshape(num_blocks * block, D))
