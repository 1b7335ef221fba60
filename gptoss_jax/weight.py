"""One weight, declared once: the `Weight` row and what the layers do with it.

Each module declares each of its weights once, in a class-level `WEIGHTS` table of `Weight`s
(logical axis names + initializer). `declare` turns a row into a linen parameter whose shape comes
from `ModelConfig.axis_sizes()`, boxed with its logical axis names so that `jax.eval_shape` of
`init` yields abstract shapes, dtypes and partitioning in one pytree, without allocating (params.py
does that, above the model). Rows marked `packable` (the expert matrices) may instead be held
MXFP4-packed, as published; rows with `inputs` may carry a low-rank adapter (training/lora.py).

This module knows nothing of the model: the layers import it, never the other way round.
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
from .mxfp4 import MXFP4, packed

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
    # with the dtype "mxfp4" it is held as an `mxfp4.MXFP4` and decoded where it is used.
    packable: bool = False
    # The input axes that x @ W contracts, on a weight that may carry a low-rank adapter
    # (training/lora.py); empty: not adaptable.
    inputs: tuple[str, ...] = ()

    def shape(self, config: ModelConfig) -> tuple[int, ...]:
        sizes = config.axis_sizes()
        return tuple(sizes[a] for a in self.axes)

    def adapter_axes(self) -> dict[str, tuple[str, ...]]:
        """Logical axes of this weight's adapter {"a", "b"}: a = [experts] + inputs + (lora,),
        b = [experts] + (lora,) + outputs, where a leading `experts` axis gives one adapter per expert."""
        if not self.inputs:
            raise ValueError(f"a weight with axes {self.axes} declares no input axes, so it takes no adapter")
        lead = self.axes[:1] if self.axes[0] == "experts" else ()
        outputs = tuple(a for a in self.axes if a not in self.inputs and a not in lead)
        return {"a": lead + self.inputs + ("lora",), "b": lead + ("lora",) + outputs}


def declare(module: nn.Module, name: str) -> jax.Array | MXFP4:
    """Create (at init) or fetch (at apply) the parameter `name` of `module.WEIGHTS`; a packable
    weight held packed comes back as its `MXFP4`."""
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


def is_table(spec: Weight, held: dict) -> bool:
    """Whether `held`, the adapter of the weight `spec` declares, is a table of served adapters (a
    leading axis more than one adapter has) rather than one adapter."""
    return held["a"].ndim > len(spec.adapter_axes()["a"])


def low_rank(module: nn.Module, name: str, x: jax.Array, down: str, up: str, rows: jax.Array | None = None):
    """(x @ a) @ b for weight `name`'s adapter, by the einsums `down` (x, a -> r) and `up` (r, b ->
    out); 0 without one.

    A table of L served adapters ({"a": [L, ...], "b": [L, ...]}, training/lora.attach_table) is
    read with `rows` [B] int32: row i of x (its leading axis) takes adapter rows[i], none where
    negative (without rows: none, the base model): every adapter's low-rank product is computed (r
    is small) and each row keeps its own, so rows of any adapters share one program."""
    held = adapter(module, name)
    if held is None:
        return 0.0
    a, b = held["a"].astype(x.dtype), held["b"].astype(x.dtype)
    if not is_table(module.WEIGHTS[name] if name in module.WEIGHTS else module.PARTS[name], held):
        return jnp.einsum(up, jnp.einsum(down, x, a), b)
    if rows is None:
        return 0.0
    (x_in, a_in), r_out = (part.split(",") if "," in part else part for part in down.split("->"))
    low = jnp.einsum(f"{x_in},l{a_in}->{r_out[:-1]}l{r_out[-1]}", x, a)  # [rows, .., L, r]
    pick = jax.nn.one_hot(rows, a.shape[0], dtype=x.dtype)  # [rows, L]: zeros for none
    low = low * pick.reshape(pick.shape[:1] + (1,) * (low.ndim - 3) + pick.shape[1:] + (1,))
    (r_in, b_in), out = (part.split(",") if "," in part else part for part in up.split("->"))
    return jnp.einsum(f"{r_in[:-1]}l{r_in[-1]},l{b_in}->{out}", low, b)


Params = dict[str, Any]


def packed_axes(axes: tuple[str, ...]) -> MXFP4:
    """Logical axes of a packed weight with these axes, as an MXFP4 of the blocks' and the scales':
    the input axis becomes `<input>_blocks` (whole 32-value blocks, split as the input axis is) and
    each block's 16 bytes `block_bytes`."""
    *lead, inp = axes
    return MXFP4(blocks=PartitionSpec(*lead, f"{inp}_blocks", "block_bytes"),
                 scales=PartitionSpec(*lead, f"{inp}_blocks"))


def param_count(params: Params) -> int:
    """Number of scalars in a (possibly abstract) parameter pytree."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


def _key(p) -> Any:
    """A key path entry's key: a dict's key, or a field's name (an MXFP4's blocks and scales)."""
    return p.name if isinstance(p, jax.tree_util.GetAttrKey) else p.key


def at_path(tree: Any, path) -> Any:
    """The subtree of `tree` at a key path (as jax.tree_util's *_with_path functions give them)."""
    for p in path:
        tree = getattr(tree, p.name) if isinstance(p, jax.tree_util.GetAttrKey) else tree[p.key]
    return tree


def path_name(path) -> str:
    """A key path as "block_0/mlp/mlp1_weight" (an MXFP4's part: ".../mlp1_weight/blocks")."""
    return "/".join(str(_key(p)) for p in path)
