"""LoRA adapters on disk, in peft's format for transformers' `GptOssForCausalLM`: what `gptoss-serve
--lora` and `gptoss-generate --lora` read, and what `gptoss-finetune` writes beside its merged model.

    FOLDER/adapter_config.json        peft's LoraConfig: r, lora_alpha, use_rslora, target_modules,
                                      target_parameters, ...
    FOLDER/adapter_model.safetensors  base_model.model.model.layers.<i>.<module>.lora_A.weight, .lora_B.weight

The modules: self_attn.q_proj, k_proj, v_proj, o_proj (target_modules, nn.Linear: lora_A [r, in],
lora_B [out, r]); the router and the experts through peft's `target_parameters`:
mlp.router.weight (lora_A [r, D], lora_B [E, r]), mlp.experts.gate_up_proj and down_proj (one
adapter of rank r per expert, stacked: lora_A [r * E, in] with expert e's rows e * r .. e * r + r - 1,
lora_B [out, r * E] with expert e's columns e, e + E, e + 2E, ...; two parameters of one module nest,
the first listed innermost: "experts.base_layer.lora_A" is the first's, "experts.lora_A" the second's).
The scale is lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora; a module's r is its tensors'
(rank_pattern's ranks are read from the shapes).

What would change the computation in ways served adapters do not follow (DoRA, biases, modules
saved whole, alpha patterns, ...) is refused, naming the file and the field, before any tensor is
read. Legend as training/lora.py: r = rank, E = experts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import shutil
import tempfile

import numpy as np

from ..config import ModelConfig
from ..sources import SourceError, read_tensor, scan
from ..weight import Params
from .lora import TARGETS, LoraConfig

CONFIG_FILE, TENSORS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers."
# peft's module (or parameter) name -> ours (module, weight), and the group of TARGETS it is in.
MODULES = {"self_attn.q_proj": ("attn", "q_weight"), "self_attn.k_proj": ("attn", "k_weight"),
           "self_attn.v_proj": ("attn", "v_weight"), "self_attn.o_proj": ("attn", "out_weight")}
PARAMETERS = {"mlp.router.weight": ("mlp", "router_weight"), "mlp.experts.gate_up_proj": ("mlp", "mlp1_weight"),
              "mlp.experts.down_proj": ("mlp", "mlp2_weight")}
# Fields that change what an adapter computes in ways this reader does not follow: each must be
# unset (null, false, empty) or hold the value given here.
UNSUPPORTED = {"use_dora": None, "lora_bias": None, "modules_to_save": None, "trainable_token_indices": None,
               "layer_replication": None, "alpha_pattern": None, "fan_in_fan_out": None, "use_qalora": None,
               "arrow_config": None, "kasa_config": None, "velora_config": None, "use_bdlora": None,
               "alora_invocation_tokens": None, "bias": "none", "peft_type": "LORA"}


class AdapterError(ValueError):
    """An adapter folder that cannot be served; the message names the file and the field or tensor."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """An adapter read from a folder: its weights in our layout (training/lora.py's tree, float32,
    each module's scale folded into b), its largest rank and the groups of TARGETS it adapts."""

    path: str
    weights: Params
    rank: int
    targets: tuple[str, ...]


def adapter_folder(path: str) -> str:
    """The folder holding adapter_config.json: `path`, or gptoss-finetune's --out folder's adapter/."""
    for folder in (path, os.path.join(path, "adapter")):
        if os.path.isfile(os.path.join(folder, CONFIG_FILE)):
            return folder
    if not os.path.isdir(path):
        raise AdapterError(f"{path}: no such folder")
    raise AdapterError(f"{path}: no {CONFIG_FILE} (a peft LoRA adapter's folder, or gptoss-finetune's --out)")


def _settings(folder: str) -> dict:
    """adapter_config.json, checked field by field (AdapterError naming the file and the field)."""
    where = os.path.join(folder, CONFIG_FILE)
    try:
        with open(where) as f:
            settings = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{where}: not readable as JSON ({e})") from None
    if not isinstance(settings, dict):
        raise AdapterError(f"{where}: holds {type(settings).__name__}, not a JSON object")
    for field, wanted in UNSUPPORTED.items():
        if field not in settings:
            continue
        value = settings[field]
        if (value != wanted) if wanted is not None else value not in (None, False, {}, [], ""):
            hint = f"must be {wanted!r}" if wanted is not None else "is not supported by served adapters"
            raise AdapterError(f"{where}: field {field} = {json.dumps(value)} {hint}")
    for field in ("r", "lora_alpha"):
        value = settings.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"{where}: field {field} must be a positive number, got {json.dumps(value)}")
    modules = settings.get("target_modules")
    if isinstance(modules, list):
        short = {name.split(".")[-1] for name in MODULES}
        unknown = [m for m in modules if m.split(".")[-1] not in short]
        if unknown:
            raise AdapterError(f"{where}: field target_modules names {', '.join(unknown)}: served adapters take "
                               f"{', '.join(sorted(short))} (and the parameters {', '.join(PARAMETERS)})")
    parameters = settings.get("target_parameters") or []
    unknown = [p for p in parameters if not any(p == known or p.endswith("." + known) for known in PARAMETERS)]
    if unknown:
        raise AdapterError(f"{where}: field target_parameters names {', '.join(unknown)}: served adapters take "
                           f"{', '.join(PARAMETERS)}")
    return settings


