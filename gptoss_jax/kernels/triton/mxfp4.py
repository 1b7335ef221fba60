"""Expert matmuls over MXFP4-packed weights in Pallas Triton (NVIDIA GPUs): the packed bytes are read
once per use and decoded in registers; no decoded weight is ever written to memory.

MXFP4 (the OCP microscaling format, as published for gpt-oss): a weight row of D inputs is D / 32
blocks of 16 bytes, each byte holding two 4-bit e2m1 codes (low nibble: the even input, high nibble:
the odd one), and one uint8 power-of-two scale per block (value = code value * 2^(scale - 127)).
Both kernels take the activations' even and odd inputs apart, so that a byte's two codes meet their
inputs without any interleaving.

- `pair_matvec_mxfp4`, decode: one matrix-vector product per (token, expert) pair, reading the
  pair's expert rows in place, whole rows at a time (the packed form of matvec.py's `pair_matvec`).
- `grouped_matmul_mxfp4`, prompts and large batches: rows laid out in blocks of `block_m` rows, each
  block for one expert (pairs.group_by_expert); a program multiplies one block by one expert's tile of
  output rows on the tensor cores, decoding each weight tile once for the whole block.

Legend: P = pairs, M = grouped rows, D = input features, F = output features, E = experts,
G = blocks of 32 inputs per row (D / 32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
try:  # deprecated in JAX 0.11, to be removed: the package imports without it, and "auto" stops picking these
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

from ...mxfp4 import packed
from .. import pairs
from .common import block_size, compiler_params, padded_span, pltriton
from .matvec import pair_matvec


def _e2m1_halves(b):
    """Bytes (int32) -> their (low, high) e2m1 codes as float32 values / 2^14, cheaply: a code's bits
    (sign, 2 exponent bits, 1 mantissa bit) placed into a float16's sign, lowest exponent bits and top
    mantissa bit make a float16 worth exactly value * 2^-14 (zero and 0.5 land on float16 subnormals,
    which scale the same way). The caller's scale carries the 2^14."""
    def half(bits):
        return jax.lax.bitcast_convert_type(bits.astype(jnp.int16), jnp.float16).astype(jnp.float32)

    return (half(((b & 0x08) << 12) | ((b & 0x07) << 9)),
            half(((b & 0x80) << 8) | ((b & 0x70) << 5)))


# The same decoding in PTX, four bytes at a time, one nibble of each per call (4 codes for about 12
# instructions, against about 6 per code in the jnp form): the bytes are permuted to (b0, b2, b1, b3)
# so that each 16-bit half of the word holds one output byte, then each nibble's magnitude and sign
# are shifted and masked into a pair of float16s at once, and each float16 widened to float32.
# $0-$3: the codes of bytes 0-3; $4: the four bytes. Per pair of bytes, {mag}/{m} shift the nibble's
# magnitude bits to float16 bits 9-11 and {s} its sign bit to bit 15.
_E2M1_PTX = """{{
.reg .b32 w, m, s, h<2>;
.reg .b16 l<4>;
prmt.b32 w, $4, 0, 0x3120;
{mag0} m, w, {m0}; and.b32 m, m, 0x0E000E00; shl.b32 s, w, {s0}; and.b32 s, s, 0x80008000; or.b32 h0, m, s;
{mag1} m, w, {m1}; and.b32 m, m, 0x0E000E00; shl.b32 s, w, {s1}; and.b32 s, s, 0x80008000; or.b32 h1, m, s;
mov.b32 {{l0, l1}}, h0; mov.b32 {{l2, l3}}, h1;
cvt.f32.f16 $0, l0; cvt.f32.f16 $1, l1; cvt.f32.f16 $2, l2; cvt.f32.f16 $3, l3;
}}"""
# Nibble at bits 0-3 (bytes 0, 1 of the permuted word's halves) and 8-11 (bytes 2, 3): low nibbles;
# bits 4-7 and 12-15: high nibbles.
_LOW_PTX = _E2M1_PTX.format(mag0="shl.b32", m0=9, s0=12, mag1="shl.b32", m1=1, s1=4)
_HIGH_PTX = _E2M1_PTX.format(mag0="shl.b32", m0=5, s0=8, mag1="shr.b32", m1=3, s1=0)


