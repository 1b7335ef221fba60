"""Small decode batches' experts without sorting the pairs, in Pallas Mosaic GPU (NVIDIA Hopper, JAX >=
0.11): each expert any token picked gets a slot, and each slot multiplies every token of the batch.

At a decode batch of a few tokens, laying the pairs out in expert blocks (kernels/pairs.py:
`to_blocks`: a sort, counts, offsets, a scatter and two gathers, about ten small kernels a layer)
costs more than the products: the tensor cores have rows to spare (8 at least, whatever few a block
holds), and the work is reading each selected expert's weights once. Here the experts in use are
numbered in expert order (a count over the E experts, no sort), and kernels/experts/mosaic_decode.py's
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

from . import mosaic_decode
from .. import pairs

def slots(idx: jax.Array, num_experts: int):
    """The experts in use by idx [N, A] (negative or >= E: dropped), in expert order.

    Returns (slot_expert [S]: each slot's expert, S = min(N * A, E), the slots from `used` on
    holding the last expert, never read; used: how many experts are in use; pair_slot [N, A]: each
    pair's slot, 0 for dropped pairs; valid [N, A]: the pairs not dropped)."""
    E = num_experts
    valid = (idx >= 0) & (idx < E)
    hit = jnp.zeros((E + 1,), jnp.int32).at[jnp.where(valid, idx, E)].set(1)[:E]  # [E]
    slot_of = jnp.cumsum(hit) - 1  # [E]: each expert's slot where hit
    S = min(idx.size, E)
    slot_expert = jnp.nonzero(hit, size=S, fill_value=E - 1)[0].astype(jnp.int32)
    return slot_expert, hit.sum(), jnp.where(valid, slot_of[jnp.where(valid, idx, 0)], 0), valid


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_slots" (kernels/experts/__init__.py): x [N, D], idx [N, A] (negative:
    dropped) -> [N, A, D], 16-bit or MXFP4-packed experts; more tokens than a block takes
    (mosaic_decode.MAX_ROWS) as "mosaic_decode"."""
    N, A = idx.shape
    Np = -(-N // 8) * 8
    if Np > mosaic_decode.MAX_ROWS:
        return mosaic_decode.experts(x, idx, w, act, kernels=kernels)
    slot_expert, used, pair_slot, valid = slots(idx, pairs.num_experts(w["mlp1_weight"]))
    S = slot_expert.shape[0]

    def matmul(rows, name, shared):
        return mosaic_decode.matvec(rows, w[name], slot_expert, used, block_m=Np, shared_rows=shared,
                                    interpret=kernels.interpret)

    rows = jnp.pad(x, ((0, Np - N), (0, 0)))  # [Np, D]: every slot's rows
    h = matmul(rows, "mlp1_weight", True).reshape(S, Np, -1) + w["mlp1_bias"][slot_expert][:, None]  # [S, Np, 2F]
    h = act(h.reshape(S * Np, -1)).astype(x.dtype)  # [S * Np, F]: slot s's rows s * Np ...
    y = matmul(h, "mlp2_weight", False).reshape(S, Np, -1) + w["mlp2_bias"][slot_expert][:, None]  # [S, Np, D]
    out = y[pair_slot, jnp.arange(N)[:, None]]  # [N, A, D]: each pair's slot, its token's row
    return jnp.where(valid[..., None], out, 0)
