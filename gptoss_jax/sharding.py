"""Sharding, declared once: logical axis names -> mesh axes, and everything derived from that table.

The mesh has three axes:
- `data`:   the batch (sequences) is split; everything else is replicated along it.
- `expert`: the experts are split (each device holds num_experts / expert of them).
- `tensor`: attention heads, the expert intermediate dimension and the vocabulary are split.

Every weight names its axes (weight.py); activations and the KV cache name theirs where they are
created. `RULES` maps each logical name to a mesh axis (or to None: replicated). Shardings of
parameters (params.py, which traces the model for their axes), cache and activations all come from
`spec()`; no PartitionSpec is written by hand.

Axes in `WHERE_DIVISIBLE` fall back to replication when the mesh axis does not divide them (a batch
of 1 on data=2, 8 KV heads on tensor=16, a fine-tuned model's vocabulary of 283 ids on tensor=2; the
published vocabularies divide by 64); `describe` says which of the model's do. Any other axis that
does not divide is an error (the experts: splitting them is the point of `expert`), raised by
`params.check_mesh` before anything is loaded.

Training adds a second table, `STATE_RULES`, for what is trained and its optimizer state: the same
rules with the model's width (`embed`) split over `data` as well (fully sharded data parallelism:
each data-parallel group holds 1/data of the float32 master weights or adapters and of AdamW's
moments; each step gathers them to the compute layout that `RULES` gives).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .config import ModelConfig
from .layout import MESH_AXES, check_sizes, default_sizes, format_sizes
from .mxfp4 import MXFP4, packed
from .weight import packed_axes, path_name

# Logical axis -> mesh axis (None: replicated). Parameters use the names of ModelConfig.axis_sizes();
# activations and the KV cache add batch, seq, cache_slots, kv_pages, page_slots and act_embed.
RULES: dict[str, str | None] = {
    "batch": "data",
    "seq": None,
    "cache_slots": None,
    "kv_pages": None,  # the paged cache's pool (paged_cache.py): every page on every device
    "page_slots": None,
    "vocab": "tensor",
    "embed": None,
    "act_embed": None,
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "qkv": None,  # the fused q, k, v weight splits over its KV heads (attention.py)
    "head_dim": None,
    "experts": "expert",
    "mlp_fused": "tensor",
    "mlp": "tensor",
    "block_bytes": None,  # the 16 bytes of an MXFP4 block; `<axis>_blocks` (whole blocks) follow <axis>
    "lora": None,  # a LoRA adapter's rank (training/lora.py)
    "adapters": None,  # a table's served adapters (training/lora.empty_table): every one on every device
}
WHERE_DIVISIBLE = frozenset({"batch", "kv_heads", "vocab"})

# What is trained (adapters, or float32 master weights) and its optimizer state: as RULES, with the
# width also split over `data`, where it divides (training/placement.py).
STATE_RULES: dict[str, str | None] = {**RULES, "embed": "data"}
STATE_WHERE_DIVISIBLE = WHERE_DIVISIBLE | {"embed"}


def _rule(name: str, rules: Mapping[str, str | None]) -> str | None:
    if name.endswith("_blocks") and name not in rules:  # a packed weight's blocks along <axis>
        name = name[: -len("_blocks")]
    try:
        return rules[name]
    except KeyError:
        raise ValueError(f"logical axis {name!r} has no sharding rule (known: {', '.join(rules)})") from None


def spec(axes: Sequence[str], shape: Sequence[int], mesh: Mesh | Mapping[str, int], *,
         what: str = "array", state: bool = False) -> PartitionSpec:
    """The PartitionSpec of an array with these logical axes and shape on this mesh (or on a mesh of
    these axis sizes); state=True: by STATE_RULES (what is trained and its optimizer state).

    Raises ValueError when a mesh axis does not divide the dimension it splits (except for the
    axes in WHERE_DIVISIBLE, which are then replicated) or when two axes map to one mesh axis.
    """
    rules, divisible = (STATE_RULES, STATE_WHERE_DIVISIBLE) if state else (RULES, WHERE_DIVISIBLE)
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    out: list[str | None] = []
    for name, size in zip(axes, shape, strict=True):
        mesh_axis = _rule(name, rules)
        if mesh_axis is None or sizes[mesh_axis] == 1:
            out.append(None)
            continue
        n = sizes[mesh_axis]
        if size % n:
            if name in divisible:
                out.append(None)
                continue
            if name.endswith("_blocks"):
                raise ValueError(f"{mesh_axis}={n} does not divide the {size} MXFP4 blocks (of 32 values) along "
                                 f"{name[: -len('_blocks')]} of {what}")
            raise ValueError(f"{mesh_axis}={n} does not divide the {size} {name} of {what}")
        if mesh_axis in out:
            raise ValueError(f"{what}: two of its axes ({', '.join(axes)}) map to the mesh axis {mesh_axis!r}")
        out.append(mesh_axis)
    return PartitionSpec(*out)


def weight_spec(axes: Sequence[str], weight, mesh: Mesh | Mapping[str, int], *, what: str) -> PartitionSpec | MXFP4:
    """`spec` of a weight (an array, or its jax.ShapeDtypeStruct) with these logical axes; of an
    MXFP4-packed weight, an MXFP4 of its blocks' and scales' specs, split as the weight would be."""
    if packed(weight):
        return MXFP4(*(spec(tuple(part_axes), part.shape, mesh, what=f"{what}/{field}")
                       for field, part_axes, part in zip(MXFP4._fields, packed_axes(tuple(axes)), weight)))
    return spec(axes, weight.shape, mesh, what=what)


def sharding(axes: Sequence[str], shape: Sequence[int], mesh: Mesh, *, what: str = "array",
             state: bool = False) -> NamedSharding:
    return NamedSharding(mesh, spec(axes, shape, mesh, what=what, state=state))


def constrain(x: Any, axes: Sequence[str], mesh: Mesh | None) -> Any:
    """Pin an activation's layout inside jit (a no-op without a mesh). Over a pytree, a leaf of fewer
    axes takes the leading ones (FP8 storage's exponents, one per vector of keys)."""
    if mesh is None:
        return x
    return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, sharding(axes[:a.ndim], a.shape, mesh)), x)


