"""EAGLE-3 draft heads (Li et al., 2025) as published for gpt-oss: one Llama decoder layer that
proposes the target's next tokens from the target's own hidden states.

A head reads the outputs of three of the target's layers (low, middle, high: `aux_layers`) at a
position p, projects their concatenation to its width (`fc`), and with the embedding of the token
at p + 1 (the target's embedding) predicts the token at p + 2 over its own vocabulary of the
target's most frequent tokens (`draft_vocab_size`; `hot`: their ids in the target's vocabulary).
Each later draft token feeds the layer's own output back in place of the target's states:

    g = concat(target layer outputs at p)                       [G]  (first draft token only)
    h = fc(g)  (RMSNorm'd first where the head has norm_before_fc), or the head's previous output
    x = concat(embed_norm(E[token]), hidden_norm(h))            [A = 2D]
    r = h + o_proj(attention(q, k, v of x; RoPE, GQA, causal over the head's own cache))
    y = r + down(silu(gate(post_norm(r))) * up(post_norm(r)))   the output fed back
    logits = lm_head(norm(y)) [U]; a draft token's target id is hot[argmax]

as SGLang's and vLLM's EAGLE-3 models compute it (their `LlamaForCausalLMEagle3`). The head's
attention has no sinks and no window; its RoPE is plain (rope_theta, no YaRN), the target's is not.

Legend: B = batch, T = positions, S = cache positions, D = hidden, A = 2D, G = the captured
states' width (3 x the target's hidden), N = query heads, K = KV heads, H = head dim, F = MLP
width, U = the draft vocabulary.
"""

from __future__ import annotations

from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..eagle3_config import Eagle3Config
from ..kernels import Kernels, fold_sinks
from ..weight import Weight, declare
from .cache import layout_of
from .layers import RMSNorm, apply_rope


def captured(state: dict, layers: tuple[int, ...]) -> jax.Array:
    """The target's captured layer outputs (`Transformer(..., capture=layers)`, applied with
    mutable=["intermediates"]: its state) concatenated low to high -> [B, T, G]."""
    return jnp.concatenate([state["intermediates"][f"layer_{i}"][0] for i in layers], axis=-1)


def init_head_cache(config: Eagle3Config, batch: int, max_len: int, dtype=jnp.bfloat16) -> dict:
    """The head's own KV cache: keys and values [B, S, K, H] of every position it has seen."""
    shape = (batch, max_len, config.num_key_value_heads, config.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype), "lengths": jnp.zeros(batch, jnp.int32)}


def _rope(config: Eagle3Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    inv_freq = 1.0 / config.rope_theta ** (np.arange(0, config.head_dim, 2, dtype=np.float64) / config.head_dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, H/2]
    return jnp.cos(angles), jnp.sin(angles)


class Eagle3Head(nn.Module):
    config: Eagle3Config
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()  # the attention variants (the target's, where the head drafts for one)
    WEIGHTS: ClassVar = {
        "fc": Weight(("aux_embed", "embed")),
        "fc_norm": Weight(("aux_embed",), init="ones", float32=True),  # with norm_before_fc only
        "q": Weight(("draft_in", "q_heads", "head_dim")),
        "k": Weight(("draft_in", "kv_heads", "head_dim")),
        "v": Weight(("draft_in", "kv_heads", "head_dim")),
        "o": Weight(("q_heads", "head_dim", "embed")),
        "gate": Weight(("embed", "mlp")),
        "up": Weight(("embed", "mlp")),
        "down": Weight(("mlp", "embed")),
        "lm_head": Weight(("embed", "draft_vocab")),
    }

    @nn.compact
    def __call__(self, embedded: jax.Array, hidden: jax.Array, cache: dict, valid: jax.Array):
        """embedded [B, T, D]: the target's embedding of the tokens after the states' positions; hidden
        [B, T, G] the target's captured states, or [B, T, D] the head's own earlier outputs; cache: its
        keys and values in either layout (`init_head_cache`'s, or a pool's storage with the rows'
        "table") with "lengths", continued there; valid [B, T] a prefix of each row ->
        (logits [B, T, U] float32, outputs [B, T, D], the cache with the valid positions written)."""
        cfg = self.config
        if hidden.shape[-1] != cfg.hidden_size:
            if cfg.norm_before_fc:
                hidden = _rms(hidden, declare(self, "fc_norm"), cfg.rms_norm_eps)
            hidden = jnp.einsum("btg,gd->btd", hidden.astype(self.param_dtype), declare(self, "fc"))
        x = jnp.concatenate([RMSNorm(cfg, name="embed_norm")(embedded.astype(self.param_dtype)),
                             RMSNorm(cfg, name="hidden_norm")(hidden)], axis=-1)  # [B, T, A]
        lengths = cache["lengths"]
        positions = lengths[:, None] + jnp.arange(x.shape[1])[None]  # [B, T]
        cos, sin = _rope(cfg, positions)
        q = apply_rope(jnp.einsum("bta,anh->btnh", x, declare(self, "q")), cos, sin)
        k = apply_rope(jnp.einsum("bta,akh->btkh", x, declare(self, "k")), cos, sin)
        v = jnp.einsum("bta,akh->btkh", x, declare(self, "v"))
        B, T = x.shape[:2]
        N, K = cfg.num_attention_heads, cfg.num_key_value_heads
        q = q.reshape(B, T, K, N // K, cfg.head_dim)
        k, v = k.astype(cache["k"].dtype), v.astype(cache["v"].dtype)
        # As the target's full layers attend (attention.py, through the cache contract of either
        # layout): the cache's first `lengths` positions and the new ones among themselves, folded
        # without sinks; the cache written after the read.
        ops = self.kernels.attention_ops(T, q.dtype)
        before, written = layout_of(cache).attend(ops, q, k, v, cache, positions, lengths, valid, None)
        attended = fold_sinks([before, ops.causal(q, k, v, None)], jnp.full((K, N // K), -1e30, jnp.float32), q.dtype)
        cache = {**cache, **written, "lengths": lengths + valid.sum(axis=1).astype(jnp.int32)}
        r = hidden + jnp.einsum("btnh,nhd->btd", attended.reshape(B, T, N, cfg.head_dim), declare(self, "o"))
        n = RMSNorm(cfg, name="post_norm")(r)
        gated = jax.nn.silu(n @ declare(self, "gate")) * (n @ declare(self, "up"))  # [B, T, F]
        y = r + gated @ declare(self, "down")
        logits = jnp.einsum("btd,du->btu", RMSNorm(cfg, name="norm")(y), declare(self, "lm_head"),
                            preferred_element_type=jnp.float32)
        return logits, y, cache


def _rms(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    t = x.astype(jnp.float32)
    return (t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + eps) * scale).astype(x.dtype)
