"""The converter end to end against both references' own loaders, and its refusals."""

import json
import os

import chex
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import gptoss_jax as gj
from noise import Exact
from gptoss_jax.convert.cli import main as convert_main
from gptoss_jax.testing import write_synthetic_checkpoint
from gptoss_jax.stored import stored_form

LAYOUTS = ("original", "hf-mxfp4", "hf-bf16")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("sources")
    for layout in LAYOUTS:
        write_synthetic_checkpoint(tiny, root / layout, layout, seed=3)
    return root


def _reference_logits(layout, source, tokens) -> Exact:
    """The reference's loader on the checkpoint, its model run in float64 (exact) and float32 (the noise)."""
    with torch.no_grad():
        if layout == "original":
            from gpt_oss.torch.model import Transformer

            model = Transformer.from_checkpoint(str(source), device="cpu").to(torch.float32)
            run = lambda m: m(torch.from_numpy(tokens[0]).long()).double().numpy()  # noqa: E731
        else:
            from transformers import GptOssForCausalLM

            model = GptOssForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager")
            model = model.float().eval()
            model.config._experts_implementation = "eager"  # transformers' grouped experts take no float64
            run = lambda m: m(torch.from_numpy(tokens).long()).logits[0].double().numpy()  # noqa: E731
        return Exact.measure(run(model), run(model.to(torch.float64)))


@pytest.mark.slow
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
    _reference_logits(layout, sources / layout, long_tokens).check(logits[0], layout)


@pytest.mark.slow
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
    assert convert_main([str(sources / "hf-bf16"), str(out), "--quiet"]) == 2  # a usage error: the flag is missing
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert convert_main([str(sources / "hf-bf16"), str(out), "--quiet", "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "gptoss_checkpoint.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_mxfp4_storage_of_decoded_source_is_refused(sources, tmp_path, capsys):
    assert convert_main([str(sources / "hf-bf16"), str(tmp_path / "out"), "--dtype", "mxfp4"]) == 2
    assert "would need quantization" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_output_holding_the_source_is_refused_even_with_overwrite(sources, tmp_path, capsys):
    source = _copy_source(sources / "original", tmp_path / "source")
    assert convert_main([str(source), str(tmp_path), "--overwrite", "--quiet"]) == 2  # would delete the source
    assert f"error: {tmp_path}: holds the source folder {source}; choose another output" in capsys.readouterr().err
    assert convert_main([str(source), str(source / "out"), "--quiet"]) == 2
    assert "must not be inside the source folder" in capsys.readouterr().err
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in (sources / "original").iterdir())


@pytest.mark.slow
def test_missing_parent_folders_are_created_and_said(sources, tmp_path, capsys):
    out = tmp_path / "a" / "b" / "out"
    assert convert_main([str(sources / "hf-bf16"), str(out), "--quiet"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"creating the missing folder {tmp_path / 'a' / 'b'}" in err, err
    assert (out / "gptoss_checkpoint.json").is_file()
    assert convert_main([str(sources / "hf-bf16"), str(tmp_path / "a" / "out2"), "--quiet"]) == 0
    assert "creating" not in capsys.readouterr().err  # said only when it happens


def test_a_failed_run_removes_the_parent_folders_it_created(sources, tmp_path):
    from gptoss_jax.convert import plan_conversion, write_checkpoint

    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "mine.txt").write_text("kept")

    def progress(n):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(plan_conversion(sources / "original"), tmp_path / "a" / "b" / "c" / "out", progress=progress)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # b and c were made by the run: gone
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["mine.txt"]


def test_failure_in_the_worker_is_one_line_and_leaves_nothing(sources, tmp_path):
    from gptoss_jax.convert import ConversionError, plan_conversion, write_checkpoint

    source = _copy_source(sources / "original", tmp_path / "source")
    plan = plan_conversion(source)
    _truncate(source)  # the source changes after it was checked: the worker fails halfway
    with pytest.raises(ConversionError, match="model.safetensors: unreadable safetensors file"):
        write_checkpoint(plan, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_keyboard_interrupt_in_the_library_call_leaves_nothing(sources, tmp_path):
    from gptoss_jax.convert import plan_conversion, write_checkpoint

    seen = []

    def progress(n):
        seen.append(n)
        if len(seen) == 5:  # a few tensors in
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_checkpoint(plan_conversion(sources / "original"), tmp_path / "out", progress=progress)
    assert list(tmp_path.iterdir()) == []


def test_load_checkpoint_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        gj.load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="not a gptoss-jax checkpoint"):
        gj.load_checkpoint(tmp_path)


def test_module_help_runs():
    import subprocess
    import sys

    for module in ("convert", "gptoss_jax.convert"):  # the checkout's short form and the package's
        out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)), check=True).stdout
        assert out.startswith(f"usage: python -m {module} ") and "--overwrite" in out and "--dtype" in out