# Meshes ---------------------------------------------------------------------------------------------

def make_mesh(data: int | None = None, expert: int | None = None, tensor: int | None = None, *,
              config: ModelConfig | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """A (data, expert, tensor) mesh over `devices` (default: every device of every process).

    Axes not given are 1; with none given, `config` picks the default layout (layout.default_sizes:
    the same one the command line uses). The product must equal the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "expert": expert, "tensor": tensor}
    if all(v is None for v in sizes.values()):
        if config is None:
            raise ValueError("make_mesh needs axis sizes (data=, expert=, tensor=) or a config for the default layout")
        local = sum(d.process_index == devices[0].process_index for d in devices)
        sizes = default_sizes(config, len(devices), local)
    sizes = {k: 1 if v is None else v for k, v in sizes.items()}
    check_sizes(sizes, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)


# The KV cache -------------------------------------------------------------------------------------

CACHE_AXES = ("batch", "cache_slots", "kv_heads", "head_dim")


def cache_shardings(cache_shapes: Any, mesh: Mesh) -> Any:
    """NamedShardings for a KV cache pytree (cache.py): lengths on `data`, k and v by CACHE_AXES (FP8
    storage's exponents by its leading three)."""
    def one(path, leaf):
        axes = ("batch",) if path[0].key == "lengths" else CACHE_AXES[:len(leaf.shape)]  # (FP8 adds a level)
        return sharding(axes, leaf.shape, mesh, what=f"KV cache {path_name(path)}")

    return jax.tree_util.tree_map_with_path(one, cache_shapes)


def mesh_of(tree: Any) -> Mesh | None:
    """The mesh a pytree of arrays is laid out on (None: one device, or not laid out on a mesh)."""
    leaves = jax.tree.leaves(tree)
    s = getattr(leaves[0], "sharding", None) if leaves else None
    return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def bytes_per_device(tree: Any) -> dict[Any, int]:
    """Bytes each device holds of a pytree of arrays (its addressable shards)."""
    out: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            out[shard.device] = out.get(shard.device, 0) + shard.data.size * shard.data.dtype.itemsize
    return out


def replicated_model_axes(config: ModelConfig, mesh: Mesh | Mapping[str, int]) -> list[str]:
    """The model's axes that fall back to replication on this mesh, as "vocab (283 on tensor=2)"."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    model = config.axis_sizes()
    return [f"{name} ({model[name]} on {axis}={sizes[axis]})" for name in sorted(WHERE_DIVISIBLE)
            if name in model and (axis := RULES[name]) and sizes[axis] > 1 and model[name] % sizes[axis]]


def describe(mesh: Mesh, config: ModelConfig | None = None) -> str:
    """One line: "data=1,expert=1,tensor=2 over 2 gpu devices (1 process)", and with a config the axes
    kept whole because the mesh does not divide them: "; replicated: vocab (283 on tensor=2)"."""
    sizes = {a: mesh.shape[a] for a in MESH_AXES}
    platform = mesh.devices.flat[0].platform
    processes = len({d.process_index for d in mesh.devices.flat})
    line = (f"{format_sizes(sizes)} over {mesh.size} {platform} device{'s' * (mesh.size != 1)} "
            f"({processes} process{'es' * (processes != 1)})")
    whole = replicated_model_axes(config, mesh) if config is not None else []
    return line + (f"; replicated: {', '.join(whole)}" if whole else "")


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def everywhere(x: jax.Array, mesh: Mesh | None) -> jax.Array:
    """Inside jit: x on every device of the mesh (sampled tokens and their logits, so that every
    process can read them and each step's inputs keep one layout); a no-op without a mesh."""
    return x if mesh is None else jax.lax.with_sharding_constraint(x, replicated(mesh))


def zeros_on_devices(shapes: Any, shardings: Any = None) -> Any:
    """Zeros for a pytree of `jax.ShapeDtypeStruct`s, made on the devices where `shardings` (a matching
    pytree, or None: the default device) lays them out, with no host copy. The jitted maker of each
    shapes-and-layout is kept, so a repeated call traces and compiles nothing."""
    leaves, tree = jax.tree.flatten(shapes)
    specs = tuple((tuple(s.shape), jnp.dtype(s.dtype)) for s in leaves)
    layout = None if shardings is None else tuple(jax.tree.leaves(shardings))
    return jax.tree.unflatten(tree, _zeros_maker(specs, layout)())


@functools.lru_cache(maxsize=32)
def _zeros_maker(specs: tuple, layout: tuple | None):
    return jax.jit(lambda: [jnp.zeros(shape, dtype) for shape, dtype in specs],
                   out_shardings=None if layout is None else list(layout))


def on_every_device(x, mesh: Mesh | None):
    """A host value (numpy, a scalar) on the devices, as a jitted step's input that can be passed
    again without another copy (the decode calls' seed, stop mask and limit). On a mesh it goes to every
    device (every process passes the same value), since with several processes jit takes no host
    value; without one, to the default device."""
    x = np.asarray(x)
    return jax.device_put(x) if mesh is None else jax.device_put(x, replicated(mesh))


def to_host_soon(tokens):
    """Queue the copy of a step's tokens (an array, or a pytree of them) to the host right behind the
    step, rather than when the host asks for them (which cost the GPU about 0.7 ms of idling after a
    prompt); -> tokens."""
    for x in jax.tree.leaves(tokens):
        if x.is_fully_addressable:  # several processes: each reads its replica when asked
            x.copy_to_host_async()
    return tokens


# Diagnostics --------------------------------------------------------------------------------------

_COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "reduce-scatter", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def collectives(hlo_text: str) -> list[tuple[str, int, str]]:
    """(op, result bytes, result type) of every collective in compiled HLO text, largest first."""
    found = []
    pattern = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        types = re.findall(r"(\w+)\[([\d,]*)\]", m.group(1))
        size = sum(_DTYPE_BYTES.get(t, 4) * math.prod(int(d) for d in dims.split(",") if d) for t, dims in types)
        found.append((m.group(2), size, m.group(1).strip()))
    return sorted(found, key=lambda f: -f[1])