def _codes(b, decoder: str):
    """uint8 bytes -> (low, high) codes as float32 values / 2^14, by `_e2m1_halves` ("jnp", also in
    interpret mode) or by `_LOW_PTX` and `_HIGH_PTX` ("ptx")."""
    if decoder == "jnp":
        return _e2m1_halves(b.astype(jnp.int32))
    if decoder != "ptx":
        raise ValueError(f"unknown MXFP4 decoder {decoder!r}; choose jnp or ptx")
    out = jax.ShapeDtypeStruct(b.shape, jnp.float32)
    return tuple(pltriton.elementwise_inline_asm(asm, args=[b], constraints="=r,=r,=r,=r,r", pack=4,
                                                 result_shape_dtypes=[out])[0]
                 for asm in (_LOW_PTX, _HIGH_PTX))


def _default_decoder(interpret: bool) -> str:
    """PTX on a GPU, jnp in interpret mode (no PTX there). On one H100 80GB PTX made the grouped
    matmul up to 15% faster and the matvec 25% (bench/kernels.py --part grouped-mxfp4 and
    --part matvec-mxfp4)."""
    return "jnp" if interpret else "ptx"


def block_scale(s):
    """uint8 scales -> float32 2^(scale - 127 + 14): the block scale times the 2^14 that
    `_e2m1_halves` leaves out. Scales above 240 (weights beyond 2^113; 255 is NaN in the OCP format)
    give inf; published weights have none."""
    exponent = jnp.minimum(s.astype(jnp.int32) + 14, 255)
    return jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)


def _even_odd(x, G):
    """x [N, 32 G] -> its even and odd inputs, [N, G, 16] each (a byte's low and high nibbles' inputs)."""
    pairs = x.reshape(x.shape[0], G, 16, 2)
    return pairs[..., 0], pairs[..., 1]


@functools.partial(jax.jit, static_argnames=("interpret", "block_f", "num_warps", "decoder"))
def pair_matvec_mxfp4(x, idx, blocks, scales, *, interpret: bool = False, block_f: int = 4, num_warps: int = 4,
                      decoder: str | None = None) -> jax.Array:
    """x [P, D], idx [P] (each pair's expert), blocks uint8 [E, F, G, 16], scales uint8 [E, F, G]
    -> [P, F] in x's dtype, float32 sums: matvec.py's `pair_matvec` over packed experts.

    No loop: each program loads `block_f` whole rows of its pair's expert in one masked load
    ([block_f, G rounded up to a power of two, 16] bytes; nothing past G is read) with their scales,
    decodes, multiplies by the pair's inputs, sums each block's 16 bytes before applying its scale,
    and writes block_f outputs. Every program issues all its loads at once, which keeps many rows in
    flight at a batch of one: on one H100 80GB, eight layers' batch-1 up-projections took 0.36 ms
    this way against 0.47 ms for the same work in a loop over 64-input steps (Triton tiles are
    powers of two, and 90 blocks a row allow no wider step). In that sweep (bench/kernels.py
    --part matvec-mxfp4) 8 rows with 8 warps were as fast on the up-projection and 19% faster on the
    down-projection; the model's figures in docs/benchmarks.md are with these defaults.
    """
    P, D = x.shape
    E, F, G, _ = blocks.shape
    decoder = decoder or _default_decoder(interpret)
    bf, width = block_size(F, block_f), 1 << (G - 1).bit_length()
    x_even, x_odd = _even_odd(x, G)  # [P, G, 16] each

    def kernel(idx_ref, xe_ref, xo_ref, b_ref, s_ref, o_ref):
        p, j = pl.program_id(0), pl.program_id(1)
        e = idx_ref[p]
        rows, groups = pl.ds(j * bf, bf), padded_span(width, p)

        def masked(ref, shape, axis):  # a load of `shape` whose entries at or past G along `axis` are 0
            mask = jax.lax.broadcasted_iota(jnp.int32, shape, axis) < G
            return pltriton.load(ref, mask=mask, other=0)[0]

        b = masked(b_ref.at[pl.ds(e, 1), rows, groups, :], (1, bf, width, 16), 2)  # [bf, width, 16]
        s = masked(s_ref.at[pl.ds(e, 1), rows, groups], (1, bf, width), 2)  # [bf, width]
        xe = masked(xe_ref.at[pl.ds(p, 1), groups, :], (1, width, 16), 1).astype(jnp.float32)  # [width, 16]
        xo = masked(xo_ref.at[pl.ds(p, 1), groups, :], (1, width, 16), 1).astype(jnp.float32)
        low, high = _codes(b, decoder)
        per_block = jnp.sum(low * xe[None] + high * xo[None], axis=2) * block_scale(s)  # [bf, width]
        o_ref[p, rows] = jnp.sum(per_block, axis=1)

    out = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((P, F), jnp.float32), grid=(P, F // bf),
                         interpret=interpret, name="gptoss_pair_matvec_mxfp4",
                         **compiler_params(interpret, num_warps, 1))(
        idx.astype(jnp.int32), x_even, x_odd, blocks, scales)
    return out.astype(x.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "unroll", "interpret", "num_warps", "num_stages",
                                             "decoder"))
