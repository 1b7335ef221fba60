"""TPU kernels that ship with JAX (Pallas, Mosaic TPU): splash attention and megablox's grouped matmul.

Neither has run on a TPU here: both are checked against the jnp code in Pallas interpret mode on
CPU (tests/test_kernels.py). docs/architecture.md says what that does and does not show.

- `causal`: splash attention with a causal (and local) mask, statistics saved, no sinks inside
  (combine.py adds them, as for every kernel). The mask is static, so this serves prompts written
  from position 0 of a chunk; a cache's earlier positions go through the jnp code.
- `ragged_dot`: megablox `gmm`, reading each expert's [F, D] weights in place (transpose_rhs).

Legend: B = batch, T = queries, K = KV heads, G = query heads per KV head, H = head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import pairs


@functools.cache
def _splash(T: int, heads: int, window: int | None, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    if window is None:
        mask = masks.CausalMask((T, T))
    else:
        mask = masks.LocalMask((T, T), window_size=(window - 1, 0), offset=0)
    block = min(512, T)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block)
    return splash.make_splash_mha(masks.MultiHeadMask([mask] * heads), block_sizes=sizes, save_residuals=True,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)


def causal(q, k, v, *, window: int | None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """q [B, T, K, G, H], k and v [B, T, K, H] -> (o [B, T, K, G, H], lse [B, T, K, G])."""
    B, T, K, G, H = q.shape
    kernel = _splash(T, K * G, window, interpret)
    qh = q.reshape(B, T, K * G, H).transpose(0, 2, 1, 3) * np.float32(1 / np.sqrt(H)).astype(q.dtype)  # [B, N, T, H]
    kh, vh = (x.transpose(0, 2, 1, 3) for x in (k, v))  # [B, K, T, H]: splash groups q heads n // G itself
    o, (lse,) = jax.vmap(kernel)(qh, kh, vh)
    return (o.transpose(0, 2, 1, 3).reshape(B, T, K, G, H),
            lse.transpose(0, 2, 1).reshape(B, T, K, G).astype(jnp.float32))


def ragged_dot(x, w, group_sizes, *, interpret: bool = False) -> jax.Array:
    """x [M, D] sorted by expert, w [E, F, D], group_sizes [E] -> [M, F] (rows past the groups: undefined)."""
    from jax.experimental.pallas.ops.tpu.megablox.gmm import gmm

    M, D = x.shape
    F = w.shape[1]
    tm = min(128, M)
    rows = -(-M // tm) * tm  # rows past the groups are never read: zero padding to whole tiles
    x = jnp.pad(x, ((0, rows - M), (0, 0)))
    tiling = (tm, _tile(D), _tile(F))
    return gmm(x, w, group_sizes.astype(jnp.int32), preferred_element_type=x.dtype, tiling=tiling,
               transpose_rhs=True, interpret=interpret)[:M]


def _tile(n: int) -> int:
    """The largest of 128, 64, ... dividing n (the kernel's tiles must divide D and F)."""
    t = 128
    while n % t:
        t //= 2
    return t


def experts(x, idx, w, act, *, kernels):
    """The experts' variant "megablox" (kernels/experts.py): the pairs sorted by expert, one
    megablox grouped matmul per projection (MXFP4-packed experts decoded whole first). x [N, D],
    idx [N, A] (negative: dropped) -> [N, A, D]."""
    return pairs.ragged(x, idx, w, act, ragged_dot=functools.partial(ragged_dot, interpret=kernels.interpret))


def splash_causal(q, k, v, *, window, kernels):
    """The attention variant "splash" (kernels/attention.py), prompts."""
    return causal(q, k, v, window=window, interpret=kernels.interpret)
