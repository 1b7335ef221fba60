"""Weight declarations and everything derived from them: shapes, init, logical axes, counts.

Each module declares each of its weights once, in a class-level `WEIGHTS` table of `Weight`s
(logical axis names + initializer). `declare` turns a row into a linen parameter whose shape comes
from `ModelConfig.axis_sizes()`, boxed with its logical axis names so that `jax.eval_shape` of
`init` yields abstract shapes, dtypes and partitioning in one pytree, without allocating.
Rows marked `packable` (the expert matrices) may instead be held MXFP4-packed, as published:
`abstract_params(..., experts="mxfp4")` and `logical_axes(..., experts="mxfp4")` describe that form.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from .config import ModelConfig
from .mxfp4 import packed, packed_shape

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
    # An expert matrix the published checkpoints ship in MXFP4, packed along its last (input) axis:
    # with experts="mxfp4" it is held as {"blocks", "scales"} (mxfp4.py) and decoded where it is used.
    packable: bool = False

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = config.axis_sizes()
        return tuple(sizes[a] for a in self.axes)


def declare(module: nn.Module, name: str) -> jax.Array | dict:
    """Create (at init) or fetch (at apply) the parameter `name` of `module.WEIGHTS`; a packable
    weight held packed comes back as its {"blocks", "scales"}."""
    spec: Weight = module.WEIGHTS[name]
    if spec.packable and module.has_variable("params", name):
        held = module.get_variable("params", name)
        if packed(held):
            return held
    dtype = jnp.float32 if spec.float32 else module.param_dtype
    init = nn.with_logical_partitioning(_INITIALIZERS[spec.init], spec.axes)
    return module.param(name, init, spec.shape(module.config), dtype)


def adapter(module: nn.Module, name: str) -> dict | None:
    """The low-rank adapter {"a", "b"} held next to weight `name` (as `<name>_lora`), or None.

    Adapters are optional parameters (training/lora.py declares and trains them): a projection
    x @ W gains (x @ a) @ b, with the LoRA scale already folded into b.
    """
    key = f"{name}_lora"
    return module.get_variable("params", key) if module.has_variable("params", key) else None


def low_rank(module: nn.Module, name: str, x: jax.Array, down: str, up: str):
    """(x @ a) @ b for weight `name`'s adapter, by the einsums `down` and `up`; 0 without one."""
    held = adapter(module, name)
    if held is None:
        return 0.0
    return jnp.einsum(up, jnp.einsum(down, x, held["a"].astype(x.dtype)), held["b"].astype(x.dtype))


Params = dict[str, Any]


def _model(config: ModelConfig, dtype):
    from .model import Transformer  # local import: model.py imports this module

    return Transformer(config, param_dtype=jnp.dtype(dtype))


def _init_tokens():
    # Two tokens are enough to trace every parameter into existence.
    return jnp.zeros((1, 2), jnp.int32)


EXPERT_FORMATS = (None, "mxfp4")  # experts as the other weights (dtype), or packed


def packable_names() -> frozenset[str]:
    """Names of the weights that may be held packed (Weight.packable)."""
    from .moe import MLPBlock  # local import: moe.py imports this module

    return frozenset(name for name, w in MLPBlock.WEIGHTS.items() if w.packable)


def check_experts(experts) -> None:
    if experts not in EXPERT_FORMATS:
        raise ValueError(f"experts must be None (the parameters' dtype) or 'mxfp4', got {experts!r}")


def _pack(tree: Params, one) -> Params:
    """Replace each packable weight's leaf by one(leaf) (a {"blocks", "scales"} node)."""
    names = packable_names()
    return jax.tree_util.tree_map_with_path(lambda p, x: one(x) if str(p[-1].key) in names else x, tree,
                                            is_leaf=lambda x: isinstance(x, (jax.ShapeDtypeStruct, PartitionSpec)))


def packed_axes(axes: tuple[str, ...]) -> dict:
    """Logical axes of a packed weight with these axes: the input axis becomes `<input>_blocks` (whole
    32-value blocks, split as the input axis is) and each block's 16 bytes `block_bytes`."""
    *lead, inp = axes
    return {"blocks": PartitionSpec(*lead, f"{inp}_blocks", "block_bytes"),
            "scales": PartitionSpec(*lead, f"{inp}_blocks")}


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> Params:
    """Random parameters (normal(0.02) matrices and sinks, zero biases, unit norm scales)."""
    boxed = jax.jit(lambda k: _model(config, dtype).init(k, _init_tokens()))(key)
    return nn.unbox(boxed["params"])


def _abstract_boxed(config: ModelConfig, dtype) -> Params:
    """Abstract parameters still boxed with their logical axis names (one trace, no allocation)."""
    return jax.eval_shape(lambda: _model(config, dtype).init(jax.random.key(0), _init_tokens()))["params"]


def abstract_params(config: ModelConfig, dtype=jnp.bfloat16, *, experts: str | None = None) -> Params:
    """`jax.ShapeDtypeStruct` for every parameter; nothing is allocated. experts="mxfp4": the
    packable expert matrices as {"blocks": uint8 [..., in/32, 16], "scales": uint8 [..., in/32]}."""
    check_experts(experts)
    tree = nn.unbox(_abstract_boxed(config, dtype))
    if experts is None:
        return tree

    def one(leaf):
        blocks, scales = packed_shape(leaf.shape)
        return {"blocks": jax.ShapeDtypeStruct(blocks, jnp.uint8), "scales": jax.ShapeDtypeStruct(scales, jnp.uint8)}

    return _pack(tree, one)


def logical_axes(config: ModelConfig, *, experts: str | None = None) -> Params:
    """A pytree of `jax.sharding.PartitionSpec` of logical axis names, shaped like the params."""
    check_experts(experts)
    tree = nn.get_partition_spec(_abstract_boxed(config, jnp.float32))
    return tree if experts is None else _pack(tree, lambda spec: packed_axes(tuple(spec)))


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
