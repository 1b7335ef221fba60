"""`cache_attention`, decode attention to a full layer's KV cache in Pallas Triton (the attention
variant "triton", by name only): it reads only each sequence's filled positions (a loop bounded on
the device by the cache length), split into key ranges so that a batch of one still fills the GPU.

Legend: B = batch, T = queries, S = cache slots, K = KV heads, G = query heads per KV head, H = head
dim, R = query rows per program.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ..blockwise import MASKED
from ..combine import fold_splits
from .common import block_size, compiler_params, pltriton, pow2_at_least


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
    """The attention variant "triton" (kernels/attention/__init__.py): decode-sized calls (the rows of one
    program); None otherwise."""
    if q.shape[1] * q.shape[3] > 128:
        return None
    return cache_attention(q, k, v, lengths, interpret=kernels.interpret)
