"""Weight declarations and everything derived from them: shapes, init, logical axes, counts.

Each module declares each of its weights once, in a class-level `WEIGHTS` table of `Weight`s
(logical axis names + initializer). `declare` turns a row into a linen parameter whose shape comes
from `ModelConfig.axis_sizes()`, boxed with its logical axis names so that `jax.eval_shape` of
`init` yields abstract shapes, dtypes and partitioning in one pytree, without allocating.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig

_INITIALIZERS = {
    # Small-normal init for matrices and sinks (what HF uses, initializer_range 0.02).
    "normal": nn.initializers.normal(stddev=0.02),
    "zeros": nn.initializers.zeros_init(),
    "ones": nn.initializers.ones_init(),
}


@dataclasses.dataclass(frozen=True)
class Weight:
    """One weight: its logical axes (sizes from the config) and how to initialize it."""

    axes: tuple[str, ...]
    init: str = "normal"
    # RMSNorm scales stay float32 whatever the model dtype, as in both references.
    float32: bool = False

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = config.axis_sizes()
        return tuple(sizes[a] for a in self.axes)


def declare(module: nn.Module, name: str) -> jax.Array:
    """Create (at init) or fetch (at apply) the parameter `name` of `module.WEIGHTS`."""
    spec: Weight = module.WEIGHTS[name]
    dtype = jnp.float32 if spec.float32 else module.param_dtype
    init = nn.with_logical_partitioning(_INITIALIZERS[spec.init], spec.axes)
    return module.param(name, init, spec.shape(module.config), dtype)


Params = dict[str, Any]


def _model(config: ModelConfig, dtype):
    from .model import Transformer  # local import: model.py imports this module

    return Transformer(config, param_dtype=jnp.dtype(dtype))


def _init_tokens():
    # Two tokens are enough to trace every parameter into existence.
    return jnp.zeros((1, 2), jnp.int32)


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> Params:
    """Random parameters (normal(0.02) matrices and sinks, zero biases, unit norm scales)."""
    boxed = jax.jit(lambda k: _model(config, dtype).init(k, _init_tokens()))(key)
    return nn.unbox(boxed["params"])


def _abstract_boxed(config: ModelConfig, dtype) -> Params:
    """Abstract parameters still boxed with their logical axis names (one trace, no allocation)."""
    return jax.eval_shape(lambda: _model(config, dtype).init(jax.random.key(0), _init_tokens()))["params"]


def abstract_params(config: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """`jax.ShapeDtypeStruct` for every parameter; nothing is allocated."""
    return nn.unbox(_abstract_boxed(config, dtype))


def logical_axes(config: ModelConfig) -> Params:
    """A pytree of `jax.sharding.PartitionSpec` of logical axis names, shaped like the params."""
    return nn.get_partition_spec(_abstract_boxed(config, jnp.float32))


def param_count(params: Params) -> int:
    """Number of scalars in a (possibly abstract) parameter pytree."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def at_path(tree: Any, path) -> Any:
    """The subtree of `tree` at a key path (as jax.tree_util's *_with_path functions give them)."""
    for p in path:
        tree = tree[p.key]
    return tree


def path_name(path) -> str:
    """A key path as "block_0/mlp/mlp1_weight"."""
    return "/".join(str(p.key) for p in path)
