"""The grouped matmul over MXFP4-packed experts for prompts, in Pallas Mosaic GPU (NVIDIA Hopper,
JAX >= 0.11): the packed bytes reach shared memory through the TMA engine, are decoded in registers
and written decoded to shared memory only, where the tensor cores (wgmma) read them; no decoded
weight reaches device memory.

The contract of triton_mxfp4.grouped_matmul_mxfp4 (MXFP4 is described there). A program multiplies
one block of `block_m` rows (all of one expert) by `block_n` output rows of that expert, with three
warpgroups: one issues the TMA copies of each step's tiles, and two compute, each decoding and
multiplying its half of the output rows, so that one's decoding (integer work) runs while the
other's products are on the tensor cores. A step brings `gs` scale blocks (32 gs inputs): the rows'
even inputs and their odd inputs ([block_m, 16 gs] each), the weights' packed bytes ([block_n,
16 gs]) and scales ([gs, block_n], read from the scales transposed, [E, G, F], so that a tile is
contiguous rows). Each compute warpgroup decodes its rows' bytes block by block into low-nibble
(even-input) and high-nibble (odd-input) weights times their scale, stores them in one of its two
shared-memory buffers, and issues two products, which run on the tensor cores while it decodes the
next step into the other buffer. Tiles past the inputs' end (G not a multiple of gs) or the outputs' end (F
not a multiple of block_n) are filled with zeros by the TMA engine on the way in, and cut on the way
out. The epilogue may add a bias to the float32 sums and apply gpt-oss's clamped SwiGLU to each
(gate, linear) pair of adjacent outputs before they leave the chip (`store_swiglu`).

Legend: M = grouped rows, D = input features, F = output features, E = experts, G = D / 32 scale
blocks per row.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir  # Mosaic GPU's MLIR, for the decoder's PTX
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax._src.lib.mlir.dialects import math as mlir_math
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu

from .. import pairs
from ..mosaic import interpret_params, load, splits_for, supported, tiles

__all__ = ["TILES", "decode_group", "decode_into", "decode_settings", "grouped_matmul_mxfp4",
           "operands", "scale_rows", "scales_by_step", "step_scales", "supported"]

TILES = tiles(jnp.bfloat16, 32)  # 16 bf16 columns: one block's 16 packed bytes decode to 16 of each


def _decode(p, s):
    """Packed bytes [n, 16] uint8 and their block's scales [n] (int32; both loaded in the wgmma
    layout) -> the low and high nibbles' weights [n, 16] in bfloat16, in 16-bit lanes (two to a
    32-bit register): each e2m1 code is placed in a float16's sign, lowest exponent bits and top
    mantissa bit, which makes exactly code value x 2^-14 (zero and 0.5 as subnormals); that is
    rounded to bfloat16 (exact: two significant bits) and multiplied by 2^(s - 113) in bfloat16,
    exact for scales up to 240 (above, inf; none published). On one H100 80GB this was 5-9% faster
    than the same in float32 (bench/kernels.py)."""
    p = p.astype(jnp.int16)
    scale = lax.bitcast_convert_type((jnp.minimum(s + 14, 255) << 7).astype(jnp.int16), jnp.bfloat16)[:, None]
    low = ((p & 0x08) << 12) | ((p & 0x07) << 9)
    high = ((p & 0x80) << 8) | ((p & 0x70) << 5)
    return tuple(lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.bfloat16) * scale for bits in (low, high))


# The e2m1 magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 as bfloat16 bits, as two byte tables of eight
# (low bytes, high bytes) in the two 32-bit words `prmt` selects from: bytes 0-3, then 4-7.
_LOW_BYTES = (0xC0800000, 0xC0804000)
_HIGH_BYTES = (0x3F3F3F00, 0x40404040)
# Two adjacent packed bytes (their four codes c0..c3 in a 32-bit register's low half, c0 lowest) ->
# two registers of two bfloat16 each: (c0, c2) and (c1, c3), the bytes' low (even-input) and high
# (odd-input) codes' values. Byte permutes look up each code's low and high value bytes in the
# tables, then pair them; the codes' sign bits are moved to bits 15 and 31. Outputs are written
# last (an output may share the input's register).
_E2M1_PAIRS_PTX = f"""{{
.reg .b32 idx, lo, hi, s, s4, e, o;
and.b32 idx, $2, 0x7777;
prmt.b32 lo, {_LOW_BYTES[0]:#x}, {_LOW_BYTES[1]:#x}, idx;
prmt.b32 hi, {_HIGH_BYTES[0]:#x}, {_HIGH_BYTES[1]:#x}, idx;
prmt.b32 e, lo, hi, 0x6240;
prmt.b32 o, lo, hi, 0x7351;
prmt.b32 s, $2, 0, 0x1404;
shl.b32 s4, s, 4;
lop3.b32 $0, e, s4, 0x80008000, 0xF8;
lop3.b32 $1, o, s, 0x80008000, 0xF8;
}}"""


def _codes_ptx(p):
    """Packed bytes [n, 16] uint8 in the wgmma layout (two adjacent bytes a register) -> their low
    and high nibbles' e2m1 values [n, 16] in bfloat16, unscaled, by byte permutes (PTX; a GPU only):
    about 2.5 instructions a weight, against about 10 for `_decode`'s bit arithmetic."""
    out = plgpu.ShapeDtypeStruct(p.shape, jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=(out, out))
    def codes(_, packed):
        i16, i32 = ir.IntegerType.get_signless(16), ir.IntegerType.get_signless(32)
        pair = ir.VectorType.get((2,), ir.BF16Type.get())
        low, high = np.empty_like(packed.registers), np.empty_like(packed.registers)
        for idx, reg in np.ndenumerate(packed.registers):  # vector<2xi8>: two adjacent bytes
            word = arith.extui(i32, mgpu.utils.bitcast(reg, i16))
            even, odd = mgpu.utils.inline_ptx(_E2M1_PAIRS_PTX, word, result_types=[i32, i32])
            low[idx], high[idx] = mgpu.utils.bitcast(even, pair), mgpu.utils.bitcast(odd, pair)
        return tuple(mgpu.FragmentedArray(_registers=r, _layout=packed.layout, _is_signed=None)
                     for r in (low, high))

    return codes(p)


def _decode_ptx(p, s):
    """As `_decode`, by byte permutes (`_codes_ptx`), then times 2^(s - 127) in bfloat16: exact
    for scales 2^-125 to 2^127 (s from 2 to 254; 0 and 1 would give results below bfloat16's
    normal range, 255 is E8M0's NaN)."""
    scale = lax.bitcast_convert_type((s << 7).astype(jnp.int16), jnp.bfloat16)[:, None]
    return tuple(c * scale for c in _codes_ptx(p))


DECODERS = ("ptx", "jnp")


def step_scales(s, rows, g: int, interpret: bool):
    """Scale block g's scales of the weight rows `rows`, from a step's scales [gs, .] in shared
    memory -> [rows] uint8 in the wgmma layout's rows, for `decode_group`."""
    return load(s, (g, rows), plgpu.Layout.WGMMA.reduce(1), interpret)


def decode_group(packed, scales, rows, g: int, interpret: bool, decoder: str = "ptx"):
    """Scale block g of a step's weight rows `rows` (packed bytes [., 16 gs] in shared memory; their
    scales [rows] uint8 in registers, `step_scales`) -> the low and high nibbles' weights [rows, 16]
    each (bfloat16, the wgmma layout: the even and odd inputs' weights). `decoder`: "ptx" (byte
    permutes, `_decode_ptx`) or "jnp" (bit arithmetic, `_decode`); interpret mode runs "jnp" (it
    cannot run PTX)."""
    if decoder not in DECODERS:
        raise ValueError(f"unknown MXFP4 decoder {decoder!r}; choose from {', '.join(DECODERS)}")
    decode = _decode if interpret or decoder == "jnp" else _decode_ptx
    p = load(packed, (rows, pl.ds(16 * g, 16)), plgpu.Layout.WGMMA, interpret)
    return decode(p, scales.astype(jnp.int32))


def decode_into(packed, s, rows, w_low, w_high, gs: int, interpret: bool, decoder: str = "ptx"):
    """One step's weight rows `rows` (a warpgroup's share), packed bytes [., 16 gs] and
    scales [gs, .] in shared memory, decoded (`decode_group`) into w_low and w_high [rows, 16 gs]
    (bfloat16 in shared memory: the even and odd inputs' weights), the stores then made visible to
    the tensor cores."""
    for g in range(gs):
        low, high = decode_group(packed, step_scales(s, rows, g, interpret), rows, g, interpret, decoder)
        w_low[:, pl.ds(16 * g, 16)] = low
        w_high[:, pl.ds(16 * g, 16)] = high
    plgpu.commit_smem()


def operands(what: str, rows, blocks):
    """What the Mosaic GPU MXFP4 kernels read of rows [M, D] (bfloat16) and packed blocks (uint8
    [E, F, G, 16]): the rows' even and odd inputs [M, D / 2] each (a block's low and high nibbles'
    inputs) and the blocks as [E, F, 16 G], after checking the rows. `what` names the kernel in
    errors."""
    if not supported():
        raise RuntimeError(f"the {what} needs JAX >= 0.11, this is {jax.__version__}")
    if rows.dtype != jnp.bfloat16:
        raise ValueError(f"the {what} takes bfloat16 rows, got {rows.dtype}")
    (M, D), (E, F, G, _) = rows.shape, blocks.shape
    if D != 32 * G:
        raise ValueError(f"the {what} takes rows of {32 * G} inputs ({G} scale blocks), got {D}")
    pairs = rows.reshape(M, G, 16, 2)
    return pairs[..., 0].reshape(M, G * 16), pairs[..., 1].reshape(M, G * 16), blocks.reshape(E, F, G * 16)


def scale_rows(scales):
    """Scales uint8 [E, F, G] as stored, for a program to copy its rows' at once with the TMA engine
    (whose strides are multiples of 16 bytes): [E, F / r, n, c], r rows' scales a row (r = 16 /
    gcd(G, 16): 8 for gpt-oss's G = 90) cut into n pieces of c <= 256 bytes, and r. Read back in
    shared memory as [rows, G] (`load_rows_strided`). F: a multiple of r."""
    E, F, G = scales.shape
    r = 16 // math.gcd(G, 16)
    row_bytes = r * G
    c = max(d for d in range(16, min(row_bytes, 256) + 1, 16) if row_bytes % d == 0)
    if F % r:
        raise ValueError(f"{F} outputs: a multiple of {r} (the scales' rows a TMA row)")
    return scales.reshape(E, F // r, row_bytes // c, c), r


def scales_by_step(scales, experts=None):
    """Scales uint8 [E, F, G] transposed, [E, G, F] (a step's as contiguous rows, for the TMA
    engine), or, given `experts` [n], those experts' only, [n, G, F]: a slice each for up to 64 (a
    byte gather took twice as long on one H100 80GB), a gather beyond."""
    if experts is not None:
        n = experts.shape[0]
        scales = (jnp.stack([lax.dynamic_index_in_dim(scales, experts[i], keepdims=False) for i in range(n)])
                  if n <= 64 else scales[experts])
    return jnp.swapaxes(scales, 1, 2)


def store_swiglu(h, out, alpha: float, limit: float):
    """gpt-oss's clamped SwiGLU (gate clamped from above, linear on both sides, linear + 1) of h [m, n]
    (float32, the wgmma layout, whose registers each hold two adjacent columns: one (gate, linear)
    pair) into out [m, n / 2] (bfloat16, shared memory, untransformed), a 2-byte store per pair (a
    GPU only: Pallas offers no op that splits a register's pair; interpret mode calls the model's
    own SwiGLU instead)."""

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType()))
    def store(_, h, out):
        f32, index = ir.F32Type.get(), ir.IndexType.get()
        const = lambda v: arith.constant(f32, ir.FloatAttr.get(f32, v))
        one, hi, lo, a = const(1.0), const(limit), const(-limit), const(-alpha)
        for reg, (row, col) in zip(np.ndindex(h.registers.shape), h.layout.thread_idxs(h.shape)):
            pair = h.registers[reg]  # vector<2xf32>: (gate, linear)
            gate = arith.minimumf(vector.extract(pair, [], [0]), hi)
            linear = arith.minimumf(arith.maximumf(vector.extract(pair, [], [1]), lo), hi)
            sigmoid = arith.divf(one, arith.addf(one, mlir_math.exp(arith.mulf(a, gate))))
            y = arith.mulf(arith.mulf(gate, sigmoid), arith.addf(linear, one))
            half_col = arith.divui(col, arith.constant(index, 2))
            memref.store(arith.truncf(ir.BF16Type.get(), y), out, [row, half_col])

    store(h, out)


def decode_settings(blocks_bound: int, F: int, G: int) -> dict:
    """Settings for few rows (decode: blocks of 64, about one per expert in use): 2 scale blocks a
    step, and the steps split over enough programs (blocks x output tiles x splits) for two per SM
    of a large GPU, their float32 partial sums added after. The model's decode runs
    kernels/experts/mosaic_decode.py instead (blocks of 8 rows; as fast or faster, docs/benchmarks.md); these
    settings stay for comparison (bench/kernels.py --part decode-experts)."""
    gs = 2
    steps = -(-G // gs)
    tiles = blocks_bound * -(-F // 256)
    splits = splits_for(steps, tiles)
    return dict(block_m=64, gs=gs, stages=3, splits=splits)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "gs", "stages", "splits", "swiglu", "interpret",
                                             "decoder"))
def grouped_matmul_mxfp4(rows, block_expert, used, blocks, scales, bias=None, *, block_m: int = 128, block_n: int = 256,
                         gs: int = 2, stages: int = 4, splits: int = 1, swiglu=None, interpret: bool = False,
                         decoder: str = "ptx") -> jax.Array:
    """rows [M, D] (bfloat16) in blocks of block_m rows, block_expert [M / block_m] (each block's
    expert), used (blocks from `used` on are skipped; their outputs are undefined), blocks uint8
    [E, F, G, 16], scales uint8 [E, F, G] -> [M, F] bfloat16, float32 sums. block_m: a multiple of
    64; block_n: of 128 (F need not be a multiple: the last tile is cut). `splits` (dividing the
    cdiv(G, gs) steps): each program walks one range of the steps, and the ranges' float32 partial
    sums are added after (few rows: `decode_settings`). The defaults are the fastest setting of
    bench/kernels.py --part grouped-mxfp4 on one H100 80GB for gpt-oss-20b's mlp1 at a 4k prompt,
    and within the runs' spread of the best for its mlp2 (docs/benchmarks.md). Each compute warpgroup decodes a step's weights while its products of the
    step before are still on the tensor cores (two buffers of decoded weights; each input tile is
    kept a step longer, so `stages` >= 3).

    Epilogue (one range only, splits=1): `bias` [E, F] is added to the float32 sums, and `swiglu`
    (the model's clamped SwiGLU, `moe.SwiGLU`: hashable, with `alpha` and `limit`, called on
    [rows, 2n] -> [rows, n]) then applies to each (gate, linear) pair of adjacent outputs (mlp1's
    interleaved halves) -> [M, F / 2]: on the GPU by `store_swiglu` with its alpha and limit, in
    interpret mode by calling it. The products' outputs never reach device memory before their
    activation."""
    M, D = rows.shape
    E, F, G, _ = blocks.shape
    steps = pl.cdiv(G, gs)
    if steps % splits:
        raise ValueError(f"splits={splits} must divide the {steps} steps of {gs} scale blocks over G={G}")
    if (bias is not None or swiglu is not None) and splits != 1:
        raise ValueError(f"a bias or SwiGLU epilogue needs whole sums: splits=1, got {splits}")
    if bias is not None and bias.shape != (E, F):
        raise ValueError(f"the bias must be [experts, outputs] = [{E}, {F}], got {list(bias.shape)}")
    if swiglu is not None and F % 2:
        raise ValueError(f"SwiGLU takes (gate, linear) pairs of outputs: F must be even, got {F}")
    per = steps // splits
    x_even, x_odd, flat = operands("Mosaic GPU MXFP4 matmul", rows, blocks)
    scales_t = scales_by_step(scales)
    if M % block_m or block_m % 64 or block_n % 128:
        raise ValueError(f"{M} rows in blocks of {block_m} (a multiple of 64), output tiles of {block_n} (of 128)")
    K, bn, half = 16 * gs, block_n, block_n // 2
    if stages < 3:
        raise ValueError(f"stages={stages}: the kernel keeps each step's tiles one step longer, so it needs 3 or more")
    out_dtype = rows.dtype if splits == 1 else jnp.float32
    spec = functools.partial(plgpu.BlockSpec, delay_release=1)  # a step's tiles kept until the next step ends
    tiles_n = pl.cdiv(F, bn)
    extra = []
    if bias is not None:  # float32, padded to whole tiles: a cut last tile reads no further than its row
        extra.append(jnp.pad(bias.astype(jnp.float32), ((0, 0), (0, tiles_n * bn - F))))
    out_half = half // 2 if swiglu is not None else half  # a warpgroup's outputs of a tile

    def body(be_ref, used_ref, xe_ref, xo_ref, b_ref, s_ref, *refs, w_low, w_high, o_smem):
        bias_ref, o_ref = refs if bias is not None else (None, refs[0])
        b, j, part = lax.axis_index("m"), lax.axis_index("n"), lax.axis_index("k")
        e = be_ref[b]
        out = o_ref if splits == 1 else o_ref.at[part]

        def pipeline(step, compute_context):
            first = part * per
            return plgpu.emit_pipeline_warp_specialized(
                step, grid=(per,), memory_registers=40, wg_axis="wg", num_compute_wgs=2,
                max_concurrent_steps=stages, compute_context=compute_context,
                in_specs=[spec((block_m, K), lambda k: (b, first + k), transforms=TILES),
                          spec((block_m, K), lambda k: (b, first + k), transforms=TILES),
                          spec((bn, K), lambda k: (j, first + k)),
                          spec((gs, bn), lambda k: (first + k, j))])

        ignore = lambda *_, **__: None

        @pl.when(b < used_ref[0])
        def _():
            @functools.partial(pl.run_scoped, collective_axes="wg",
                               allocs=pipeline(ignore, ignore).get_allocations(xe_ref, xo_ref, b_ref.at[e], s_ref.at[e]))
            def _(allocs):
                wg = lax.axis_index("wg")
                mine = pl.ds(wg * half, half)

                def compute_context(run):
                    @functools.partial(pl.run_scoped, acc=plgpu.ACC((block_m, half), jnp.float32))
                    def _(acc):
                        run(acc)
                        plgpu.wgmma_wait(0)
                        h = acc[...]
                        if bias_ref is not None:
                            h = h + load(bias_ref.at[e], pl.ds(j * bn + wg * half, half),
                                         plgpu.Layout.WGMMA.reduce(0), interpret)[None, :]
                        if swiglu is None:
                            o_smem[wg] = h.astype(o_smem.dtype)
                        elif interpret:
                            o_smem[wg] = swiglu(h).astype(o_smem.dtype)
                        else:
                            store_swiglu(h, o_smem.at[wg], swiglu.alpha, swiglu.limit)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(o_smem.at[wg], out.at[pl.ds(b * block_m, block_m),
                                                                      pl.ds(j * 2 * out_half + wg * out_half, out_half)])
                        plgpu.wait_smem_to_gmem(0)

                def step(idx, xe, xo, packed, s, acc):  # the tiles of one step, [block_m, K] [block_m, K] [bn, K] [gs, bn]
                    buf = lax.rem(idx[0], 2)
                    wl, wh = w_low.at[wg, buf], w_high.at[wg, buf]  # this warpgroup's decoded weights, [half, K] each
                    decode_into(packed, s, mine, wl, wh, gs, interpret, decoder)
                    plgpu.wgmma(acc, xe, wl.T)
                    plgpu.wgmma(acc, xo, wh.T)
                    # The step before's products are done before the next step overwrites its
                    # buffers (and the pipeline reuses its input tiles); this step's two stay in flight.
                    plgpu.wgmma_wait(2)
                    return acc

                pipeline(step, compute_context)(xe_ref, xo_ref, b_ref.at[e], s_ref.at[e], allocations=allocs)

    out_cols = F // 2 if swiglu is not None else F
    out_shape = (M, out_cols) if splits == 1 else (splits, M, F)
    # SwiGLU's outputs are stored a pair at a time into an untransformed buffer (`store_swiglu`).
    out_tiles = () if swiglu is not None else TILES if splits == 1 else tiles(jnp.float32)
    kernel = plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct(out_shape, out_dtype), grid=(M // block_m, tiles_n, splits),
        grid_names=("m", "n", "k"), num_threads=3, thread_name="wg", interpret=interpret_params(interpret),
        scratch_types=dict(w_low=plgpu.SMEM((2, 2, half, K), jnp.bfloat16, transforms=TILES),
                           w_high=plgpu.SMEM((2, 2, half, K), jnp.bfloat16, transforms=TILES),
                           o_smem=plgpu.SMEM((2, block_m, out_half), out_dtype, transforms=out_tiles)))
    out = kernel(block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x_even, x_odd, flat,
                 scales_t, *extra)
    return out if splits == 1 else out.sum(axis=0).astype(rows.dtype)


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "mosaic_grouped" (kernels/experts/__init__.py): MXFP4-packed experts over the
    pairs in expert blocks of 128 rows, the biases and the activation (`act`: alpha, limit) applied
    in the kernel's epilogue. x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    def matmul(inputs, name, block_expert, used):
        weight = w[name]
        return grouped_matmul_mxfp4(inputs, block_expert, used, weight.blocks, weight.scales,
                                    w[name.replace("weight", "bias")], block_m=128,
                                    swiglu=act if name == "mlp1_weight" else None, interpret=kernels.interpret)

    return pairs.blocked(x, idx, w, act, block=128, matmul=matmul, epilogue=True)
