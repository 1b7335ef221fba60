"""The attention variant "tokamax" (attention/__init__.py): tokamax's Mosaic GPU flash attention
for prompts on NVIDIA GPUs (sm80/sm90/sm100). It takes no sinks; it returns the softmax statistics
(row max and sum), and combine.py folds the sinks in from them. Key blocks outside the causal band,
the window or a cache's filled length are skipped inside the kernel.

Legend: B = batch, T = queries, S = keys, N = query heads, K = KV heads, G = N / K, H = head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ... import fp8
from .. import tokamax
from ..combine import lse_of
from . import paged


def _flash(q, k, v, mask) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, S, K, H] -> (o [B, T, K, G, H], lse [B, T, K, G])."""
    B, T, K, G, H = q.shape
    _, _, op, _ = tokamax.modules()
    # Query head n reads KV head n // G, tokamax's grouping too.
    o, (m, l) = op(q.reshape(B, T, K * G, H), k, v, mask=mask, return_residuals=True)
    lse = lse_of(m, l).swapaxes(1, 2).reshape(B, T, K, G)  # [B, N, T] -> [B, T, K, G]
    return o.reshape(B, T, K, G, H), lse


# Each entry point is its own jit: the 24 layers' identical calls then lower (and compile their
# Mosaic GPU kernel) once per shape, not once per layer.
@functools.partial(jax.jit, static_argnames=("window",))
def causal(q, k, v, *, window: int | None) -> tuple[jax.Array, jax.Array]:
    """Queries and keys of the same positions, causal (and windowed: i - window < j <= i)."""
    _, base, _, _ = tokamax.modules()
    mask = base.Mask(None, is_causal=True)
    if window is not None:
        mask &= base.CausalMask(offset=0, window_size=window)
    return _flash(q, k, v, mask)


@jax.jit
def prefix(q, k, v, kv_len) -> tuple[jax.Array, jax.Array]:
    """Every query sees keys [0, kv_len[b]) (a cache's earlier positions); blocks past it are skipped."""
    _, base, _, _ = tokamax.modules()
    return _flash(q, k, v, base.Mask(None, k_end=kv_len.astype(jnp.int32)[:, None, None]))


# The attention variant "tokamax" (kernels/attention/__init__.py): flash attention for prompts.
# Positions (sequences x table width x page) up to which a prompt chunk's cached prefix is gathered
# out of the paged cache for the flash kernel at once (about 0.5 GiB of keys and values at gpt-oss's
# 8 KV heads); longer tables are gathered a piece of columns at a time (paged.in_pieces).
GATHER_FOR_FLASH = 262_144


def tokamax_causal(q, k, v, *, window, kernels):
    return causal(q, k, v, window=window)


def tokamax_prefix(q, k, v, lengths, *, kernels):
    return prefix(q, fp8.read(k, q.dtype), fp8.read(v, q.dtype), lengths)


def tokamax_paged_full(q, pool_k, pool_v, table, lengths, *, kernels, mesh):
    """A prompt chunk after its cached prefix (one device): the flash kernel over the prefix's keys
    gathered out of the pages, the whole table where sequences x width x page <= GATHER_FOR_FLASH
    (one NVIDIA H200, 256 prompts of 1k in chunks of 512: first tokens at 2.6 s p50, not 3.2 in jnp
    blocks), else pieces of a power of two columns under that bound."""
    if mesh is not None:
        return None
    B, W, P = q.shape[0], table.shape[1], pool_k.shape[1]
    if B * W * P <= GATHER_FOR_FLASH:
        return prefix(q, paged.gather(pool_k, table, q.dtype), paged.gather(pool_v, table, q.dtype), lengths)
    pages = 1 << max(0, (GATHER_FOR_FLASH // (B * P)).bit_length() - 1)
    return paged.in_pieces(q, pool_k, pool_v, table, lengths, prefix, pages=pages)