def _site(name: str, where: str) -> tuple[int, str, int, str]:
    """(layer, peft module, how deep its wrapper nests, "A" or "B") of a tensor's name."""
    m = re.fullmatch(r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+?)\.lora_([AB])\.weight", name)
    if m is None:
        raise AdapterError(f"{where}: tensor {name} is not a LoRA weight of GptOssForCausalLM's layers")
    layer, module, part = int(m.group(1)), m.group(2), m.group(3)
    depth, owner = module.count(".base_layer"), module.replace(".base_layer", "")
    if (owner in MODULES and not depth) or owner in ("mlp.router", "mlp.experts"):
        return layer, owner, depth, part
    raise AdapterError(f"{where}: tensor {name} adapts {module}: served adapters take "
                       f"{', '.join(m.split('.')[-1] for m in MODULES)} and the parameters {', '.join(PARAMETERS)}")


def _parameter(c: ModelConfig, settings: dict, owner: str, depth: int, depths: set[int], rows: int, where: str,
               layer: int) -> str:
    """The parameter that the wrapper of module `owner` nested `depth` deep adapts (`depths`: those of
    its layer; `rows`: its lora_B's). peft wraps a module's parameters in the order the module
    declares them, the first innermost: the experts' gate_up_proj, then down_proj."""
    if owner == "mlp.router":
        if depth:
            raise AdapterError(f"{where}: layer {layer}'s router has nested adapters; served adapters take its weight")
        return "mlp.router.weight"
    if len(depths) == 2:
        return ("mlp.experts.down_proj", "mlp.experts.gate_up_proj")[depth]
    by_rows = {2 * c.intermediate_size: "mlp.experts.gate_up_proj", c.hidden_size: "mlp.experts.down_proj"}
    if 2 * c.intermediate_size != c.hidden_size:
        if rows not in by_rows:
            raise AdapterError(f"{where}: layer {layer}'s experts' lora_B has {rows} rows: neither gate_up_proj's "
                               f"{2 * c.intermediate_size} nor down_proj's {c.hidden_size}")
        return by_rows[rows]
    listed = {known for p in settings.get("target_parameters") or [] for known in PARAMETERS
              if known.startswith("mlp.experts") and (p == known or p.endswith("." + known))}
    if len(listed) != 1:
        raise AdapterError(f"{where}: layer {layer}'s experts adapt one of gate_up_proj and down_proj, of the same "
                           "shape here, and target_parameters does not say which")
    return listed.pop()


