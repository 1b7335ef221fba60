"""Adapters on disk in peft's format (training/adapter_files.py): peft's own adapters for transformers'
GptOssForCausalLM, trained there, served as a table and compared with peft's model in float64; ours
written and read back, and loaded by peft; every folder we cannot serve refused, naming the file
and the field."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax.training.adapter_files import AdapterError, read_adapter, write_adapter
from gptoss_jax.training.lora import LoraConfig, attach_table, init_adapters
from refs import PEFT_PARAMETERS, peft_logits, peft_trained


@pytest.fixture(scope="module")
def peft_adapters(tiny_f32, tmp_path_factory):
    config, params = tiny_f32
    root = tmp_path_factory.mktemp("peft")
    return (peft_trained(config, params, str(root / "rslora"), rank=4, rslora=True),
            peft_trained(config, params, str(root / "plain"), rank=2, rslora=False,
                         parameters=PEFT_PARAMETERS[:0:-1]))  # (down_proj listed first)


@pytest.mark.slow
def test_peft_adapters_served_in_one_batch_give_peft_models_logits(tiny_f32, peft_adapters):
    """Two adapters trained by peft (rank 4 with rsLoRA on attention, router and experts; rank 2 on
    attention and experts, down_proj listed before gate_up_proj: peft nests them in the module's own
    order whatever the list's), read from their folders and
    served as one table, rows of both and of none in one batch: each row's logits peft's own model's
    in float64, within transformers' float32 noise."""
    config, params = tiny_f32
    adapters = [read_adapter(folder, config) for folder in peft_adapters]
    assert [a.rank for a in adapters] == [4, 2]
    assert adapters[0].targets == ("attention", "router", "experts") and adapters[1].targets == ("attention", "experts")
    table = attach_table(config, params, [(a.weights, 1.0) for a in adapters], rank=4)
    rows = np.array([0, 1, -1, 0], np.int32)
    tokens = np.random.default_rng(8).integers(0, config.vocab_size, (len(rows), 14)).astype(np.int32)
    logits, _ = gj.extend(config, table, tokens, gj.init_cache(config, len(rows), 32, jnp.float32), adapters=rows)
    for b, row in enumerate(rows):
        if row < 0:
            continue
        exact = peft_logits(config, params, peft_adapters[row], tokens[b:b + 1])
        exact.check(np.asarray(logits[b:b + 1]), f"row {b} (adapter {row})")
        plain = np.asarray(gj.extend(config, params, tokens[b:b + 1], gj.init_cache(config, 1, 32, jnp.float32))[0])
        assert float(np.abs(plain - exact.value).max()) > 100 * exact.noise  # (the adapter changes something)


@pytest.mark.slow
def test_our_adapters_written_in_peft_format_are_read_back_and_loaded_by_peft(tiny_f32, tmp_path):
    """gptoss-finetune's adapters (attention, router, experts) written as a peft folder: read back
    equal (b scaled), and peft's model over transformers' with it gives our attached adapter's logits."""
    from gptoss_jax.training.lora import attach

    config, params = tiny_f32
    lora = LoraConfig(rank=3, alpha=5.0, targets=("attention", "router", "experts"))
    adapters = init_adapters(config, lora, jax.random.key(4))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(5), x.shape), adapters)
    folder = str(tmp_path / "adapter")
    write_adapter(folder, config, adapters, lora)
    back = read_adapter(str(tmp_path), config)  # a --out folder: its adapter/ is found
    assert back.rank == 3 and back.targets == lora.targets
    want = jax.tree.map(np.asarray, adapters)
    for layer, modules in want.items():
        for module, weights in modules.items():
            for name, ab in weights.items():
                got = back.weights[layer][module][name]
                np.testing.assert_array_equal(got["a"], ab["a"])
                np.testing.assert_allclose(got["b"], ab["b"] * lora.scale, rtol=1e-6)
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (1, 12)).astype(np.int32)
    ours = gj.extend(config, attach(params, adapters, lora.scale), tokens, gj.init_cache(config, 1, 32, jnp.float32))[0]
    peft_logits(config, params, folder, tokens).check(np.asarray(ours), "ours, loaded by peft")


