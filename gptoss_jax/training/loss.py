"""The training loss: mean next-token cross-entropy over the tokens a mask selects.

Token t of a row is predicted from tokens 0..t-1; loss_mask[b, t] says whether that prediction
counts (the first position has no prediction and never counts). The logits are computed a chunk of
positions at a time and recomputed in the backward pass, so that [B, T, V] float32 logits (51 GB at
64K positions of gpt-oss's 201,088-token vocabulary) never exist at once.

Legend: B = batch, T = positions, D = embed, V = vocab, C = positions per logits chunk.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..config import ModelConfig
from ..kernels import Kernels
from ..model.transformer import Transformer
from ..weight import Params

LOGITS_CHUNK = 1024  # positions whose logits exist at once (times the batch)


def token_losses(logits: jax.Array, targets: jax.Array, label_smoothing: float = 0.0) -> jax.Array:
    """logits [..., V] float32, targets [...] -> [...]: -log p(target), or with label smoothing e,
    (1 - e) * -log p(target) + e * mean over the vocabulary of -log p (what torch's cross_entropy
    computes with label_smoothing=e)."""
    lse = jax.nn.logsumexp(logits, axis=-1)
    nll = lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    if not label_smoothing:
        return nll
    return (1.0 - label_smoothing) * nll + label_smoothing * (lse - logits.mean(axis=-1))


def loss_terms(config: ModelConfig, params: Params, tokens: jax.Array, loss_mask: jax.Array, *,
               label_smoothing: float = 0.0, kernels: Kernels = Kernels(), remat: bool = False,
               chunk: int = LOGITS_CHUNK, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """(sum of the selected tokens' losses, how many were selected), both float32 scalars.

    tokens [B, T] int32, loss_mask [B, T] bool. remat: recompute each block's activations in the
    backward pass (activation checkpointing) instead of keeping them. mesh: the one the parameters
    are laid out on (the model then runs its experts in parallel over it), None: one device.
    """
    hidden = Transformer(config, kernels=kernels, remat=remat, mesh=mesh).apply({"params": params}, tokens,
                                                                               hidden=True)
    x, targets = hidden[:, :-1], tokens[:, 1:]  # position t predicts token t + 1
    mask = loss_mask[:, 1:].astype(jnp.float32)
    B, N, D = x.shape
    C = min(chunk, N)
    n = -(-N // C)
    pad = ((0, 0), (0, n * C - N))
    x = jnp.pad(x, pad + ((0, 0),)).reshape(B, n, C, D).swapaxes(0, 1)  # [n, B, C, D]
    targets = jnp.pad(targets, pad).reshape(B, n, C).swapaxes(0, 1)
    mask = jnp.pad(mask, pad).reshape(B, n, C).swapaxes(0, 1)
    unembedding = params["unembedding"]

    @jax.checkpoint  # keep no chunk's logits for the backward pass: recompute them there
    def chunk_loss(total, xs):
        x_c, t_c, m_c = xs
        logits = jnp.einsum("bcd,dv->bcv", x_c, unembedding, preferred_element_type=jnp.float32)
        return total + jnp.sum(token_losses(logits, t_c, label_smoothing) * m_c), None

    total, _ = jax.lax.scan(chunk_loss, jnp.zeros((), jnp.float32), (x, targets, mask))
    return total, mask.sum()


@functools.partial(jax.jit, static_argnames=("config", "label_smoothing", "kernels", "remat", "chunk", "mesh"))
def loss(config: ModelConfig, params: Params, tokens: jax.Array, loss_mask: jax.Array, *,
         label_smoothing: float = 0.0, kernels: Kernels = Kernels(), remat: bool = False,
         chunk: int = LOGITS_CHUNK, mesh: Mesh | None = None) -> jax.Array:
    """Mean next-token cross-entropy over the tokens loss_mask [B, T] selects (a float32 scalar).

    `jax.grad(loss, argnums=1)` gives the gradient for every parameter. No token selected: 0. Jitted
    (the settings after loss_mask are static): called alone, one compiled program per shape.
    """
    total, count = loss_terms(config, params, tokens, loss_mask, label_smoothing=label_smoothing, kernels=kernels,
                              remat=remat, chunk=chunk, mesh=mesh)
    return total / jnp.maximum(count, 1.0)
