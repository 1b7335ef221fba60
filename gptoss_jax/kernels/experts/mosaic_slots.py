"""The experts of a decode batch of up to 32 tokens in two Pallas Mosaic GPU kernels (NVIDIA Hopper, JAX
>= 0.11): each expert the batch picked read once, nothing sorted, nothing laid out between them.

At a decode batch the work is reading the selected experts' weights once, at the memory's rate, and
every kernel launched costs a few microseconds of waiting (on one NVIDIA H200, 2026-11-30, the
gpt-oss-20b block at one token: 17 kernels, 86 us of them busy, 142 us in all; docs/benchmarks.md).
So the pairs are never sorted or gathered: each expert any token picked gets a slot (numbered by
its first pair, token-major; at most S = min(N * A, E) of them), and each kernel's program works
out its slot's expert from the routing itself, then multiplies the whole batch (the Nq tokens,
padded) by its rows of that expert:
- `up`: program (tile of mlp1's output rows, slot): + bias, then gpt-oss's clamped SwiGLU of each
  (gate, linear) pair of rows, written as h [S, parts, Nq, F / parts] (F rounded up to whole
  tiles), parts = 2 for MXFP4 experts (the even units, then the odd ones: the two halves the second
  kernel's decoder multiplies), 1 for bfloat16 ones;
- `down`: program (tile of outputs, range of the inputs, slot): h[slot] by mlp2, + bias (the first
  range), times each token's routing weight for the slot's expert (0 where the token did not pick
  it), written as float32 partial sums y [S, ranges, D, Nq] (D rounded up to whole tiles) that XLA
  adds (with what reads the block's output). Slots no expert holds are written as zeros.
A slot's products for tokens that did not pick its expert are computed and weighted by zero: the
tensor cores have rows to spare (they take 8 or more), and decode reads weights at the memory's rate.

The products run transposed, out^T = W x^T: the weights' rows are the tensor cores' 64-row operand
and the tokens the narrow one. A program is one warpgroup over 64 or 128 rows (`rows_per_program`):
it has the TMA engine bring its weight tiles (and the tokens') `stages` deep and multiplies them,
and several programs share an SM, hiding each other's memory latency. (Three warpgroups a program,
one bringing the tiles while two multiplied, held one program an SM, 168 registers a thread, and
took 14 to 25% more time on one NVIDIA H200: docs/benchmarks.md.) MXFP4 weights are decoded on the
chip as in kernels/experts/mosaic_mxfp4.py, their scales read as stored ([E, F, G], no transpose or
gather per call): a program's rows' scales are copied into shared memory once, before its first step.

Legend: N = tokens (Nq: padded to a multiple of 8), A = experts per token, P = pairs = N * A, E = experts,
S = slots, D = embed, F = the experts' intermediate size (mlp1 has 2F rows), G = input blocks of 32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir  # Mosaic GPU's MLIR, for the SwiGLU epilogue's stores
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from ...mxfp4 import packed
from . import mosaic_decode, mosaic_mxfp4
from .. import pairs
from ..mosaic import interpret_params, load, load_rows_strided, splits_for, supported, tiles

__all__ = ["MAX_TOKENS", "slot_matvec", "supported", "weighted_sum"]

MAX_TOKENS = 32  # the tokens a call takes: every slot multiplies all of them
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a program's [rows, Nq] products
_COLUMN = plgpu.Layout.WGMMA.reduce(0)  # one value per column (token)


def padded_tokens(n: int) -> int:
    """The token rows every slot multiplies: n padded to a multiple of 8 (the tensor cores' narrowest operand)."""
    if n > MAX_TOKENS:
        raise ValueError(f"the Mosaic GPU slot kernels take up to {MAX_TOKENS} tokens, got {n}")
    return -(-n // 8) * 8


def _slot_expert(idx_ref, slot, P: int, E: int):
    """The expert of `slot` among the experts idx [P] (GMEM; negative or >= E: dropped) picked,
    numbered by their first pair, and whether that many experts were picked: scalar work of a few
    operations a pair, the same in every thread."""
    words = [jnp.int32(0)] * -(-E // 32)  # the experts seen so far, a bit each
    count, expert = jnp.int32(0), jnp.int32(0)
    for p in range(P):
        e = idx_ref[p]
        ok = (e >= 0) & (e < E)
        word, bit = e >> 5, jnp.left_shift(jnp.int32(1), e & 31)
        seen = functools.reduce(lambda a, b: a | b, [(word == i) & ((w & bit) != 0) for i, w in enumerate(words)])
        new = ok & ~seen
        expert = jnp.where(new & (count == slot), e, expert)
        count = count + new.astype(jnp.int32)
        words = [w | jnp.where(new & (word == i), bit, 0) for i, w in enumerate(words)]
    return expert, slot < count


def _store_swiglu_split(h, out, parts: int, alpha: float, limit: float):
    """gpt-oss's clamped SwiGLU of a program's products h [rows, Nq] (float32, the wgmma layout;
    rows in (gate, linear) pairs: unit u's are rows 2u and 2u + 1) into out [parts, Nq, rows / 2 /
    parts] (bfloat16, shared memory, untransformed): unit u at out[u % parts, :, u // parts]. A row's
    partner is held by the thread four lanes away (the wgmma layout puts rows r and r ^ 1 there),
    so a shuffle of each register brings it; the even row's thread stores the register's first token,
    the odd row's its second. A GPU only: interpret mode computes the same with jnp."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, h, out):
        f32, index = ir.F32Type.get(), ir.IndexType.get()
        const = lambda v: arith.constant(f32, ir.FloatAttr.get(f32, v))  # noqa: E731
        one, hi, lo, a = const(1.0), const(limit), const(-limit), const(-alpha)
        two, nparts = arith.constant(index, 2), arith.constant(index, parts)
        for reg, (row, col) in zip(np.ndindex(h.registers.shape), h.layout.thread_idxs(h.shape)):
            mine = h.registers[reg]  # vector<2xf32>: tokens col and col + 1 of this row
            other = mgpu.utils.shfl_bfly(mine, 4)  # the partner row's
            even = arith.cmpi(arith.CmpIPredicate.eq, arith.remui(row, two), arith.constant(index, 0))
            # Even row: gate = mine, linear = other, token col; odd row: gate = other, linear = mine, col + 1.
            gate = arith.select(even, vector.extract(mine, [], [0]), vector.extract(other, [], [1]))
            linear = arith.select(even, vector.extract(other, [], [0]), vector.extract(mine, [], [1]))
            gate = arith.minimumf(gate, hi)
            linear = arith.minimumf(arith.maximumf(linear, lo), hi)
            sigmoid = arith.divf(one, arith.addf(one, mlir_math.exp(arith.mulf(a, gate))))
            y = arith.mulf(arith.mulf(gate, sigmoid), arith.addf(linear, one))
            unit = arith.divui(row, two)
            token = arith.select(even, col, arith.addi(col, arith.constant(index, 1)))
            memref.store(arith.truncf(ir.BF16Type.get(), y), out,
                         [arith.remui(unit, nparts), token, arith.divui(unit, nparts)])

    store(h, out)


def _swiglu_split(h, parts: int, act):
    """`_store_swiglu_split`'s values, in jnp (interpret mode): h [rows, Nq] -> [parts, Nq, rows / 2 / parts]."""
    rows, nq = h.shape
    y = act(h.T)  # [Nq, rows / 2]: the model's SwiGLU over interleaved (gate, linear) pairs
    return y.reshape(nq, rows // 2 // parts, parts).transpose(2, 0, 1)


@functools.partial(jax.jit, static_argnames=("act", "block_f", "gs", "block_k", "stages", "splits", "interpret",
                                             "decoder"))
def slot_matvec(rows, idx, weight, bias, wd=None, *, act=None, block_f: int = 64, gs: int = 6, block_k: int = 64,
                stages: int = 4, splits: int = 1, interpret: bool = False, decoder: str = "ptx") -> jax.Array:
    """One of the two kernels: rows [R, parts, Nq, K / parts] bfloat16 (R = 1: every slot's, the
    first kernel's tokens; R = S: each slot's own, the second's h), idx [P] int32 (the pairs'
    experts), weight bfloat16 [E, F, K] or MXFP4-packed (parts = 2: the rows' even and odd inputs),
    bias [E, F] ->
    - with `act` (the model's SwiGLU, hashable, with alpha and limit): h [S, parts, Nq, F' / 2 / parts]
      bfloat16, F' = F rounded up to whole tiles (`up`; splits must be 1);
    - with wd [E, Nq] float32 (each token's routing weight for each expert): y [S, splits, F', Nq]
      float32, F' = F rounded up to whole tiles (`down`).
    block_f: rows of a program (a multiple of 64); gs: scale blocks a MXFP4 step, block_k: inputs a
    bfloat16 step; `splits` divides the steps."""
    R, parts, Nq, half_k = rows.shape
    P = idx.shape[0]
    is_packed = packed(weight)
    E, F = (weight.blocks.shape[:2] if is_packed else weight.shape[:2])
    S = min(P, E)
    if not supported():
        raise RuntimeError(f"the Mosaic GPU slot kernels need JAX >= 0.11, this is {jax.__version__}")
    if (act is None) == (wd is None):
        raise ValueError("give the SwiGLU (the first kernel) or the routing weights (the second), one of them")
    if rows.dtype != jnp.bfloat16 or parts != (2 if is_packed else 1) or R not in (1, S) or Nq % 8:
        raise ValueError(f"rows [1 or {S}, {2 if is_packed else 1}, a multiple of 8, K / parts] bfloat16, got "
                         f"{list(rows.shape)} {rows.dtype}")
    if not is_packed and weight.dtype != rows.dtype:
        raise ValueError(f"bfloat16 or MXFP4-packed experts, got {weight.dtype}")
    if block_f % 64 or (act is not None and splits != 1):
        raise ValueError(f"tiles of {block_f} rows (a multiple of 64); the SwiGLU takes whole sums (splits=1, got "
                         f"{splits})")
    tiles_f = pl.cdiv(F, block_f)
    bias = jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, tiles_f * block_f - F)))  # whole tiles
    if is_packed:
        G = weight.blocks.shape[2]
        if half_k < 16 * G:  # (more: the first kernel's whole tiles, zeros past F)
            raise ValueError(f"rows of {32 * G} inputs ({G} scale blocks), got {2 * half_k}")
        steps = pl.cdiv(G, gs)
        flat = weight.blocks.reshape(E, F, 16 * G)
        scale_table, r = mosaic_mxfp4.scale_rows(weight.scales)  # as stored, a program's rows at once
        K = 16 * gs
    else:
        steps = weight.shape[2] // block_k
        if weight.shape[2] % block_k or half_k < weight.shape[2]:
            raise ValueError(f"{weight.shape[2]} inputs in steps of {block_k}, rows of {half_k}")
        K = block_k
    if steps % splits:
        raise ValueError(f"{steps} steps split {splits} ways")
    per = steps // splits
    x_tiles = mosaic_mxfp4.TILES if is_packed else tiles(rows.dtype, block_k * 2)
    w_tiles = () if is_packed else tiles(rows.dtype, block_k * 2)
    up = act is not None
    out_rows = block_f // 2 // parts  # a program's units a part (up)

    def body(idx_ref, rows_ref, w_ref, *refs, o_smem, s_smem=None, s_arrived=None, w_low=None, w_high=None):
        if is_packed:
            s_ref, *refs = refs
        bias_ref, *refs = refs
        wd_ref, o_ref = refs if not up else (None, refs[0])
        j, part, slot = lax.axis_index("f"), lax.axis_index("k"), lax.axis_index("s")
        e, used = _slot_expert(idx_ref, slot, P, E)
        first = part * per
        row0 = j * block_f  # this program's first row
        source = rows_ref.at[0 if R == 1 else slot]

        if not up:
            @pl.when(~used)
            def _():  # no expert holds this slot: zeros, for XLA's sum over the slots
                o_smem[...] = jnp.zeros((block_f, Nq), jnp.float32)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[slot, part, pl.ds(row0, block_f)])
                plgpu.wait_smem_to_gmem(0)

        if is_packed:
            specs = [plgpu.BlockSpec((Nq, K), lambda k: (0, first + k), transforms=x_tiles),
                     plgpu.BlockSpec((Nq, K), lambda k: (0, first + k), transforms=x_tiles),
                     plgpu.BlockSpec((block_f, K), lambda k: (j, first + k))]
        else:
            specs = [plgpu.BlockSpec((Nq, K), lambda k: (0, first + k), transforms=x_tiles),
                     plgpu.BlockSpec((block_f, K), lambda k: (j, first + k), transforms=w_tiles)]
        operands = ((source.at[0], source.at[1], w_ref.at[e]) if is_packed else (source.at[0], w_ref.at[e]))

        def epilogue(acc):
            """The sums [block_f, Nq] + bias, then the SwiGLU (up) or the routing weights (down), out."""
            b = load(bias_ref.at[e], pl.ds(row0, block_f), _ROW, interpret)
            if splits > 1:  # the bias once: in the first range's sums
                b = b * jnp.where(part == 0, 1.0, 0.0)
            h = acc[...] + b[:, None]
            if up:
                if interpret:
                    o_smem[...] = _swiglu_split(h, parts, act).astype(o_smem.dtype)
                else:
                    _store_swiglu_split(h, o_smem, parts, act.alpha, act.limit)
                plgpu.commit_smem()
                for q in range(parts):
                    plgpu.copy_smem_to_gmem(o_smem.at[q], o_ref.at[slot, q, :, pl.ds(row0 // 2 // parts, out_rows)])
            else:
                h = h * load(wd_ref.at[e], pl.ds(0, Nq), _COLUMN, interpret)[None, :]
                o_smem[...] = h
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_ref.at[slot, part, pl.ds(row0, block_f)])
            plgpu.wait_smem_to_gmem(0)

        def column_scales(step_index, g):
            """The program's rows' scales of scale block g of the step: [block_f] uint8, _ROW."""
            col = (first + step_index) * gs + g
            if G % gs:  # past the last scale block (its packed bytes are zeros): any stored scale
                col = jnp.minimum(col, G - 1)
            if interpret:
                return s_smem[...].reshape(block_f, G)[:, col]
            table = s_smem.reshape(block_f * G)
            return load_rows_strided(table.at[pl.ds(col, (block_f - 1) * G + 1)], block_f, G)

        def step_packed(index, xe, xo, codes, acc):  # [Nq, K] [Nq, K] [block_f, K]
            for g in range(gs):
                low, high = mosaic_mxfp4.decode_group(codes, column_scales(index[0], g), pl.ds(0, block_f), g,
                                                      interpret, decoder)
                cols = pl.ds(16 * g, 16)
                if interpret:  # the interpreter's wgmma takes its left operand from shared memory only
                    w_low[...] = low
                    w_high[...] = high
                    low, high = w_low, w_high
                plgpu.wgmma(acc, low, xe.at[:, cols].T)  # [block_f, Nq] += W_even x_even^T
                plgpu.wgmma(acc, high, xo.at[:, cols].T)
                if interpret:
                    plgpu.wgmma_wait(0)
            plgpu.wgmma_wait(0)  # before the pipeline reuses the step's buffers

        def step_16bit(_, xs, ws, acc):  # [Nq, K] [block_f, K]
            plgpu.wgmma(acc, ws, xs.T)  # [block_f, Nq] += W x^T
            plgpu.wgmma_wait(0)

        step = step_packed if is_packed else step_16bit

        @pl.when(used)
        def _():
            if is_packed:  # this program's rows' scales, [block_f / r, n, c], once
                plgpu.copy_gmem_to_smem(s_ref.at[e, pl.ds(j * (block_f // r), block_f // r)], s_smem, s_arrived)
                plgpu.barrier_wait(s_arrived)

            @functools.partial(pl.run_scoped, acc=plgpu.ACC((block_f, Nq), jnp.float32))
            def _(acc):
                plgpu.emit_pipeline(lambda index, *tiles: step(index, *tiles, acc), grid=(per,), in_specs=specs,
                                    max_concurrent_steps=stages)(*operands)
                epilogue(acc)

    if up:
        # Whole tiles: the units past F / 2 (zero weights and biases) are SwiGLU(0, 0) = 0, which the
        # second kernel multiplies by its zeros past the end of its inputs.
        out_type = jax.ShapeDtypeStruct((S, parts, Nq, tiles_f * block_f // 2 // parts), rows.dtype)
        o_smem = plgpu.SMEM((parts, Nq, out_rows), rows.dtype)
    else:
        out_type = jax.ShapeDtypeStruct((S, splits, tiles_f * block_f, Nq), jnp.float32)
        o_smem = plgpu.SMEM((block_f, Nq), jnp.float32)
    scratch = dict(o_smem=o_smem)
    if is_packed:
        scratch.update(s_smem=plgpu.SMEM((block_f // r, *scale_table.shape[2:]), jnp.uint8), s_arrived=plgpu.Barrier())
        if interpret:
            scratch.update(w_low=plgpu.SMEM((block_f, 16), jnp.bfloat16, transforms=mosaic_mxfp4.TILES),
                           w_high=plgpu.SMEM((block_f, 16), jnp.bfloat16, transforms=mosaic_mxfp4.TILES))
    kernel = plgpu.kernel(
        body, out_type=out_type, grid=(tiles_f, splits, S), grid_names=("f", "k", "s"),
        interpret=interpret_params(interpret), scratch_types=scratch)
    args = [idx.astype(jnp.int32), rows, flat if is_packed else weight]
    if is_packed:
        args.append(scale_table)
    args.append(bias)
    if not up:
        args.append(wd.astype(jnp.float32))
    return kernel(*args)


def down_settings(programs: int, K: int, is_packed: bool) -> dict:
    """Ranges of the second kernel's steps (MXFP4: of 6 scale blocks; bfloat16: of 64 inputs) so that
    its `programs` (slots x output tiles) times the ranges reach about two programs per SM of a large
    GPU (264), among the steps' divisors (the first kernel takes whole sums)."""
    return dict(splits=splits_for(pl.cdiv(K // 32, 6) if is_packed else K // 64, programs))


def as_parts(x, weight):
    """x [Nq, K] -> [1, parts, Nq, K / parts]: for MXFP4-packed experts their even and odd inputs
    (mosaic_mxfp4.operands), else x."""
    if not packed(weight):
        return x[None, None]
    x_even, x_odd, _ = mosaic_mxfp4.operands("Mosaic GPU slot kernels", x, weight.blocks)
    return jnp.stack([x_even, x_odd])[None]


def rows_per_program(slots: int) -> int:
    """Output rows a program of either kernel: 64 for fewer than 8 slots (one token: twice the programs
    to spread over the SMs), 128 from 8 on. On one NVIDIA H200 (docs/benchmarks.md, "Decode batches in
    two kernels"), gpt-oss-20b's MXFP4 experts alone: 91.3 us at one token against 114.2 with 128;
    224.8 and 288.4 us at 8 and 16 tokens against 236.3 and 328.1 with 64."""
    return 64 if slots < 8 else 128


def weighted_sum(x, idx, weights, w, act, *, kernels) -> jax.Array:
    """The experts' variant "mosaic_slots" (kernels/experts/__init__.py), summed: x [N, D], idx [N, A]
    (negative: dropped), weights [N, A] -> sum over a of weights[n, a] * expert idx[n, a] (x[n]),
    [N, D] float32, in the two kernels; bfloat16 or MXFP4-packed experts. More than MAX_TOKENS tokens
    run as "mosaic_decode"."""
    if idx.shape[0] > MAX_TOKENS:
        y = mosaic_decode.experts(x, idx, w, act, kernels=kernels)  # [N, A, D]
        return jnp.sum(y.astype(jnp.float32) * weights[..., None], axis=1)
    N, A = idx.shape
    Nq = padded_tokens(N)
    E = pairs.num_experts(w["mlp1_weight"])
    is_packed = packed(w["mlp1_weight"])
    D = x.shape[1]
    block_f = rows_per_program(min(N * A, E))
    flat = jnp.where((idx >= 0) & (idx < E), idx, -1).reshape(-1).astype(jnp.int32)
    # Each token's routing weight for each expert, 0 where it picked none: [E, Nq].
    wd = jnp.sum(jnp.where(idx[..., None] == jnp.arange(E), weights[..., None].astype(jnp.float32), 0.0), axis=1)
    wd = jnp.pad(wd, ((0, Nq - N), (0, 0))).T
    rows = as_parts(jnp.pad(x.astype(jnp.bfloat16), ((0, Nq - N), (0, 0))), w["mlp1_weight"])
    h = slot_matvec(rows, flat, w["mlp1_weight"], w["mlp1_bias"], act=act, block_f=block_f, interpret=kernels.interpret)
    S = h.shape[0]
    F = (w["mlp2_weight"].blocks.shape[2] * 32) if is_packed else w["mlp2_weight"].shape[2]
    y = slot_matvec(h, flat, w["mlp2_weight"], w["mlp2_bias"], wd, block_f=block_f, interpret=kernels.interpret,
                    **down_settings(S * pl.cdiv(D, block_f), F, is_packed))
    return jnp.sum(y, axis=(0, 1))[:D, :N].T  # [N, D]
