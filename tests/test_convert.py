"""The converter end to end against both references' own loaders, and its refusals."""

import json
import os

import chex
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import gptoss_jax as gj
from conftest import assert_rel_close
from convert.cli import main as convert_main
from gptoss_jax.testing import write_synthetic_checkpoint

LAYOUTS = ("original", "hf-mxfp4", "hf-bf16")


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("sources")
    for layout in LAYOUTS:
        write_synthetic_checkpoint(tiny, root / layout, layout, seed=3)
    return root


def _reference_logits(layout, source, tokens):
    with torch.no_grad():
        if layout == "original":
            from gpt_oss.torch.model import Transformer

            model = Transformer.from_checkpoint(str(source), device="cpu").to(torch.float32)
            return model(torch.from_numpy(tokens[0]).long()).numpy()
        from transformers import GptOssForCausalLM

        model = GptOssForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager")
        return model.float().eval()(torch.from_numpy(tokens).long()).logits[0].numpy()


@pytest.mark.parametrize("layout, dtype", [("original", None), ("original", "bfloat16"), ("hf-mxfp4", None),
                                           ("hf-bf16", None)])
def test_converted_logits_match_the_references_loaders(sources, tmp_path, long_tokens, layout, dtype, capsys):
    # Each reference loads the synthetic checkpoint with its own loader (OpenAI's from_checkpoint,
    # HF's from_pretrained, which dequantizes MXFP4 itself); we convert, load and run in float32.
    argv = [str(sources / layout), str(tmp_path / "out")] + (["--dtype", dtype] if dtype else [])
    assert convert_main(argv) == 0
    assert f"({layout} layout" in capsys.readouterr().err
    config, params = gj.load_checkpoint(tmp_path / "out", dtype="float32")
    chex.assert_trees_all_equal_shapes_and_dtypes(params, gj.abstract_params(config, "float32"))
    logits = gj.forward(config, params, long_tokens)
    # float32 noise floor, measured against a float64 run of OpenAI's model: ours 5e-6, torch's own 3e-6.
    assert_rel_close(logits[0], _reference_logits(layout, sources / layout, long_tokens), rtol=1e-5)


def test_packed_and_decoded_storage_load_identically(sources, tmp_path):
    assert convert_main([str(sources / "original"), str(tmp_path / "packed"), "--quiet"]) == 0
    assert convert_main([str(sources / "original"), str(tmp_path / "decoded"), "--dtype", "bfloat16", "--quiet"]) == 0
    import orbax.checkpoint as ocp

    stored = ocp.StandardCheckpointer().restore((tmp_path / "packed" / "params" / "block_0").absolute())
    blocks = stored["block_0"]["mlp"]["mlp1_weight"]["blocks"]  # the experts really stay packed
    assert blocks.dtype == np.uint8 and blocks.shape[-1] == 16
    _, packed = gj.load_checkpoint(tmp_path / "packed")
    _, decoded = gj.load_checkpoint(tmp_path / "decoded")
    chex.assert_trees_all_equal(packed, decoded)
    meta = json.loads((tmp_path / "packed" / "gptoss_checkpoint.json").read_text())
    assert meta["expert_storage"] == "mxfp4" and meta["source_layout"] == "original"
    assert "convert" in meta["converter_version"]


def _copy_source(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def _edit_config(folder, **changes):
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (folder / "config.json").write_text(json.dumps(raw))


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


BAD_INPUTS = {
    "truncated file": (_truncate, "model.safetensors: unreadable safetensors file"),
    "missing tensor": (lambda f: _edit_tensors(f, lambda t: t.pop("block.1.attn.sinks")),
                       "lacks tensor(s) block.1.attn.sinks"),
    "wrong shape": (lambda f: _edit_tensors(f, lambda t: t.update({"block.0.attn.sinks": np.zeros(3, np.float32)})),
                    "tensor block.0.attn.sinks has shape [3]"),
    "unknown tensor": (lambda f: _edit_tensors(f, lambda t: t.update({"block.0.attn.extra": np.zeros(3, np.float32)})),
                       "unknown tensor(s) block.0.attn.extra"),
    "config disagrees": (lambda f: _edit_config(f, num_experts=16), "config.json implies"),
    "wrong dtype": (lambda f: _edit_tensors(f, lambda t: t.update({"block.0.mlp.mlp1_weight.scales":
                                                                   t["block.0.mlp.mlp1_weight.scales"].astype(np.int32)})),
                    "has dtype I32, expected U8"),
    "pickle only": (lambda f: [p.unlink() for p in f.glob("*.safetensors")] and (f / "model.bin").write_bytes(b"x"),
                    "no .safetensors files"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_one_line_error_and_leaves_nothing(sources, tmp_path, capsys, case):
    corrupt, message = BAD_INPUTS[case]
    source = _copy_source(sources / "original", tmp_path / "source")
    corrupt(source)
    capsys.readouterr()
    assert convert_main([str(source), str(tmp_path / "out"), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]  # no output, no partial folder


def test_existing_output_needs_overwrite(sources, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert convert_main([str(sources / "hf-bf16"), str(out), "--quiet"]) == 1
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert convert_main([str(sources / "hf-bf16"), str(out), "--quiet", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "gptoss_checkpoint.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_mxfp4_storage_of_decoded_source_is_refused(sources, tmp_path, capsys):
    assert convert_main([str(sources / "hf-bf16"), str(tmp_path / "out"), "--dtype", "mxfp4"]) == 1
    assert "would need quantization" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("failure", ["error", "interrupt"])
def test_failure_midway_leaves_nothing(sources, tmp_path, monkeypatch, capsys, failure):
    import convert.pipeline as pipeline

    calls = []

    def failing_save(directory, name, tree):
        calls.append(name)
        if len(calls) == 3:  # after two items were written
            raise KeyboardInterrupt if failure == "interrupt" else pipeline.ConversionError("disk full")
        return original(directory, name, tree)

    original = pipeline.save_item
    monkeypatch.setattr(pipeline, "save_item", failing_save)
    code = convert_main([str(sources / "original"), str(tmp_path / "out"), "--quiet"])
    assert code == (130 if failure == "interrupt" else 1)
    assert list(tmp_path.iterdir()) == []


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        gj.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a gptoss-jax checkpoint"):
        gj.load_checkpoint(tmp_path)


def test_module_help_runs():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "convert", "--help"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)), check=True).stdout
    assert "SOURCE_DIR" in out and "--overwrite" in out and "--dtype" in out