def grouped_matmul_mxfp4(rows, block_expert, used, blocks, scales, *, block_m: int, block_n: int = 128,
                         unroll: int | None = None, interpret: bool = False, num_warps: int = 4,
                         num_stages: int = 3, decoder: str | None = None) -> jax.Array:
    """rows [M, D] in blocks of block_m rows (M = len(block_expert) * block_m), block_expert [M / block_m]
    (each block's expert), used (int32 scalar: blocks from `used` on hold no rows and are skipped;
    their outputs are undefined), blocks uint8 [E, F, G, 16], scales uint8 [E, F, G]
    -> [M, F] in rows' dtype, float32 sums.

    A program computes one block's rows times `block_n` output rows of its expert. Each step decodes
    a [block_n, 2 blocks] tile of weights (64 inputs: gpt-oss's 90 blocks per row allow no wider
    power of two) into rows' dtype, scaled exactly (a code value times a power of two has two
    significant bits), and adds two tensor-core products: even inputs times low nibbles, odd inputs
    times high nibbles. Each weight tile is decoded once per block of rows, so the decoding's integer
    work is shared by block_m rows. The decoded tile is the products' first operand, the one Triton
    may keep in registers (the result [block_n, block_m] is transposed once at the end; on one H100
    80GB the other order was within a few percent).
    """
    M, D = rows.shape
    E, F, G, _ = blocks.shape
    if jnp.dtype(rows.dtype).itemsize != 2:
        raise ValueError(f"grouped_matmul_mxfp4 takes 16-bit rows (float32 would be TF32 on the tensor cores), got {rows.dtype}")
    decoder = decoder or _default_decoder(interpret)
    num_blocks = block_expert.shape[0]
    if num_blocks * block_m != M:
        raise ValueError(f"{M} rows are not {num_blocks} blocks of {block_m}")
    bn, gs = block_size(F, block_n), 2 if G % 2 == 0 else 1
    steps = G // gs
    if unroll is None:
        unroll = next(u for u in (3, 2, 1) if steps % u == 0)
    if steps % unroll:
        raise ValueError(f"unroll={unroll} must divide the {steps} steps of {gs} blocks per row")
    x_even, x_odd = (h.reshape(M, G * 16) for h in _even_odd(rows, G))  # [M, D/2] each
    flat = blocks.reshape(E, F, G * 16)  # a row's bytes, contiguous
    width = gs * 16  # bytes (= even or odd inputs) per step

    def kernel(be_ref, used_ref, xe_ref, xo_ref, b_ref, s_ref, o_ref):
        b, j = pl.program_id(0), pl.program_id(1)

        @pl.when(b < used_ref[0])
        def _():
            e = be_ref[b]
            m, n = pl.ds(b * block_m, block_m), pl.ds(j * bn, bn)
            group = jax.lax.broadcasted_iota(jnp.int32, (bn, width), 1) // 16  # each byte's block in the tile

            def step(i, acc):
                for u in range(unroll):
                    g0 = (i * unroll + u) * gs
                    low, high = _codes(b_ref[e, n, pl.ds(g0 * 16, width)], decoder)  # [bn, width] each
                    scale = block_scale(s_ref[e, n, g0])[:, None]  # [bn, 1]
                    for g in range(1, gs):
                        scale = jnp.where(group == g, block_scale(s_ref[e, n, g0 + g])[:, None], scale)
                    xe = xe_ref[m, pl.ds(g0 * 16, width)]  # [block_m, width]
                    xo = xo_ref[m, pl.ds(g0 * 16, width)]
                    for x, codes in ((xe, low), (xo, high)):  # [bn, width] x [block_m, width]^T
                        acc += pltriton.dot((codes * scale).astype(x.dtype), x, trans_b=True).astype(jnp.float32)
                return acc

            acc = jax.lax.fori_loop(0, steps // unroll, step, jnp.zeros((bn, block_m), jnp.float32))
            o_ref[m, n] = acc.T.astype(o_ref.dtype)

    return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((M, F), rows.dtype), grid=(num_blocks, F // bn),
                          interpret=interpret, name="gptoss_grouped_matmul_mxfp4",
                          **compiler_params(interpret, num_warps, num_stages))(
        block_expert.astype(jnp.int32), jnp.reshape(used, (1,)).astype(jnp.int32), x_even, x_odd, flat, scales)


def _grouped_settings(block: int, name: str) -> dict:
    """The grouped kernel's settings, the best of bench/kernels.py --part grouped-mxfp4 on one H100
    80GB: for decode batches (blocks of 16 to 32 rows), then for prompts per projection."""
    if block < 64:
        return dict(block_n=64, num_warps=4, num_stages=3)
    return dict(block_n=128, num_warps=8, num_stages=3) if name == "mlp1_weight" else \
        dict(block_n=128, num_warps=4, num_stages=2)


def grouped_experts(x, idx, w, act, *, kernels):
    """The experts' variant "triton_grouped" (kernels/experts/__init__.py): MXFP4-packed experts over the
    pairs in expert blocks sized to the pairs per expert (16 rows at a batch of 64, 128 on long
    prompts). x [N, D], idx [N, A] (negative: dropped) -> [N, A, D]."""
    E = pairs.num_experts(w["mlp1_weight"])
    block = min(128, max(16, 1 << (max(1, idx.size // E) - 1).bit_length()))

    def matmul(inputs, name, block_expert, used):
        weight = w[name]
        return grouped_matmul_mxfp4(inputs, block_expert, used, weight.blocks, weight.scales, block_m=block,
                                    interpret=kernels.interpret, **_grouped_settings(block, name))

    return pairs.blocked(x, idx, w, act, block=block, matmul=matmul)


def pairwise_experts(x, idx, w, act, *, kernels):
    """The experts' variant "triton" (kernels/experts/__init__.py): each pair's expert rows read in place by
    a Pallas Triton kernel, 16-bit or MXFP4-packed (decoded in registers). x [N, D], idx [N, A]
    (negative: held elsewhere, computed with expert 0 and weighted zero) -> [N, A, D]."""
    def matvec(inputs, weight):
        if packed(weight):
            return pair_matvec_mxfp4(inputs, flat, weight.blocks, weight.scales, interpret=kernels.interpret)
        return pair_matvec(inputs, flat, weight, interpret=kernels.interpret)

    N, A = idx.shape
    flat = jnp.maximum(idx, 0).reshape(N * A)
    h = matvec(jnp.repeat(x, A, axis=0), w["mlp1_weight"]) + w["mlp1_bias"][flat]
    y = matvec(act(h), w["mlp2_weight"]) + w["mlp2_bias"][flat]
    return y.reshape(N, A, -1)
