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
from ..sharding import mesh_of, sharding
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


def table_axes(module: str, name: str) -> dict[str, tuple[str, ...]]:
    """{"a": axes, "b": axes} of a table of served adapters of weight `name`: an adapter's axes after
    the table's `adapters` axis (one entry per served adapter)."""
    return {part: ("adapters",) + axes for part, axes in adapter_logical_axes(module, name).items()}


def table_sites(config: ModelConfig, targets: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(layer key, module, weight name) of every weight the groups `targets` (of TARGETS) adapt."""
    return [(layer, module, name) for layer, module, name, _ in sites(config, LoraConfig(targets=targets))]


def empty_table(config: ModelConfig, params: Params, slots: int, rank: int, targets: tuple[str, ...]) -> Params:
    """The base params with a table of `slots` served adapters of rank up to `rank`, zero (no
    adapter yet), beside each weight the groups `targets` adapt ("<weight>_lora": {"a": [slots, ...],
    "b": [slots, ...]}), in the dtype of the weights, laid out on the params' mesh (sharding.RULES;
    every adapter on every device, each split as its weight); `put_adapter` fills one entry."""
    sizes = dict(config.axis_sizes(), lora=rank, adapters=slots)
    dtype, mesh = params["embedding"].dtype, mesh_of(params)

    def zeros(axes, what):
        shape = tuple(sizes[a] for a in axes)
        if mesh is None:
            return jnp.zeros(shape, dtype)
        return jax.device_put(np.zeros(shape, dtype), sharding(axes, shape, mesh, what=what))

    out = dict(params)
    for layer, module, name in table_sites(config, targets):
        table = {part: zeros(axes, f"{layer}/{module}/{name}_lora/{part}")
                 for part, axes in table_axes(module, name).items()}
        out[layer] = dict(out[layer])
        out[layer][module] = dict(out[layer][module], **{f"{name}_lora": table})
    return out


def _padded(module: str, name: str, ab: dict, scale: float, rank: int) -> dict:
    """An adapter {"a", "b"} padded with zeros to `rank` (exact: a padded rank adds zero products),
    its scale folded into b."""
    r = ab["a"].shape[-1]
    lead = 1 if _weight(module, name).axes[0] == "experts" else 0  # b's rank axis: after an expert axis
    pad_b = [(0, 0)] * ab["b"].ndim
    pad_b[lead] = (0, rank - r)
    return {"a": jnp.pad(ab["a"], [(0, 0)] * (ab["a"].ndim - 1) + [(0, rank - r)]), "b": jnp.pad(ab["b"] * scale, pad_b)}


def check_fits(params: Params, adapters: Params, *, what: str = "the adapter") -> None:
    """ValueError, naming the weight, where `adapters` adapts a weight the params' tables do not
    hold, or with a rank above theirs."""
    for layer, module, name, ab in _nodes(adapters):
        held = params.get(layer, {}).get(module, {}).get(f"{name}_lora")
        if held is None or not is_table(_weight(module, name), held):
            group = next(g for g, pairs in TARGETS.items() if (module, name) in pairs)
            raise ValueError(f"{what} adapts {layer}/{module}/{name} ({group}), which the served adapters' table "
                             f"does not hold (it adapts: {', '.join(table_groups(params)) or 'nothing'})")
        r, rank = ab["a"].shape[-1], held["a"].shape[-1]
        if r > rank:
            raise ValueError(f"{what} has rank {r} at {layer}/{module}/{name}, above the table's {rank}")


def table_groups(params: Params) -> list[str]:
    """The groups of TARGETS whose weights the params' tables of served adapters hold."""
    held = {(module, key[:-len("_lora")]) for _, module, key, _ in _tables(params)}
    return [group for group, pairs in TARGETS.items() if set(pairs) <= held]


def _tables(params: Params):
    """(layer key, module, "<weight>_lora", table) of every table of served adapters in params."""
    for layer, modules in params.items():
        if not isinstance(modules, dict):
            continue
        for module, weights in modules.items():
            if module not in _BLOCKS or not isinstance(weights, dict):
                continue
            for key, held in weights.items():
                if key.endswith("_lora") and is_table(_weight(module, key[:-len("_lora")]), held):
                    yield layer, module, key, held


