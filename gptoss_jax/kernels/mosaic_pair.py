"""One token's expert products over MXFP4-packed experts in Pallas Mosaic GPU (NVIDIA Hopper, JAX
>= 0.11), without the tensor cores: at a batch of one each pair is one row, so the work is reading
its expert's packed weights once and a multiply-add per weight.

A program takes one pair, `block_f` output features and one range of the input dimension. One
warpgroup has the TMA engine bring each step's packed bytes ([block_f, 16 gs]) and the pair's even
and odd inputs ([2, 16 gs]) into shared memory `stages` deep; two compute warpgroups each first
copy their rows' scales, as stored, into shared memory, then each step decode their half of the
rows (kernels/mosaic_mxfp4.py's decoder, in the wgmma register layout), multiply them by the
inputs broadcast down the rows and add into float32 registers [rows, 16]. The last step's sums are
added across each row's 16 columns (within a thread, then across the four threads of a row), and
the ranges' partial sums after the kernel. Unlike kernels/mosaic_decode.py nothing waits on the
tensor cores, no row is padding, and nothing of the weights is sliced or transposed outside the
kernel. On one H100 80GB (gpt-oss-20b, batch 1) its two projections take 51 us a layer against 41
for the fused Pallas Triton kernels (docs/benchmarks.md).

Legend: P = pairs, D = input features, F = output features, E = experts, G = D / 32 scale blocks.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import mosaic_mxfp4
from .mosaic import interpret_params, supported

__all__ = ["pair_matvec_mxfp4", "supported"]


@functools.partial(jax.jit, static_argnames=("block_f", "gs", "stages", "splits", "interpret", "decoder"))
def pair_matvec_mxfp4(rows, pair_expert, blocks, scales, *, block_f: int = 256, gs: int = 6, stages: int = 3,
                      splits: int = 1, interpret: bool = False, decoder: str = "ptx") -> jax.Array:
    """rows [P, D] bfloat16 (a row per pair), pair_expert [P] (each pair's expert, in [0, E)),
    blocks uint8 [E, F, G, 16], scales uint8 [E, F, G] -> [P, F] bfloat16: row p times its expert's
    weights decoded, float32 sums. block_f: a multiple of 128 (F need not be one: the last tile is
    cut); gs: even; `splits` divides the cdiv(G, gs) steps; F: a multiple of the `r` rows whose
    scales make a multiple of 16 bytes (r = 16 / gcd(G, 16): 8 for gpt-oss's G = 90). Settings for
    P pairs: mosaic_decode.decode_settings_mxfp4(P, F, G, block_m=1)."""
    P = rows.shape[0]
    E, F, G, _ = blocks.shape
    steps = pl.cdiv(G, gs)
    r = 16 // math.gcd(G, 16)
    if block_f % 128 or gs % 2 or steps % splits or F % r:
        raise ValueError(f"output tiles of {block_f} (of 128), {steps} steps of {gs} (an even number of) scale "
                         f"blocks split {splits} ways, {F} outputs (a multiple of {r})")
    per = steps // splits
    x_even, x_odd, flat = mosaic_mxfp4.operands("Mosaic GPU MXFP4 pair matvec", rows, blocks)
    # [P, 2, D / 2]: a step's even and odd inputs in one buffer of 64 gs bytes. The TMA engine writes
    # shared memory at multiples of 128 bytes; two buffers of 32 gs bytes each (gs = 6 at gpt-oss's
    # shapes) put the second stage's off that and failed on one H100 80GB (misaligned address).
    x = jnp.stack([x_even, x_odd], axis=1)
    K, half = 16 * gs, block_f // 2
    column = plgpu.Layout.WGMMA.reduce(0)  # [16]: one value per column of a [rows, 16] tile
    # The scales as stored, [F, G] an expert, rows of G bytes: the TMA engine needs strides of
    # multiples of 16 bytes, so they are read as [F / r, n, c] (r rows' scales a row, cut into n
    # pieces of c <= 256 bytes), a warpgroup's rows at once before the first step, and read back
    # as [half, G]. (Transposing them for each call instead took 7.6 us a layer on one H100 80GB.)
    row_bytes = r * G
    c = max(d for d in range(16, min(row_bytes, 256) + 1, 16) if row_bytes % d == 0)
    n = row_bytes // c
    scales = scales.reshape(E, F // r, n, c)

    def body(pe_ref, x_ref, b_ref, s_ref, o_ref, o_smem, s_smem, s_arrived):
        p, j, part = lax.axis_index("p"), lax.axis_index("n"), lax.axis_index("k")
        first = part * per

        def pipeline(step, compute_context):
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=stages, compute_context=compute_context,
                in_specs=[plgpu.BlockSpec((1, 2, K), lambda k: (p, 0, first + k)),
                          plgpu.BlockSpec((block_f, K), lambda k: (j, first + k))])

        ignore = lambda *_, **__: None  # noqa: E731
        e = pe_ref[p]

        @functools.partial(pl.run_scoped, collective_axes="wg",
                           allocs=pipeline(ignore, ignore).get_allocations(x_ref, b_ref.at[e]))
        def _(allocs):
            wg = lax.axis_index("wg")
            mine = pl.ds(wg * half, half)

            def compute_context(run):
                plgpu.copy_gmem_to_smem(s_ref.at[e, pl.ds((j * block_f + wg * half) // r, half // r)], s_smem.at[wg],
                                        s_arrived.at[wg])
                plgpu.barrier_wait(s_arrived.at[wg])
                acc = run(plgpu.layout_cast(jnp.zeros((half, 16), jnp.float32), plgpu.Layout.WGMMA))
                o_smem[wg] = acc.sum(axis=1)  # [half]: this warpgroup's rows
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem.at[wg], o_ref.at[part, p, pl.ds(j * block_f + wg * half, half)])
                plgpu.wait_smem_to_gmem(0)

            def step(index, x, packed, acc):  # [1, 2, K] [block_f, K]; acc [half, 16]
                for g in range(gs):
                    col = (first + index[0]) * gs + g
                    if G % gs:  # past the last scale block (its packed bytes are zeros): any stored scale
                        col = jnp.minimum(col, G - 1)
                    if interpret:  # (the interpreter reshapes values, not refs)
                        sc = s_smem[wg].reshape(half, G)[:, col]
                    else:  # column col of the table [half, G], row-major
                        table = s_smem.at[wg].reshape(half * G)
                        sc = mosaic_mxfp4.load_rows_strided(table.at[pl.ds(col, (half - 1) * G + 1)], half, G)
                    low, high = mosaic_mxfp4.decode_group(packed, sc, mine, g, interpret, decoder)
                    x_low, x_high = (mosaic_mxfp4.load(x, (0, h, pl.ds(16 * g, 16)), column, interpret)
                                     .astype(jnp.float32) for h in (0, 1))
                    acc = acc + low.astype(jnp.float32) * x_low[None, :] + high.astype(jnp.float32) * x_high[None, :]
                return acc

            pipeline(step, compute_context)(x_ref, b_ref.at[e], allocations=allocs)

    # Outputs padded to whole tiles: a row's copy back is one contiguous run, which the copy engine
    # does not clip at the row's end (on one H100 80GB a cut last tile's outputs landed in the next
    # row's first columns).
    tiles = pl.cdiv(F, block_f)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((splits, P, tiles * block_f), jnp.float32),
        grid=(P, tiles, splits), grid_names=("p", "n", "k"), num_threads=3, thread_name="wg",
        interpret=interpret_params(interpret),
        scratch_types=dict(o_smem=plgpu.SMEM((2, half), jnp.float32),
                           s_smem=plgpu.SMEM((2, half // r, n, c), jnp.uint8),
                           s_arrived=plgpu.Barrier(num_barriers=2)))
    out = kernel(pair_expert.astype(jnp.int32), x, flat, scales)
    return out[:, :, :F].sum(axis=0).astype(rows.dtype)
