"""The attention variant "splash" (attention/__init__.py): splash attention, the TPU kernel that
ships with JAX (Pallas, Mosaic TPU), with a causal (and local) mask, statistics saved, no sinks
inside (combine.py adds them, as for every kernel). The mask is static, so this serves prompts
written from position 0 of a chunk; a cache's earlier positions go through the jnp code. Never
run on a TPU here: checked against the jnp code in Pallas interpret mode on CPU
(tests/test_kernels.py); docs/architecture.md says what that does and does not show.

Legend: B = batch, T = queries, K = KV heads, G = query heads per KV head, H = head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


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


def splash_causal(q, k, v, *, window, kernels):
    """The attention variant "splash" (kernels/attention/__init__.py), prompts."""
    return causal(q, k, v, window=window, interpret=kernels.interpret)
