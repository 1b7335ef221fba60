"""The model's parameter tree, found by tracing `model.Transformer` once: init, abstract shapes,
logical axes, and the layout of every weight on a mesh.

Each weight is declared once, in its module's `WEIGHTS` table (weight.py); tracing the model's
`init` with `jax.eval_shape` turns those tables into one pytree of shapes, dtypes and logical axis
names, without allocating. Everything here derives from that trace, so it sits above model.py:
- `init_params`, `abstract_params`, `logical_axes`: the tree itself (experts="mxfp4": the
  packable expert matrices as the {"blocks", "scales"} the published checkpoints hold);
- `param_specs`, `param_shardings`, `check_mesh`: each weight's layout on a mesh, by the rules of
  sharding.py.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelConfig
from .model import Transformer
from .moe import MLPBlock
from .mxfp4 import packed_shape
from .sharding import spec
from .weight import Params, at_path, check_experts, packed_axes, path_name


def _model(config: ModelConfig, dtype) -> Transformer:
    return Transformer(config, param_dtype=jnp.dtype(dtype))


def _init_tokens():
    # Two tokens are enough to trace every parameter into existence.
    return jnp.zeros((1, 2), jnp.int32)


def packable_names() -> frozenset[str]:
    """Names of the weights that may be held packed (Weight.packable)."""
    return frozenset(name for name, w in MLPBlock.WEIGHTS.items() if w.packable)


def _pack(tree: Params, one) -> Params:
    """Replace each packable weight's leaf by one(leaf) (a {"blocks", "scales"} node)."""
    names = packable_names()
    return jax.tree_util.tree_map_with_path(lambda p, x: one(x) if str(p[-1].key) in names else x, tree,
                                            is_leaf=lambda x: isinstance(x, (jax.ShapeDtypeStruct, PartitionSpec)))


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


# Layout on a mesh -----------------------------------------------------------------------------------

def param_specs(config: ModelConfig, mesh: Mesh | Mapping[str, int], *, experts: str | None = None) -> Any:
    """A PartitionSpec for every parameter, shaped like the params (from their logical axes);
    experts="mxfp4": packed experts' blocks and scales, split along the axes of the weight they hold.

    Given axis sizes rather than a mesh, it only checks that the rules can split every parameter
    (ValueError otherwise), which is how the command line checks a --mesh before anything is loaded.
    """
    axes = logical_axes(config, experts=experts)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: spec(tuple(at_path(axes, path)), leaf.shape, mesh, what=path_name(path)),
        abstract_params(config, experts=experts))


def check_mesh(config: ModelConfig, sizes: Mapping[str, int], *, experts: str | None = None) -> None:
    """ValueError unless the rules can split every parameter on a mesh of these axis sizes."""
    param_specs(config, sizes, experts=experts)


def param_shardings(config: ModelConfig, mesh: Mesh, *, experts: str | None = None) -> Any:
    """A NamedSharding for every parameter, shaped like the params."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), param_specs(config, mesh, experts=experts),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))
