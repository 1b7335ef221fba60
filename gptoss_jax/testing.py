"""Synthetic weights for tests, demos and benchmarks (no real checkpoint is needed).

Unlike `init_params` (a training-style init whose tiny activations never reach the SwiGLU clamp or
make the router's choice matter), `random_params` draws weights whose activations have the
magnitudes a trained model shows: unit-scale residual stream, expert pre-activations that often pass
the clamp at +-7, sinks of order 1, non-trivial norm scales and biases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .params import Params, abstract_params, logical_axes

# Per-weight scale of a standard normal draw, by the weight's last path component.
# Matrices get gain / sqrt(fan_in) with fan_in the product of their input axes.
_GAINS = {"mlp1_weight": 4.0, "router_weight": 2.0}


# The input axes of each matrix; "embed" unless listed.
_INPUT_AXES = {"mlp2_weight": {"mlp"}, "out_weight": {"q_heads", "head_dim"}}


def _fan_in(name: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> int:
    inputs = _INPUT_AXES.get(name, {"embed"})
    return int(np.prod([n for a, n in zip(axes, shape, strict=True) if a in inputs])) or 1


def random_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Params:
    """Random parameters with realistic activation magnitudes, drawn on the host with numpy."""
    rng = np.random.default_rng(seed)
    shapes = abstract_params(config, jnp.float32)
    axes = logical_axes(config)

    def draw(path, leaf, spec):
        name = str(path[-1].key)
        z = rng.standard_normal(leaf.shape, dtype=np.float32)
        if name == "scale":  # RMSNorm
            value = 1.0 + 0.2 * z
        elif name == "sinks":
            value = z
        elif name.endswith("_bias"):
            value = 0.1 * z
        elif name == "embedding":
            value = z
        else:
            value = z * (_GAINS.get(name, 1.0) / np.sqrt(_fan_in(name, tuple(spec), leaf.shape)))
        keep_f32 = name == "scale"
        return jnp.asarray(value, jnp.float32 if keep_f32 else dtype)

    return jax.tree_util.tree_map_with_path(draw, shapes, axes, is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
