"""The published checkpoint layouts, tensor by tensor, and how each maps to our parameters.

Three source layouts:
- "original": `original/` on the hub. Fused qkv, linear weights [out, in], experts MXFP4
  (`.blocks` / `.scales`), one `model.safetensors`.
- "hf-mxfp4": the Hugging Face repository. Separate q/k/v/o projections, experts MXFP4
  (`_blocks` / `_scales`), sharded files with `model.safetensors.index.json`.
- "hf-bf16": a dequantized Hugging Face checkpoint; experts bf16 and stored [E, in, out]
  (transposed against the published blocks and against ours, which are [E, out, in]).

Each `Rule` names its source tensors with their shapes (from the config), the parameters it
produces, and both directions of the transform, so that the converter (to ours), the synthetic
checkpoint writer and the tests (from ours) share one table. Rules with `packed=True` are the MXFP4
experts: their sources are (blocks, scales) and they are stored packed or decoded (see mxfp4.py).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from .config import ModelConfig

ORIGINAL, HF_MXFP4, HF_BF16 = "original", "hf-mxfp4", "hf-bf16"
LAYOUTS = (ORIGINAL, HF_MXFP4, HF_BF16)
FLOAT, UINT8 = "float", "uint8"  # the two kinds of source tensor: bf16/f32 values, or MXFP4 bytes


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    shape: tuple[int, ...]
    kind: str = FLOAT


@dataclasses.dataclass(frozen=True)
class Rule:
    sources: tuple[Source, ...]
    targets: tuple[str, ...]  # parameter paths, "/"-joined: "block_0/attn/qkv_weight"
    to_ours: Callable[..., tuple[np.ndarray, ...]] | None = None
    from_ours: Callable[..., tuple[np.ndarray, ...]] | None = None
    packed: bool = False

    @property
    def item(self) -> str:
        """The unit the converter writes at once: "embedding", "block_N" or "final"."""
        head = self.targets[0].split("/")[0]
        return head if head.startswith("block_") or head == "embedding" else "final"


def _same(x):
    return (x,)


def _transpose(x):  # [out, in] <-> [in, out]
    return (np.swapaxes(x, -1, -2),)


def _rule(source: Source, target: str, to_ours=_same, from_ours=_same) -> Rule:
    return Rule((source,), (target,), to_ours, from_ours)


def _head_rules(c: ModelConfig, embed: str, unembed: str, norm: str) -> list[Rule]:
    V, D = c.vocab_size, c.hidden_size
    return [
        _rule(Source(embed, (V, D)), "embedding"),
        _rule(Source(unembed, (V, D)), "unembedding", _transpose, _transpose),
        _rule(Source(norm, (D,)), "norm/scale"),
    ]


def qkv_part(fused, name: str):
    """The q, k or v part (`name` "q_weight", "k_weight", "v_weight", or a bias) of our fused weight
    [D, K, G + 2, H] (for each KV head: its G query heads, its key, its value) or bias [K, G + 2, H],
    laid out as if declared alone: q [D, N, H], k and v [D, K, H] (biases without D). numpy or JAX."""
    K, G, H = fused.shape[-3], fused.shape[-2] - 2, fused.shape[-1]
    if name[0] == "q":
        return fused[..., :G, :].reshape(*fused.shape[:-3], K * G, H)
    return fused[..., G if name[0] == "k" else G + 1, :]


def fuse_qkv(q, k, v):
    """q [D, N, H], k and v [D, K, H] (or the three biases, without D) -> our fused weight
    [D, K, G + 2, H] (`qkv_part` takes it apart). numpy or JAX."""
    xp = q.__array_namespace__()
    K, H = k.shape[-2:]
    q = q.reshape(*q.shape[:-2], K, q.shape[-2] // K, H)
    return xp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2)


def _proj_in(heads: int, c: ModelConfig):
    """[heads * H, D] (torch) <-> [D, heads, H] (ours), and the bias [heads * H] <-> [heads, H]."""
    H, D = c.head_dim, c.hidden_size
    w = (lambda x: (x.reshape(heads, H, D).transpose(2, 0, 1),),
         lambda x: (x.transpose(1, 2, 0).reshape(heads * H, D),))
    b = (lambda x: (x.reshape(heads, H),), lambda x: (x.reshape(heads * H),))
    return w, b


def _out_proj(c: ModelConfig):
    """[D, N * H] (torch) <-> [N, H, D] (ours)."""
    N, H, D = c.num_attention_heads, c.head_dim, c.hidden_size
    return (lambda x: (x.T.reshape(N, H, D),), lambda x: (x.reshape(N * H, D).T,))


def _qkv(q_in, k_in):
    """Our fused q, k, v (weight or bias) <-> the three parts in torch's layout, through each part's
    own transform (`_proj_in`'s): (q, k, v) -> (fused,), fused -> (q, k, v)."""
    def to_ours(q, k, v):
        return (fuse_qkv(q_in[0](q)[0], k_in[0](k)[0], k_in[0](v)[0]),)

    def from_ours(x):
        return q_in[1](qkv_part(x, "q"))[0], k_in[1](qkv_part(x, "k"))[0], k_in[1](qkv_part(x, "v"))[0]
    return to_ours, from_ours


def _packed(c: ModelConfig, blocks: str, scales: str, target: str, out: int, inp: int) -> Rule:
    groups = inp // 32
    return Rule((Source(blocks, (c.num_experts, out, groups, 16), UINT8),
                 Source(scales, (c.num_experts, out, groups), UINT8)), (target,), packed=True)


def _original_rules(c: ModelConfig) -> list[Rule]:
    N, K, H, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    E, F = c.num_experts, c.intermediate_size
    splits = np.cumsum([N * H, K * H])
    (qw, qb), (kw, kb) = _proj_in(N, c), _proj_in(K, c)

    def fused(q_in, k_in):  # the published qkv [(N + 2K) H, ...]: q's rows, then k's, then v's
        to_ours, from_ours = _qkv(q_in, k_in)
        return lambda x: to_ours(*np.split(x, splits, axis=0)), lambda x: (np.concatenate(from_ours(x)),)

    rules = _head_rules(c, "embedding.weight", "unembedding.weight", "norm.scale")
    for n in range(c.num_hidden_layers):
        s, t = f"block.{n}.", f"block_{n}/"
        rules += [
            _rule(Source(s + "attn.norm.scale", (D,)), t + "attn/norm/scale"),
            _rule(Source(s + "attn.qkv.weight", ((N + 2 * K) * H, D)), t + "attn/qkv_weight", *fused(qw, kw)),
            _rule(Source(s + "attn.qkv.bias", ((N + 2 * K) * H,)), t + "attn/qkv_bias", *fused(qb, kb)),
            _rule(Source(s + "attn.sinks", (N,)), t + "attn/sinks"),
            _rule(Source(s + "attn.out.weight", (D, N * H)), t + "attn/out_weight", *_out_proj(c)),
            _rule(Source(s + "attn.out.bias", (D,)), t + "attn/out_bias"),
            _rule(Source(s + "mlp.norm.scale", (D,)), t + "mlp/norm/scale"),
            _rule(Source(s + "mlp.gate.weight", (E, D)), t + "mlp/router_weight", _transpose, _transpose),
            _rule(Source(s + "mlp.gate.bias", (E,)), t + "mlp/router_bias"),
            _packed(c, s + "mlp.mlp1_weight.blocks", s + "mlp.mlp1_weight.scales", t + "mlp/mlp1_weight", 2 * F, D),
            _rule(Source(s + "mlp.mlp1_bias", (E, 2 * F)), t + "mlp/mlp1_bias"),
            _packed(c, s + "mlp.mlp2_weight.blocks", s + "mlp.mlp2_weight.scales", t + "mlp/mlp2_weight", D, F),
            _rule(Source(s + "mlp.mlp2_bias", (E, D)), t + "mlp/mlp2_bias"),
        ]
    return rules


def _hf_rules(c: ModelConfig, packed: bool) -> list[Rule]:
    N, K, H, D = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    E, F = c.num_experts, c.intermediate_size
    (qw, qb), (kw, kb) = _proj_in(N, c), _proj_in(K, c)
    rules = _head_rules(c, "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight")
    for n in range(c.num_hidden_layers):
        s, t = f"model.layers.{n}.", f"block_{n}/"
        rules += [_rule(Source(s + "input_layernorm.weight", (D,)), t + "attn/norm/scale")]
        for kind, inner, parts in (("weight", (D,), _qkv(qw, kw)), ("bias", (), _qkv(qb, kb))):
            sources = tuple(Source(s + f"self_attn.{x}_proj.{kind}", (heads * H,) + inner)
                            for x, heads in (("q", N), ("k", K), ("v", K)))
            rules.append(Rule(sources, (t + f"attn/qkv_{kind}",), *parts))
        e = s + "mlp.experts."
        rules += [
            _rule(Source(s + "self_attn.sinks", (N,)), t + "attn/sinks"),
            _rule(Source(s + "self_attn.o_proj.weight", (D, N * H)), t + "attn/out_weight", *_out_proj(c)),
            _rule(Source(s + "self_attn.o_proj.bias", (D,)), t + "attn/out_bias"),
            _rule(Source(s + "post_attention_layernorm.weight", (D,)), t + "mlp/norm/scale"),
            _rule(Source(s + "mlp.router.weight", (E, D)), t + "mlp/router_weight", _transpose, _transpose),
            _rule(Source(s + "mlp.router.bias", (E,)), t + "mlp/router_bias"),
            _rule(Source(e + "gate_up_proj_bias", (E, 2 * F)), t + "mlp/mlp1_bias"),
            _rule(Source(e + "down_proj_bias", (E, D)), t + "mlp/mlp2_bias"),
        ]
        if packed:
            rules += [_packed(c, e + "gate_up_proj_blocks", e + "gate_up_proj_scales", t + "mlp/mlp1_weight", 2 * F, D),
                      _packed(c, e + "down_proj_blocks", e + "down_proj_scales", t + "mlp/mlp2_weight", D, F)]
        else:  # dequantized experts are stored [E, in, out]; ours are [E, out, in]
            rules += [_rule(Source(e + "gate_up_proj", (E, D, 2 * F)), t + "mlp/mlp1_weight", _transpose, _transpose),
                      _rule(Source(e + "down_proj", (E, F, D)), t + "mlp/mlp2_weight", _transpose, _transpose)]
    return rules


def rules(config: ModelConfig, layout: str) -> list[Rule]:
    """Every rule of a layout, in the order the converter writes them (embedding, blocks, final)."""
    if layout == ORIGINAL:
        return _original_rules(config)
    if layout in (HF_MXFP4, HF_BF16):
        return _hf_rules(config, packed=layout == HF_MXFP4)
    raise ValueError(f"unknown checkpoint layout {layout!r}; known: {', '.join(LAYOUTS)}")


def detect_layout(config_json: dict, tensor_names) -> str:
    """Which layout a folder holds, from its config.json fields and its tensor names."""
    names = set(tensor_names)
    if "model_type" not in config_json:
        return ORIGINAL
    return HF_MXFP4 if any(n.endswith("_blocks") for n in names) else HF_BF16