def _to_ours(c: ModelConfig, target: str, A: np.ndarray, B: np.ndarray, where: str) -> tuple[dict, int]:
    """peft's (lora_A, lora_B) of one target -> ({"a", "b"} in our layout, rank r)."""
    N, K, H, D, E, F = (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.num_experts,
                        c.intermediate_size)
    ins_outs = {"self_attn.q_proj": (D, N * H), "self_attn.k_proj": (D, K * H), "self_attn.v_proj": (D, K * H),
                "self_attn.o_proj": (N * H, D), "mlp.router.weight": (D, E), "mlp.experts.gate_up_proj": (D, 2 * F),
                "mlp.experts.down_proj": (F, D)}
    inp, out = ins_outs[target]
    experts = E if target.startswith("mlp.experts") else 1
    r = A.shape[0] // experts
    if A.ndim != 2 or B.ndim != 2 or A.shape != (r * experts, inp) or B.shape != (out, r * experts) or r < 1:
        raise AdapterError(f"{where}: {target}'s lora_A {tuple(A.shape)} and lora_B {tuple(B.shape)} do not fit "
                           f"this model ({'rank x experts, ' if experts > 1 else 'rank, '}{inp}) and ({out}, ...)")
    if experts > 1:  # a [E, in, r], b [E, r, out]
        return {"a": A.reshape(E, r, inp).transpose(0, 2, 1), "b": B.reshape(out, r, E).transpose(2, 1, 0)}, r
    a, b = A.T, B.T  # [in, r], [r, out]
    if target == "self_attn.o_proj":
        a = a.reshape(N, H, r)
    elif target.startswith("self_attn."):
        b = b.reshape(r, out // H, H)
    return {"a": a, "b": b}, r


def read_adapter(path: str, config: ModelConfig, *, max_rank: int | None = None) -> Adapter:
    """The adapter in folder `path` (or gptoss-finetune's --out), checked against `config` (and a
    rank of at most `max_rank`) before its tensors are read: AdapterError naming the file and field."""
    folder = adapter_folder(path)
    settings = _settings(folder)
    where = os.path.join(folder, TENSORS_FILE)
    if not os.path.isfile(where):
        raise AdapterError(f"{where}: missing (the adapter's weights)")
    try:
        infos = {name: info for name, info in scan(folder).items() if info.file == where}
    except SourceError as e:
        raise AdapterError(str(e)) from None
    wrappers: dict[tuple[int, str, int], dict[str, str]] = {}  # (layer, module, depth) -> {"A": name, "B": name}
    for name in infos:
        layer, owner, depth, part = _site(name, where)
        if layer >= config.num_hidden_layers:
            raise AdapterError(f"{where}: tensor {name} adapts layer {layer}; the model has {config.num_hidden_layers}")
        wrappers.setdefault((layer, owner, depth), {})[part] = name
    if not wrappers:
        raise AdapterError(f"{where}: holds no LoRA weights")
    depths: dict[tuple[int, str], set[int]] = {}
    for layer, owner, depth in wrappers:
        depths.setdefault((layer, owner), set()).add(depth)
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for (layer, owner, depth), names in sorted(wrappers.items()):
        if len(names) != 2:
            raise AdapterError(f"{where}: layer {layer}'s {owner} has lora_{''.join(names)} without its pair")
        target = owner if owner in MODULES else _parameter(config, settings, owner, depth, depths[(layer, owner)],
                                                           infos[names["B"]].shape[0], where, layer)
        if (layer, target) in pairs:
            raise AdapterError(f"{where}: layer {layer}'s {target} is adapted twice")
        r = infos[names["A"]].shape[0] // (config.num_experts if target.startswith("mlp.experts") else 1)
        if max_rank is not None and r > max_rank:  # (from the file's header: before any tensor is read)
            raise AdapterError(f"{where}: layer {layer}'s {target} has rank {r}, above the most served ({max_rank})")
        pairs[(layer, target)] = names
    weights: Params = {}
    rank = 0
    for (layer, target), names in sorted(pairs.items()):
        A, B = (np.asarray(read_tensor(infos[names[p]], names[p]), np.float32) for p in "AB")
        ab, r = _to_ours(config, target, A, B, where)
        scale = settings["lora_alpha"] / (math.sqrt(r) if settings.get("use_rslora") else r)
        module, weight = {**MODULES, **PARAMETERS}[target]
        weights.setdefault(f"block_{layer}", {}).setdefault(module, {})[weight] = {"a": ab["a"], "b": ab["b"] * scale}
        rank = max(rank, r)
    adapted = {(module, name) for layer in weights.values() for module, ws in layer.items() for name in ws}
    targets = tuple(group for group, sites in TARGETS.items() if adapted & set(sites))
    return Adapter(folder, weights, rank, targets)


def write_adapter(path: str, config: ModelConfig, adapters: Params, lora: LoraConfig) -> None:
    """Write training/lora.py's adapters (b without its scale) as a peft adapter folder `path` for
    GptOssForCausalLM, whole or not at all (written beside it, then renamed into place)."""
    from safetensors.numpy import save_file  # (safetensors is a dependency; imported where it is used)

    ours = {weight: target for target, (_, weight) in {**MODULES, **PARAMETERS}.items()}
    nesting = {"mlp1_weight": ".base_layer", "mlp2_weight": ""}  # gate_up_proj listed first: innermost
    tensors = {}
    for layer, modules in adapters.items():
        for module, weights in modules.items():
            for weight, ab in weights.items():
                a, b = np.asarray(ab["a"], np.float32), np.asarray(ab["b"], np.float32)
                target = ours[weight]
                if weight in nesting:  # a [E, in, r] -> [r * E, in]; b [E, r, out] -> [out, r * E]
                    A, B = a.transpose(0, 2, 1).reshape(-1, a.shape[1]), b.transpose(2, 1, 0).reshape(b.shape[2], -1)
                    target = "mlp.experts" + nesting[weight]
                else:
                    A, B = a.reshape(-1, a.shape[-1]).T, b.reshape(b.shape[0], -1).T
                    target = target.removesuffix(".weight")
                stem = f"{PREFIX}{layer.removeprefix('block_')}.{target}"
                tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(A)
                tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(B)
    parameters = ([p for p, (_, w) in PARAMETERS.items() if w == "router_weight"] if "router" in lora.targets else []) \
        + (["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if "experts" in lora.targets else [])
    settings = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
                "use_rslora": False, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
                "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"] if "attention" in lora.targets else None,
                "target_parameters": parameters, "base_model_name_or_path": None, "inference_mode": True}
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        save_file(tensors, os.path.join(staging, TENSORS_FILE))
        with open(os.path.join(staging, CONFIG_FILE), "w") as f:
            json.dump(settings, f, indent=2)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
