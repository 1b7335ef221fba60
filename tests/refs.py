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


def t(x, dtype=torch.float32) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor (through float32, so bf16 values stay exact)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float32).copy()).to(dtype)


def openai_config(config: ModelConfig):
    from gpt_oss.torch.model import ModelConfig as RefConfig

    return RefConfig(**config.to_original_json())


def _state_dict(config: ModelConfig, params, layout: str) -> dict[str, np.ndarray]:
    """Our pytree in a layout's tensor names, through the converter's own rules (formats.py) run backwards.

    MXFP4 experts are given decoded, as the reference modules hold them: [E, out, in], like ours.
    """
    flat = {"/".join(str(k.key) for k in path): np.asarray(leaf, np.float32)
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
