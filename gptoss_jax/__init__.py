"""gptoss-jax: OpenAI's GPT-OSS models (gpt-oss-20b, gpt-oss-120b) in JAX/Flax.

    import gptoss_jax as gj
    config = gj.ModelConfig.tiny()
    params = gj.init_params(config, jax.random.key(0), dtype=jnp.float32)
    logits = gj.forward(config, params, tokens)  # [batch, seq, vocab] float32

The names below are imported on first use, so `import gptoss_jax` (and the command lines' argument
checks) stay fast and do not start JAX.
"""

from __future__ import annotations

import importlib

from .version import __version__

_EXPORTS = {
    "attention_blockwise": "model.attention", "attention_reference": "model.attention",
    "init_cache": "model.cache", "Generator": "decoding.generator",
    "load_checkpoint": "checkpoint",
    "PRESETS": "config", "ModelConfig": "config",
    "Kernels": "kernels", "Transformer": "model", "extend": "model", "forward": "model",
    "Sampling": "sampling",
    "Weight": "weight", "param_count": "weight",
    "abstract_params": "params", "init_params": "params", "logical_axes": "params", "param_shardings": "params",
    "make_mesh": "sharding", "RULES": "sharding",
    "decode_params": "mxfp4",
}

__all__ = ["__version__", *sorted(_EXPORTS)]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
