"""The experts' variant "megablox" (experts/__init__.py): megablox's grouped matmul (`gmm`, ships
with JAX: Pallas, Mosaic TPU), reading each expert's [F, D] weights in place (transpose_rhs). Never
run on a TPU here: checked against the jnp code in Pallas interpret mode on CPU
(tests/test_kernels.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from .. import pairs


def ragged_dot(x, w, group_sizes, *, interpret: bool = False) -> jax.Array:
    """x [M, D] sorted by expert, w [E, F, D], group_sizes [E] -> [M, F] (rows past the groups: undefined)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    M, D = x.shape
    F = w.shape[1]
    tm = min(128, M)
    rows = -(-M // tm) * tm  # rows past the groups are never read: zero padding to whole tiles
    x = jnp.pad(x, ((0, rows - M), (0, 0)))
    tiling = (tm, _tile(D), _tile(F))
    return gmm(x, w, group_sizes.astype(jnp.int32), preferred_element_type=x.dtype, tiling=tiling,
               transpose_rhs=True, interpret=interpret)[:M]


def _tile(n: int) -> int:
    """The largest of 128, 64, ... dividing n (the kernel's tiles must divide D and F)."""
    t = 128
    while n % t:
        t //= 2
    return t


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "megablox" (kernels/experts/__init__.py): the pairs sorted by expert, one
    megablox grouped matmul per projection (MXFP4-packed experts decoded whole first). x [N, D],
    idx [N, A] (negative: dropped) -> [N, A, D]."""
    return pairs.ragged(x, idx, w, act, ragged_dot=functools.partial(ragged_dot, interpret=kernels.interpret))
