"""A converted checkpoint's JSON side: its format version, item list and model config.

Reading it needs neither JAX nor the weights, so command lines can check a checkpoint (and the
model's limits) before anything heavy starts. The arrays themselves are in checkpoint.py.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .config import ModelConfig

FORMAT_VERSION = 1
META_FILE = "gptoss_checkpoint.json"


def expand(path: str | os.PathLike) -> str:
    """A user-given path with `~` expanded."""
    return os.path.expanduser(os.fspath(path))


def item_names(config: ModelConfig) -> list[str]:
    return ["embedding"] + [f"block_{n}" for n in range(config.num_hidden_layers)] + ["final"]


def write_metadata(directory: str, config: ModelConfig, **fields: Any) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_json_dict(), f, indent=2)
    meta = {"format_version": FORMAT_VERSION, "items": item_names(config), **fields}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def read_metadata(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """(config, metadata) of a converted checkpoint; one-line errors naming the file."""
    path = expand(path)
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        what = "is not a directory" if os.path.exists(path) else "checkpoint directory not found"
        raise FileNotFoundError(f"{path}: {what}")
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path}: not a gptoss-jax checkpoint (no {META_FILE}); convert a published "
                         f"checkpoint first with `gptoss-convert` (or `python -m convert`)")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{meta_path}: not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        version = meta.get("format_version") if isinstance(meta, dict) else None
        raise ValueError(f"{meta_path}: format version {version!r}, this gptoss-jax reads version {FORMAT_VERSION}")
    return ModelConfig.from_json(os.path.join(path, "config.json")), meta
