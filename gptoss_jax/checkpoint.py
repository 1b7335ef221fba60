"""gptoss-jax checkpoints: an Orbax checkpoint per item, written one item at a time.

    CHECKPOINT/
      gptoss_checkpoint.json   format version, converter version, source layout, expert storage, items
      config.json              the ModelConfig
      params/embedding/        Orbax checkpoints of {"embedding"}, {"block_N": ...} for each layer,
      params/block_N/          and {"norm", "unembedding"}: the converter streams item by item, so
      params/final/            memory stays near one layer's size
Expert weights are stored either decoded ([E, in, out], like the parameters) or, by default, packed
as published: `mlp1_weight` becomes {"blocks": uint8 [E, out, in/32, 16], "scales": uint8 [E, out, in/32]}
and is decoded when loaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from .config import ModelConfig
from .mxfp4 import unpack_experts
from .params import Params, abstract_params

FORMAT_VERSION = 1
META_FILE = "gptoss_checkpoint.json"
EXPERT_STORAGES = ("mxfp4", "bfloat16", "float32")
PACKED_WEIGHTS = ("mlp1_weight", "mlp2_weight")
_NP_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def item_names(config: ModelConfig) -> list[str]:
    return ["embedding"] + [f"block_{n}" for n in range(config.num_hidden_layers)] + ["final"]


def _item(params: Params, name: str) -> Params:
    if name == "final":
        return {"norm": params["norm"], "unembedding": params["unembedding"]}
    return {name: params[name]}


def storage_spec(config: ModelConfig, storage: str) -> Params:
    """`jax.ShapeDtypeStruct`s of everything a checkpoint with this expert storage holds."""
    if storage not in EXPERT_STORAGES:
        raise ValueError(f"unknown expert storage {storage!r}; expected one of {', '.join(EXPERT_STORAGES)}")
    dtype = jnp.float32 if storage == "float32" else jnp.bfloat16
    spec = abstract_params(config, dtype)
    if storage == "mxfp4":
        E, D, F = config.num_experts, config.hidden_size, config.intermediate_size
        for n in range(config.num_hidden_layers):
            mlp = spec[f"block_{n}"]["mlp"]
            for name, (out, inp) in zip(PACKED_WEIGHTS, ((2 * F, D), (D, F)), strict=True):
                mlp[name] = {"blocks": jax.ShapeDtypeStruct((E, out, inp // 32, 16), jnp.uint8),
                             "scales": jax.ShapeDtypeStruct((E, out, inp // 32), jnp.uint8)}
    return spec


def item_spec(config: ModelConfig, storage: str, name: str) -> Params:
    return _item(storage_spec(config, storage), name)


def save_item(directory: str, name: str, tree: Params) -> None:
    """Write one item (numpy arrays) as its own Orbax checkpoint, synchronously."""
    import orbax.checkpoint as ocp

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.abspath(os.path.join(directory, "params", name)), tree)
    checkpointer.wait_until_finished()
    checkpointer.close()


def write_metadata(directory: str, config: ModelConfig, **fields: Any) -> None:
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_json_dict(), f, indent=2)
    meta = {"format_version": FORMAT_VERSION, "items": item_names(config), **fields}
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=2)


def read_metadata(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    path = os.fspath(path)
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: checkpoint directory not found")
    if not os.path.isfile(meta_path):
        raise ValueError(f"{path}: not a gptoss-jax checkpoint (no {META_FILE}); convert a published "
                         f"checkpoint first with `python -m convert`")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_path}: format version {meta.get('format_version')!r}, "
                         f"this gptoss-jax reads version {FORMAT_VERSION}")
    return ModelConfig.from_json(os.path.join(path, "config.json")), meta


def _to_param(path, stored, dtype: str):
    """A stored leaf (or packed {"blocks", "scales"} node) as the parameter of the given dtype."""
    name = str(path[-1].key)
    if isinstance(stored, dict):  # packed experts
        return jnp.asarray(unpack_experts(np.asarray(stored["blocks"]), np.asarray(stored["scales"]), dtype))
    if name == "scale":  # RMSNorm scales stay float32
        return jnp.asarray(np.asarray(stored, np.float32))
    return jnp.asarray(np.asarray(stored).astype(_NP_DTYPES[dtype]))


def load_checkpoint(path: str | os.PathLike, *, dtype: str | None = None) -> tuple[ModelConfig, Params]:
    """Restore a converted checkpoint -> (config, params), item by item, experts decoded.

    dtype: "bfloat16" or "float32" for the parameters; None keeps what was stored (bfloat16 for
    packed experts). Norm scales are float32 either way.
    """
    import orbax.checkpoint as ocp

    config, meta = read_metadata(path)
    storage = meta["expert_storage"]
    dtype = dtype or ("float32" if storage == "float32" else "bfloat16")
    if dtype not in _NP_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_NP_DTYPES)}, got {dtype!r}")
    checkpointer = ocp.StandardCheckpointer()
    params: Params = {}
    for name in item_names(config):
        item_dir = os.path.abspath(os.path.join(os.fspath(path), "params", name))
        if not os.path.isdir(item_dir):
            raise ValueError(f"{item_dir}: missing checkpoint item {name!r}")
        expected = item_spec(config, storage, name)
        stored = checkpointer.restore(item_dir)
        got = jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), stored)
        want = jax.tree.map(lambda x: (tuple(x.shape), np.dtype(x.dtype)), expected)
        if got != want:
            raise ValueError(f"{item_dir}: contents do not match config.json (expected {want}, found {got})")
        packed = jax.tree_util.tree_map_with_path(
            lambda p, x: _to_param(p, x, dtype), stored,
            is_leaf=lambda x: isinstance(x, dict) and set(x) == {"blocks", "scales"})
        params.update(packed)
    return config, params
