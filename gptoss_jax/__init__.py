"""gptoss-jax: OpenAI's GPT-OSS models (gpt-oss-20b, gpt-oss-120b) in JAX/Flax.

    import gptoss_jax as gj
    config = gj.ModelConfig.tiny()
    params = gj.init_params(config, jax.random.key(0), dtype=jnp.float32)
    logits = gj.forward(config, params, tokens)  # [batch, seq, vocab] float32
"""

from .attention import attention_blockwise, attention_reference
from .cache import init_cache
from .checkpoint import load_checkpoint
from .config import PRESETS, ModelConfig
from .model import Kernels, Transformer, extend, forward
from .params import Weight, abstract_params, init_params, logical_axes, param_count

__version__ = "0.1.0"

__all__ = [
    "Kernels",
    "ModelConfig",
    "PRESETS",
    "Transformer",
    "Weight",
    "abstract_params",
    "attention_blockwise",
    "attention_reference",
    "extend",
    "forward",
    "init_cache",
    "init_params",
    "load_checkpoint",
    "logical_axes",
    "param_count",
]
