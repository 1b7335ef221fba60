"""The GPT-OSS transformer as linen modules, and `forward`, the cache-free entry point.

Parameters are a plain pytree passed to `apply` (see weight.py for how they are declared, params.py for the tree):
    {"embedding": [V, D], "block_0": {"attn": {...}, "mlp": {...}}, ..., "norm": {"scale": [D]},
     "unembedding": [D, V]}
Activations follow the parameters' dtype (float32 or bfloat16); RMSNorm, attention scores and
softmax, the router and the final logits are float32 whatever the parameter dtype.

Legend: B = batch, T = positions, D = embed, V = vocab.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ..config import ModelConfig
from ..kernels import Kernels
from ..sharding import constrain, mesh_of, on_every_device
from ..weight import Params, Weight, declare
from .attention import AttentionBlock
from .layers import RMSNorm
from .moe import MLPBlock
from .paged_cache import layer_view, storage_of


class TransformerBlock(nn.Module):
    config: ModelConfig
    layer: int
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()
    mesh: Mesh | None = None

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, layer_cache=None, lengths=None, valid=None,
                 adapters=None):
        with jax.named_scope("attention"):
            attn = AttentionBlock(self.config, self.layer, self.param_dtype, self.kernels, self.mesh, name="attn")
            if layer_cache is None:
                x = x + attn(x, positions, adapters=adapters)
            else:
                out, layer_cache = attn(x, positions, layer_cache, lengths, valid, adapters)
                x = x + out
        with jax.named_scope("moe"):
            x = x + MLPBlock(self.config, self.param_dtype, self.kernels, self.mesh, name="mlp")(x, adapters)
        return x if layer_cache is None else (x, layer_cache)


class Transformer(nn.Module):
    config: ModelConfig
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()
    mesh: Mesh | None = None  # the mesh the parameters are laid out on (sharding.py); None: one device
    # Training: recompute each block's activations in the backward pass rather than keep them
    # (activation checkpointing: memory for one block's activations plus each block's input).
    remat: bool = False
    # The layers whose outputs (the residual stream after them) are kept, as "intermediates"
    # "layer_<i>" (apply with mutable=["intermediates"]): an EAGLE-3 draft head reads them (eagle3.py).
    capture: tuple[int, ...] = ()
    WEIGHTS: ClassVar = {
        "embedding": Weight(("vocab", "embed")),
        "unembedding": Weight(("embed", "vocab")),
    }

    @nn.compact
    def __call__(self, tokens: jax.Array, cache: dict | None = None, valid: jax.Array | None = None,
                 logits_at: jax.Array | None = None, hidden: bool = False, adapters: jax.Array | None = None):
        """tokens [B, T] int32 -> logits [B, T, V] float32.

        With a cache (cache.py, or a paged one: paged_cache.py), the tokens continue each sequence
        (valid [B, T]: real tokens, a prefix of each row; padding after them is ignored) and
        (logits, updated cache) is returned.
        logits_at [B] int32: only the logits at that index of each row, [B, V] (a prompt needs its
        last position's alone; [B, T, V] float32 for a 512-token chunk at batch 64 is 26 GB).
        hidden (no cache): the final norm's output [B, T, D] instead of the logits, for a loss that
        computes the logits a chunk at a time (training/loss.py).
        adapters [B] int32: each row's adapter among the served ones the parameters hold (a table,
        training/lora.attach_table; -1: the base model alone), rows of any adapters in one call.
        """
        cfg = self.config
        embedding = declare(self, "embedding")
        x = constrain(jnp.take(embedding, tokens, axis=0), ("batch", "seq", "act_embed"), self.mesh)  # [B, T, D]
        steps = jnp.arange(tokens.shape[1], dtype=jnp.int32)
        if cache is None:
            positions = jnp.broadcast_to(steps, tokens.shape)
        else:
            valid = jnp.ones(tokens.shape, bool) if valid is None else valid
            lengths = cache["lengths"]
            positions = lengths[:, None] + steps  # [B, T]
            new_cache = {"lengths": lengths + valid.sum(axis=1, dtype=jnp.int32)}
            if "pages" in cache:  # paged (paged_cache.py): layers share storages, the tables stay
                new_cache["tables"], new_cache["pages"] = cache["tables"], list(cache["pages"])
        for i in range(cfg.num_hidden_layers):
            name = f"block_{i}"
            block_type = nn.remat(TransformerBlock) if self.remat and cache is None else TransformerBlock
            block = block_type(cfg, i, self.param_dtype, self.kernels, self.mesh, name=name)
            with jax.named_scope(name):
                if cache is None:
                    x = block(x, positions, None, None, None, adapters)
                elif "pages" in cache:
                    x, storage = block(x, positions, layer_view(cfg, new_cache, i), lengths, valid, adapters)
                    new_cache["pages"][storage_of(cfg, i)] = storage
                else:
                    x, new_cache[name] = block(x, positions, cache[name], lengths, valid, adapters)
            if i in self.capture:
                self.sow("intermediates", f"layer_{i}", x)
        if logits_at is not None:
            x = jnp.take_along_axis(x, logits_at[:, None, None], axis=1)  # [B, 1, D]
        x = RMSNorm(cfg, name="norm")(x)
        if hidden and cache is None:
            return x
        logits = jnp.einsum("btd,dv->btv", x, declare(self, "unembedding"), preferred_element_type=jnp.float32)
        if logits_at is not None:
            logits = logits[:, 0]  # [B, V]
        return logits if cache is None else (logits, new_cache)


def _check_tokens(config: ModelConfig, tokens) -> jax.Array:
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got {tokens.dtype}")
    if not isinstance(tokens, jax.core.Tracer) and tokens.size:
        lo, hi = int(np.min(tokens)), int(np.max(tokens))
        if lo < 0 or hi >= config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {config.vocab_size}); got min {lo}, max {hi}")
    return tokens.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"))
def _forward(config: ModelConfig, params: Params, tokens: jax.Array, kernels: Kernels, mesh) -> jax.Array:
    return Transformer(config, kernels=kernels, mesh=mesh).apply({"params": params}, tokens)


def forward(config: ModelConfig, params: Params, tokens, *, kernels: Kernels = Kernels()) -> jax.Array:
    """Logits [B, T, V] (float32) of int32 tokens [B, T] for a fresh sequence (positions 0..T-1), no cache.

    Parameters laid out on a mesh (sharding.py) run sharded on it; the logits come back sharded
    (batch on `data`, vocabulary on `tensor`).
    """
    mesh = mesh_of(params)
    return _forward(config, params, on_every_device(_check_tokens(config, tokens), mesh), kernels, mesh)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("cache",))
def _extend(config, params, tokens, cache, valid, adapters, kernels, mesh):
    return Transformer(config, kernels=kernels, mesh=mesh).apply({"params": params}, tokens, cache, valid,
                                                                 adapters=adapters)


def extend(config: ModelConfig, params: Params, tokens, cache: dict, valid=None, *, adapters=None,
           kernels: Kernels = Kernels()) -> tuple[jax.Array, dict]:
    """Append tokens [B, T] to each cached sequence -> (their logits [B, T, V], the updated cache).

    One call serves a prompt (or a chunk of one) and a decode step alike. The cache is donated:
    use only the returned one. valid [B, T] marks real tokens (a prefix of each row), so prompts of
    different lengths share a batch. adapters [B] int32: each row's served adapter, where the
    parameters hold a table of them (training/lora.attach_table; -1: none).
    """
    tokens = _check_tokens(config, tokens)
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid, bool)
    mesh = mesh_of(params)
    if adapters is not None:
        adapters = on_every_device(jnp.asarray(adapters, jnp.int32), mesh)
    return _extend(config, params, on_every_device(tokens, mesh), cache, on_every_device(valid, mesh), adapters,
                   kernels, mesh)
