"""The MoE block of a decode step over MXFP4 experts, in four Pallas Triton kernels (NVIDIA GPUs).

At batch 1 a decode step's MoE reads about 50 MB a layer of gpt-oss-20b (17 us at an H100's
bandwidth), and each small XLA kernel around the expert products costs 1 to 3 us: so the norm,
router, bias, SwiGLU and the hand-over between the two expert products are folded into the kernels
rather than left as a dozen small XLA ones (docs/benchmarks.md has the measurements).
- `route`: RMSNorm, router logits (float32 sums of exact bf16 products) and bias, by programs of a
  few experts each, then top-k and softmax over the k picked in a second, one-program-per-token
  kernel; it also writes the normed token in the form the expert kernels read (below).
- `up_swiglu`: one program per (pair, 16 consecutive mlp1 rows: 8 units' gate and linear rows):
  the packed rows of the pair's expert, plus bias, clamped SwiGLU; writes the activations in that
  same form.
- `down`: one program per (pair, output rows): mlp2, plus bias, times the pair's routing weight.
XLA then adds each token's pairs and the residual (one fused kernel).

How a product is computed: a 32-bit word holds 4 packed bytes (8 codes of 8 consecutive inputs).
PTX turns it into four float16 pairs (the low codes of bytes 0 and 1, of bytes 2 and 3, the high
codes of bytes 0 and 1, of bytes 2 and 3), each code's bits placed so that the float16 is exactly
value * 2^-14, and multiplies them with the matching inputs, paired the same way, by four
half2 multiply-adds: two codes per instruction. The inputs are float16, scaled so that every
product is the true one divided by a power of two m >= max|input| (tokens: per token; SwiGLU
outputs: limit * (limit + 1) bounds them, so a constant), which keeps float16 sums of 8 products
far from overflow and from subnormals; each word's two halves are added in float32 and scaled
there by the block's power of two and by m. Precision: against float32 products at gpt-oss's
widths the error is about that of rounding mlp1's output to bf16, as the bf16 paths do.

Input order ("pair order"): per 8 consecutive inputs x0..x7, the float16s x0 x2 x4 x6 x1 x3 x5 x7,
so that the 32-bit view of the array holds the four pairs of each word: (x0, x2), (x4, x6),
(x1, x3), (x5, x7). The producing kernel writes that order itself (strided stores), so nothing
re-orders between kernels.

Legend: N = tokens, A = experts per token, P = pairs = N * A, D = embed, E = experts, F = SwiGLU
units, Q = groups of 8 inputs or outputs, G = blocks of 32 inputs, W = words (4 bytes) per block.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
try:  # deprecated in JAX 0.11, to be removed: the package imports without it, and "auto" stops picking these
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None

from ...mxfp4 import packed
from .common import compiler_params, padded_span, pow2_at_least
from .mxfp4 import block_scale

HALF_ONE = 2.0 ** 14  # a code decoded as float16 is its value times 2^-14
# Blocks of 32 values a load of a row spans in up_swiglu and down (`_spans`): gpt-oss's rows of 90
# blocks read as 3 loads of 32 (96, the last masked) rather than one padded to 128. On one NVIDIA
# H200 (2026-11-28, bench/decode_moe.py, 8 layers of gpt-oss-20b's MoE) the block took 0.319 ms
# against 0.374 at 1 token and 0.747 against 0.914 at 4 (docs/benchmarks.md).
CHUNK = 32

# One word (8 codes) against its 8 inputs as 4 half2 registers ($2-$5) -> float32 sum ($0).
# Bytes permuted to (b0, b2, b1, b3), so that each 16-bit half holds a byte of each pair; per pair
# the nibble's magnitude bits go to float16 bits 9-11 (shift {m}) and its sign to bit 15 ({s}).
_DOT_PTX = """{
.reg .b32 w, m, s, h, acc;
.reg .b16 l0, l1;
.reg .f32 f0, f1;
prmt.b32 w, $1, 0, 0x3120;
shl.b32 m, w, 9; and.b32 m, m, 0x0E000E00; shl.b32 s, w, 12; and.b32 s, s, 0x80008000; or.b32 h, m, s;
mul.rn.f16x2 acc, h, $2;
shl.b32 m, w, 1; and.b32 m, m, 0x0E000E00; shl.b32 s, w, 4; and.b32 s, s, 0x80008000; or.b32 h, m, s;
fma.rn.f16x2 acc, h, $3, acc;
shl.b32 m, w, 5; and.b32 m, m, 0x0E000E00; shl.b32 s, w, 8; and.b32 s, s, 0x80008000; or.b32 h, m, s;
fma.rn.f16x2 acc, h, $4, acc;
shr.b32 m, w, 3; and.b32 m, m, 0x0E000E00; and.b32 s, w, 0x80008000; or.b32 h, m, s;
fma.rn.f16x2 acc, h, $5, acc;
mov.b32 {l0, l1}, acc;
cvt.f32.f16 f0, l0; cvt.f32.f16 f1, l1;
add.f32 $0, f0, f1;
}"""


def _word_dot_jnp(words, regs):
    """`_DOT_PTX` in jnp, for interpret mode: words uint32 [...], regs 4 x uint32 [...] -> float32 [...]."""
    def code(nibble):  # e2m1 -> float16 value * 2^-14
        bits = ((nibble & 8) << 12) | ((nibble & 7) << 9)
        return jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)

    b = [(words >> (8 * i)) & 0xFF for i in range(4)]
    pairs = [(b[0] & 15, b[1] & 15), (b[2] & 15, b[3] & 15), (b[0] >> 4, b[1] >> 4), (b[2] >> 4, b[3] >> 4)]
    acc = [None, None]
    for (n0, n1), r in zip(pairs, regs):
        lo = jax.lax.bitcast_convert_type((r & 0xFFFF).astype(jnp.uint16), jnp.float16)
        hi = jax.lax.bitcast_convert_type((r >> 16).astype(jnp.uint16), jnp.float16)
        for i, (c, x) in enumerate(((code(n0), lo), (code(n1), hi))):
            acc[i] = c * x if acc[i] is None else (c * x + acc[i]).astype(jnp.float16)
    return acc[0].astype(jnp.float32) + acc[1].astype(jnp.float32)


def _word_dot(words, regs, interpret: bool):
    if interpret:
        return _word_dot_jnp(words, regs)
    return pltriton.elementwise_inline_asm(_DOT_PTX, args=[words, *regs], constraints="=r,r,r,r,r,r", pack=1,
                                           result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float32)])[0]


def _pow2(n: int) -> int:
    return pow2_at_least(n, 1)


def _masked(ref, shape, axis: int, bound: int):
    """A load of `shape` from ref whose entries at or past `bound` along `axis` read as 0."""
    return pltriton.load(ref, mask=jax.lax.broadcasted_iota(jnp.int32, shape, axis) < bound, other=0)


def _i(n: int) -> jax.Array:
    """A constant index for `ref.at[...]` (a plain int there fails in interpret mode)."""
    return jnp.int32(n)


def _words(blocks):
    """Packed blocks uint8 [..., G, 16] -> uint32 [..., G, 4] (a bitcast: nothing is copied)."""
    return jax.lax.bitcast_convert_type(blocks.reshape(*blocks.shape[:-1], 4, 4), jnp.uint32)


def swiglu_bound(limit: float) -> float:
    """A power of two >= |SwiGLU output| when the gate is clamped to <= limit and the linear half to
    [-limit, limit]: |gate * sigmoid| <= max(limit, 0.28) and |linear + 1| <= limit + 1."""
    return 2.0 ** math.ceil(math.log2(max(limit, 1.0) * (limit + 1)))


def _top_k(logits, expert, k: int, EP: int):
    """logits [EP] (-inf past the experts) -> (softmax of the k largest [k], their experts [k]); the
    lowest expert first among equals, as `jax.lax.top_k`.

    NaN logits (a token whose values are not finite) count as -inf, so they tie with the padding and
    the lowest experts not yet taken, which are real, are picked (as `jax.lax.top_k` does for such a
    token, whose output is NaN either way). Left as NaN, no logit equals the max and the expert past the last
    one was picked: the expert kernels then read a whole expert past the end of the weights, which
    on one H100 80GB passed unnoticed inside JAX's memory pool but is an illegal address wherever
    nothing is mapped there."""
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    slot = jax.lax.broadcasted_iota(jnp.int32, (k,), 0)
    picked_w, picked_e = jnp.zeros((k,), jnp.float32), jnp.zeros((k,), jnp.int32)
    taken = expert < 0  # none yet
    for j in range(k):
        left = jnp.where(taken, -jnp.inf, logits)
        best = jnp.max(left)
        e = jnp.min(jnp.where((left == best) & ~taken, expert, EP))
        picked_w, picked_e = jnp.where(slot == j, best, picked_w), jnp.where(slot == j, e, picked_e)
        taken = taken | (expert == e)
    p = jnp.exp(picked_w - jnp.max(picked_w))
    return p / jnp.sum(p), picked_e


@functools.partial(jax.jit, static_argnames=("k", "eps", "interpret", "block_d", "expert_block", "num_warps",
                                             "num_stages"))
def route(x, scale, router_weight, router_bias, *, k: int, eps: float, interpret: bool = False,
          block_d: int = 1024, expert_block: int = 4, num_warps: int = 4, num_stages: int = 2):
    """x [N, D] (16-bit), RMSNorm scale [D], router weight [D, E] and bias [E]
    -> (weights [N, k] float32, experts [N, k] int32, t [N, D] float16 in pair order, m [N] float32).

    The normed token is cast to x's dtype (as the model's RMSNorm), then written as t * 2^14 / m in
    float16, m the least power of two >= max|t| (1 for a zero token). Ties in the logits pick the
    lower expert first, as `jax.lax.top_k`.

    Programs (token, `expert_block` experts) compute the logits, and a second kernel, one program
    per token, the top-k. One program per token for everything took about 10 us a layer on one H100
    80GB for gpt-oss-20b (32 experts, 184 KB of router weight), and for gpt-oss-120b's 128 experts
    its [block_d, 128] tiles overflowed the registers: batch-1 decode of the 120b fell from 189 to 59
    tokens/s.
    """
    N, D = x.shape
    E = router_weight.shape[1]
    if D % 64:
        raise ValueError(f"route needs an embedding width divisible by 64, got {D}")
    Q, width, EP = D // 8, _pow2(D // 8), _pow2(E)
    eb = min(expert_block, EP)
    if EP % eb:
        raise ValueError(f"expert_block={eb} must divide {EP}")
    dtype = x.dtype

    def logits_kernel(x_ref, xq_ref, s_ref, sq_ref, w_ref, b_ref, t_ref, m_ref, l_ref):
        n, j = pl.program_id(0), pl.program_id(1)
        # The whole token in pair order: even and odd inputs of each group of 8, [width, 4] each.
        halves = [_masked(xq_ref.at[n, padded_span(width, n), :, _i(h)], (width, 4), 0, Q).astype(jnp.float32)
                  for h in (0, 1)]
        r = jax.lax.rsqrt((jnp.sum(halves[0] * halves[0]) + jnp.sum(halves[1] * halves[1])) / D + eps)

        @pl.when(j == 0)
        def _():
            sq = [_masked(sq_ref.at[padded_span(width, n), :, _i(h)], (width, 4), 0, Q) for h in (0, 1)]
            t = [(xh * r * sh).astype(dtype).astype(jnp.float32) for xh, sh in zip(halves, sq)]
            top = jnp.maximum(jnp.max(jnp.abs(t[0])), jnp.max(jnp.abs(t[1])))
            m = jnp.where(top > 0, jnp.exp2(jnp.ceil(jnp.log2(jnp.where(top > 0, top, 1.0)))), 1.0)
            rows = jax.lax.broadcasted_iota(jnp.int32, (width, 4), 0) < Q
            for h in (0, 1):
                pltriton.store(t_ref.at[n, padded_span(width, n), _i(h), :], (t[h] * (HALF_ONE / m)).astype(jnp.float16),
                               mask=rows)
            m_ref[n] = m

        # Logits of experts [j * eb, (j + 1) * eb) in natural order, block_d inputs at a time (the
        # same arithmetic as above); -inf for the padding past E.
        expert = j * eb + jax.lax.broadcasted_iota(jnp.int32, (eb,), 0)

        def step(i, logits):
            ds = pl.ds(i * block_d, block_d)
            live = i * block_d + jax.lax.broadcasted_iota(jnp.int32, (block_d,), 0) < D
            xs = pltriton.load(x_ref.at[n, ds], mask=live, other=0).astype(jnp.float32)
            ts = (xs * r * pltriton.load(s_ref.at[ds], mask=live, other=0)).astype(dtype).astype(jnp.float32)
            ws = pltriton.load(w_ref.at[ds, pl.ds(j * eb, eb)], mask=live[:, None] & (expert < E)[None], other=0)
            return logits + jnp.sum(ts[:, None] * ws.astype(jnp.float32), axis=0)

        logits = jax.lax.fori_loop(0, -(-D // block_d), step, jnp.zeros((eb,), jnp.float32))
        bias = pltriton.load(b_ref.at[pl.ds(j * eb, eb)], mask=expert < E, other=0).astype(jnp.float32)
        l_ref[n, pl.ds(j * eb, eb)] = jnp.where(expert < E, logits + bias, -jnp.inf)

    def top_k_kernel(l_ref, wt_ref, ex_ref):
        n = pl.program_id(0)
        wt_ref[n, :], ex_ref[n, :] = _top_k(l_ref[n, :], jax.lax.broadcasted_iota(jnp.int32, (EP,), 0), k, EP)

    t, m, logits = pl.pallas_call(
        logits_kernel, grid=(N, EP // eb), interpret=interpret, name="gptoss_decode_route",
        out_shape=(jax.ShapeDtypeStruct((N, Q, 2, 4), jnp.float16), jax.ShapeDtypeStruct((N,), jnp.float32),
                   jax.ShapeDtypeStruct((N, EP), jnp.float32)),
        **compiler_params(interpret, num_warps, num_stages))(
        x, x.reshape(N, Q, 4, 2), scale.astype(jnp.float32), scale.astype(jnp.float32).reshape(Q, 4, 2),
        router_weight, router_bias)
    weights, experts = pl.pallas_call(
        top_k_kernel, grid=(N,), interpret=interpret, name="gptoss_decode_top_k",
        out_shape=(jax.ShapeDtypeStruct((N, k), jnp.float32), jax.ShapeDtypeStruct((N, k), jnp.int32)),
        **compiler_params(interpret, 1, 1))(logits)
    return weights, experts, t.reshape(N, D), m


def _pairs_of(t):
    """float16 [R, D] in pair order -> the half2 registers uint32 [R, G, W, 4] (a bitcast)."""
    R, D = t.shape
    return jax.lax.bitcast_convert_type(t.reshape(R, D // 32, 4, 4, 2), jnp.uint32)


def _block_sums(words, scales, regs, interpret: bool):
    """words uint32 [..., G', W], scales uint8 [..., G'], regs 4 x uint32 [..., G', W] broadcastable
    -> float32 [...]: each row's sum over its blocks of (code * input / 2^14 products) * block scale."""
    regs = [jnp.broadcast_to(r, words.shape) for r in regs]
    per_block = jnp.sum(_word_dot(words, regs, interpret), axis=-1) * block_scale(scales)  # 2^(s - 113)
    return jnp.sum(per_block, axis=-1) * (1.0 / HALF_ONE)


def _spans(G: int, chunk: int | None, program_id):
    """The loads along a row's G blocks: (slice, blocks it spans, blocks of it that exist). chunk None:
    one load of G padded to a power of two; else loads of `chunk` blocks (a power of two), the last
    masked past G (less padding: 96 for 90 blocks with chunks of 32, against 128)."""
    if chunk is not None and (chunk < 1 or chunk & (chunk - 1)):
        raise ValueError(f"chunk must be a power of two, got {chunk}")
    if chunk is None or chunk >= _pow2(G):  # one load: as many blocks as chunks would read, or fewer
        return [(padded_span(_pow2(G), program_id), _pow2(G), G)]
    return [(pl.ds(program_id * 0 + c, chunk), chunk, G - c) for c in range(0, G, chunk)]


def _row_sums(r_ref, r_at, w_ref, s_ref, e, rows, R: int, G: int, chunk: int | None, program_id, interpret: bool):
    """float32 [R]: rows `rows` of expert e's blocks (w_ref, s_ref) against the input r_ref.at[r_at]'s
    half2 registers, over every span of the row (`_spans`)."""
    total = 0.0
    for gs, width, bound in _spans(G, chunk, program_id):
        xr = [_masked(r_ref.at[r_at, gs, :, _i(r)], (width, 4), 0, bound)[None] for r in range(4)]  # [1, width, W]
        w = _masked(w_ref.at[e, rows, gs, :], (R, width, 4), 1, bound)
        s = _masked(s_ref.at[e, rows, gs], (R, width), 1, bound)
        total = total + _block_sums(w, s, xr, interpret)
    return total


@functools.partial(jax.jit, static_argnames=("tokens_per_pair", "alpha", "limit", "interpret", "groups", "num_warps",
                                             "chunk"))
def up_swiglu(t, m, experts, blocks, scales, bias, *, tokens_per_pair: int, alpha: float, limit: float,
              interpret: bool = False, groups: int = 1, num_warps: int = 4, chunk: int | None = CHUNK):
    """t [N, D] float16 (pair order, route's), m [N], experts [P] (pair p is token p // tokens_per_pair),
    mlp1 blocks uint8 [E, 2F, G, 16], scales [E, 2F, G], bias [E, 2F]
    -> SwiGLU activations [P, F] float16 in pair order, scaled by 2^14 / swiglu_bound(limit).

    Rows 2f and 2f + 1 of mlp1 are unit f's gate and linear halves. A program reads 16 * groups
    consecutive rows (8 * groups units) in one load, and picks each output's gate and linear sums
    out of the row sums (unit 8q + 2i + h goes to position 8q + 4h + i of the pair order). chunk:
    blocks a load spans (`_spans`; None: the whole row at once).
    """
    P = experts.shape[0]
    E, F2, G, _ = blocks.shape
    R = 16 * groups
    if F2 % R:
        raise ValueError(f"up_swiglu: {F2 // 2} units are not whole groups of 8 * {groups}")
    words = _words(blocks)  # [E, 2F, G, W]
    regs = _pairs_of(t)  # [N, G, W, 4]
    out_scale = HALF_ONE / swiglu_bound(limit)

    def kernel(e_ref, m_ref, r_ref, w_ref, s_ref, b_ref, o_ref):
        p, j = pl.program_id(0), pl.program_id(1)
        e, n = e_ref[p], p // tokens_per_pair
        rs = pl.ds(j * R, R)
        sums = (_row_sums(r_ref, n, w_ref, s_ref, e, rs, R, G, chunk, p, interpret) * m_ref[n]
                + b_ref[e, rs].astype(jnp.float32))  # [R]
        o = jax.lax.broadcasted_iota(jnp.int32, (R // 2, R), 0)  # output position in pair order
        gate_row = 16 * (o // 8) + 4 * (o % 4) + 2 * ((o // 4) % 2)
        row = jax.lax.broadcasted_iota(jnp.int32, (R // 2, R), 1)
        gate = jnp.minimum(jnp.sum(jnp.where(row == gate_row, sums[None], 0.0), axis=1), limit)
        linear = jnp.clip(jnp.sum(jnp.where(row == gate_row + 1, sums[None], 0.0), axis=1), -limit, limit)
        act = gate / (1.0 + jnp.exp(-alpha * gate)) * (linear + 1.0)
        o_ref[p, pl.ds(j * (R // 2), R // 2)] = (act * out_scale).astype(jnp.float16)

    return pl.pallas_call(kernel, grid=(P, F2 // R), out_shape=jax.ShapeDtypeStruct((P, F2 // 2), jnp.float16),
                          interpret=interpret, name="gptoss_decode_up_swiglu",
                          **compiler_params(interpret, num_warps, 1))(
        experts.astype(jnp.int32), m.astype(jnp.float32), regs, words, scales, bias)


@functools.partial(jax.jit, static_argnames=("limit", "interpret", "block_f", "num_warps", "chunk"))
def down(a, experts, pair_weights, blocks, scales, bias, *, limit: float, interpret: bool = False,
         block_f: int = 8, num_warps: int = 2, chunk: int | None = CHUNK):
    """a [P, F] float16 (up_swiglu's), experts [P], pair_weights [P] float32, mlp2 blocks uint8
    [E, D, G, 16], scales [E, D, G], bias [E, D] -> (mlp2 product + bias) * weight, [P, D] float32.
    chunk: as up_swiglu's."""
    P = experts.shape[0]
    E, D, G, _ = blocks.shape
    if D % block_f:
        raise ValueError(f"down: block_f={block_f} does not divide {D}")
    regs = _pairs_of(a)
    words = _words(blocks)
    factor = swiglu_bound(limit)

    def kernel(e_ref, pw_ref, r_ref, w_ref, s_ref, b_ref, o_ref):
        p, j = pl.program_id(0), pl.program_id(1)
        e = e_ref[p]
        fs = pl.ds(j * block_f, block_f)
        y = (_row_sums(r_ref, p, w_ref, s_ref, e, fs, block_f, G, chunk, p, interpret) * factor
             + b_ref[e, fs].astype(jnp.float32))
        o_ref[p, fs] = y * pw_ref[p]

    return pl.pallas_call(kernel, grid=(P, D // block_f), out_shape=jax.ShapeDtypeStruct((P, D), jnp.float32),
                          interpret=interpret, name="gptoss_decode_down",
                          **compiler_params(interpret, num_warps, 1))(
        experts.astype(jnp.int32), pair_weights.astype(jnp.float32), regs, words, scales, bias)


def moe(x, norm_scale, w, *, k: int, eps: float, alpha: float, limit: float, interpret: bool = False,
        settings: dict | None = None):
    """The MoE block's output [N, D] float32 (no residual) for tokens x [N, D] (16-bit), with the
    block's weights w (router_weight, router_bias, and mlp1/mlp2 packed: mxfp4.MXFP4)."""
    N, D = x.shape
    settings = settings or {}
    weights, experts, t, m = route(x, norm_scale, w["router_weight"], w["router_bias"], k=k, eps=eps,
                                   interpret=interpret, **settings.get("route", {}))
    experts, weights = experts.reshape(N * k), weights.reshape(N * k)
    a = up_swiglu(t, m, experts, w["mlp1_weight"].blocks, w["mlp1_weight"].scales, w["mlp1_bias"],
                  tokens_per_pair=k, alpha=alpha, limit=limit, interpret=interpret, **settings.get("up", {}))
    y = down(a, experts, weights, w["mlp2_weight"].blocks, w["mlp2_weight"].scales, w["mlp2_bias"],
             limit=limit, interpret=interpret, **settings.get("down", {}))
    return y.reshape(N, k, D).sum(axis=1)


def fits(x, w, config) -> bool:
    """Whether these kernels take a block of this config, its weights w and 16-bit tokens x [N, D]:
    MXFP4-packed experts, and the Triton blocks' shapes (powers of two; the SwiGLU bound they scale)."""
    return (packed(w["mlp1_weight"]) and jnp.dtype(x.dtype).itemsize == 2
            and config.hidden_size % 64 == 0 and config.intermediate_size % 32 == 0
            and config.experts_per_token & (config.experts_per_token - 1) == 0
            and 0 < config.swiglu_limit < float("inf"))
