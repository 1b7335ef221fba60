"""The two PyTorch references, built on CPU from our parameter pytree.

`openai_model` builds OpenAI's `gpt_oss.torch.model.Transformer`, `hf_model` builds transformers'
`GptOssForCausalLM`; both receive exactly our weights, re-laid out into their tensor names.
"""

from __future__ import annotations

import numpy as np
import torch

from gptoss_jax import ModelConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def t(x, dtype=torch.float32) -> torch.Tensor:
    """A JAX or numpy array as a torch tensor (through float32, so bf16 values stay exact)."""
    return torch.from_numpy(np.asarray(x, dtype=np.float32).copy()).to(dtype)


def openai_config(config: ModelConfig):
    from gpt_oss.torch.model import ModelConfig as RefConfig

    return RefConfig(
        num_hidden_layers=config.num_hidden_layers, num_experts=config.num_experts,
        experts_per_token=config.experts_per_token, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        swiglu_limit=config.swiglu_limit, head_dim=config.head_dim,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        sliding_window=config.sliding_window, initial_context_length=config.initial_context_length,
        rope_theta=config.rope_theta, rope_scaling_factor=config.rope_scaling_factor,
        rope_ntk_alpha=config.rope_ntk_alpha, rope_ntk_beta=config.rope_ntk_beta)


def openai_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    """Our pytree in the original checkpoint's names and [out, in] layouts (experts decoded)."""
    D = config.hidden_size
    sd = {
        "embedding.weight": params["embedding"],
        "unembedding.weight": np.asarray(params["unembedding"]).T,
        "norm.scale": params["norm"]["scale"],
    }
    for n in range(config.num_hidden_layers):
        a, m = params[f"block_{n}"]["attn"], params[f"block_{n}"]["mlp"]
        p = f"block.{n}."
        sd[p + "attn.norm.scale"] = a["norm"]["scale"]
        sd[p + "attn.qkv.weight"] = np.concatenate(
            [np.asarray(a[f"{x}_weight"]).reshape(D, -1).T for x in "qkv"], axis=0)
        sd[p + "attn.qkv.bias"] = np.concatenate([np.asarray(a[f"{x}_bias"]).reshape(-1) for x in "qkv"])
        sd[p + "attn.sinks"] = a["sinks"]
        sd[p + "attn.out.weight"] = np.asarray(a["out_weight"]).reshape(-1, D).T
        sd[p + "attn.out.bias"] = a["out_bias"]
        sd[p + "mlp.norm.scale"] = m["norm"]["scale"]
        sd[p + "mlp.gate.weight"] = np.asarray(m["router_weight"]).T
        sd[p + "mlp.gate.bias"] = m["router_bias"]
        sd[p + "mlp.mlp1_weight"] = np.asarray(m["mlp1_weight"]).transpose(0, 2, 1)
        sd[p + "mlp.mlp1_bias"] = m["mlp1_bias"]
        sd[p + "mlp.mlp2_weight"] = np.asarray(m["mlp2_weight"]).transpose(0, 2, 1)
        sd[p + "mlp.mlp2_bias"] = m["mlp2_bias"]
    return sd


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

    return GptOssConfig(
        num_hidden_layers=config.num_hidden_layers, num_local_experts=config.num_experts,
        num_experts_per_tok=config.experts_per_token, vocab_size=config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        head_dim=config.head_dim, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, sliding_window=config.sliding_window,
        swiglu_limit=config.swiglu_limit, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_context_length, layer_types=list(config.layer_types),
        rope_parameters={"rope_type": "yarn", "rope_theta": config.rope_theta,
                         "factor": config.rope_scaling_factor, "beta_fast": config.rope_ntk_beta,
                         "beta_slow": config.rope_ntk_alpha, "truncate": False,
                         "original_max_position_embeddings": config.initial_context_length},
        attn_implementation="eager")


def hf_state_dict(config: ModelConfig, params) -> dict[str, np.ndarray]:
    """Our pytree in Hugging Face's dequantized names and layouts (experts [E, in, out])."""
    D = config.hidden_size
    sd = {
        "model.embed_tokens.weight": params["embedding"],
        "lm_head.weight": np.asarray(params["unembedding"]).T,
        "model.norm.weight": params["norm"]["scale"],
    }
    for n in range(config.num_hidden_layers):
        a, m = params[f"block_{n}"]["attn"], params[f"block_{n}"]["mlp"]
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = a["norm"]["scale"]
        for x in "qkv":
            sd[p + f"self_attn.{x}_proj.weight"] = np.asarray(a[f"{x}_weight"]).reshape(D, -1).T
            sd[p + f"self_attn.{x}_proj.bias"] = np.asarray(a[f"{x}_bias"]).reshape(-1)
        sd[p + "self_attn.o_proj.weight"] = np.asarray(a["out_weight"]).reshape(-1, D).T
        sd[p + "self_attn.o_proj.bias"] = a["out_bias"]
        sd[p + "self_attn.sinks"] = a["sinks"]
        sd[p + "post_attention_layernorm.weight"] = m["norm"]["scale"]
        sd[p + "mlp.router.weight"] = np.asarray(m["router_weight"]).T
        sd[p + "mlp.router.bias"] = m["router_bias"]
        sd[p + "mlp.experts.gate_up_proj"] = m["mlp1_weight"]
        sd[p + "mlp.experts.gate_up_proj_bias"] = m["mlp1_bias"]
        sd[p + "mlp.experts.down_proj"] = m["mlp2_weight"]
        sd[p + "mlp.experts.down_proj_bias"] = m["mlp2_bias"]
    return sd


def hf_model(config: ModelConfig, params, dtype: str = "float32"):
    from transformers import GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(hf_config(config)).to(TORCH_DTYPES[dtype])
    _load(model, hf_state_dict(config, params), TORCH_DTYPES[dtype])
    return model.eval()
