"""Model configuration: one frozen dataclass, named presets, readers for both on-disk formats.

Field names follow the original checkpoint's `config.json` (OpenAI's `gpt_oss.torch.model.ModelConfig`),
so that format reads straight in; the Hugging Face format is mapped field by field in `_from_hf`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

SLIDING = "sliding_attention"
FULL = "full_attention"
# Even layers (0, 2, ...) use the sliding window, odd layers full causal attention.
DEFAULT_LAYER_PATTERN = (SLIDING, FULL)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of a GPT-OSS model. Frozen and hashable, so it can be a static jit argument."""

    num_hidden_layers: int = 24
    num_experts: int = 32
    experts_per_token: int = 4
    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    head_dim: int = 64
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    sliding_window: int = 128
    initial_context_length: int = 4096
    rope_theta: float = 150000.0
    rope_scaling_factor: float = 32.0
    rope_ntk_alpha: float = 1.0  # YaRN beta_slow
    rope_ntk_beta: float = 32.0  # YaRN beta_fast
    rms_norm_eps: float = 1e-5
    max_context_length: int = 131072
    # One entry per layer; None means "generate from DEFAULT_LAYER_PATTERN".
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self):
        if self.layer_types is None:
            pattern = DEFAULT_LAYER_PATTERN
            types = tuple(pattern[i % len(pattern)] for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", types)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is inconsistent."""
        positive = ["num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
                    "intermediate_size", "head_dim", "num_attention_heads", "num_key_value_heads",
                    "sliding_window", "initial_context_length", "max_context_length"]
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"ModelConfig.experts_per_token ({self.experts_per_token}) exceeds "
                             f"num_experts ({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple "
                             f"of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"ModelConfig.layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")
        for i, kind in enumerate(self.layer_types):
            if kind not in (SLIDING, FULL):
                raise ValueError(f"ModelConfig.layer_types[{i}] is {kind!r}; expected {SLIDING!r} or {FULL!r}")
        if self.rope_scaling_factor < 1.0:
            raise ValueError(f"ModelConfig.rope_scaling_factor must be >= 1, got {self.rope_scaling_factor}")
        if self.rope_scaling_factor > 1.0:
            low, high = self.yarn_ramp_bounds()
            if not 0 < low < high < self.head_dim // 2 - 1:
                raise ValueError(
                    f"YaRN ramp bounds ({low:.3f}, {high:.3f}) fall outside (0, head_dim/2 - 1): "
                    f"initial_context_length={self.initial_context_length} is too small for "
                    f"rope_ntk_beta={self.rope_ntk_beta} and head_dim={self.head_dim}")

    # Derived quantities ---------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        """Query heads sharing one KV head (query head h reads KV head h // q_per_kv)."""
        return self.num_attention_heads // self.num_key_value_heads

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def yarn_ramp_bounds(self) -> tuple[float, float]:
        """NTK-by-parts (low, high) dimension bounds of the YaRN ramp."""
        d_half = self.head_dim / 2
        log_base = math.log(self.rope_theta)
        low = d_half * math.log(self.initial_context_length / (self.rope_ntk_beta * 2 * math.pi)) / log_base
        high = d_half * math.log(self.initial_context_length / (self.rope_ntk_alpha * 2 * math.pi)) / log_base
        return low, high

    def axis_sizes(self) -> dict[str, int]:
        """Size of every logical axis name used by the weight declarations (see weight.py)."""
        return {
            "vocab": self.vocab_size,
            "embed": self.hidden_size,
            "q_heads": self.num_attention_heads,
            "kv_heads": self.num_key_value_heads,
            "qkv": self.q_per_kv + 2,  # a KV head's query heads, its key and its value (attention.py)
            "head_dim": self.head_dim,
            "experts": self.num_experts,
            # Expert input projection: gate and linear halves interleaved, 2 * intermediate outputs.
            "mlp_fused": 2 * self.intermediate_size,
            "mlp": self.intermediate_size,
        }

    def replace(self, **changes: Any) -> "ModelConfig":
        if "num_hidden_layers" in changes and "layer_types" not in changes:
            changes["layer_types"] = None
        return dataclasses.replace(self, **changes)

    # Presets --------------------------------------------------------------------------------------
    @classmethod
    def gpt_oss_20b(cls) -> "ModelConfig":
        return cls(num_hidden_layers=24, num_experts=32)

    @classmethod
    def gpt_oss_120b(cls) -> "ModelConfig":
        return cls(num_hidden_layers=36, num_experts=128)

    @classmethod
    def tiny(cls) -> "ModelConfig":
        """A few-MB model with every architectural feature (window, sinks, GQA, YaRN, top-k MoE).

        Its initial context (256) is small so YaRN's interpolated band is exercised by short prompts.
        """
        return cls(num_hidden_layers=4, num_experts=8, experts_per_token=4, vocab_size=1024,
                   hidden_size=64, intermediate_size=96, head_dim=16, num_attention_heads=8,
                   num_key_value_heads=2, sliding_window=16, initial_context_length=256,
                   max_context_length=8192)

    @classmethod
    def demo(cls) -> "ModelConfig":
        """The tiny model with the real 201088-token vocabulary, so real text can go through it."""
        return cls.tiny().replace(vocab_size=201088)

    @classmethod
    def preset(cls, name: str) -> "ModelConfig":
        try:
            factory = PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
        return factory()

    # Readers --------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read an original (`original/config.json`) or Hugging Face (`model_type: gpt_oss`) config."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"{path}: config file not found") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: expected a JSON object")
        try:
            if "model_type" in raw:
                return _from_hf(raw)
            return _from_original(raw)
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_original_json(self) -> dict[str, Any]:
        """The original checkpoint's config.json (exactly the reference ModelConfig's fields)."""
        if self.layer_types != ModelConfig(num_hidden_layers=self.num_hidden_layers).layer_types:
            raise ValueError("the original config format cannot express a custom layer_types pattern")
        return {name: getattr(self, name) for name in _ORIGINAL_FIELDS}

    def to_hf_json(self, *, mxfp4: bool) -> dict[str, Any]:
        """A Hugging Face config.json (transformers 5 `rope_parameters` form)."""
        out = {
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
            "num_hidden_layers": self.num_hidden_layers, "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "swiglu_limit": self.swiglu_limit, "swiglu_alpha": self.swiglu_alpha, "head_dim": self.head_dim,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "sliding_window": self.sliding_window, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_context_length, "layer_types": list(self.layer_types),
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": self.rope_theta,
                                "factor": self.rope_scaling_factor, "beta_fast": self.rope_ntk_beta,
                                "beta_slow": self.rope_ntk_alpha, "truncate": False,
                                "original_max_position_embeddings": self.initial_context_length},
        }
        if mxfp4:
            out["quantization_config"] = {
                "quant_method": "mxfp4",
                "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"]}
        return out

    def to_json_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layer_types"] = list(self.layer_types)
        return out


