"""Small decode batches' experts without sorting the pairs, in Pallas Mosaic GPU (NVIDIA Hopper, JAX >=
0.11): each expert any token picked gets a slot, and each slot multiplies every token of the batch.

At a decode batch of a few tokens, laying the pairs out in expert blocks (kernels/pairs.py:
`to_blocks`: a sort, counts, offsets, a scatter and two gathers, about ten small kernels a layer)
costs more than the products: the tensor cores have rows to spare (8 at least, whatever few a block
holds), and the work is reading each selected expert's weights once. Here the experts in use are
numbered in expert order (a count over the E experts, no sort), and kernels/mosaic_decode.py's
kernels run one block per slot, every block the same rows: the whole batch (`shared_rows`) for
the first projection, each slot's own activations for the second. A slot's products for tokens
that did not pick its expert are computed and never read. Each selected expert is read once, as in
"mosaic_decode"; the tensor cores do (tokens / pairs per expert) times the useful work, which is
free while the batch stays within a few dozen tokens (decode reads weights at the memory's rate).

Legend: N = tokens (Np: padded to a multiple of 8), A = active experts per token, E = experts,
S = slots (at most min(N * A, E) experts in use), D = embed, F = the experts' intermediate size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..mxfp4 import packed
from . import mosaic_decode, pairs

# Tokens up to which the variant runs (one block of rows: the decode kernels' limit); beyond it,
# "mosaic_decode".
MAX_TOKENS = 256


def slots(idx: jax.Array, num_experts: int):
    """The experts in use by idx [N, A] (negative or >= E: dropped), in expert order.

    Returns (slot_expert [S]: each slot's expert, S = min(N * A, E), the slots from `used` on
    holding the last expert, never read; used: how many experts are in use; pair_slot [N, A]: each
    pair's slot, 0 for dropped pairs)."""
    E = num_experts
    valid = (idx >= 0) & (idx < E)
    hit = jnp.zeros((E + 1,), jnp.int32).at[jnp.where(valid, idx, E)].set(1)[:E]  # [E]
    slot_of = jnp.cumsum(hit) - 1  # [E]: each expert's slot where hit
    S = min(idx.size, E)
    slot_expert = jnp.nonzero(hit, size=S, fill_value=E - 1)[0].astype(jnp.int32)
    return slot_expert, hit.sum(), jnp.where(valid, slot_of[jnp.where(valid, idx, 0)], 0)


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_slots" (kernels/experts.py): x [N, D], idx [N, A] (negative:
    dropped) -> [N, A, D], 16-bit or MXFP4-packed experts; more than MAX_TOKENS tokens as
    "mosaic_decode"."""
    N, A = idx.shape
    if N > MAX_TOKENS:
        return mosaic_decode.experts(x, idx, w, act, kernels=kernels)
    E = pairs.num_experts(w["mlp1_weight"])
    slot_expert, used, pair_slot = slots(idx, E)
    S, Np = slot_expert.shape[0], -(-N // 8) * 8

    def matmul(rows, name, shared):
        weight = w[name]
        if packed(weight):
            _, F, G, _ = weight.blocks.shape
            settings = mosaic_decode.decode_settings_mxfp4(S, F, G, block_m=Np)
            return mosaic_decode.grouped_matvec_mxfp4(rows, slot_expert, used, weight.blocks, weight.scales, block_m=Np,
                                                      shared_rows=shared, interpret=kernels.interpret, **settings)
        _, F, D = weight.shape
        return mosaic_decode.grouped_matvec(rows, slot_expert, used, weight, block_m=Np, shared_rows=shared,
                                            interpret=kernels.interpret, **mosaic_decode.decode_settings(S, F, D))

    rows = jnp.pad(x, ((0, Np - N), (0, 0)))  # [Np, D]: every slot's rows
    h = matmul(rows, "mlp1_weight", True).reshape(S, Np, -1) + w["mlp1_bias"][slot_expert][:, None]  # [S, Np, 2F]
    h = act(h.reshape(S * Np, -1)).astype(x.dtype)  # [S * Np, F]: slot s's rows s * Np ...
    y = matmul(h, "mlp2_weight", False).reshape(S, Np, -1) + w["mlp2_bias"][slot_expert][:, None]  # [S, Np, D]
    out = y[pair_slot, jnp.arange(N)[:, None]]  # [N, A, D]: each pair's slot, its token's row
    return jnp.where(((idx >= 0) & (idx < E))[..., None], out, 0)
