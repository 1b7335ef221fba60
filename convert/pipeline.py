"""Plan (check every tensor against the config from headers alone), then stream item by item.

Nothing is written before the whole plan checks out; the output is assembled in a hidden sibling
folder and renamed into place only when complete, so a failed or interrupted run leaves no
checkpoint behind.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
from collections import defaultdict
from typing import Callable

import ml_dtypes
import numpy as np

import gptoss_jax
from gptoss_jax import ModelConfig, formats
from gptoss_jax.checkpoint import item_names, item_spec, save_item, write_metadata
from gptoss_jax.mxfp4 import unpack_experts

from .sources import SourceError, TensorInfo, read_config_json, read_tensor, scan

_FLOAT_DTYPES = {"BF16", "F32"}
_STORE_DTYPE = {"mxfp4": np.dtype(ml_dtypes.bfloat16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float32": np.dtype(np.float32)}


class ConversionError(ValueError):
    """Conversion refused or failed; the message is one line naming the file and tensor."""


@dataclasses.dataclass
class Plan:
    source: str
    config: ModelConfig
    layout: str
    storage: str  # expert storage: mxfp4 (packed), bfloat16 or float32
    rules: list[formats.Rule]
    tensors: dict[str, TensorInfo]

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


@dataclasses.dataclass
class Summary:
    layout: str
    storage: str
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float


def _check_sources(plan_rules, tensors, config_path: str) -> None:
    missing, consumed = [], set()
    for rule in plan_rules:
        for src in rule.sources:
            info = tensors.get(src.name)
            if info is None:
                missing.append(src.name)
                continue
            consumed.add(src.name)
            if info.shape != src.shape:
                raise ConversionError(f"{info.file}: tensor {src.name} has shape {list(info.shape)}, but "
                                      f"{config_path} implies {list(src.shape)}")
            ok = info.dtype == "U8" if src.kind == formats.UINT8 else info.dtype in _FLOAT_DTYPES
            if not ok:
                want = "U8" if src.kind == formats.UINT8 else " or ".join(sorted(_FLOAT_DTYPES))
                raise ConversionError(f"{info.file}: tensor {src.name} has dtype {info.dtype}, expected {want}")
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more}, "
                              f"required by {config_path}")
    unknown = sorted(set(tensors) - consumed)
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise ConversionError(f"{tensors[unknown[0]].file}: unknown tensor(s) {', '.join(unknown[:3])}{more}")


def plan_conversion(source: str, dtype: str | None = None) -> Plan:
    """Read config.json and every header; check every tensor; decide the expert storage."""
    source = os.path.abspath(source)
    if not os.path.isdir(source):
        raise ConversionError(f"{source}: source directory not found")
    try:
        raw = read_config_json(source)
        config = ModelConfig.from_json(os.path.join(source, "config.json"))
        tensors = scan(source)
    except (SourceError, ValueError) as e:
        raise ConversionError(str(e)) from None
    layout = formats.detect_layout(raw, tensors)
    packed = layout != formats.HF_BF16
    if dtype is None:
        dtype = "mxfp4" if packed else "bfloat16"
    if dtype not in _STORE_DTYPE:
        raise ConversionError(f"--dtype must be one of mxfp4, bfloat16, float32; got {dtype!r}")
    if dtype == "mxfp4" and not packed:
        raise ConversionError(f"{source}: the {layout} layout holds decoded experts; --dtype mxfp4 would "
                              f"need quantization, which this converter does not do (use bfloat16 or float32)")
    plan_rules = formats.rules(config, layout)
    _check_sources(plan_rules, tensors, os.path.join(source, "config.json"))
    return Plan(source, config, layout, dtype, plan_rules, tensors)


def _convert_rule(rule: formats.Rule, arrays: list[np.ndarray], storage: str) -> list[tuple[str, object]]:
    if rule.packed:
        blocks, scales = arrays
        value = ({"blocks": blocks, "scales": scales} if storage == "mxfp4"
                 else unpack_experts(blocks, scales, "float32" if storage == "float32" else "bfloat16"))
        return [(rule.targets[0], value)]
    outputs = rule.to_ours(*arrays)
    converted = []
    for target, out in zip(rule.targets, outputs, strict=True):
        dtype = np.float32 if target.endswith("/scale") else _STORE_DTYPE[storage]  # norm scales: float32
        converted.append((target, np.ascontiguousarray(out.astype(dtype, copy=False))))
    return converted


def _insert(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    if leaf in tree:
        raise ConversionError(f"parameter {path} produced twice")
    tree[leaf] = value


def _shapes(tree):
    if isinstance(tree, dict):
        return {k: _shapes(v) for k, v in tree.items()}
    return (tuple(tree.shape), np.dtype(tree.dtype))


def _write_all(plan: Plan, directory: str, progress: Callable[[int], None]) -> Summary:
    start = time.perf_counter()
    by_item = defaultdict(list)
    for rule in plan.rules:
        by_item[rule.item].append(rule)
    bytes_read = bytes_written = 0
    for name in item_names(plan.config):
        tree: dict = {}
        for rule in by_item[name]:
            arrays = []
            for src in rule.sources:
                info = plan.tensors[src.name]
                try:
                    arrays.append(read_tensor(info, src.name))
                except SourceError as e:
                    raise ConversionError(str(e)) from None
                bytes_read += info.nbytes
                progress(info.nbytes)
            for target, value in _convert_rule(rule, arrays, plan.storage):
                _insert(tree, target, value)
            del arrays  # the sources are no longer needed: free them before the item is saved
        expected = _shapes(item_spec(plan.config, plan.storage, name))
        if _shapes(tree) != expected:
            raise ConversionError(f"item {name}: converted tensors {_shapes(tree)} do not match {expected}")
        bytes_written += sum(x.nbytes for x in _leaves(tree))
        save_item(directory, name, tree)
    write_metadata(directory, plan.config, converter_version=_version(), source_layout=plan.layout,
                   expert_storage=plan.storage, source=plan.source)
    return Summary(plan.layout, plan.storage, len(plan.tensors), bytes_read, bytes_written,
                   time.perf_counter() - start)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree


def _version() -> str:
    from . import __version__

    return f"convert {__version__} (gptoss_jax {gptoss_jax.__version__})"


def check_output(output: str, overwrite: bool, source: str | None = None) -> str:
    output = os.path.abspath(output)
    if source is not None and os.path.commonpath([output, os.path.abspath(source)]) == os.path.abspath(source):
        raise ConversionError(f"{output}: the output must not be inside the source folder")
    if os.path.exists(output) and not overwrite:
        raise ConversionError(f"{output}: already exists; pass --overwrite to replace it")
    if os.path.exists(output) and not os.path.isdir(output):
        raise ConversionError(f"{output}: exists and is not a directory")
    return output


def write_checkpoint(plan: Plan, output: str, *, overwrite: bool = False,
                     progress: Callable[[int], None] = lambda n: None) -> Summary:
    """Stream the plan into `output`, which appears only once complete."""
    output = check_output(output, overwrite, plan.source)
    parent = os.path.dirname(output)
    os.makedirs(parent, exist_ok=True)
    partial = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.partial-", dir=parent)
    try:
        summary = _write_all(plan, partial, progress)
        if os.path.exists(output):  # --overwrite: swap, then delete the old one
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.old-", dir=parent)
            os.rename(output, os.path.join(old, "checkpoint"))
            os.rename(partial, output)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(partial, output)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return summary


def convert_checkpoint(source: str, output: str, *, dtype: str | None = None, overwrite: bool = False,
                       progress: Callable[[int], None] = lambda n: None) -> Summary:
    """Plan and write in one call (the CLI does the same with a progress bar)."""
    check_output(output, overwrite, source)
    return write_checkpoint(plan_conversion(source, dtype), output, overwrite=overwrite, progress=progress)