PRESETS = {
    "gpt-oss-20b": ModelConfig.gpt_oss_20b,
    "gpt-oss-120b": ModelConfig.gpt_oss_120b,
    "tiny": ModelConfig.tiny,
    "demo": ModelConfig.demo,
}

_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
# The fields of OpenAI's reference ModelConfig, which is what the original config.json holds.
_ORIGINAL_FIELDS = ("num_hidden_layers", "num_experts", "experts_per_token", "vocab_size", "hidden_size",
                    "intermediate_size", "swiglu_limit", "head_dim", "num_attention_heads",
                    "num_key_value_heads", "sliding_window", "initial_context_length", "rope_theta",
                    "rope_scaling_factor", "rope_ntk_alpha", "rope_ntk_beta")


def _from_original(raw: dict[str, Any]) -> ModelConfig:
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s) in original-format config: {', '.join(unknown)}")
    return ModelConfig(**raw)


def _from_hf(raw: dict[str, Any]) -> ModelConfig:
    if raw["model_type"] != "gpt_oss":
        raise ValueError(f"model_type is {raw['model_type']!r}, expected 'gpt_oss'")
    if raw.get("attention_bias", True) is not True:
        raise ValueError("attention_bias=false is not a GPT-OSS model")
    if raw.get("tie_word_embeddings", False):
        raise ValueError("tie_word_embeddings=true is not a GPT-OSS model")
    # Published checkpoints: rope_theta + rope_scaling. transformers 5: rope_parameters with rope_theta.
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = rope.get("rope_theta", raw.get("rope_theta", 150000.0))
    rope_type = rope.get("rope_type", rope.get("type", "yarn"))
    if rope_type == "yarn":
        if rope.get("truncate", False):
            raise ValueError("YaRN with truncate=true is not what GPT-OSS uses")
        factor = rope.get("factor", 32.0)
        initial = rope.get("original_max_position_embeddings", 4096)
        alpha, beta = rope.get("beta_slow", 1.0), rope.get("beta_fast", 32.0)
    elif rope_type == "default":
        factor, initial, alpha, beta = 1.0, raw.get("max_position_embeddings", 4096), 1.0, 32.0
    else:
        raise ValueError(f"unsupported rope_type {rope_type!r}")
    kwargs = dict(
        num_hidden_layers=raw["num_hidden_layers"],
        num_experts=raw["num_local_experts"],
        experts_per_token=raw["num_experts_per_tok"],
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw["num_key_value_heads"],
        sliding_window=raw["sliding_window"],
        initial_context_length=int(initial),
        rope_theta=float(theta),
        rope_scaling_factor=float(factor),
        rope_ntk_alpha=float(alpha),
        rope_ntk_beta=float(beta),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        max_context_length=raw.get("max_position_embeddings", 131072),
        layer_types=tuple(raw["layer_types"]) if raw.get("layer_types") else None,
    )
    return ModelConfig(**kwargs)
