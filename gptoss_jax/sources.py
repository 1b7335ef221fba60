"""Reading a source folder: its config.json and the headers and tensors of its safetensors files.

Only JSON and safetensors are read (no pickle, nothing executable). Every error names the file and,
where there is one, the tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"


class SourceError(ValueError):
    """A problem with the source checkpoint; the message names the file and tensor."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: BF16, F32, U8, ...

    @property
    def nbytes(self) -> int:
        size = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "U8": 1, "I8": 1, "I32": 4, "I64": 8}.get(self.dtype, 4)
        return int(np.prod(self.shape, dtype=np.int64)) * size


def read_config_json(source: str) -> dict:
    path = os.path.join(source, "config.json")
    if not os.path.isfile(path):
        raise SourceError(f"{path}: config.json not found (is {source} a GPT-OSS checkpoint folder?)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise SourceError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SourceError(f"{path}: expected a JSON object")
    return raw


def _safetensors_files(source: str) -> list[str]:
    index_path = os.path.join(source, INDEX_FILE)
    if os.path.isfile(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise SourceError(f"{index_path}: not a valid safetensors index ({e})") from None
        files = sorted(set(weight_map.values()))
        for name in files:
            if not os.path.isfile(os.path.join(source, name)):
                raise SourceError(f"{index_path}: lists {name}, which is missing")
        return [os.path.join(source, name) for name in files]
    files = sorted(os.path.join(source, n) for n in os.listdir(source) if n.endswith(".safetensors"))
    if not files:
        raise SourceError(f"{source}: no .safetensors files")
    return files


def scan(source: str) -> dict[str, TensorInfo]:
    """Every tensor's file, shape and dtype, from the headers alone (truncated files are caught here)."""
    tensors: dict[str, TensorInfo] = {}
    for path in _safetensors_files(source):
        try:
            with safe_open(path, framework="numpy") as f:
                for name in f.keys():
                    s = f.get_slice(name)
                    if name in tensors:
                        raise SourceError(f"{path}: tensor {name} also appears in {tensors[name].file}")
                    tensors[name] = TensorInfo(path, tuple(s.get_shape()), s.get_dtype())
        except SafetensorError as e:
            raise SourceError(f"{path}: unreadable safetensors file ({e})") from None
    index_path = os.path.join(source, INDEX_FILE)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            weight_map = json.load(f)["weight_map"]
        for name, file in weight_map.items():
            if name not in tensors or os.path.basename(tensors[name].file) != file:
                raise SourceError(f"{index_path}: maps tensor {name} to {file}, which does not hold it")
    return tensors


def read_tensor(info: TensorInfo, name: str) -> np.ndarray:
    try:
        with safe_open(info.file, framework="numpy") as f:
            return f.get_tensor(name)
    except SafetensorError as e:
        raise SourceError(f"{info.file}: cannot read tensor {name} ({e})") from None
