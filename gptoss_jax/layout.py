"""Mesh layouts as plain numbers (no JAX): the axis names, parsing `--mesh`, checks, the default.

The command line checks a requested layout with these before JAX starts; sharding.py turns a
layout into a `jax.sharding.Mesh`.
"""

from __future__ import annotations

import math

from .config import ModelConfig
from .mxfp4 import split_dtype

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


def default_sizes(config: ModelConfig, num_devices: int, devices_per_process: int, *,
                  dtype="bfloat16") -> dict[str, int]:
    """The layout used when none is asked for, suited to generation.

    `expert` as far as it divides the experts: each device holds and reads only its experts, and
    the MoE costs one all-reduce of the tokens' outputs. On two NVIDIA H200s, gpt-oss-20b decodes
    faster so than with `tensor`=2 at batch 1 and 32 (docs/benchmarks.md). Then `tensor` over what
    is left within one process (it adds an all-reduce per attention block, best kept on the fastest
    links), as far as it divides the query heads, the intermediate size (for the parameters' dtype
    "mxfp4", packed experts: its blocks of 32) and the vocabulary; `data` takes the rest.
    """
    sizes = [config.num_attention_heads, config.intermediate_size, config.vocab_size]
    if split_dtype(dtype)[1]:
        sizes.append(config.intermediate_size // 32)

    def fits_tensor(t: int) -> bool:
        return all(n % t == 0 for n in sizes)

    expert = math.gcd(num_devices, config.num_experts)
    rest = num_devices // expert
    local = max(devices_per_process // math.gcd(devices_per_process, expert), 1)  # a process's share of `rest`
    tensor = max(t for t in range(1, rest + 1) if rest % t == 0 and local % t == 0 and fits_tensor(t))
    return {"data": rest // tensor, "expert": expert, "tensor": tensor}
