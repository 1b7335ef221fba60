"""The model's parameter tree, found by tracing `model.Transformer` once: init, abstract shapes,
logical axes, and the layout of every weight on a mesh.

Each weight is declared once, in its module's `WEIGHTS` table (weight.py); tracing the model's
`init` with `jax.eval_shape` turns those tables into one pytree of shapes, dtypes and logical axis
names, without allocating. Everything here derives from that trace, so it sits above model.py:
- `init_params`, `abstract_params`, `logical_axes`: the tree itself (dtype "mxfp4": bfloat16, with
  the packable expert matrices as the `mxfp4.MXFP4` blocks and scales the published checkpoints hold);
- `param_specs`, `param_shardings`, `check_mesh`: each weight's layout on a mesh, by the rules of
  sharding.py (for the parameters of a dtype: "mxfp4" lays out the packed experts).
"""

from __future__ import annotations

import functools

from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelConfig
from .model.moe import MLPBlock
from .model.transformer import Transformer
from .mxfp4 import MXFP4, packed, packed_shape, split_dtype
from .sharding import weight_spec
from .weight import Params, at_path, path_name


def _model(config: ModelConfig, dtype) -> Transformer:
    return Transformer(config, param_dtype=jnp.dtype(dtype))


def _init_tokens():
    # Two tokens are enough to trace every parameter into existence.
    return jnp.zeros((1, 2), jnp.int32)


def packable_names() -> frozenset[str]:
    """Names of the weights that may be held packed (Weight.packable)."""
    return frozenset(name for name, w in MLPBlock.WEIGHTS.items() if w.packable)


def _pack(tree: Params, one) -> Params:
    """Replace each packable weight's leaf by one(leaf) (an MXFP4)."""
    names = packable_names()
    return jax.tree_util.tree_map_with_path(lambda p, x: one(x) if str(p[-1].key) in names else x, tree,
                                            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.bfloat16) -> Params:
    """Random parameters (normal(0.02) matrices and sinks, zero biases, unit norm scales)."""
    boxed = jax.jit(lambda k: _model(config, dtype).init(k, _init_tokens()))(key)
    return nn.unbox(boxed["params"])


def _abstract_boxed(config: ModelConfig, dtype) -> Params:
    """Abstract parameters still boxed with their logical axis names (no allocation)."""
    return _abstract_boxed_of(config, jnp.dtype(dtype))


@functools.cache
def _abstract_boxed_of(config: ModelConfig, dtype: jnp.dtype) -> Params:
    # One trace of the model's init per config and dtype in a process (gpt-oss-120b's takes 0.6 s on
    # a CPU; loading asks for the shapes and the axes several times). Callers get trees of immutable
    # leaves and build new trees from them (unbox, get_partition_spec, tree_map).
    return jax.eval_shape(lambda: _model(config, dtype).init(jax.random.key(0), _init_tokens()))["params"]


def abstract_params(config: ModelConfig, dtype=jnp.bfloat16) -> Params:
    """`jax.ShapeDtypeStruct` for every parameter; nothing is allocated. dtype "mxfp4": bfloat16, with
    the packable expert matrices as MXFP4(blocks uint8 [..., in/32, 16], scales uint8 [..., in/32])."""
    dtype, packs = split_dtype(dtype)
    tree = nn.unbox(_abstract_boxed(config, dtype))
    if not packs:
        return tree

    def one(leaf):
        blocks, scales = packed_shape(leaf.shape)
        return MXFP4(jax.ShapeDtypeStruct(blocks, jnp.uint8), jax.ShapeDtypeStruct(scales, jnp.uint8))

    return _pack(tree, one)


def logical_axes(config: ModelConfig) -> Params:
    """A pytree of `jax.sharding.PartitionSpec` of logical axis names, shaped like the params (each
    weight's own axes, packed or not: weight.packed_axes gives a packed one's blocks' and scales')."""
    return nn.get_partition_spec(_abstract_boxed(config, jnp.float32))


# Layout on a mesh -----------------------------------------------------------------------------------

def param_specs(config: ModelConfig, mesh: Mesh | Mapping[str, int], *, dtype=jnp.bfloat16) -> Any:
    """A PartitionSpec for every parameter of this dtype, shaped like the params (from their logical
    axes); dtype "mxfp4": for each packed expert, an MXFP4 of its blocks' and scales' specs, split
    along the axes of the weight they hold.

    Given axis sizes rather than a mesh, it only checks that the rules can split every parameter
    (ValueError otherwise), which is how the command line checks a --mesh before anything is loaded.
    """
    axes = logical_axes(config)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: weight_spec(tuple(at_path(axes, path)), leaf, mesh, what=path_name(path)),
        abstract_params(config, dtype), is_leaf=packed)


def check_mesh(config: ModelConfig, sizes: Mapping[str, int], *, dtype=jnp.bfloat16) -> None:
    """ValueError unless the rules can split every parameter of this dtype on a mesh of these sizes."""
    param_specs(config, sizes, dtype=dtype)


def param_shardings(config: ModelConfig, mesh: Mesh, *, dtype=jnp.bfloat16) -> Any:
    """A NamedSharding for every parameter of this dtype, shaped like the params (an MXFP4 of two
    for a packed expert: dtype "mxfp4")."""
    return jax.tree.map(lambda p: NamedSharding(mesh, p), param_specs(config, mesh, dtype=dtype),
                        is_leaf=lambda x: isinstance(x, PartitionSpec))