@pytest.mark.slow
def test_paths_expand_home_and_dtypes_take_both_forms_and_output_permissions(sources, tmp_path, monkeypatch):
    import jax.numpy as jnp

    monkeypatch.setenv("HOME", str(tmp_path))
    umask = os.umask(0o027)
    try:
        assert convert_main([str(sources / "hf-bf16"), "~/ckpt", "--quiet"]) == 0
    finally:
        os.umask(umask)
    assert (tmp_path / "ckpt" / "gptoss_checkpoint.json").is_file()
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o750  # the umask's, not mkdtemp's 0700
    _, by_name = gj.load_checkpoint("~/ckpt", dtype="float32")
    for dtype in (jnp.float32, np.float32, np.dtype("float32")):
        _, params = gj.load_checkpoint("~/ckpt", dtype=dtype)
        chex.assert_trees_all_equal(params, by_name)
    _, bf16 = gj.load_checkpoint("~/ckpt", dtype=jnp.bfloat16)
    assert bf16["embedding"].dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
        gj.load_checkpoint("~/ckpt", dtype=jnp.float16)


# Twenty loads of a damaged checkpoint in one process, each freeing what its restore left behind at a
# different moment, with logging configured (as an application would, so that asyncio's records
# print); then a read that fails after its restore gave up, freed unretrieved, as asyncio reports one.
_DAMAGED_LOADS = """
import asyncio, gc, logging, sys, time
import gptoss_jax as gj
logging.basicConfig()
for i in range(20):
    try:
        gj.load_checkpoint(sys.argv[1])
    except ValueError as e:
        print(e, file=sys.stderr)
    if i % 2:
        gc.collect()
    time.sleep(0.01 * (i % 5))
loop = asyncio.new_event_loop()
late = loop.create_future()
late.set_exception(ValueError("OUT_OF_RANGE: Error reading a chunk"))
del late
gc.collect()
time.sleep(0.5)  # reads still in flight land here
"""


