"""run_inference.py end to end: the demo, greedy parity with transformers' generate, batches, errors."""

import json
import os

import numpy as np
import pytest
import torch

import run_inference
from gptoss_jax.convert.cli import main as convert_main
from gptoss_jax import ModelConfig
from gptoss_jax.testing import write_synthetic_checkpoint

VOCAB = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "tokenizer", "o200k_base.tiktoken")
needs_vocab = pytest.mark.skipif(not os.path.isfile(VOCAB), reason=f"genuine vocabulary not at {VOCAB}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny model (window 128) as a dequantized HF checkpoint, and its conversion."""
    root = tmp_path_factory.mktemp("ckpt")
    config = ModelConfig.tiny().replace(sliding_window=128)
    write_synthetic_checkpoint(config, root / "hf", "hf-bf16", seed=6)
    assert convert_main([str(root / "hf"), str(root / "converted"), "--quiet"]) == 0
    return root


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_demo_runs_without_a_tokenizer(capsys, monkeypatch):
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "/nonexistent")
    assert run_inference.main(["--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert "RANDOM weights" in captured.err and "token ids" in captured.err
    assert "decode" in captured.err and "tokens/s" in captured.err


def test_greedy_matches_transformers_generate(checkpoint, capsys):
    from transformers import GptOssForCausalLM

    prompt = np.random.default_rng(6).integers(0, 1024, 150).tolist()  # longer than the window
    argv = ["--checkpoint", str(checkpoint / "converted"), "--prompt-ids", ",".join(map(str, prompt)),
            "--temperature", "0", "--dtype", "float32", "--json", "--max-new-tokens", "64", "--max-context", "256"]
    assert run_inference.main(argv) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    assert record["prompt_ids"] == prompt and len(record["output_ids"]) == 64
    assert set(record["timings"]) >= {"time_to_first_token_s", "prefill_tokens_per_s", "decode_tokens_per_s"}
    model = GptOssForCausalLM.from_pretrained(str(checkpoint / "hf"), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    assert record["output_ids"] == out[0, len(prompt):].tolist()


@needs_vocab
def test_batch_file_gives_one_json_object_per_prompt_and_batch_equals_single(tmp_path, capsys):
    prompts = ["Hello there", "A longer prompt about JAX, XLA and accelerators", "Bonjour 🎉"]
    (tmp_path / "batch.txt").write_text("\n".join(prompts) + "\n")
    common = ["--tokenizer", VOCAB, "--temperature", "0", "--max-new-tokens", "6", "--json"]
    assert run_inference.main(["--batch-file", str(tmp_path / "batch.txt")] + common) == 0
    batch = _json_lines(capsys.readouterr().out)
    assert len(batch) == 3 and all(isinstance(r["text"], str) for r in batch)
    assert run_inference.main(["--prompt", prompts[1]] + common) == 0
    (single,) = _json_lines(capsys.readouterr().out)
    assert single["output_ids"] == batch[1]["output_ids"]


@needs_vocab
def test_chat_json_has_channels(capsys):
    argv = ["--tokenizer", VOCAB, "--chat", "--prompt", "What is 2+2?", "--reasoning-effort", "low",
            "--system", "Be brief.", "--max-new-tokens", "4", "--json"]
    assert run_inference.main(argv) == 0
    (record,) = _json_lines(capsys.readouterr().out)
    assert {"analysis", "final"} <= set(record)
    assert record["prompt_ids"][-2:] == [200006, 173781]  # ... <|start|>assistant


@pytest.mark.parametrize("argv, message", [
    (["--prompt-ids", "1,2,3,4,5", "--max-context", "4", "--json"], "exceeds the max context of 4"),
    (["--prompt-ids", "1,2", "--top-p", "0", "--json"], "top-p must be in (0, 1]"),
    (["--prompt-ids", "1,2", "--top-p", "1.5", "--json"], "top-p must be in (0, 1]"),
    (["--prompt-ids", "1,2", "--temperature", "-1", "--json"], "temperature must be >= 0"),
    (["--checkpoint", "/nonexistent/ckpt", "--prompt-ids", "1", "--json"], "checkpoint directory not found"),
    (["--prompt-ids", "1,2", "--max-new-tokens", "0", "--json"], "at least 1"),
])
def test_bad_input_exits_non_zero_with_a_message(capsys, argv, message):
    assert run_inference.main(argv) != 0
    assert message in capsys.readouterr().err


def test_tokenizer_with_the_wrong_hash_is_refused(tmp_path, capsys):
    bad = tmp_path / "o200k_base.tiktoken"
    bad.write_bytes(b"aGVsbG8= 0\n")
    assert run_inference.main(["--tokenizer", str(bad), "--prompt", "hi"]) != 0
    assert "is not o200k_base's" in capsys.readouterr().err


def test_unparseable_ids_are_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        run_inference.main(["--prompt-ids", "1,x"])
    assert info.value.code == 2 and "comma-separated integers" in capsys.readouterr().err


def test_prompt_file_equals_prompt_ids(checkpoint, tmp_path, capsys):
    common = ["--checkpoint", str(checkpoint / "converted"), "--temperature", "0", "--max-new-tokens", "4",
              "--json", "--max-context", "64"]
    assert run_inference.main(common + ["--prompt-ids", "5,6,7"]) == 0
    (by_ids,) = _json_lines(capsys.readouterr().out)
    assert by_ids["finish_reason"] == "length" and by_ids["text"] is None  # a 1024-token test vocabulary
    missing = tmp_path / "nope.txt"
    assert run_inference.main(common + ["--prompt-file", str(missing)]) != 0
    assert "error:" in capsys.readouterr().err
