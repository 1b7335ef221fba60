"""`pair_matvec`, the experts at decode in Pallas Triton (bf16 experts; mxfp4.py holds the same for
experts packed in MXFP4): a batch has few (token, expert) pairs, and the work is reading the
selected experts' weights: per pair a matrix-vector product with its expert's [F, D] matrix. The
kernel reads each pair's rows of that matrix in place, straight from the [E, F, D] array (rows of D
contiguous, so every load is coalesced), with no gathered copy of the weights and no host round
trip. Pairs that share an expert read it again (at batch 1 the 4 pairs of a token are 4 distinct
experts).

Legend: P = pairs, D = input features, F = output features, E = experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .common import block_size, compiler_params, splits as split_count


@functools.partial(jax.jit, static_argnames=("interpret", "block_f", "block_d", "num_warps", "num_stages", "splits"))
def pair_matvec(x, idx, w, *, interpret: bool = False, block_f: int = 64, block_d: int = 64, num_warps: int = 4,
                num_stages: int = 3, splits: int | None = None) -> jax.Array:
    """x [P, D], idx [P] (each pair's expert), w [E, F, D] -> [P, F] in x's dtype, float32 sums.

    Each program computes `block_f` outputs of one pair over one of `splits` ranges of D, walking it
    in `block_d` steps with an elementwise [block_f, block_d] accumulator (one cross-lane reduction
    at the end, not one per step); the ranges' float32 partial sums are added after. Splitting D
    gives a batch of one enough programs to keep every SM reading (by default at least ~1024).
    """
    P, D = x.shape
    E, F, _ = w.shape
    bf, bd = block_size(F, block_f), block_size(D, block_d)
    steps = D // bd
    splits = split_count(steps, P * (F // bf), splits, f"the {steps} steps of {bd} over D={D}")
    per_split = steps // splits

    def kernel(idx_ref, x_ref, w_ref, o_ref):
        p, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        e = idx_ref[p]

        def step(i, acc):
            d0 = (part * per_split + i) * bd
            xs = x_ref[p, pl.ds(d0, bd)].astype(jnp.float32)  # [bd]
            ws = w_ref[e, pl.ds(j * bf, bf), pl.ds(d0, bd)].astype(jnp.float32)  # [bf, bd]
            return acc + ws * xs[None, :]

        acc = jax.lax.fori_loop(0, per_split, step, jnp.zeros((bf, bd), jnp.float32))
        o_ref[part, p, pl.ds(j * bf, bf)] = jnp.sum(acc, axis=1)

    return pairs_call(kernel, "gptoss_pair_matvec", (splits, P, F, bf), x.dtype, interpret, num_warps, num_stages,
                       idx.astype(jnp.int32), x, w)


def pairs_call(kernel, name, sizes, dtype, interpret, num_warps, num_stages, *inputs) -> jax.Array:
    """Run a per-pair matvec kernel on the grid (pairs, output tiles, splits) and add the splits'
    float32 partial sums [splits, P, F] -> [P, F] in dtype."""
    splits, P, F, bf = sizes
    partial = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((splits, P, F), jnp.float32),
                             grid=(P, F // bf, splits), interpret=interpret, name=name,
                             **compiler_params(interpret, num_warps, num_stages))(*inputs)
    return partial.sum(axis=0).astype(dtype)
