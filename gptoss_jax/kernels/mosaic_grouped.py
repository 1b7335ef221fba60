"""A grouped matmul for decode-sized calls over 16-bit experts, in Pallas Mosaic GPU (NVIDIA Hopper,
JAX >= 0.11): few rows of each expert, so the work is reading the experts' weights.

The pairs are laid out in blocks of `block_m` rows of one expert each (moe.group_by_expert; at a
decode batch of one, 4 blocks of one row and 63 zeros). A program multiplies one block by one tile
of `block_n` of its expert's output rows over one range of the input dimension: the TMA engine
brings the rows' and the weights' tiles ([block_m, block_k] and [block_n, block_k]) into shared
memory `stages` deep, and the tensor cores read both from there (wgmma), so the weights never pass
through registers. Splitting the input dimension into `splits` ranges gives a batch of one enough
programs to keep every SM reading; their float32 partial sums are added after. The tensor cores
do block_m x the useful work at a batch of one, which still costs less than reading the weights.

Legend: M = grouped rows, D = input features, F = output features, E = experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from .mosaic_mxfp4 import supported  # JAX's Mosaic GPU interface, shared by the Mosaic GPU kernels

__all__ = ["decode_settings", "grouped_matmul", "supported"]


def _tiles(dtype, width: int):
    """Swizzled tiles of `width` elements a row: the layout wgmma reads its operands in."""
    row_bytes = width * jnp.dtype(dtype).itemsize
    return plgpu.TilingTransform((8, width)), plgpu.SwizzleTransform(min(128, row_bytes))


def decode_settings(blocks_bound: int, F: int, D: int, block_n: int = 128, block_k: int = 64) -> dict:
    """Splits of the input dimension for about two programs per SM of a large GPU (blocks x output
    tiles x splits >= 264), among the divisors of its D / block_k steps."""
    steps = D // block_k
    tiles = blocks_bound * -(-F // block_n)
    splits = next(d for d in range(1, steps + 1) if steps % d == 0 and (tiles * d >= 264 or d == steps))
    return dict(block_n=block_n, block_k=block_k, splits=splits)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "stages", "splits", "interpret"))
def grouped_matmul(rows, block_expert, used, w, *, block_m: int = 64, block_n: int = 128, block_k: int = 64,
                   stages: int = 4, splits: int = 1, interpret: bool = False) -> jax.Array:
    """rows [M, D] in blocks of block_m rows, block_expert [M / block_m] (each block's expert), used
    (blocks from `used` on are skipped; their outputs are undefined), w [E, F, D] of rows' dtype
    (16-bit) -> [M, F] in rows' dtype, float32 sums. block_m: a multiple of 64; D: of block_k; F need
    not be a multiple of block_n (the last tile is cut); splits: dividing D / block_k."""
    M, D = rows.shape
    E, F, _ = w.shape
    if not supported():
        raise RuntimeError(f"the Mosaic GPU grouped matmul needs JAX >= 0.11, this is {jax.__version__}")
    if w.dtype != rows.dtype or jnp.dtype(rows.dtype).itemsize != 2:
        raise ValueError(f"the Mosaic GPU grouped matmul takes 16-bit rows and weights of one dtype, got {rows.dtype} "
                         f"and {w.dtype}")
    if M % block_m or block_m % 64 or D % block_k or (D // block_k) % splits:
        raise ValueError(f"{M} rows in blocks of {block_m} (a multiple of 64), D={D} in steps of {block_k}, split "
                         f"{splits} ways")
    per = D // block_k // splits
    tiles = _tiles(rows.dtype, block_k)
    out_dtype = rows.dtype if splits == 1 else jnp.float32

    def body(be_ref, used_ref, x_ref, w_ref, o_ref):
        b, j, part = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("k")
        out = o_ref if splits == 1 else o_ref.at[part]

        @pl.when(b < used_ref[0])
        def _():
            e = be_ref[b]
            first = part * per

            def step(_, xs, ws, acc):
                plgpu.wgmma(acc, xs, ws.T)
                plgpu.wgmma_wait(1)  # the step before's product: done, so its tiles can be refilled
                return acc

            def products(acc):
                plgpu.emit_pipeline(
                    functools.partial(step, acc=acc), grid=(per,), max_concurrent_steps=stages,
                    in_specs=[plgpu.BlockSpec((block_m, block_k), lambda k: (b, first + k), transforms=tiles,
                                              delay_release=1),
                              plgpu.BlockSpec((block_n, block_k), lambda k: (j, first + k), transforms=tiles,
                                              delay_release=1)])(x_ref, w_ref.at[e])
                return acc[...]

            acc = pl.run_scoped(products, plgpu.ACC((block_m, block_n), jnp.float32))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((block_m, block_n), out_dtype,
                                                                transforms=_tiles(out_dtype, 128 // jnp.dtype(out_dtype).itemsize)))
            def _(o_smem):
                o_smem[...] = acc.astype(out_dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, out.at[pl.ds(b * block_m, block_m), pl.ds(j * block_n, block_n)])
                plgpu.wait_smem_to_gmem(0)

    out_shape = (M, F) if splits == 1 else (splits, M, F)
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype),
                          grid=(M // block_m, pl.cdiv(F, block_n), splits), grid_names=("m", "n", "k"),
                          interpret=plgpu.InterpretGPUParams() if interpret else None)
    out = kernel(block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), rows, w)
    return out if splits == 1 else out.sum(axis=0).astype(rows.dtype)
