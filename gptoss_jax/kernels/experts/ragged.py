"""The experts' variants "tokamax" and "mosaic_gpu" (experts/__init__.py): one grouped matmul (ragged
dot) per projection over rows sorted by expert, each expert's weights read in place (no gathered
copy). On Hopper, the Mosaic GPU ragged dot that ships with JAX reads the model's [E, out, in]
experts directly (`mosaic_ragged_dot`); tokamax's (`ragged_dot`) wants [E, in, out] and so
transposes each call's weights first, about twice as slow here (one H100: 0.53 vs 1.41 ms for 32
rows over 32 experts, 1.23 vs 3.17 ms for 16,384; docs/benchmarks.md).

Legend: M = rows, G_e = experts, F = output features, D = input features.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import pairs
from .. import tokamax as library


@jax.jit
def ragged_dot(x, w, group_sizes) -> jax.Array:
    """x [M, D] with rows sorted by expert, w [G_e, F, D] (as the model holds experts: out, in),
    group_sizes [G_e] -> [M, F]; rows past sum(group_sizes) are left undefined."""
    tokamax, _, _, ragged_base = library.modules()
    return tokamax.ragged_dot_general(x, w, group_sizes.astype(jnp.int32),
                                      ragged_dot_dimension_numbers=ragged_base.TRANS_RHS_RAGGED_DOT_DIM_NUMS,
                                      preferred_element_type=x.dtype, implementation="mosaic")


def mosaic_tiles(rows: int, F: int) -> dict | None:
    """The Mosaic GPU ragged dot's tiles for `rows` rows and F outputs, or None where none fits.

    192-wide output tiles divide both of gpt-oss's widths (5760 and 2880); 128-row tiles, with four
    output tiles walked together (so neighbouring programs share rows in L2), pay off on prompts;
    64-row tiles on decode batches, whose experts get a few rows each. One H100, 16,384 rows over
    32 experts: 1.23 ms for [5760, 2880] experts (441 TFLOP/s) and 0.68 ms for [2880, 2880]
    (399 TFLOP/s), against 2.46 ms with 64 x 128 tiles and 1.61 ms with tokamax's transposing
    kernel (docs/benchmarks.md).
    """
    block_n = next((n for n in (192, 128, 64) if F % n == 0), None)
    if block_n is None:
        return None
    large = rows > 1024
    return dict(block_m=128 if large else 64, block_n=block_n, block_k=64, max_concurrent_steps=4,
                grid_block_n=4 if large else 1)


def _mosaic(x, w, group_sizes, *, transpose: bool) -> jax.Array:
    """x [M, K] by w [E, N, K] (transpose) or w [E, K, N], rows grouped by expert -> [M, N]."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    N, K = w.shape[1:] if transpose else w.shape[:0:-1]
    tiles = mosaic_tiles(x.shape[0], N)
    if tiles is None or K % 64:
        if transpose:
            return ragged_dot(x, w, group_sizes)
        return jax.lax.ragged_dot(x, w, group_sizes.astype(jnp.int32), preferred_element_type=x.dtype)
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=transpose,
                                      **tiles)


@jax.custom_vjp
def _mosaic_ragged_dot(x, w, group_sizes):
    return _mosaic(x, w, group_sizes, transpose=True)


def _mosaic_fwd(x, w, group_sizes):
    return _mosaic(x, w, group_sizes, transpose=True), (x, w, group_sizes)


def _mosaic_bwd(residuals, dy):
    """dx = dy @ w[e] by the same kernel reading w untransposed; dw[e] = dy_e^T x_e by XLA's ragged
    dot (training with frozen experts, LoRA, never uses it, and XLA then drops it)."""
    x, w, group_sizes = residuals
    dx = _mosaic(dy, w, group_sizes, transpose=False)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([0], [0]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw = jax.lax.ragged_dot_general(dy, x, group_sizes.astype(jnp.int32), dims, preferred_element_type=jnp.float32)
    return dx, dw.astype(w.dtype), None


_mosaic_ragged_dot.defvjp(_mosaic_fwd, _mosaic_bwd)


@jax.jit
def mosaic_ragged_dot(x, w, group_sizes) -> jax.Array:
    """As `ragged_dot`, by the Mosaic GPU kernel in JAX's Pallas ops (Hopper), reading w [E, F, D]
    tiles transposed in shared memory rather than transposing w. Differentiable: the backward pass
    runs the same kernel on the untransposed weights for the input's gradient."""
    return _mosaic_ragged_dot(x, w, group_sizes)


def tokamax_experts(x, idx, w, act, *, kernels):
    """The experts' variant "tokamax" (kernels/experts/__init__.py): the pairs sorted by expert, one ragged
    dot per projection by tokamax. x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    return pairs.ragged(x, idx, w, act, ragged_dot=ragged_dot)


def mosaic_experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_gpu" (kernels/experts/__init__.py): as `tokamax_experts`, by the Mosaic
    GPU ragged dot (Hopper)."""
    return pairs.ragged(x, idx, w, act, ragged_dot=mosaic_ragged_dot)