@pytest.fixture(scope="module")
def written(tiny_f32, tmp_path_factory) -> str:
    """An adapter folder as gptoss-finetune writes one (attention and experts, rank 2)."""
    config, _ = tiny_f32
    lora = LoraConfig(rank=2, alpha=4.0, targets=("attention", "experts"))
    folder = str(tmp_path_factory.mktemp("written") / "adapter")
    write_adapter(folder, config, init_adapters(config, lora, jax.random.key(0)), lora)
    return folder


def _edit(folder: str, **fields) -> str:
    path = os.path.join(folder, "adapter_config.json")
    with open(path) as f:
        settings = json.load(f)
    settings.update(fields)
    with open(path, "w") as f:
        json.dump(settings, f)
    return path


@pytest.mark.parametrize("fields, message", [
    ({"use_dora": True}, "field use_dora = true is not supported"),
    ({"target_modules": ["q_proj", "gate_proj"]}, "field target_modules names gate_proj"),
    ({"target_parameters": ["mlp.experts.up_proj"]}, "field target_parameters names mlp.experts.up_proj"),
    ({"bias": "all"}, "field bias = \"all\" must be 'none'"),
    ({"modules_to_save": ["lm_head"]}, "field modules_to_save"),
    ({"r": 0}, "field r must be a positive number, got 0"),
])
def test_an_adapter_we_cannot_serve_is_refused_naming_the_file_and_field(tiny_f32, written, tmp_path, fields, message):
    import shutil

    config, _ = tiny_f32
    folder = str(tmp_path / "bad")
    shutil.copytree(written, folder)
    path = _edit(folder, **fields)
    with pytest.raises(AdapterError) as e:
        read_adapter(folder, config)
    assert str(e.value).startswith(path) and message in str(e.value), str(e.value)


def test_a_rank_above_the_most_served_a_missing_folder_and_bad_json_are_refused(tiny_f32, written, tmp_path):
    import shutil

    config, _ = tiny_f32
    with pytest.raises(AdapterError, match="has rank 2, above the most served \\(1\\)"):
        read_adapter(written, config, max_rank=1)
    with pytest.raises(AdapterError, match="no such folder"):
        read_adapter(str(tmp_path / "nowhere"), config)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        read_adapter(str(tmp_path), config)
    folder = str(tmp_path / "json")
    shutil.copytree(written, folder)
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(AdapterError, match="adapter_config.json: not readable as JSON"):
        read_adapter(folder, config)


@pytest.mark.slow
def test_gptoss_generate_lora_runs_an_adapter_unmerged_or_merged(tmp_path, capsys):
    """gptoss-generate --lora DIR (the demo model): the greedy tokens of the base with the adapter
    attached (training.lora.attach, b scaled as read), and with --merge-lora of the adapter merged;
    --merge-lora alone and a folder we cannot serve are one-line usage errors."""
    from gptoss_jax.cli.generate import main as generate
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params
    from gptoss_jax.training.lora import attach, merge

    config = gj.ModelConfig.demo()
    params = random_params(config, seed=0, dtype=jnp.float32)  # the command line's demo weights
    lora = LoraConfig(rank=4, alpha=64.0, targets=("attention", "router"))
    adapters = init_adapters(config, lora, jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.key(2), x.shape), adapters)
    write_adapter(str(tmp_path / "adapter"), config, adapters, lora)
    read = read_adapter(str(tmp_path), config)
    argv = ["--prompt-ids", "1,2,3,4", "--max-new-tokens", "6", "--temperature", "0", "--json", "--quiet",
            "--lora", str(tmp_path)]

    def tokens(extra):
        capsys.readouterr()
        assert generate(argv + extra) == 0
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["output_ids"]

    def alone(p):
        out = Generator(config, p, max_len=64).generate([[1, 2, 3, 4]], max_new_tokens=6, sampling=Sampling(temperature=0))
        return out[0].output_ids

    assert tokens([]) == alone(attach(params, read.weights, 1.0))
    assert tokens(["--merge-lora"]) == alone(merge(params, read.weights, 1.0))
    assert generate(argv[:-2] + ["--merge-lora"]) == 2
    assert "--merge-lora folds an adapter" in capsys.readouterr().err
    with open(tmp_path / "adapter" / "adapter_config.json", "w") as f:
        f.write("[]")
    assert generate(argv) == 2
    errors = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(errors) == 1 and "adapter_config.json: holds list, not a JSON object" in errors[0], errors
