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

from .config import ModelConfig
from .params import Weight, declare


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
    """(concentration, inverse frequencies [H/2]) of YaRN with NTK-by-parts interpolation.

    Computed in float32 in the same order as both references, so the frequencies agree to the bit
    (a last-bit difference in a frequency shifts the angle at position 131072 measurably).
    """
    d = config.head_dim
    f32 = np.float32
    freq = f32(config.rope_theta) ** (np.arange(0, d, 2, dtype=f32) / f32(d))  # [H/2]
    s = config.rope_scaling_factor
    if s <= 1.0:
        return 1.0, (f32(1.0) / freq).astype(f32)
    low, high = config.yarn_ramp_bounds()
    interpolation = f32(1.0) / (f32(s) * freq)
    extrapolation = f32(1.0) / freq
    ramp = (np.arange(d // 2, dtype=f32) - f32(low)) / f32(high - low)
    mask = f32(1.0) - np.clip(ramp, f32(0.0), f32(1.0))  # 1 = keep the original frequency
    inv_freq = interpolation * (f32(1.0) - mask) + extrapolation * mask
    concentration = 0.1 * math.log(s) + 1.0
    return concentration, inv_freq.astype(f32)


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
