"""Where training's arrays live on a mesh (sharding.py's `data`, `expert` and `tensor` axes).

- The frozen base weights (LoRA) are laid out as for inference (`sharding.RULES`), as
  `load_checkpoint(..., mesh=mesh)` places them.
- What is trained (adapters, or full fine-tuning's float32 master weights) and AdamW's two moments
  are laid out by `sharding.STATE_RULES`: as the weights, with the model's width also split over
  `data` (fully sharded data parallelism). Each step gathers them to the compute layout
  (`compute_shardings`); their gradients come back reduced and split the same way.
- Batches [A, B, T] (micro-batches, sequences, positions) split their sequences over `data`, where
  `data` divides the batch.

Without a mesh (one device) every function here returns None and nothing moves.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from ..config import ModelConfig
from ..params import abstract_params, logical_axes as param_logical_axes
from ..sharding import replicated, sharding, spec
from ..weight import Params
from . import lora as lora_lib


def _is_axes(x) -> bool:
    return isinstance(x, (tuple, PartitionSpec))


def trainable_axes(config: ModelConfig, lora: lora_lib.LoraConfig | None) -> Params:
    """Logical axes of what is trained: the adapters' (LoRA) or every weight's (full fine-tuning)."""
    if lora is not None:
        return lora_lib.logical_axes(config, lora)
    return jax.tree.map(tuple, param_logical_axes(config), is_leaf=_is_axes)


def _abstract_trainable(config: ModelConfig, lora: lora_lib.LoraConfig | None) -> Params:
    if lora is not None:
        return jax.eval_shape(lambda: lora_lib.init_adapters(config, lora, jax.random.key(0)))
    return abstract_params(config, np.float32)


@functools.lru_cache(maxsize=16)  # traced into every step and eval: the model is traced for the shapes once
def trainable_shardings(config: ModelConfig, lora: lora_lib.LoraConfig | None, mesh: Mesh | None, *,
                        state: bool = True) -> Params | None:
    """NamedShardings of what is trained: by STATE_RULES (state=True, how it is kept between steps)
    or by RULES (state=False, how the model uses it within a step)."""
    if mesh is None:
        return None
    axes = trainable_axes(config, lora)
    return jax.tree.map(lambda a, leaf: sharding(a, leaf.shape, mesh, what="trained weight", state=state),
                        axes, _abstract_trainable(config, lora), is_leaf=_is_axes)


def compute_shardings(config: ModelConfig, lora: lora_lib.LoraConfig | None, mesh: Mesh | None) -> Params | None:
    return trainable_shardings(config, lora, mesh, state=False)


def opt_state_shardings(tx: optax.GradientTransformation, config: ModelConfig, lora: lora_lib.LoraConfig | None,
                        mesh: Mesh | None):
    """NamedShardings of the optimizer state: its copies of the trained tree (AdamW's moments) as
    that tree is kept, everything else (step counts) on every device."""
    if mesh is None:
        return None
    abstract = jax.eval_shape(tx.init, _abstract_trainable(config, lora))
    return optax.tree_map_params(tx, lambda _, s: s, abstract, trainable_shardings(config, lora, mesh),
                                 transform_non_params=lambda _: replicated(mesh),
                                 is_leaf=lambda x: isinstance(x, NamedSharding))


def place(tree, shardings):
    """A pytree of arrays moved into the given layout (shardings None: as it is)."""
    return tree if shardings is None else jax.device_put(tree, shardings)


def batch_sharding(shape: tuple[int, ...], mesh: Mesh | None) -> NamedSharding | None:
    """The layout of tokens or masks [A, B, T] (or [B, T]): sequences on `data` where it divides."""
    if mesh is None:
        return None
    lead = (None,) * (len(shape) - 2)
    return NamedSharding(mesh, PartitionSpec(*lead, *spec(("batch", "seq"), shape[-2:], mesh)))


def put_batch(x: np.ndarray, mesh: Mesh | None) -> jax.Array:
    """A host batch on the devices. With several processes each passes the same whole batch (the
    data order is the same everywhere) and its devices take their slices of it."""
    x = np.asarray(x)
    if mesh is None:
        return jax.device_put(x)
    return jax.make_array_from_callback(x.shape, batch_sharding(x.shape, mesh), lambda index: x[index])
