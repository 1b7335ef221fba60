"""The layout tables (formats.py) that the converter, the synthetic writer and the tests share."""

import json

import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax import formats
from gptoss_jax.testing import _path_specs


@pytest.mark.parametrize("layout", formats.LAYOUTS)
def test_rules_cover_every_parameter_once_and_invert(tiny, layout):
    specs = _path_specs(tiny)
    rules = formats.rules(tiny, layout)
    targets = [t for r in rules for t in r.targets]
    assert sorted(targets) == sorted(specs)  # every parameter exactly once
    sources = [s.name for r in rules for s in r.sources]
    assert len(sources) == len(set(sources))
    rng = np.random.default_rng(0)
    for rule in rules:
        if rule.packed:
            continue
        ours = [rng.standard_normal(specs[t][1]).astype(np.float32) for t in rule.targets]
        back = rule.from_ours(*ours)
        assert [b.shape for b in back] == [s.shape for s in rule.sources]
        for a, b in zip(rule.to_ours(*back), ours, strict=True):
            np.testing.assert_array_equal(a, b)


def test_the_fused_attention_weight_holds_each_kv_heads_queries_then_its_key_and_value():
    """[D, K, G + 2, H]: KV head k's slots are query heads k * G ... k * G + G - 1, its key, its value
    (query head n reads KV head n // G); `qkv_part` gives each part back as declared alone."""
    rng = np.random.default_rng(0)
    D, K, G, H = 3, 2, 4, 5
    q, k, v = rng.standard_normal((D, K * G, H)), rng.standard_normal((D, K, H)), rng.standard_normal((D, K, H))
    fused = formats.fuse_qkv(q, k, v)
    assert fused.shape == (D, K, G + 2, H)
    np.testing.assert_array_equal(fused[:, 1, 2], q[:, 1 * G + 2])
    np.testing.assert_array_equal(fused[:, 1, G], k[:, 1])
    np.testing.assert_array_equal(fused[:, 0, G + 1], v[:, 0])
    for name, part in (("q_weight", q), ("k_weight", k), ("v_weight", v), ("q_bias", q[0])):
        np.testing.assert_array_equal(formats.qkv_part(fused if name.endswith("weight") else fused[0], name), part)


def test_layout_detection():
    assert formats.detect_layout({"num_experts": 32}, ["block.0.attn.sinks"]) == formats.ORIGINAL
    hf = {"model_type": "gpt_oss"}
    assert formats.detect_layout(hf, ["model.layers.0.mlp.experts.gate_up_proj_blocks"]) == formats.HF_MXFP4
    assert formats.detect_layout(hf, ["model.layers.0.mlp.experts.gate_up_proj"]) == formats.HF_BF16


@pytest.mark.parametrize("mxfp4", [False, True])
def test_hf_config_writer_round_trips(tmp_path, tiny, mxfp4):
    (tmp_path / "config.json").write_text(json.dumps(tiny.to_hf_json(mxfp4=mxfp4)))
    assert gj.ModelConfig.from_json(tmp_path) == tiny


def test_original_config_writer_round_trips(tmp_path):
    config = gj.ModelConfig.gpt_oss_120b()
    (tmp_path / "config.json").write_text(json.dumps(config.to_original_json()))
    assert gj.ModelConfig.from_json(tmp_path) == config
