"""Decode-sized expert matmuls as a Pallas Triton kernel (ships with JAX; NVIDIA GPUs).

At decode a batch has few (token, expert) pairs, and the work is reading the selected experts'
weights: per pair a matrix-vector product with its expert's [F, D] matrix. The kernel reads each
pair's rows of that matrix in place, straight from the [E, F, D] array (rows of D contiguous, so
every load is coalesced), with no gathered copy of the weights and no host round trip. Pairs that
share an expert read it again (at batch 1 the 4 pairs of a token are 4 distinct experts).

Legend: P = pairs, D = input features, F = output features, E = experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _block(n: int, preferred: int) -> int:
    """The largest power of two <= preferred dividing n (Triton blocks are powers of two)."""
    b = preferred
    while n % b:
        b //= 2
    return b


@functools.partial(jax.jit, static_argnames=("interpret", "block_f", "block_d"))
def pair_matvec(x, idx, w, *, interpret: bool = False, block_f: int = 64, block_d: int = 64) -> jax.Array:
    """x [P, D], idx [P] (each pair's expert), w [E, F, D] -> [P, F] in x's dtype, float32 sums."""
    P, D = x.shape
    E, F, _ = w.shape
    bf, bd = _block(F, block_f), _block(D, block_d)

    def kernel(idx_ref, x_ref, w_ref, o_ref):
        p, j = pl.program_id(0), pl.program_id(1)
        e = idx_ref[p]

        def step(i, acc):
            xs = x_ref[p, pl.ds(i * bd, bd)].astype(jnp.float32)  # [bd]
            ws = w_ref[e, pl.ds(j * bf, bf), pl.ds(i * bd, bd)].astype(jnp.float32)  # [bf, bd]
            return acc + jnp.sum(ws * xs[None, :], axis=1)

        acc = jax.lax.fori_loop(0, D // bd, step, jnp.zeros((bf,), jnp.float32))
        o_ref[p, pl.ds(j * bf, bf)] = acc.astype(o_ref.dtype)

    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        params["compiler_params"] = pltriton.CompilerParams(num_warps=4, num_stages=3)
    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((P, F), x.dtype), grid=(P, F // bf),
                          interpret=interpret, name="gptoss_pair_matvec", **params)(idx.astype(jnp.int32), x, w)
