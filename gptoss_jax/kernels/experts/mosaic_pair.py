"""One token's expert products over MXFP4-packed experts in Pallas Mosaic GPU (NVIDIA Hopper, JAX
>= 0.11), without the tensor cores: at a batch of one each pair is one row, so the work is reading
its expert's packed weights once and a multiply-add per weight.

A program takes one pair, `block_f` output rows and one range of the input dimension: one
warpgroup copies its rows' scales, as stored, into shared memory, then runs a pipeline that has
the TMA engine bring each step's packed bytes ([block_f, 16 gs]) and the pair's even and odd inputs
([2, 16 gs]) `stages` deep while it decodes the step before (kernels/experts/mosaic_mxfp4.py's decoder, in
the wgmma register layout), multiplies the weights by the inputs broadcast down the rows and adds
into float32 registers [rows, 16]. Programs are small (64 rows, at most `stages` steps), so that
several run on each SM and hide each other's memory latency, as a matvec needs (a warp-specialized
form, one warpgroup copying and two computing 128 rows, held one program an SM and took 33 / 20
us a layer, docs/benchmarks.md). The last step's sums are added across each row's 16 columns
(within a thread, then across the four threads of a row), and the ranges' partial sums after the
kernel. Unlike kernels/experts/mosaic_decode.py nothing waits on the tensor cores, no row is padding, and
nothing of the weights is sliced or transposed outside the kernel. On one H100 80GB (gpt-oss-20b,
batch 1) its two projections take 23 / 13 us a layer against 26 / 15 for the Pallas Triton matvec
(`pair_settings`).

Legend: P = pairs, D = input features, F = output features, E = experts, G = D / 32 scale blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from ...mxfp4 import packed
from . import mosaic_decode, mosaic_mxfp4
from .. import pairs
from ..mosaic import interpret_params, load, load_rows_strided, supported

__all__ = ["pair_matvec_mxfp4", "pair_settings", "supported"]


def pair_settings(G: int, *, gs: int = 6, stages: int = 3) -> dict:
    """One warpgroup a program and 64 output rows (several programs an SM), `gs` scale blocks a step,
    and the cdiv(G, gs) steps split into ranges of at most `stages` steps (so a program has its
    whole range in flight at once; at gpt-oss's G = 90: 5 ranges of 3). On one H100 80GB
    (gpt-oss-20b, one token's 4 pairs, kernel time in a profile, bench/kernels.py --part
    decode-experts) these took 23 / 13 us a layer for mlp1 / mlp2, against 26 / 18 for whole ranges
    (splits=1), 26 / 15 for 3 ranges, and 26 / 15 for the Pallas Triton matvec."""
    steps = -(-G // gs)
    splits = next(d for d in range(1, steps + 1) if steps % d == 0 and steps // d <= stages)
    return dict(block_f=64, gs=gs, stages=stages, splits=splits)


@functools.partial(jax.jit, static_argnames=("block_f", "gs", "stages", "splits", "interpret", "decoder"))
def pair_matvec_mxfp4(rows, pair_expert, blocks, scales, *, block_f: int = 64, gs: int = 6, stages: int = 3,
                      splits: int = 1, interpret: bool = False, decoder: str = "ptx") -> jax.Array:
    """rows [P, D] bfloat16 (a row per pair), pair_expert [P] (each pair's expert, in [0, E)),
    blocks uint8 [E, F, G, 16], scales uint8 [E, F, G] -> [P, F] bfloat16: row p times its expert's
    weights decoded, float32 sums. block_f: a multiple of 64 (F need not be one: the last tile is
    cut);
    gs: even; `splits` divides the cdiv(G, gs) steps; F: a multiple of the `r` rows whose scales
    make a multiple of 16 bytes (r = 16 / gcd(G, 16): 8 for gpt-oss's G = 90). Settings:
    `pair_settings(G)`."""
    P = rows.shape[0]
    E, F, G, _ = blocks.shape
    steps = pl.cdiv(G, gs)
    # The scales as stored, read a program's rows at once before the first step and read back as
    # [block_f, G] (`scale_rows`). (Transposing them for each call instead took 7.6 us a layer on one
    # H100 80GB.)
    scales, r = mosaic_mxfp4.scale_rows(scales)
    if block_f % 64 or gs % 2 or steps % splits:
        raise ValueError(f"output tiles of {block_f} (of 64), {steps} steps of {gs} (an even number of) scale "
                         f"blocks split {splits} ways")
    per = steps // splits
    x_even, x_odd, flat = mosaic_mxfp4.operands("Mosaic GPU MXFP4 pair matvec", rows, blocks)
    # [P, 2, D / 2]: a step's even and odd inputs in one buffer of 64 gs bytes. The TMA engine writes
    # shared memory at multiples of 128 bytes; two buffers of 32 gs bytes each (gs = 6 at gpt-oss's
    # shapes) put the second stage's off that and failed on one H100 80GB (misaligned address).
    x = jnp.stack([x_even, x_odd], axis=1)
    K = 16 * gs
    column = plgpu.Layout.WGMMA.reduce(0)  # [16]: one value per column of a [rows, 16] tile

    def body(pe_ref, x_ref, b_ref, s_ref, o_ref, o_smem, s_smem, s_arrived):
        p, j, part = lax.axis_index("p"), lax.axis_index("n"), lax.axis_index("k")
        first = part * per
        e = pe_ref[p]
        plgpu.copy_gmem_to_smem(s_ref.at[e, pl.ds(j * block_f // r, block_f // r)], s_smem, s_arrived)
        plgpu.barrier_wait(s_arrived)
        rows = pl.ds(0, block_f)

        def step(index, x, packed, acc):  # [1, 2, K] [block_f, K] in shared memory; acc [block_f, 16]
            for g in range(gs):
                col = (first + index[0]) * gs + g
                if G % gs:  # past the last scale block (its packed bytes are zeros): any stored scale
                    col = jnp.minimum(col, G - 1)
                if interpret:  # (the interpreter reshapes values, not refs)
                    sc = s_smem[...].reshape(block_f, G)[:, col]
                else:  # column col of the table [block_f, G], row-major
                    table = s_smem.reshape(block_f * G)
                    sc = load_rows_strided(table.at[pl.ds(col, (block_f - 1) * G + 1)], block_f, G)
                low, high = mosaic_mxfp4.decode_group(packed, sc, rows, g, interpret, decoder)
                x_low, x_high = (load(x, (0, h, pl.ds(16 * g, 16)), column, interpret)
                                 .astype(jnp.float32) for h in (0, 1))
                acc = acc + low.astype(jnp.float32) * x_low[None, :] + high.astype(jnp.float32) * x_high[None, :]
            return acc

        acc = plgpu.emit_pipeline(
            step, grid=(per,), max_concurrent_steps=stages,
            in_specs=[plgpu.BlockSpec((1, 2, K), lambda k: (p, 0, first + k)),
                      plgpu.BlockSpec((block_f, K), lambda k: (j, first + k))],
            init_carry=plgpu.layout_cast(jnp.zeros((block_f, 16), jnp.float32), plgpu.Layout.WGMMA),
        )(x_ref, b_ref.at[e])
        o_smem[...] = acc.sum(axis=1)  # [block_f]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[part, p, pl.ds(j * block_f, block_f)])
        plgpu.wait_smem_to_gmem(0)

    # Outputs padded to whole tiles: a row's copy back is one contiguous run, which the copy engine
    # does not clip at the row's end (on one H100 80GB a cut last tile's outputs landed in the next
    # row's first columns).
    tiles = pl.cdiv(F, block_f)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, P, tiles * block_f), jnp.float32),
        grid=(P, tiles, splits), grid_names=("p", "n", "k"), interpret=interpret_params(interpret),
        scratch_types=dict(o_smem=plgpu.SMEM((block_f,), jnp.float32),
                           s_smem=plgpu.SMEM((block_f // r, *scales.shape[2:]), jnp.uint8), s_arrived=plgpu.Barrier()))
    out = kernel(pair_expert.astype(jnp.int32), x, flat, scales)
    return out[:, :, :F].sum(axis=0).astype(rows.dtype)


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_pair" (kernels/experts/__init__.py): up to `kernels.moe_pair_max_pairs`
    pairs over MXFP4-packed experts a row each, in their own order (no sorting, no tensor cores, no
    padding rows; an expert two pairs share is read twice); any other call as "mosaic_decode".
    x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    if idx.size > kernels.moe_pair_max_pairs or not (packed(w["mlp1_weight"]) and packed(w["mlp2_weight"])):
        return mosaic_decode.experts(x, idx, w, act, kernels=kernels)

    def matmul(inputs, name, block_expert, used):
        weight = w[name]
        return pair_matvec_mxfp4(inputs, block_expert, weight.blocks, weight.scales, interpret=kernels.interpret,
                                 **pair_settings(weight.blocks.shape[2]))

    return pairs.blocked(x, idx, w, act, block=1, matmul=matmul)
