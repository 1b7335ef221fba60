"""Mesh layouts as plain numbers (no JAX): the axis names, parsing `--mesh`, checks, the default.

The command line checks a requested layout with these before JAX starts; sharding.py turns a
layout into a `jax.sharding.Mesh`.
"""

from __future__ import annotations

import math

from .config import ModelConfig

MESH_AXES = ("data", "expert", "tensor")


def check_sizes(sizes: dict[str, int], num_devices: int) -> None:
    """Axis names known, sizes positive, product = the device count; one-line errors."""
    for name, size in sizes.items():
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r}; the axes are {', '.join(MESH_AXES)}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"mesh axis {name} must be a positive integer, got {size!r}")
    product = math.prod(sizes.values())
    if product != num_devices:
        raise ValueError(f"mesh {format_sizes(sizes)} spans {product} device{'s' * (product != 1)}, but there "
                         f"{'are' if num_devices != 1 else 'is'} {num_devices}")


def parse_mesh(text: str) -> dict[str, int]:
    """"data=2,expert=2,tensor=2" -> {"data": 2, "expert": 2, "tensor": 2} (names and values checked)."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or not name:
            raise ValueError(f"expected AXIS=SIZE pairs such as data=1,expert=2,tensor=4; got {text!r}")
        if name not in MESH_AXES:
            raise ValueError(f"unknown mesh axis {name!r}; the axes are {', '.join(MESH_AXES)}")
        if name in sizes:
            raise ValueError(f"mesh axis {name!r} is given twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise ValueError(f"mesh axis {name}: expected an integer, got {value.strip()!r}") from None
        if sizes[name] < 1:
            raise ValueError(f"mesh axis {name} must be at least 1, got {sizes[name]}")
    return {a: sizes.get(a, 1) for a in MESH_AXES}


def format_sizes(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in MESH_AXES if a in sizes)


def default_sizes(config: ModelConfig, num_devices: int, devices_per_process: int) -> dict[str, int]:
    """The layout used when none is asked for, suited to generation.

    `tensor` over the devices of one process, as far as it divides the query heads, the
    intermediate size and the vocabulary (one all-reduce per attention and per MoE block, over the
    fastest links, and every device reads an equal share of every selected expert, which is what
    bounds decode); then `expert` across processes as far as it divides the experts; `data` takes
    what is left.
    """
    def fits_tensor(t: int) -> bool:
        return all(n % t == 0 for n in (config.num_attention_heads, config.intermediate_size, config.vocab_size))

    tensor = max(t for t in range(1, devices_per_process + 1) if devices_per_process % t == 0 and fits_tensor(t))
    rest = num_devices // tensor
    expert = math.gcd(rest, config.num_experts)
    return {"data": rest // expert, "expert": expert, "tensor": tensor}
