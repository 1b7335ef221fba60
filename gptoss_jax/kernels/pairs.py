"""(token, expert) pairs laid out for the expert kernels: sorted by expert (the ragged dots), in
blocks of rows of one expert each (the grouped kernels), or, for one token, each pair a block of its
own (the decode kernels). kernels/experts/__init__.py runs the experts over these layouts.

Legend: N = tokens, D = embed, E = experts, A = active experts per token, P = pairs = N * A.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..mxfp4 import decode, packed


def sort_by_expert(idx: jax.Array, num_experts: int):
    """The pairs of idx [N, A] in expert order. Pairs whose expert lies outside [0, num_experts)
    (experts held by other devices) are dropped: they sort last, under expert num_experts.

    Returns (order [P]: the pairs' flat indices sorted by expert (stable), sorted_expert [P],
    counts [num_experts]: pairs per expert, dropped ones not counted).
    """
    flat = idx.reshape(idx.size)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = jnp.argsort(flat, stable=True)
    return order, flat[order], jnp.bincount(flat, length=num_experts + 1)[:num_experts]


def unsort(rows: jax.Array, order: jax.Array) -> jax.Array:
    """Rows in expert order [P, ...] back in pair order: a gather by the inverse permutation, which
    XLA fuses into the weighted sum that reads it (a scatter by `order` would write every row once
    more: on one H100, 0.65 vs 0.13 ms for 16,384 rows of 2880)."""
    return _permute(rows, _inverse(order), order)


def pair_inputs(x: jax.Array, order: jax.Array, A: int) -> jax.Array:
    """x [N, D] -> [P, D]: the input row of each pair in expert order (pair p is token p // A)."""
    return _pair_rows(x, order, _inverse(order), A)


def _inverse(order: jax.Array) -> jax.Array:
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=order.dtype))


# The gradients of these two gathers are gathers too. Autodiff would transpose each into a
# scatter-add into a zero buffer of the pairs' size; on a GPU, XLA creates such zero buffers at the
# start of the backward pass for every layer at once (training the 20b at 16K positions: 1.4 GiB a
# layer, held through the whole backward pass).
@jax.custom_vjp
def _permute(rows, perm, inverse):
    """rows[perm], perm a permutation and inverse its inverse."""
    return rows[perm]


def _permute_fwd(rows, perm, inverse):
    return rows[perm], (perm, inverse)


