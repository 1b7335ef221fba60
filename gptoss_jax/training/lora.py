"""LoRA: low-rank adapters on chosen weights, trained while the base weights stay frozen.

An adapted projection x @ W becomes x @ W + (alpha / r) (x @ a) @ b, with a [inputs..., r] and
b [r, outputs...] (expert matrices: a pair per expert, a [E, in, r] and b [E, r, out]). The model
adds the adapters where it finds them next to their weight (`weight.adapter`, names
"<weight>_lora"), so the adapted model is the base pytree plus those entries (`attach`), and the
base weights are never rewritten while training. `merge` folds the adapters into the weights for
inference: W + (alpha / r) a @ b, laid out as W.

Which weights, by group (`TARGETS`): "attention" (the q, k, v and output projections; q, k and v are
parts of one fused weight, each adapted on its own as in peft), "router",
"experts" (both expert matrices). The shapes come from the weights' own declarations (WEIGHTS
tables, `Weight.inputs` and `Weight.adapter_axes`): a weight's axes split into expert axes (leading,
one adapter per expert), input axes and output axes.

Legend: r = rank, E = experts.
"""

from __future__ import annotations

import dataclasses
import string

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..model.attention import AttentionBlock
from ..model.moe import MLPBlock
from ..weight import Params, Weight, is_table

# Group -> the (module, weight) pairs it adapts. Each weight's input axes (what `a` takes) are declared
# with the weight itself (`Weight.inputs`); a leading experts axis gives one adapter per expert.
TARGETS = {
    "attention": (("attn", "q_weight"), ("attn", "k_weight"), ("attn", "v_weight"), ("attn", "out_weight")),
    "router": (("mlp", "router_weight"),),
    "experts": (("mlp", "mlp1_weight"), ("mlp", "mlp2_weight")),
}
_BLOCKS = {"attn": AttentionBlock, "mlp": MLPBlock}


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = ("attention",)  # groups of TARGETS

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets must be among {', '.join(TARGETS)}, got {', '.join(self.targets) or 'none'}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _weight(module: str, name: str) -> Weight:
    """The declaration of an adaptable weight, or of an adaptable part of a fused one (a block's PARTS)."""
    block = _BLOCKS[module]
    return block.WEIGHTS[name] if name in block.WEIGHTS else block.PARTS[name]


def input_axes(module: str, name: str) -> tuple[str, ...]:
    """The input axes of an adaptable weight (as its declaration gives them)."""
    return _weight(module, name).inputs


def adapter_logical_axes(module: str, name: str) -> dict[str, tuple[str, ...]]:
    """{"a": axes, "b": axes} of weight `name`'s adapter: a = experts + inputs + (lora,), b = experts +
    (lora,) + outputs (Weight.adapter_axes)."""
    return _weight(module, name).adapter_axes()


def sites(config: ModelConfig, lora: LoraConfig):
    """(layer key, module, weight name, input axes) of every adapted weight."""
    for i in range(config.num_hidden_layers):
        for group in lora.targets:
            for module, name in TARGETS[group]:
                yield f"block_{i}", module, name, input_axes(module, name)


def init_adapters(config: ModelConfig, lora: LoraConfig, key: jax.Array) -> Params:
    """Fresh float32 adapters {block_i: {module: {weight: {"a", "b"}}}}: a ~ normal(1 / sqrt(fan_in)),
    b = 0, so the adapted model starts as the base model (as peft initialises LoRA's B to zero)."""
    sizes = dict(config.axis_sizes(), lora=lora.rank)
    out: Params = {}
    for n, (layer, module, name, inputs) in enumerate(sites(config, lora)):
        axes = adapter_logical_axes(module, name)
        fan_in = int(np.prod([sizes[a] for a in inputs]))
        a = jax.random.normal(jax.random.fold_in(key, n), tuple(sizes[x] for x in axes["a"]), jnp.float32)
        out.setdefault(layer, {}).setdefault(module, {})[name] = {
            "a": a / np.sqrt(fan_in), "b": jnp.zeros(tuple(sizes[x] for x in axes["b"]), jnp.float32)}
    return out


def logical_axes(config: ModelConfig, lora: LoraConfig) -> Params:
    """The adapters' logical axes, shaped like init_adapters' output: {"a": axes, "b": axes} leaves."""
    out: Params = {}
    for layer, module, name, _ in sites(config, lora):
        out.setdefault(layer, {}).setdefault(module, {})[name] = adapter_logical_axes(module, name)
    return out


