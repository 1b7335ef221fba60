import json

import chex
import jax
import jax.numpy as jnp
import pytest

import gptoss_jax as gj
from gptoss_jax.config import FULL, SLIDING


def test_presets_match_reference_sizes():
    c20, c120 = gj.ModelConfig.preset("gpt-oss-20b"), gj.ModelConfig.preset("gpt-oss-120b")
    assert (c20.num_hidden_layers, c20.num_experts) == (24, 32)
    assert (c120.num_hidden_layers, c120.num_experts) == (36, 128)
    for c in (c20, c120):
        assert (c.hidden_size, c.intermediate_size, c.head_dim) == (2880, 2880, 64)
        assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (64, 8, 201088)
        assert (c.sliding_window, c.initial_context_length, c.rope_theta) == (128, 4096, 150000.0)
        assert (c.rope_scaling_factor, c.rope_ntk_alpha, c.rope_ntk_beta) == (32.0, 1.0, 32.0)
        assert (c.swiglu_limit, c.swiglu_alpha, c.rms_norm_eps, c.experts_per_token) == (7.0, 1.702, 1e-5, 4)
        assert c.layer_types[:4] == (SLIDING, FULL, SLIDING, FULL)
        assert all(c.is_sliding(i) == (i % 2 == 0) for i in range(c.num_hidden_layers))
    hash(c20)  # static jit argument
    with pytest.raises(ValueError, match="unknown preset"):
        gj.ModelConfig.preset("gpt-oss-7b")


@pytest.mark.parametrize("name, billions", [("gpt-oss-20b", 20.9), ("gpt-oss-120b", 116.8)])
def test_parameter_count_without_allocating(name, billions):
    shapes = gj.abstract_params(gj.ModelConfig.preset(name), jnp.bfloat16)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))  # nothing allocated
    assert abs(gj.param_count(shapes) / 1e9 - billions) <= 0.1


@pytest.mark.slow
def test_init_params_matches_the_abstract_shapes(tiny):
    chex.assert_trees_all_equal_shapes_and_dtypes(gj.init_params(tiny, jax.random.key(0), jnp.float32),
                                                   gj.abstract_params(tiny, jnp.float32))


def test_logical_axes_cover_every_weight(tiny):
    shapes, axes = gj.abstract_params(tiny), gj.logical_axes(tiny)
    assert jax.tree.structure(shapes) == jax.tree.structure(axes, is_leaf=lambda x: isinstance(x, tuple))
    specs = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple))
    for leaf, spec in zip(jax.tree.leaves(shapes), specs, strict=True):
        assert len(spec) == len(leaf.shape)


ORIGINAL_20B = {
    "num_hidden_layers": 24, "num_experts": 32, "experts_per_token": 4, "vocab_size": 201088,
    "hidden_size": 2880, "intermediate_size": 2880, "swiglu_limit": 7.0, "head_dim": 64,
    "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
    "initial_context_length": 4096, "rope_theta": 150000, "rope_scaling_factor": 32.0,
    "rope_ntk_alpha": 1, "rope_ntk_beta": 32,
}

HF_20B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
    "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_experts_per_tok": 4,
    "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
    "output_router_logits": False, "pad_token_id": 199999, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True,
    "vocab_size": 201088,
    "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                       "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
}


def _write(tmp_path, obj):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(obj))
    return path


def test_from_json_reads_original_and_both_hf_rope_forms(tmp_path):
    expected = gj.ModelConfig.gpt_oss_20b()
    assert gj.ModelConfig.from_json(_write(tmp_path, ORIGINAL_20B)) == expected
    assert gj.ModelConfig.from_json(_write(tmp_path, HF_20B)) == expected
    # transformers 5 writes rope_parameters with rope_theta inside instead of rope_theta + rope_scaling.
    v5 = {k: v for k, v in HF_20B.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = dict(HF_20B["rope_scaling"], rope_theta=150000.0)
    assert gj.ModelConfig.from_json(_write(tmp_path, v5)) == expected
    # A directory holding config.json works too.
    assert gj.ModelConfig.from_json(tmp_path) == expected


def test_from_json_written_by_transformers_round_trips(tmp_path, tiny):
    from refs import hf_config

    hf_config(tiny).save_pretrained(tmp_path)
    assert gj.ModelConfig.from_json(tmp_path / "config.json") == tiny


@pytest.mark.parametrize("mutate, message", [
    (lambda c: c.update(bogus_field=1), "bogus_field"),
    (lambda c: c.update(num_attention_heads=60), "multiple of num_key_value_heads"),
    (lambda c: c.update(experts_per_token=64), "experts_per_token"),
    (lambda c: c.update(hidden_size=-1), "hidden_size"),
])
def test_from_json_rejects_bad_original_configs(tmp_path, mutate, message):
    raw = dict(ORIGINAL_20B)
    mutate(raw)
    path = _write(tmp_path, raw)
    with pytest.raises(ValueError, match=message) as info:
        gj.ModelConfig.from_json(path)
    assert str(path) in str(info.value)


def test_from_json_rejects_bad_hf_configs(tmp_path):
    with pytest.raises(ValueError, match="truncate"):
        truncated = dict(HF_20B, rope_scaling=dict(HF_20B["rope_scaling"], truncate=True))
        gj.ModelConfig.from_json(_write(tmp_path, truncated))
    with pytest.raises(ValueError, match="model_type"):
        gj.ModelConfig.from_json(_write(tmp_path, dict(HF_20B, model_type="llama")))
    with pytest.raises(ValueError, match="num_local_experts"):
        gj.ModelConfig.from_json(_write(tmp_path, {k: v for k, v in HF_20B.items() if k != "num_local_experts"}))
    with pytest.raises(FileNotFoundError, match="config file not found"):
        gj.ModelConfig.from_json(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        gj.ModelConfig.from_json(tmp_path / "broken.json")


def test_yarn_bounds_are_checked():
    with pytest.raises(ValueError, match="YaRN ramp bounds"):
        gj.ModelConfig.tiny().replace(initial_context_length=64)