def table_entry(params: Params, adapters: Params, scale: float) -> Params:
    """One entry of every table of served adapters in params, holding `adapters` (scale folded in,
    rank padded; zeros where it adapts nothing): {layer: {module: {"<weight>_lora": {"a", "b"}}}}, the
    same structure and shapes whatever the adapter (`set_entry` compiles once). check_fits first."""
    given = {(layer, module, f"{name}_lora"): ab for layer, module, name, ab in _nodes(adapters)}
    out: Params = {}
    for layer, module, key, held in _tables(params):
        ab = given.get((layer, module, key))
        entry = (_padded(module, key[:-len("_lora")], ab, scale, held["a"].shape[-1]) if ab is not None
                 else {part: jnp.zeros(held[part].shape[1:]) for part in held})
        out.setdefault(layer, {}).setdefault(module, {})[key] = {part: entry[part].astype(held[part].dtype)
                                                                 for part in held}
    return out


def set_entry(params: Params, index, entry: Params) -> Params:
    """params with entry `index` of each table set to `entry`'s (`table_entry`); `index` may be traced."""
    out = dict(params)
    for layer, modules in entry.items():
        out[layer] = dict(out[layer])
        for module, weights in modules.items():
            out[layer][module] = dict(out[layer][module], **{
                key: {part: out[layer][module][key][part].at[index].set(x) for part, x in parts.items()}
                for key, parts in weights.items()})
    return out


def tables_of(params: Params) -> Params:
    """The params' tables of served adapters alone, {layer: {module: {"<weight>_lora": table}}}: what
    `set_entry` changes (and `with_tables` puts back), so that a put copies none of the weights."""
    out: Params = {}
    for layer, module, key, held in _tables(params):
        out.setdefault(layer, {}).setdefault(module, {})[key] = held
    return out


def with_tables(params: Params, tables: Params) -> Params:
    """params with the tables `tables` (`tables_of`'s structure) in place of theirs."""
    out = dict(params)
    for layer, modules in tables.items():
        out[layer] = dict(out[layer])
        for module, weights in modules.items():
            out[layer][module] = dict(out[layer][module], **weights)
    return out


def put_adapter(params: Params, index, adapters: Params, scale: float) -> Params:
    """params with entry `index` of every table set to `adapters` (`table_entry`, `set_entry`)."""
    return with_tables(params, set_entry(tables_of(params), index, table_entry(params, adapters, scale)))


def attach_table(config: ModelConfig, params: Params, served: list[tuple[Params, float]], rank: int) -> Params:
    """The base params with a table of the served adapters `served` ([(adapters, scale)], adapter i
    at index i) beside each weight any of them adapts, of rank `rank` (`empty_table`, `put_adapter`)."""
    adapted = {(module, name) for adapters, _ in served for _, module, name, _ in _nodes(adapters)}
    targets = tuple(g for g, pairs in TARGETS.items() if adapted & set(pairs))
    out = empty_table(config, params, len(served), rank, targets)
    for i, (adapters, scale) in enumerate(served):
        check_fits(out, adapters, what=f"adapter {i}")
        out = put_adapter(out, i, adapters, scale)
    return out


def served_count(params: Params) -> int:
    """How many served adapters the params' tables hold (`empty_table`; 0 without one)."""
    return max((held["a"].shape[0] for *_, held in _tables(params)), default=0)


def _merge_einsum(module: str, name: str) -> str:
    """The einsum taking (a, b) to the weight's own axis order."""
    axes = adapter_logical_axes(module, name)
    a_axes, b_axes = axes["a"], axes["b"]
    letters = dict(zip(dict.fromkeys(a_axes + b_axes), string.ascii_letters))
    word = lambda axes: "".join(letters[x] for x in axes)  # noqa: E731
    return f"{word(a_axes)},{word(b_axes)}->{word(_weight(module, name).axes)}"


def merge(params: Params, adapters: Params, lora: LoraConfig | float) -> Params:
    """Params with every adapter folded into its weight, W + scale * a @ b (computed in float32 and
    cast to W's dtype), the scale lora's (a float: that scale; 1.0 for adapters read from disk, whose
    scales are folded in); the result runs without the adapters."""
    scale = lora.scale if isinstance(lora, LoraConfig) else float(lora)
    out = dict(params)
    for layer, module, name, ab in _nodes(adapters):
        block = _BLOCKS[module]
        part = name not in block.WEIGHTS  # a part of a fused weight (q, k or v of qkv_weight)
        held = block.PARTS_OF if part else name
        whole = out[layer][module][held]
        w = block.part(whole, name) if part else whole
        delta = jnp.einsum(_merge_einsum(module, name), ab["a"].astype(jnp.float32),
                           ab["b"].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        merged = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
        out[layer] = dict(out[layer])
        merged = block.with_part(whole, name, merged) if part else merged
        out[layer][module] = dict(out[layer][module], **{held: merged})
    return out

