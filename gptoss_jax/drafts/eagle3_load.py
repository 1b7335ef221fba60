"""Loading a published EAGLE-3 head (a folder with config.json and safetensors, as on the hub) beside
its gpt-oss target: every tensor named, checked against the head's config and turned into the
head's parameters (eagle3.py); nothing unknown is ignored silently.

    published tensor (PyTorch Linear: [out, in])       parameter (x @ W: [in, out])
    fc.weight [D, G]                                    fc [G, D]
    input_norm.weight [G] (norm_before_fc heads)        fc_norm [G]
    midlayer.input_layernorm.weight [D]                 embed_norm/scale
    midlayer.hidden_norm.weight [D]                     hidden_norm/scale
    midlayer.self_attn.{q,k,v}_proj.weight [N|K*H, A]   q [A, N, H], k and v [A, K, H]
    midlayer.self_attn.o_proj.weight [D, N*H]           o [N, H, D]
    midlayer.post_attention_layernorm.weight [D]        post_norm/scale
    midlayer.mlp.{gate,up}_proj.weight [F, D]           gate, up [D, F]
    midlayer.mlp.down_proj.weight [D, F]                down [F, D]
    norm.weight [D]                                     norm/scale
    lm_head.weight [U, D]                               lm_head [D, U]
    d2t [U] (int64)                                     hot [U] int32: hot[i] = i + d2t[i], the target id
    t2d [V] (bool)                                      checked: true exactly at the hot ids

vLLM speculators' heads name the layer `layers.0.` instead of `midlayer.`. The heads carry no
embedding of their own: the target's is used (an `embed_tokens.weight` is checked to be the
target's shape and otherwise not read).
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..eagle3_config import Eagle3Config
from ..sources import SourceError, read_config_json, read_tensor, scan


def _layout(c: Eagle3Config) -> dict[str, tuple[tuple[int, ...], str, object]]:
    """published name -> (its shape, the parameter path, how the array becomes the parameter)."""
    D, A, G, N, K, H, F, U = (c.hidden_size, 2 * c.hidden_size, len(c.aux_layers) * c.target_hidden_size,
                              c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
                              c.draft_vocab_size)
    t = np.transpose
    out = {"fc.weight": ((D, G), "fc", t), "norm.weight": ((D,), "norm/scale", None),
           "lm_head.weight": ((U, D), "lm_head", t),
           "midlayer.input_layernorm.weight": ((D,), "embed_norm/scale", None),
           "midlayer.hidden_norm.weight": ((D,), "hidden_norm/scale", None),
           "midlayer.self_attn.q_proj.weight": ((N * H, A), "q", lambda w: w.T.reshape(A, N, H)),
           "midlayer.self_attn.k_proj.weight": ((K * H, A), "k", lambda w: w.T.reshape(A, K, H)),
           "midlayer.self_attn.v_proj.weight": ((K * H, A), "v", lambda w: w.T.reshape(A, K, H)),
           "midlayer.self_attn.o_proj.weight": ((D, N * H), "o", lambda w: w.T.reshape(N, H, D)),
           "midlayer.post_attention_layernorm.weight": ((D,), "post_norm/scale", None),
           "midlayer.mlp.gate_proj.weight": ((F, D), "gate", t), "midlayer.mlp.up_proj.weight": ((F, D), "up", t),
           "midlayer.mlp.down_proj.weight": ((D, F), "down", t)}
    if c.norm_before_fc:
        out["input_norm.weight"] = ((G,), "fc_norm", None)
    return out


def load_eagle3(folder: str, target: ModelConfig, dtype=jnp.bfloat16) -> tuple[Eagle3Config, dict, np.ndarray]:
    """A published head beside `target` -> (its config, its parameters {"params": ...}, hot [U] int32:
    the target id of each draft token). SourceError names the file and tensor of what does not fit."""
    config = Eagle3Config.from_json(read_config_json(folder), target.num_hidden_layers,
                                    os.path.join(folder, "config.json"))
    if config.vocab_size != target.vocab_size or config.target_hidden_size != target.hidden_size:
        raise SourceError(f"{folder}: a head for a target of vocabulary {config.vocab_size} and hidden size "
                          f"{config.target_hidden_size}, not this model's {target.vocab_size} and {target.hidden_size}")
    tensors = {name.replace("layers.0.", "midlayer.", 1) if name.startswith("layers.0.") else name: (name, info)
               for name, info in scan(folder).items()}
    layout = _layout(config)
    expected = {**{n: s for n, (s, _, _) in layout.items()}, "d2t": (config.draft_vocab_size,)}
    optional = {"t2d": (config.vocab_size,), "embed_tokens.weight": (target.vocab_size, target.hidden_size)}
    unknown = sorted(set(tensors) - set(expected) - set(optional))
    missing = sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise SourceError(f"{folder}: not an EAGLE-3 head of this config: "
                          + "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                                  f"unknown {', '.join(unknown)}" if unknown else "") if x))
    for name, shape in {**expected, **{n: s for n, s in optional.items() if n in tensors}}.items():
        original, info = tensors[name]
        if tuple(info.shape) != shape:
            raise SourceError(f"{info.file}: tensor {original} has shape {list(info.shape)}, expected {list(shape)}")
    params: dict = {}
    for name, (_, path, transform) in layout.items():
        original, info = tensors[name]
        array = read_tensor(info, original)
        value = np.asarray(transform(array) if transform else array)
        node = params
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = jnp.asarray(value, jnp.float32 if leaf in ("scale", "fc_norm") else dtype)  # norms: float32
    original, info = tensors["d2t"]
    hot = np.arange(config.draft_vocab_size) + read_tensor(info, original).astype(np.int64)
    if hot.min() < 0 or hot.max() >= config.vocab_size or len(np.unique(hot)) != len(hot):
        raise SourceError(f"{info.file}: d2t maps draft tokens outside the target's vocabulary, or two to one")
    if "t2d" in tensors:
        original, info = tensors["t2d"]
        if not np.array_equal(np.flatnonzero(read_tensor(info, original)), np.sort(hot)):
            raise SourceError(f"{info.file}: t2d does not mark exactly the target ids d2t maps to")
    return config, {"params": params}, hot.astype(np.int32)
