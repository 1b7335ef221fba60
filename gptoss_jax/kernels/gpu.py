"""Fused kernels for NVIDIA GPUs (Ampere, Hopper, Blackwell) from tokamax, Google DeepMind's kernel
library: `pip install -e ".[cuda]"` (Python >= 3.12). Nothing here is imported without a GPU.

- Attention: tokamax's Mosaic GPU flash attention (sm80/sm90/sm100). It takes no sinks; it returns
  the softmax statistics (row max and sum), and combine.py folds the sinks in from them. Key blocks
  outside the causal band, the window or a cache's filled length are skipped inside the kernel.
- Experts: one grouped matmul (ragged dot) over rows sorted by expert, each expert's weights read in
  place (no gathered copy). On Hopper, the Mosaic GPU ragged dot that ships with JAX reads the
  model's [E, out, in] experts directly (`mosaic_ragged_dot`); tokamax's (`ragged_dot`) wants
  [E, in, out] and so transposes each call's weights first, about twice as slow here (one H100:
  0.53 vs 1.41 ms for 32 rows over 32 experts, 1.23 vs 3.17 ms for 16,384; docs/benchmarks.md).

Legend: B = batch, T = queries, S = keys, N = query heads, K = KV heads, G = N / K, H = head dim,
M = rows, G_e = experts, F = output features, D = input features.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import paged, pairs
from .combine import lse_of


@functools.cache
def _tokamax():
    try:
        import tokamax
        from tokamax._src.ops.attention import base, pallas_mosaic_gpu
        from tokamax._src.ops.ragged_dot import base as ragged_base
    except ImportError as e:  # tokamax itself, or a dependency of it
        raise ImportError(f"the GPU kernels need tokamax (pip install -e \".[cuda]\", Python >= 3.12): {e}") from e
    return tokamax, base, pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(), ragged_base


def available() -> bool:
    try:
        _tokamax()
    except ImportError:
        return False
    return True


def _flash(q, k, v, mask) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, S, K, H] -> (o [B, T, K, G, H], lse [B, T, K, G])."""
    B, T, K, G, H = q.shape
    _, _, op, _ = _tokamax()
    # Query head n reads KV head n // G, tokamax's grouping too.
    o, (m, l) = op(q.reshape(B, T, K * G, H), k, v, mask=mask, return_residuals=True)
    lse = lse_of(m, l).swapaxes(1, 2).reshape(B, T, K, G)  # [B, N, T] -> [B, T, K, G]
    return o.reshape(B, T, K, G, H), lse


# Each entry point is its own jit: the 24 layers' identical calls then lower (and compile their
# Mosaic GPU kernel) once per shape, not once per layer.
@functools.partial(jax.jit, static_argnames=("window",))
def causal(q, k, v, *, window: int | None) -> tuple[jax.Array, jax.Array]:
    """Queries and keys of the same positions, causal (and windowed: i - window < j <= i)."""
    _, base, _, _ = _tokamax()
    mask = base.Mask(None, is_causal=True)
    if window is not None:
        mask &= base.CausalMask(offset=0, window_size=window)
    return _flash(q, k, v, mask)


@jax.jit
def prefix(q, k, v, kv_len) -> tuple[jax.Array, jax.Array]:
    """Every query sees keys [0, kv_len[b]) (a cache's earlier positions); blocks past it are skipped."""
    _, base, _, _ = _tokamax()
    return _flash(q, k, v, base.Mask(None, k_end=kv_len.astype(jnp.int32)[:, None, None]))


@jax.jit
def ragged_dot(x, w, group_sizes) -> jax.Array:
    """x [M, D] with rows sorted by expert, w [G_e, F, D] (as the model holds experts: out, in),
    group_sizes [G_e] -> [M, F]; rows past sum(group_sizes) are left undefined."""
    tokamax, _, _, ragged_base = _tokamax()
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


def is_hopper() -> bool:
    devices = jax.devices()
    return devices[0].platform == "gpu" and getattr(devices[0], "compute_capability", "") == "9.0"


def tokamax_experts(x, idx, w, act, *, kernels):
    """The experts' variant "tokamax" (kernels/experts.py): the pairs sorted by expert, one ragged
    dot per projection by tokamax. x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    return pairs.ragged(x, idx, w, act, ragged_dot=ragged_dot)


def mosaic_experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_gpu" (kernels/experts.py): as `tokamax_experts`, by the Mosaic
    GPU ragged dot (Hopper)."""
    return pairs.ragged(x, idx, w, act, ragged_dot=mosaic_ragged_dot)


# The attention variant "tokamax" (kernels/attention.py): flash attention for prompts.
# Positions (sequences x table width x page) up to which a prompt chunk's cached prefix is gathered
# out of the paged cache for the flash kernel at once (about 0.5 GiB of keys and values at gpt-oss's
# 8 KV heads); longer tables are gathered a piece of columns at a time (paged.in_pieces).
GATHER_FOR_FLASH = 262_144


def tokamax_causal(q, k, v, *, window, kernels):
    return causal(q, k, v, window=window)


def tokamax_prefix(q, k, v, lengths, *, kernels):
    return prefix(q, k, v, lengths)


def tokamax_paged_full(q, pool_k, pool_v, table, lengths, *, kernels, mesh):
    """A prompt chunk after its cached prefix (one device): the flash kernel over the prefix's keys
    gathered out of the pages, the whole table where sequences x width x page <= GATHER_FOR_FLASH
    (one NVIDIA H200, 256 prompts of 1k in chunks of 512: first tokens at 2.6 s p50, not 3.2 in jnp
    blocks), else pieces of a power of two columns under that bound."""
    if mesh is not None:
        return None
    B, W, P = q.shape[0], table.shape[1], pool_k.shape[1]
    if B * W * P <= GATHER_FOR_FLASH:
        return prefix(q, paged.gather(pool_k, table), paged.gather(pool_v, table), lengths)
    pages = 1 << max(0, (GATHER_FOR_FLASH // (B * P)).bit_length() - 1)
    return paged.in_pieces(q, pool_k, pool_v, table, lengths, prefix, pages=pages)