def _nodes(adapters: Params):
    for layer, modules in adapters.items():
        for module, weights in modules.items():
            for name, ab in weights.items():
                yield layer, module, name, ab


def attach(params: Params, adapters: Params, scale: float) -> Params:
    """The base params with each adapter beside its weight ("<weight>_lora": {"a", "b" * scale}),
    what the model runs; the base arrays are shared, not copied."""
    out = dict(params)
    for layer, module, name, ab in _nodes(adapters):
        out[layer] = dict(out[layer])
        out[layer][module] = dict(out[layer][module], **{f"{name}_lora": {"a": ab["a"], "b": ab["b"] * scale}})
    return out


def attach_table(params: Params, served: list[tuple[Params, float]], rank: int) -> Params:
    """The base params with a table of served adapters beside each weight any of them adapts
    ("<weight>_lora": {"a": [L, ...], "b": [L, ...]}, adapter i at index i), for a model called with
    each row's index (Transformer's `adapters`): `served` is [(adapters, scale)], each padded with
    zeros to `rank` (exact: a padded rank adds zero products) and its scale folded into b; an adapter
    that does not adapt a weight holds zeros there."""
    sites_of = {}
    for i, (adapters, scale) in enumerate(served):
        for layer, module, name, ab in _nodes(adapters):
            r = ab["a"].shape[-1]
            if r > rank:
                raise ValueError(f"adapter {i} has rank {r} at {layer}/{module}/{name}, above the table's {rank}")
            lead = 1 if _weight(module, name).axes[0] == "experts" else 0  # b's rank axis: after an expert axis
            pad_a = [(0, 0)] * (ab["a"].ndim - 1) + [(0, rank - r)]
            pad_b = [(0, 0)] * ab["b"].ndim
            pad_b[lead] = (0, rank - r)
            sites_of.setdefault((layer, module, name), {})[i] = {"a": jnp.pad(ab["a"], pad_a),
                                                               "b": jnp.pad(ab["b"] * scale, pad_b)}
    out = dict(params)
    for (layer, module, name), held in sites_of.items():
        like = next(iter(held.values()))
        table = {part: jnp.stack([held[i][part] if i in held else jnp.zeros_like(like[part])
                                  for i in range(len(served))]) for part in ("a", "b")}
        out[layer] = dict(out[layer])
        out[layer][module] = dict(out[layer][module], **{f"{name}_lora": table})
    return out


def served_count(params: Params) -> int:
    """How many served adapters the params' tables hold (`attach_table`; 0 without one)."""
    count = 0
    for layer, modules in params.items():
        if not isinstance(modules, dict):
            continue
        for module, weights in modules.items():
            if module not in _BLOCKS or not isinstance(weights, dict):
                continue
            for key, held in weights.items():
                if key.endswith("_lora") and is_table(_weight(module, key[:-len("_lora")]), held):
                    count = max(count, held["a"].shape[0])
    return count


def _merge_einsum(module: str, name: str) -> str:
    """The einsum taking (a, b) to the weight's own axis order."""
    axes = adapter_logical_axes(module, name)
    a_axes, b_axes = axes["a"], axes["b"]
    letters = dict(zip(dict.fromkeys(a_axes + b_axes), string.ascii_letters))
    word = lambda axes: "".join(letters[x] for x in axes)  # noqa: E731
    return f"{word(a_axes)},{word(b_axes)}->{word(_weight(module, name).axes)}"


def merge(params: Params, adapters: Params, lora: LoraConfig) -> Params:
    """Params with every adapter folded into its weight, W + scale * a @ b (computed in float32 and
    cast to W's dtype); the result runs without the adapters."""
    out = dict(params)
    for layer, module, name, ab in _nodes(adapters):
        block = _BLOCKS[module]
        part = name not in block.WEIGHTS  # a part of a fused weight (q, k or v of qkv_weight)
        held = block.PARTS_OF if part else name
        whole = out[layer][module][held]
        w = block.part(whole, name) if part else whole
        delta = jnp.einsum(_merge_einsum(module, name), ab["a"].astype(jnp.float32),
                           ab["b"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        merged = (w.astype(jnp.float32) + lora.scale * delta).astype(w.dtype)
        out[layer] = dict(out[layer])
        merged = block.with_part(whole, name, merged) if part else merged
        out[layer][module] = dict(out[layer][module], **{held: merged})
    return out

