"""Decode's expert products over 16-bit experts in Pallas Mosaic GPU (NVIDIA Hopper, JAX >= 0.11):
few rows per expert (a batch of one: one row each for 4 experts), so the work is reading the
selected experts' weights once, at the memory's rate.

The pairs come in blocks of `block_m` rows of one expert each (pairs.group_by_expert; 8 rows, the
least the tensor cores take on this side). The products run transposed, out^T = W x^T: the weights'
tile is the tensor cores' 64-row operand and the block's rows the narrow one ([block_m, K] read
transposed), so no row of padding costs a 64-row tile. A program takes one block, `block_f` output
features and one range of the input dimension: one warpgroup has the TMA engine bring the weights'
and the rows' tiles into shared memory `stages` deep, the other multiplies them there (wgmma)
into float32 registers. With `splits` ranges a batch of one has enough programs to keep every SM
reading; their float32 partial sums are added after (at a batch of one, 2 MB against 130 MB of
weights for gpt-oss-20b's mlp1).

Legend: M = grouped rows, D = input features, F = output features, E = experts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ...mxfp4 import packed
from . import mosaic_mxfp4
from .. import pairs
from ..mosaic import interpret_params, splits_for, supported, tiles

# Rows a block takes at most: its tiles and float32 sums in a Hopper SM's 227 KB of shared memory
# (the MXFP4 kernel at 128 rows asks 239 KB).
MAX_ROWS = 64

__all__ = ["decode_settings", "decode_settings_mxfp4", "grouped_matvec", "grouped_matvec_mxfp4", "supported"]


def decode_settings(blocks_bound: int, F: int, D: int, *, block_f: int = 128, block_k: int = 64) -> dict:
    """Splits of the D / block_k input steps for about two programs per SM of a large GPU (blocks x
    output tiles x splits >= 264), among the steps' divisors."""
    return dict(block_f=block_f, block_k=block_k, splits=splits_for(D // block_k, blocks_bound * -(-F // block_f)))


@functools.partial(jax.jit, static_argnames=("block_m", "block_f", "block_k", "stages", "splits", "interpret"))
def grouped_matvec(rows, block_expert, used, w, *, block_m: int = 8, block_f: int = 128, block_k: int = 64,
                   stages: int = 4, splits: int = 1, interpret: bool = False) -> jax.Array:
    """rows [M, D] in blocks of block_m rows, block_expert [M / block_m] (each block's expert), used
    (blocks from `used` on are skipped; their outputs are undefined), w [E, F, D] of rows' dtype
    (16-bit) -> [M, F] in rows' dtype, float32 sums. block_m: a multiple of 8 up to MAX_ROWS; block_f: of
    64 (F need not be one: the last tile is cut); D: a multiple of block_k, whose steps `splits`
    divides."""
    M, D = rows.shape
    E, F, _ = w.shape
    blocks = block_expert.shape[0]
    if M != blocks * block_m:
        raise ValueError(f"{M} rows for {blocks} blocks of {block_m}")
    if not supported():
        raise RuntimeError(f"the Mosaic GPU decode matvec needs JAX >= 0.11, this is {jax.__version__}")
    if w.dtype != rows.dtype or jnp.dtype(rows.dtype).itemsize != 2:
        raise ValueError(f"the Mosaic GPU decode matvec takes 16-bit rows and weights of one dtype, got {rows.dtype} "
                         f"and {w.dtype}")
    if M % block_m or block_m % 8 or block_m > MAX_ROWS or block_f % 64 or D % block_k or (D // block_k) % splits:
        raise ValueError(f"{M} rows in blocks of {block_m} (a multiple of 8), output tiles of {block_f} (of 64), "
                         f"D={D} in steps of {block_k} split {splits} ways")
    per = D // block_k // splits
    operand = tiles(rows.dtype, block_k * jnp.dtype(rows.dtype).itemsize)

    def body(be_ref, used_ref, x_ref, w_ref, o_ref, o_smem):
        b, j, part = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("k")
        e = be_ref[b]
        first = part * per

        def pipeline(step, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=1,
                max_concurrent_steps=stages, compute_context=compute_context,
                in_specs=[plgpu.BlockSpec((block_f, block_k), lambda k: (j, first + k), transforms=operand),
                          plgpu.BlockSpec((block_m, block_k), lambda k: (b, first + k),
                                          transforms=operand)])

        ignore = lambda *_, **__: None  # noqa: E731

        @pl.when(b < used_ref[0])
        def _():
            @functools.partial(pl.run_scoped, collective_axes="wg",
                               allocs=pipeline(ignore, ignore).get_allocations(w_ref.at[e], x_ref))
            def _(allocs):
                def compute_context(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((block_f, block_m), jnp.float32))
                    def _(acc):
                        run(acc)
                        o_smem[...] = acc[...]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[part, pl.ds(j * block_f, block_f),
                                                                 pl.ds(b * block_m, block_m)])
                        plgpu.wait_smem_to_gmem(0)

                def step(_, ws, xs, acc):  # one step's tiles: weights [block_f, block_k], rows [block_m, block_k]
                    plgpu.wgmma(acc, ws, xs.T)  # [block_f, block_m] += W x^T
                    plgpu.wgmma_wait(0)  # before the memory warpgroup refills these tiles
                    return acc

                pipeline(step, compute_context)(w_ref.at[e], x_ref, allocations=allocs)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, F, blocks * block_m), jnp.float32),
        grid=(blocks, pl.cdiv(F, block_f), splits), grid_names=("m", "n", "k"), num_threads=2,
        thread_name="wg", interpret=interpret_params(interpret),
        scratch_types=dict(o_smem=plgpu.SMEM((block_f, block_m), jnp.float32)))
    out = kernel(block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), rows, w)
    return _rows_out(out, rows.dtype)


