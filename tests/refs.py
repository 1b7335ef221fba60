"""The two PyTorch references, built on CPU from our parameter pytree.

`openai_model` builds OpenAI's `gpt_oss.torch.model.Transformer`, `hf_model` builds transformers'
`GptOssForCausalLM`; both receive exactly our weights, re-laid out into their tensor names.
"""

from __future__ import annotations

import jax
import numpy as np
import torch

from gptoss_jax import ModelConfig, formats

TORCH_DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16}


def host(x) -> np.ndarray:
    """A JAX or numpy array on the host: float64 kept, anything else as float32 (bf16 values stay exact)."""
    x = np.asarray(x)
    return x if x.dtype == np.float64 else x.astype(np.float32)


def t(x, dtype=torch.float32) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor (through host(): float64 weights stay exact)."""
    return torch.from_numpy(host(x).copy()).to(dtype)


def openai_config(config: ModelConfig):
    from gpt_oss.torch.model import ModelConfig as RefConfig

    return RefConfig(**config.to_original_json())


def _state_dict(config: ModelConfig, params, layout: str) -> dict[str, np.ndarray]:
    """Our pytree in a layout's tensor names, through the converter's own rules (formats.py) run backwards.

    MXFP4 experts are given decoded, as the reference modules hold them: [E, out, in], like ours.
    """
    flat = {"/".join(str(k.key) for k in path): host(leaf)
            for path, leaf in jax.tree_util.tree_leaves_with_path(params)}
    sd = {}
    for rule in formats.rules(config, layout):
        if rule.packed:
            sd[rule.sources[0].name.removesuffix(".blocks")] = flat[rule.targets[0]]
            continue
        for src, value in zip(rule.sources, rule.from_ours(*(flat[t] for t in rule.targets)), strict=True):
            sd[src.name] = value
    return sd


def openai_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    return _state_dict(config, params, formats.ORIGINAL)


def _load(model: torch.nn.Module, sd: dict[str, np.ndarray], dtype: torch.dtype) -> None:
    expected = dict(model.named_parameters())
    assert set(expected) == set(sd), (set(expected) ^ set(sd))
    with torch.no_grad():
        for name, param in expected.items():
            value = t(sd[name])
            assert tuple(value.shape) == tuple(param.shape), (name, value.shape, param.shape)
            # Norm scales stay float32 in both references; everything else takes the model dtype.
            param.copy_(value.to(param.dtype))


def openai_model(config: ModelConfig, params, dtype: str = "float32"):
    from gpt_oss.torch.model import Transformer

    torch.manual_seed(0)
    model = Transformer(openai_config(config), device=torch.device("cpu"))
    if dtype == "float32":
        model = model.to(torch.float32)
    _load(model, openai_state_dict(config, params), TORCH_DTYPES[dtype])
    return model.eval()


def hf_config(config: ModelConfig):
    from transformers import GptOssConfig

    return GptOssConfig(**config.to_hf_json(mxfp4=False), attn_implementation="eager")


def hf_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    return _state_dict(config, params, formats.HF_BF16)


def hf_model(config: ModelConfig, params, dtype: str = "float32"):
    """float64: the exact reference for gradients (transformers' grouped-matmul experts take 32-bit
    and 16-bit floats only, so its eager experts run instead)."""
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    hf = hf_config(config)
    if dtype == "float64":
        hf._experts_implementation = "eager"
    model = GptOssForCausalLM(hf).to(TORCH_DTYPES[dtype])
    _load(model, hf_state_dict(config, params), TORCH_DTYPES[dtype])
    return model.eval()


# --- float64 results: the exact side of every parity check (noise.py) -------------------------------

def attention64(q, k, v, sinks, q_pos, k_pos, window: int | None, *, with_lse: bool = False):
    """Attention with sinks by its definition, in float64 (torch, so that it can be differentiated):
    q [B, T, K, G, H], k and v [B, S, K, H], sinks [K, G] (None: no sink), positions [B, T] and
    [B, S] (negative: no key) -> o [B, T, K, G, H] (and lse [B, T, K, G] of the keys alone)."""
    q, k, v = (x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x, np.float64)) for x in (q, k, v))
    qp, kp = (torch.from_numpy(np.array(p))[..., None] for p in (q_pos, k_pos))
    keep = (kp.transpose(-1, -2) <= qp) & (kp.transpose(-1, -2) >= 0)  # [B, T, S]
    if window is not None:
        keep &= kp.transpose(-1, -2) > qp - window
    s = torch.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(q.shape[-1])
    s = s.masked_fill(~keep[:, None, None], -torch.inf)
    lse = torch.logsumexp(s, dim=-1)  # [B, K, G, T]
    if sinks is not None:
        sinks = sinks if isinstance(sinks, torch.Tensor) else torch.from_numpy(np.asarray(sinks, np.float64))
        total = torch.logaddexp(lse, sinks[None, :, :, None])
    else:
        total = lse
    p = torch.exp(s - total[..., None]).nan_to_num(0.0)  # a row with no key and no sink: zeros
    o = torch.einsum("bkgts,bskh->btkgh", p, v)
    return (o, lse.permute(0, 3, 1, 2)) if with_lse else o


def hf_logits(config: ModelConfig, params, tokens, dtype: str) -> np.ndarray:
    """transformers' logits [B, T, V] (float64 numpy) for fresh sequences, no cache."""
    with torch.no_grad():
        out = hf_model(config, params, dtype)(input_ids=torch.from_numpy(np.asarray(tokens)).long()).logits
    return out.double().numpy()


def exact_logits(config: ModelConfig, params, tokens):
    """noise.Exact of the logits: transformers in float64, with its float32 run as the noise."""
    from noise import Exact

    return Exact.measure(hf_logits(config, params, tokens, "float32"), hf_logits(config, params, tokens, "float64"))


def hf_layer_outputs(config: ModelConfig, params, tokens, inputs, dtype: str) -> list[np.ndarray]:
    """transformers' decoder layer i applied to inputs[i] [B, T, D] (in place of its own input, within a
    run on `tokens`, which supplies the masks and rotary tables): each layer's output, float64 numpy."""
    model = hf_model(config, params, dtype)
    outputs = []
    for i, layer in enumerate(model.model.layers):
        given = t(inputs[i], TORCH_DTYPES[dtype])
        hooks = [layer.register_forward_pre_hook(lambda _, args, x=given: (x,) + args[1:]),
                 layer.register_forward_hook(lambda _, __, out: outputs.append(out.double().numpy()))]
        with torch.no_grad():
            model(input_ids=torch.from_numpy(np.asarray(tokens)).long())
        for h in hooks:
            h.remove()
    return outputs
