"""Small shared layers: RMSNorm and rotary embeddings with YaRN.

Legend: B = batch, T = positions, H = head dim.
"""

from __future__ import annotations

import math
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..weight import Weight, declare


class RMSNorm(nn.Module):
    """`x * rsqrt(mean(x^2) + eps) * scale`, computed in float32 and cast back to x's dtype."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.float32
    WEIGHTS: ClassVar = {"scale": Weight(("embed",), init="ones", float32=True)}

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = declare(self, "scale")
        t = x.astype(jnp.float32)
        t = t * jax.lax.rsqrt(jnp.mean(t * t, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        return (t * scale).astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> tuple[float, np.ndarray]:
    """(concentration, inverse frequencies [H/2] float32) of YaRN with NTK-by-parts interpolation.

    The formula is evaluated in float64 and rounded once, so each frequency is the float32 nearest
    the exact value. The references evaluate it in float32 (torch's pow is not correctly rounded) and
    land within 1 ulp of it; at position p a 1-ulp frequency difference moves an angle by about
    p * 6e-8 * freq, which is the references' own sensitivity (see tests/test_layers.py).
    """
    d = config.head_dim
    freq = config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)  # [H/2]
    s = config.rope_scaling_factor
    if s <= 1.0:
        return 1.0, (1.0 / freq).astype(np.float32)
    low, high = config.yarn_ramp_bounds()
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0.0, 1.0)
    # ramp 0: keep the original frequency (fast dims); ramp 1: divide it by s (slow dims).
    inv_freq = (1.0 / (s * freq)) * ramp + (1.0 / freq) * (1.0 - ramp)
    concentration = 0.1 * math.log(s) + 1.0
    return concentration, inv_freq.astype(np.float32)


def rope_tables(config: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin [..., H/2] (float32) for integer positions [...], both scaled by YaRN's concentration."""
    concentration, inv_freq = rope_inv_freq(config)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * concentration, jnp.sin(angles) * concentration


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + H/2) of x [B, T, ..., H] by tables [B, T, H/2] (half-split, not interleaved).

    cos and sin are cast to x's dtype first, as both references do.
    """
    extra = x.ndim - cos.ndim  # head axes between T and H
    shape = cos.shape[:-1] + (1,) * extra + cos.shape[-1:]
    cos = cos.reshape(shape).astype(x.dtype)
    sin = sin.reshape(shape).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
