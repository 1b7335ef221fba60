"""Decode-sized kernels in Pallas Triton (ships with JAX; NVIDIA GPUs). JAX 0.11 deprecated this
backend: "auto" never picks these kernels (nor triton_mxfp4.py's and decode_moe.py's); they run
when named (`Kernels(moe="triton")`, `Kernels(attention="triton")`), for comparison and for GPUs
before Hopper, and JAX warns as each compiles.

`pair_matvec`, the experts at decode: a batch has few (token, expert) pairs, and the work is reading
the selected experts' weights: per pair a matrix-vector product with its expert's [F, D] matrix.
The kernel reads each pair's rows of that matrix in place, straight from the [E, F, D] array (rows
of D contiguous, so every load is coalesced), with no gathered copy of the weights and no host
round trip. Pairs that share an expert read it again (at batch 1 the 4 pairs of a token are 4
distinct experts). triton_mxfp4.py holds the same for experts packed in MXFP4.

`cache_attention`, decode attention to a full layer's KV cache: it reads only each sequence's
filled positions (a loop bounded on the device by the cache length), split into key ranges so that
a batch of one still fills the GPU.

Legend: P = pairs, D = input features, F = output features, E = experts; B = batch, T = queries,
S = cache slots, K = KV heads, G = query heads per KV head, H = head dim, R = query rows per program.
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

from .combine import fold_splits
from .xla import MASKED


def block_size(n: int, preferred: int) -> int:
    """The largest power of two <= preferred dividing n (Triton blocks are powers of two)."""
    b = preferred
    while n % b:
        b //= 2
    return b


@functools.partial(jax.jit, static_argnames=("interpret", "block_f", "block_d", "num_warps", "num_stages", "splits"))
def pair_matvec(x, idx, w, *, interpret: bool = False, block_f: int = 64, block_d: int = 64, num_warps: int = 4,
                num_stages: int = 3, splits: int | None = None) -> jax.Array:
    """x [P, D], idx [P] (each pair's expert), w [E, F, D] -> [P, F] in x's dtype, float32 sums.

    Each program computes `block_f` outputs of one pair over one of `splits` ranges of D, walking it
    in `block_d` steps with an elementwise [block_f, block_d] accumulator (one cross-lane reduction
    at the end, not one per step); the ranges' float32 partial sums are added after. Splitting D
    gives a batch of one enough programs to keep every SM reading (by default at least ~1024).
    """
    P, D = x.shape
    E, F, _ = w.shape
    bf, bd = block_size(F, block_f), block_size(D, block_d)
    steps = D // bd
    splits = _splits(steps, P * (F // bf), splits, f"the {steps} steps of {bd} over D={D}")
    per_split = steps // splits

    def kernel(idx_ref, x_ref, w_ref, o_ref):
        p, j, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        e = idx_ref[p]

        def step(i, acc):
            d0 = (part * per_split + i) * bd
            xs = x_ref[p, pl.ds(d0, bd)].astype(jnp.float32)  # [bd]
            ws = w_ref[e, pl.ds(j * bf, bf), pl.ds(d0, bd)].astype(jnp.float32)  # [bf, bd]
            return acc + ws * xs[None, :]

        acc = jax.lax.fori_loop(0, per_split, step, jnp.zeros((bf, bd), jnp.float32))
        o_ref[part, p, pl.ds(j * bf, bf)] = jnp.sum(acc, axis=1)

    return _pairs_call(kernel, "gptoss_pair_matvec", (splits, P, F, bf), x.dtype, interpret, num_warps, num_stages,
                       idx.astype(jnp.int32), x, w)


def padded_span(width: int, program_id: jax.Array) -> pl.Slice:
    """`pl.ds(0, width)` for a masked load or store that runs past the end of its axis (Triton blocks
    are powers of two; the mask covers what lies past). Its start is traced, a program id the kernel
    read at its top level times 0: JAX 0.12 refuses a constant slice past an array's end while
    tracing a kernel (seen with jax 0.12.0.1) and checks no traced one; the compiler folds it to 0."""
    return pl.ds(program_id * 0, width)


def compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's Triton settings (none in interpret mode). Every Triton kernel here asks for them."""
    if pltriton is None:
        raise RuntimeError(f"this JAX ({jax.__version__}) no longer has Pallas's Triton backend; the Pallas Triton "
                           "kernels ('triton', 'triton_grouped') cannot run: pick another, or 'auto'")
    if interpret:
        return {}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def _splits(steps: int, programs: int, splits: int | None, what: str) -> int:
    """Ranges to split a row's `steps` into (dividing them): by default the fewest giving ~1024 programs."""
    if splits is None:
        return next(s for s in range(1, steps + 1) if steps % s == 0 and (programs * s >= 1024 or s == steps))
    if steps % splits:
        raise ValueError(f"splits={splits} must divide {what}")
    return splits


def _pairs_call(kernel, name, sizes, dtype, interpret, num_warps, num_stages, *inputs) -> jax.Array:
    """Run a per-pair matvec kernel on the grid (pairs, output tiles, splits) and add the splits'
    float32 partial sums [splits, P, F] -> [P, F] in dtype."""
    splits, P, F, bf = sizes
    partial = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((splits, P, F), jnp.float32),
                             grid=(P, F // bf, splits), interpret=interpret, name=name,
                             **compiler_params(interpret, num_warps, num_stages))(*inputs)
    return partial.sum(axis=0).astype(dtype)


def pow2_at_least(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("interpret", "block_k", "splits", "num_warps", "num_stages"))
def cache_attention(q, k, v, kv_len, *, interpret: bool = False, block_k: int = 64, splits: int | None = None,
                    num_warps: int = 4, num_stages: int = 2) -> tuple[jax.Array, jax.Array]:
    """Decode attention to a KV cache: q [B, T, K, G, H], k and v [B, S, K, H], every query seeing keys
    [0, kv_len[b]) -> (o [B, T, K, G, H] float32, lse [B, T, K, G] float32), sink-free (see combine.py).

    Reads only the filled part of the cache: the keys are split into `splits` ranges (enough programs
    to fill the GPU at small batches), and each program visits the key blocks of its range below
    kv_len, a loop whose trip count is read on the device. One program holds the T * G query rows
    of one KV head (padded to 16, the smallest dot Triton takes) with a running max, sum and
    accumulator; the ranges are folded by their log-sum-exp.
    """
    B, T, K, G, H = q.shape
    S = k.shape[1]
    R = pow2_at_least(T * G)
    bk = block_size(S, block_k)
    if splits is None:  # about 4 programs per SM of a large GPU, one key block per range at least
        splits = max(1, min(S // bk, -(-528 // (B * K))))
    chunk = -(-S // splits // bk) * bk
    splits = -(-S // chunk)
    scale = 1.0 / math.sqrt(H)
    exact = False if q.dtype == jnp.float32 else None  # float32 dots in full, not TF32
    rows = q.transpose(0, 2, 1, 3, 4).reshape(B, K, T * G, H)  # [B, K, T*G, H], row = t * G + g
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, R - T * G), (0, 0)))

    def kernel(len_ref, q_ref, k_ref, v_ref, o_ref, lse_ref):
        b, kh, part = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        lo = part * chunk
        n = jnp.maximum(jnp.minimum(lo + chunk, len_ref[b]) - lo, 0)  # keys of this range below kv_len
        qs = q_ref[b, kh, :, :]  # [R, H]

        def visit(i, carry):
            m, l, acc = carry
            first = lo + i * bk
            ks = k_ref[b, pl.ds(first, bk), kh, :]  # [bk, H]
            vs = v_ref[b, pl.ds(first, bk), kh, :]
            s = pltriton.dot(qs, ks, trans_b=True, allow_tf32=exact).astype(jnp.float32) * scale  # [R, bk]
            seen = (i * bk + jax.lax.broadcasted_iota(jnp.int32, (R, bk), 1)) < n
            s = jnp.where(seen, s, MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            alpha = jnp.exp(m - m_new)
            p = jnp.where(seen, jnp.exp(s - m_new[:, None]), 0.0)
            pv = pltriton.dot(p.astype(vs.dtype), vs, allow_tf32=exact).astype(jnp.float32)  # [R, H]
            return m_new, l * alpha + jnp.sum(p, axis=1), acc * alpha[:, None] + pv

        init = (jnp.full((R,), MASKED, jnp.float32), jnp.zeros((R,), jnp.float32), jnp.zeros((R, H), jnp.float32))
        m, l, acc = jax.lax.fori_loop(0, (n + bk - 1) // bk, visit, init)
        o_ref[b, part, kh, :, :] = acc / jnp.maximum(l, 1e-30)[:, None]
        lse_ref[b, part, kh, :] = jnp.where(l > 0, m + jnp.log(jnp.maximum(l, 1e-30)), -jnp.inf)

    o, lse = pl.pallas_call(
        kernel, grid=(B, K, splits), interpret=interpret, name="gptoss_cache_attention",
        out_shape=(jax.ShapeDtypeStruct((B, splits, K, R, H), jnp.float32),
                   jax.ShapeDtypeStruct((B, splits, K, R), jnp.float32)),
        **compiler_params(interpret, num_warps, num_stages))(kv_len.astype(jnp.int32), rows, k, v)
    return fold_splits(o[:, :, :, : T * G], lse[..., : T * G], T, G)


def triton_prefix(q, k, v, lengths, *, kernels):
    """The attention variant "triton" (kernels/attention.py): decode-sized calls (the rows of one
    program); None otherwise."""
    if q.shape[1] * q.shape[3] > 128:
        return None
    return cache_attention(q, k, v, lengths, interpret=kernels.interpret)