def _rows_out(out, dtype) -> jax.Array:
    """The kernels' float32 partial sums [splits, F, M] -> [M, F] in dtype."""
    return out.sum(axis=0).T.astype(dtype)


def decode_settings_mxfp4(blocks_bound: int, F: int, G: int, *, block_m: int = 8, block_f: int = 256,
                          gs: int | None = None) -> dict:
    """Scale blocks a step (`gs`): six (192 inputs) for blocks of up to 16 rows, three above (six
    would not fit a Hopper SM's 227 KB of shared memory); output tiles of 256 rows; and splits of
    the cdiv(G, gs) steps for about two programs per SM of a large GPU, among the steps' divisors.
    On one H100 80GB (gpt-oss-20b, one token's 4 pairs, kernel time in a profile) six blocks a step
    took 37.6 us a layer against 43.4 with three for mlp1 (weights through shared memory)."""
    if gs is None:
        gs = 6 if block_m <= 16 else 3
    return dict(block_f=block_f, gs=gs, splits=splits_for(-(-G // gs), blocks_bound * -(-F // block_f)))


@functools.partial(jax.jit, static_argnames=("block_m", "block_f", "gs", "stages", "splits", "interpret", "decoder",
                                             "weights"))
def grouped_matvec_mxfp4(rows, block_expert, used, blocks, scales, *, block_m: int = 8, block_f: int = 256,
                         gs: int = 3, stages: int = 3, splits: int = 1, interpret: bool = False,
                         decoder: str = "ptx", weights: str = "registers") -> jax.Array:
    """As `grouped_matvec` over MXFP4-packed experts (blocks uint8 [E, F, G, 16], scales uint8
    [E, F, G]; rows bfloat16), decoded on the chip as kernels/experts/mosaic_mxfp4.py does, products
    transposed: two warpgroups each decode half of the program's `block_f` weight rows and multiply
    them (the tensor cores' left operand, 64 rows an instruction) by the block's even and odd
    inputs; a third has the TMA engine bring each step's packed bytes, scales and inputs (`gs` scale
    blocks). `weights`: "registers" hands each scale block's decoded weights to the tensor cores
    straight from the decoder's registers; "smem" stores a step's into shared memory first, then
    makes the stores visible to the tensor cores (what interpret mode runs: its wgmma reads shared
    memory only). On one H100 80GB "registers" took 0.62-0.71x the time of "smem" (gpt-oss-20b's
    projections at 4 and 256 pairs, docs/benchmarks.md). Three compute warpgroups of 64 rows failed
    there (misaligned address) and four cannot get their registers. block_m: a multiple of 8 up to
    MAX_ROWS; block_f: of 128 (F need not be one: the last tile is cut); `splits` divides the
    cdiv(G, gs) steps."""
    M = rows.shape[0]
    E, F, G, _ = blocks.shape
    nblocks = block_expert.shape[0]
    if M != nblocks * block_m:
        raise ValueError(f"{M} rows for {nblocks} blocks of {block_m}")
    steps = pl.cdiv(G, gs)
    if M % block_m or block_m % 8 or block_m > MAX_ROWS or block_f % 128 or steps % splits:
        raise ValueError(f"{M} rows in blocks of {block_m} (a multiple of 8), output tiles of {block_f} (of 128), "
                         f"{steps} steps of {gs} scale blocks split {splits} ways")
    if weights not in ("registers", "smem"):
        raise ValueError(f"weights from 'registers' or 'smem', got {weights!r}")
    if interpret:  # the interpreter's wgmma takes its left operand from shared memory only
        weights = "smem"
    per = steps // splits
    # Where there are fewer blocks than experts (a batch of one: 4 of 32), only the blocks' experts'
    # scales are transposed, by block.
    by_block = nblocks < E
    x_even, x_odd, flat = mosaic_mxfp4.operands("Mosaic GPU MXFP4 decode matvec", rows, blocks)
    scales_t = mosaic_mxfp4.scales_by_step(scales, block_expert if by_block else None)
    K, half = 16 * gs, block_f // 2
    x_tiles = mosaic_mxfp4.TILES

    def body(be_ref, used_ref, xe_ref, xo_ref, b_ref, s_ref, o_ref, o_smem, w_low=None, w_high=None):
        b, j, part = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("k")
        e = be_ref[b]
        s_ref = s_ref.at[b if by_block else e]
        first = part * per

        def pipeline(step, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=stages, compute_context=compute_context,
                in_specs=[plgpu.BlockSpec((block_m, K), lambda k: (b, first + k), transforms=x_tiles),
                          plgpu.BlockSpec((block_m, K), lambda k: (b, first + k), transforms=x_tiles),
                          plgpu.BlockSpec((block_f, K), lambda k: (j, first + k)),
                          plgpu.BlockSpec((gs, block_f), lambda k: (first + k, j))])

        ignore = lambda *_, **__: None  # noqa: E731

        @pl.when(b < used_ref[0])
        def _():
            @functools.partial(pl.run_scoped, collective_axes="wg",
                               allocs=pipeline(ignore, ignore).get_allocations(xe_ref, xo_ref, b_ref.at[e], s_ref))
            def _(allocs):
                wg = lax.axis_index("wg")
                mine = pl.ds(wg * half, half)

                def compute_context(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((half, block_m), jnp.float32))
                    def _(acc):
                        run(acc)
                        o_smem[wg] = acc[...]
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[part, pl.ds(j * block_f + wg * half, half),
                                                                         pl.ds(b * block_m, block_m)])
                        plgpu.wait_smem_to_gmem(0)

                def step(_, xe, xo, packed, s, acc):  # [block_m, K] [block_m, K] [block_f, K] [gs, block_f]
                    if weights == "registers":  # each scale block's weights straight from the decoder
                        for g in range(gs):
                            low, high = mosaic_mxfp4.decode_group(
                                packed, mosaic_mxfp4.step_scales(s, mine, g, interpret), mine, g, interpret, decoder)
                            cols = pl.ds(16 * g, 16)
                            plgpu.wgmma(acc, low, xe.at[:, cols].T)  # [half, block_m] += W_even x_even^T
                            plgpu.wgmma(acc, high, xo.at[:, cols].T)
                        plgpu.wgmma_wait(0)  # before the pipeline reuses the inputs' buffers
                        return acc
                    wl, wh = w_low.at[wg], w_high.at[wg]  # this warpgroup's decoded weights, [half, K] each
                    mosaic_mxfp4.decode_into(packed, s, mine, wl, wh, gs, interpret, decoder)
                    plgpu.wgmma(acc, wl, xe.T)  # [half, block_m] += W_even x_even^T
                    plgpu.wgmma(acc, wh, xo.T)
                    plgpu.wgmma_wait(0)  # before the next step overwrites wl and wh
                    return acc

                pipeline(step, compute_context)(xe_ref, xo_ref, b_ref.at[e], s_ref, allocations=allocs)

    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, F, nblocks * block_m), jnp.float32),
        grid=(nblocks, pl.cdiv(F, block_f), splits), grid_names=("m", "n", "k"), num_threads=3,
        thread_name="wg", interpret=interpret_params(interpret),
        scratch_types=dict(o_smem=plgpu.SMEM((2, half, block_m), jnp.float32),
                           **({} if weights == "registers" else
                              dict(w_low=plgpu.SMEM((2, half, K), jnp.bfloat16, transforms=x_tiles),
                                   w_high=plgpu.SMEM((2, half, K), jnp.bfloat16, transforms=x_tiles)))))
    out = kernel(block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x_even, x_odd, flat,
                 scales_t)
    return _rows_out(out, rows.dtype)


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_decode" (kernels/experts/__init__.py) for decode-sized calls: products
    transposed, so that an expert's few pairs take blocks of as few as 8 rows (`decode_block`; one
    token's pairs each a block of its own), 16-bit or MXFP4-packed experts (decoded on the chip).
    x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    block = pairs.decode_block(idx.size, pairs.num_experts(w["mlp1_weight"]))

    def matmul(inputs, name, block_expert, used):
        return matvec(inputs, w[name], block_expert, used, block_m=block, interpret=kernels.interpret)

    return pairs.blocked(x, idx, w, act, block=block, matmul=matmul)


def matvec(rows, weight, block_expert, used, *, block_m: int, interpret: bool):
    """rows by `weight` (16-bit [E, F, D] or MXFP4-packed) in blocks of block_m rows, each block's
    expert from block_expert, with decode's settings for that many blocks: `grouped_matvec_mxfp4` or
    `grouped_matvec`."""
    bound = block_expert.shape[0]
    if packed(weight):
        _, F, G, _ = weight.blocks.shape
        return grouped_matvec_mxfp4(rows, block_expert, used, weight.blocks, weight.scales, block_m=block_m,
                                    interpret=interpret, **decode_settings_mxfp4(bound, F, G, block_m=block_m))
    _, F, D = weight.shape
    return grouped_matvec(rows, block_expert, used, weight, block_m=block_m, interpret=interpret,
                          **decode_settings(bound, F, D))