@pytest.mark.slow
def test_a_damaged_checkpoint_is_one_error_line(sources, tmp_path, capfd):
    """Each failed load is one line, whatever TensorStore's other reads do (they fail or finish into a
    closed event loop at any moment, even before the failure reaches the caller); the command line
    exits 1 with that line. Mutations tried: without the filter on asyncio's log, the late failed
    read prints three lines; with the filters installed only once a restore has failed, 3 of 30
    command-line runs on a loaded 2-core machine printed a traceback of a read that landed first."""
    import subprocess
    import sys

    assert convert_main([str(sources / "original"), str(tmp_path / "ckpt"), "--quiet"]) == 0
    data = max((tmp_path / "ckpt" / "params" / "block_1").rglob("d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    capfd.readouterr()
    message = "params/block_1: cannot read checkpoint item 'block_1'; is the checkpoint truncated"
    err = subprocess.run([sys.executable, "-c", _DAMAGED_LOADS, str(tmp_path / "ckpt")], capture_output=True,
                         text=True, cwd=ROOT).stderr
    lines = err.splitlines()
    assert len(lines) == 20 and all(message in line for line in lines), err  # which read fails first varies
    run = subprocess.run([sys.executable, os.path.join(ROOT, "run_inference.py"), "--checkpoint",
                          str(tmp_path / "ckpt"), "--prompt-ids", "1,2", "--quiet"], capture_output=True, text=True,
                         cwd=ROOT)
    # Its own header lines (what it loads, on which devices), then the error, once.
    errors = [line for line in run.stderr.splitlines() if not line.startswith(("model: ", "devices: "))]
    assert run.returncode == 1 and len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], \
        run.stderr


@pytest.mark.slow
def test_loading_shows_a_progress_bar_over_the_items_on_stderr(sources, tmp_path, capsys):
    assert convert_main([str(sources / "original"), str(tmp_path / "ckpt"), "--quiet"]) == 0
    capsys.readouterr()
    config, _ = gj.load_checkpoint(tmp_path / "ckpt", progress=True)
    captured = capsys.readouterr()
    items = config.num_hidden_layers + 2
    assert captured.out == "" and "loading" in captured.err and f"/{items} (" in captured.err  # item i/N
    assert "B/s" in captured.err  # bytes, with a rate and ETA
    gj.load_checkpoint(tmp_path / "ckpt")
    assert capsys.readouterr().err == ""  # the library is quiet unless asked


@pytest.mark.slow
def test_arrays_stored_in_chunks_load_a_chunk_at_a_time(sources, tmp_path, monkeypatch):
    """Without a mesh, items holding arrays stored in chunks (experts: one expert a chunk; the
    embedding and unembedding above 64 MiB, re-saved here in 4 KiB chunks) are read a few whole
    chunks at a time, each read placed on the device on its own: the values are exactly the stored
    ones (packed experts stay packed), no read exceeds the budget, and a damaged chunk is one error."""
    import shutil

    import ml_dtypes
    import orbax.checkpoint as ocp

    from gptoss_jax import checkpoint

    assert convert_main([str(sources / "original"), str(tmp_path / "ckpt"), "--quiet"]) == 0
    items = tmp_path / "ckpt" / "params"
    stored = {}
    for item in sorted(items.iterdir()):
        stored.update(ocp.StandardCheckpointer().restore(item.absolute()))
    for name in ("embedding", "final"):
        tree = ocp.StandardCheckpointer().restore((items / name).absolute())
        shutil.rmtree(items / name)
        checkpoint.save_item(str(tmp_path / "ckpt"), name, tree, chunk_bytes=4096)
    layout = checkpoint._stored_layout(ocp.StandardCheckpointer(), str(items / "final"), "final")
    assert checkpoint._chunk_shape(layout["unembedding"]) is not None
    monkeypatch.setattr(checkpoint, "CHUNK_BYTES", 8192)
    placed = []
    place = checkpoint._place
    monkeypatch.setattr(checkpoint, "_place", lambda whole, part, start: placed.append(part.nbytes) or
                        place(whole, part, start))
    _, packed = gj.load_checkpoint(tmp_path / "ckpt", dtype="mxfp4")
    chex.assert_trees_all_equal(stored_form(packed), jax_tree_cast(stored, ml_dtypes.bfloat16))  # as on disk
    assert len(placed) > 20 and max(placed) <= 8192
    _, f32 = gj.load_checkpoint(tmp_path / "ckpt", dtype="float32")  # experts decoded on the host
    for name in ("embedding", "unembedding"):
        np.testing.assert_array_equal(f32[name], stored[name].astype(np.float32))
    data = max((items / "embedding").rglob("d/*"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ValueError, match="params/embedding: cannot read checkpoint item 'embedding'"):
        gj.load_checkpoint(tmp_path / "ckpt", dtype="mxfp4")


def jax_tree_cast(tree, dtype):
    """Floating arrays other than the norm scales (float32) cast to dtype; packed bytes as they are."""
    import jax

    def cast(path, x):
        floating = np.issubdtype(x.dtype, np.floating) or x.dtype == dtype
        return x.astype(dtype) if floating and str(path[-1].key) != "scale" else x

    return jax.tree_util.tree_map_with_path(cast, tree)


def test_allocator_arenas_can_be_limited():
    """The command line caps glibc's malloc arenas as it starts (hostmem.py); elsewhere it is a no-op."""
    import platform

    from gptoss_jax.hostmem import limit_allocator_arenas

    assert limit_allocator_arenas() is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")


def test_checkpoints_store_q_k_v_apart_as_published(tiny, tmp_path):
    """The model's fused q, k, v weight is stored as the three parts the published checkpoints name
    (so checkpoints written before the model fused them load unchanged), and loading fuses them back
    exactly: on one device, and onto a mesh with the KV heads split."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import PartitionSpec

    from gptoss_jax import formats
    from gptoss_jax.checkpoint import save_checkpoint
    from gptoss_jax.testing import random_params

    params = random_params(tiny, seed=1, dtype=jnp.bfloat16)
    save_checkpoint(tmp_path, tiny, params)
    attn = ocp.StandardCheckpointer().restore((tmp_path / "params" / "block_0").absolute())["block_0"]["attn"]
    fused = np.asarray(params["block_0"]["attn"]["qkv_weight"])
    assert "qkv_weight" not in attn and attn["q_weight"].shape == (tiny.hidden_size, tiny.num_attention_heads,
                                                                   tiny.head_dim)
    for name in ("q_weight", "k_weight", "v_weight"):
        np.testing.assert_array_equal(np.asarray(attn[name]), formats.qkv_part(fused, name))
    mesh = gj.make_mesh(expert=4, tensor=2)
    for kwargs in ({}, {"mesh": mesh}):
        _, back = gj.load_checkpoint(tmp_path, **kwargs)
        chex.assert_trees_all_equal(jax.tree.map(np.asarray, back), jax.tree.map(np.asarray, params))
    assert back["block_0"]["attn"]["qkv_weight"].sharding.spec == PartitionSpec(None, "tensor", None, None)