def _permute_bwd(residuals, g):
    perm, inverse = residuals
    return g[inverse], None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _pair_rows(x, order, inverse, A):
    return x[order // A]


def _pair_rows_fwd(x, order, inverse, A):
    return x[order // A], (order, inverse)


def _pair_rows_bwd(A, residuals, g):
    order, inverse = residuals
    N = order.size // A
    # Back in pair order, then each token's A pairs summed (float32 sums, as a scatter-add would).
    per_pair = g[inverse].reshape(N, A, -1)
    return jnp.sum(per_pair.astype(jnp.float32), axis=1).astype(g.dtype), None, None


_pair_rows.defvjp(_pair_rows_fwd, _pair_rows_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_rows(x, src, dest, A):
    """x [N, D] -> [M, D]: row r holds the input of pair src[r] (token src[r] // A), zeros where
    src[r] = P (padding). dest [P]: each pair's row, in pair order (past M: dropped)."""
    P = dest.size
    return jnp.where((src < P)[:, None], x[jnp.minimum(src, P - 1) // A], 0)


def _block_rows_fwd(x, src, dest, A):
    return _block_rows(x, src, dest, A), dest


def _block_rows_bwd(A, dest, g):
    # Each pair's row of g (zeros for dropped pairs), then each token's A pairs summed (float32
    # sums, as a scatter-add would): a gather, where autodiff would scatter-add into the pairs.
    N = dest.size // A
    per_pair = jnp.take(g, dest, axis=0, mode="fill", fill_value=0).reshape(N, A, -1)
    return jnp.sum(per_pair.astype(jnp.float32), axis=1).astype(g.dtype), None, None


_block_rows.defvjp(_block_rows_fwd, _block_rows_bwd)


def group_by_expert(idx: jax.Array, num_experts: int, block: int):
    """Lay the pairs of idx [N, A] out in blocks of `block` rows, each block holding one expert's pairs.

    Returns (order [P]: pairs sorted by expert, dest [P]: padded row of each sorted pair (past the
    end for dropped pairs), block_expert [num_blocks], used: how many blocks hold pairs). num_blocks
    is the static bound ceil((P + min(E, P) * (block - 1)) / block): the selected pairs plus at
    most block - 1 padding rows for each expert that holds a pair (at most P of them: 4 blocks, not
    E, at a decode batch of one); blocks from `used` on hold no pair (their expert is the last).
    """
    P = idx.size
    order, sorted_expert, counts = sort_by_expert(idx, num_experts)
    padded = (counts + block - 1) // block * block
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded
    start = jnp.cumsum(counts) - counts
    num_blocks = -(-(P + min(num_experts, P) * (block - 1)) // block)  # at most P experts hold a pair
    # Padded row of each sorted pair: its expert's padded start + its rank within the expert.
    e = jnp.minimum(sorted_expert, num_experts - 1)
    dest = jnp.where(sorted_expert < num_experts, padded_start[e] + jnp.arange(P) - start[e], num_blocks * block)
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(num_blocks) * block, side="right"),
                               num_experts - 1)
    return order, dest, block_expert, padded_end[-1] // block


def to_blocks(x, idx, num_experts: int, block: int):
    """x [N, D], idx [N, A] -> (rows [num_blocks * block, D]: each pair's input in its expert's
    blocks, zero padding; undo: a function taking per-row outputs [num_blocks * block, D] back to
    per-pair outputs [N, A, D], zero for dropped pairs; block_expert [num_blocks]; used)."""
    N, A = idx.shape
    P = N * A
    order, dest, block_expert, used = group_by_expert(idx, num_experts, block)
    # Each padded row's pair (P: a padding row), then the rows gathered from x: a gather of the
    # inputs instead of a scatter of the sorted pairs' rows into the blocks (on one H100 80GB the
    # scatter took 0.40 ms a layer of a 4k prompt's 16,384 pairs; an un-sorting gather of the same
    # rows 0.13 against 0.65 for its scatter).
    src = jnp.full((block_expert.shape[0] * block,), P, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    rows = _block_rows(x, src, dest[_inverse(order)], A)

    def undo(out):
        picked = jnp.take(out, dest, axis=0, mode="fill", fill_value=0)  # dropped pairs -> 0
        return unsort(picked, order).reshape(N, A, -1)

    return rows, undo, block_expert, used


def decode_block(pairs: int, num_experts: int) -> int:
    """Rows per expert block of the Mosaic GPU decode kernels: a power of two near twice the pairs
    per expert (8 to mosaic_decode.MAX_ROWS: the kernels' shared memory), so that an expert's pairs rarely spill into a
    second block, which would read its weights again (a batch of 64 over 32 experts: blocks of 16)."""
    return min(64, max(8, 1 << max(0, -(-2 * pairs // num_experts) - 1).bit_length()))


def pairs_as_blocks(x, idx, num_experts: int, block: int):
    """`to_blocks` for one token (whose pairs' experts are distinct), or for blocks of one row: each
    pair a block of its own (its input, then block - 1 zero rows), in the pairs' order, with no sorting. Dropped pairs
    (idx < 0 or >= E) compute with expert 0 and are zeroed by undo."""
    N, A = idx.shape
    # x as an array of its own, so that the padding is not fused into the RMSNorm that makes x (a
    # one-row reduction, on one SM): a profile on one H100 80GB showed a pad-and-reduce fusion of
    # 43 us a layer with this kernel at a batch of one, none with the Triton one.
    x = jax.lax.optimization_barrier(x)
    rows = jnp.zeros((N * A, block, x.shape[-1]), x.dtype).at[:, 0].set(jnp.repeat(x, A, axis=0))
    kept = ((idx >= 0) & (idx < num_experts))[..., None]

    def undo(out):
        return jnp.where(kept, out.reshape(N * A, block, -1)[:, 0].reshape(N, A, -1), 0)

    return rows.reshape(N * A * block, -1), undo, jnp.where(kept[..., 0], idx, 0).reshape(N * A), N * A


def num_experts(weight) -> int:
    """E of an expert weight [E, out, in], 16-bit or MXFP4-packed (an MXFP4)."""
    return (weight.scales if packed(weight) else weight).shape[0]


def whole_experts(weight, dtype) -> jax.Array:
    """An expert weight [E, out, in]; a packed one is decoded here, the layer's experts at once."""
    return decode(weight.blocks, weight.scales, dtype) if packed(weight) else weight


def blocked(x, idx, w, act, *, block: int, matmul, epilogue: bool = False):
    """x [N, D], idx [N, A] (negative: dropped) -> [N, A, D] by a kernel over expert blocks: the pairs
    in blocks of `block` rows of one expert each (`to_blocks`; for one token, a block per pair), then
    matmul(rows, name, block_expert, used) -> [rows, out] for each projection ("mlp1_weight",
    "mlp2_weight"); blocks of one row are the pairs in their own order, unsorted. Rows of blocks past `used` are undefined, and dropped. `epilogue`: the kernel
    adds the biases itself, and applies the activation to mlp1's outputs."""
    E = num_experts(w["mlp1_weight"])
    blocks_of = pairs_as_blocks if idx.shape[0] == 1 or block == 1 else to_blocks
    rows, undo, block_expert, used = blocks_of(x, idx, E, block)
    num_blocks = block_expert.shape[0]

    def project(inputs, name):
        out = matmul(inputs, name, block_expert, used)
        if epilogue:
            return out
        bias = w[name.replace("weight", "bias")][block_expert][:, None]  # [num_blocks, 1, out]
        return (out.reshape(num_blocks, block, -1) + bias).reshape(num_blocks * block, -1)

    h = project(rows, "mlp1_weight")
    return undo(project(h if epilogue else act(h), "mlp2_weight"))


def ragged(x, idx, w, act, *, ragged_dot):
    """x [N, D], idx [N, A] (negative or >= E: dropped) -> [N, A, D]: the pairs sorted by expert, then
    one grouped matmul per projection (ragged_dot(rows, w [E, out, in], group_sizes [E]))."""
    N, A = idx.shape
    E = num_experts(w["mlp1_weight"])
    order, expert, sizes = sort_by_expert(idx, E)
    e = jnp.minimum(expert, E - 1)
    h = ragged_dot(pair_inputs(x, order, A), whole_experts(w["mlp1_weight"], x.dtype), sizes) + w["mlp1_bias"][e]  # [P, 2F]
    y = ragged_dot(act(h), whole_experts(w["mlp2_weight"], x.dtype), sizes) + w["mlp2_bias"][e]  # [P, D]
    kept = ((idx >= 0) & (idx < E))[..., None]
    return jnp.where(kept, unsort(y, order).reshape(N, A, -1), 0)  # rows past the groups are undefined
