"""Sharded against one device: 8 CPU devices (conftest.py), five meshes, and two processes of 4.

For each mesh the parameters are loaded straight into their sharded layout from a converted
checkpoint (MXFP4 experts), then checked against the single-device run: float32 logits, greedy
tokens, each parameter's sharding as the rules table says, bytes per device, and the compiled
steps' collectives (activation-sized, never a gathered weight).
"""

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec

import gptoss_jax as gj
from conftest import TWO_LAYERS, command_env, expected_spec, free_port
from refs import exact_logits
from gptoss_jax import sharding as sh
from gptoss_jax.convert.cli import main as convert_main
from gptoss_jax.decoding import steps
from gptoss_jax.decoding.checked import row_settings
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.model.transformer import _forward
from gptoss_jax.params import check_mesh, param_shardings
from gptoss_jax.sampling import Sampling
from gptoss_jax.testing import write_synthetic_checkpoint
from gptoss_jax.weight import path_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MESHES = [dict(data=8), dict(expert=8), dict(tensor=8), dict(data=2, expert=2, tensor=2), dict(expert=4, tensor=2)]
PROMPT_LENGTHS = (5, 150, 17, 1, 40, 140, 9, 64)  # a batch of 8, several past the 16-token window
GREEDY = Sampling(temperature=0.0)


def _mesh_id(sizes):
    return ",".join(f"{k}={v}" for k, v in sizes.items())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model with two layers (conftest.TWO_LAYERS): a layout is a weight's, whatever its layer."""
    root = tmp_path_factory.mktemp("sharded")
    write_synthetic_checkpoint(TWO_LAYERS, root / "source", "original", seed=5)
    assert convert_main([str(root / "source"), str(root / "ckpt"), "--quiet"]) == 0
    return root / "ckpt"


@pytest.fixture(scope="module")
def single(checkpoint):
    """The one-device run everything is compared with."""
    config, params = gj.load_checkpoint(checkpoint, dtype="float32")
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, config.vocab_size, size=(8, 160)).astype(np.int32)
    prompts = [list(rng.integers(0, config.vocab_size, n)) for n in PROMPT_LENGTHS]
    results = Generator(config, params, max_len=192).generate(prompts, max_new_tokens=10, sampling=GREEDY)
    # Logits are checked against transformers in float64 (noise.py): one device in test_model.py,
    # the meshes here, so that the two agree to within twice the bound.
    return {"config": config, "params": params, "tokens": tokens, "prompts": prompts,
            "exact": exact_logits(config, params, tokens), "greedy": [r.output_ids for r in results]}


@pytest.mark.slow
@pytest.mark.parametrize("sizes", MESHES, ids=_mesh_id)
def test_sharded_matches_one_device(checkpoint, single, sizes):
    config = single["config"]
    mesh = gj.make_mesh(**sizes)
    _, params = gj.load_checkpoint(checkpoint, dtype="float32", mesh=mesh)

    # Loaded straight into the layout the rules give, values identical to the one-device load.
    axes = gj.logical_axes(config)
    flat_axes = jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, PartitionSpec))
    per_device = dict.fromkeys(mesh.devices.flat, 0)
    total = 0
    for (path, leaf), names, ref in zip(jax.tree_util.tree_leaves_with_path(params), flat_axes,
                                        jax.tree.leaves(single["params"]), strict=True):
        what = path_name(path)
        assert leaf.sharding.spec == expected_spec(tuple(names), leaf.shape, mesh, gj.RULES), what
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref), err_msg=what)
        split = math.prod(mesh.shape[a] for a in leaf.sharding.spec if a is not None)
        for shard in leaf.addressable_shards:
            assert shard.data.nbytes * split == leaf.nbytes, what  # each device holds 1/split of it
            per_device[shard.device] += shard.data.nbytes
        total += leaf.nbytes
    expert_bytes = sum(leaf.nbytes for path, leaf in jax.tree_util.tree_leaves_with_path(params)
                       if "mlp1_weight" in path_name(path) or "mlp2_weight" in path_name(path))
    ways = sizes.get("expert", 1) * sizes.get("tensor", 1)
    for device, held in per_device.items():
        # No device holds the model: the expert matrices are split over expert x tensor.
        assert held <= total - expert_bytes * (1 - 1 / ways) + 1, (device, held, total)
    # Some layouts must split the experts; check the specs the table implies.
    mlp1 = params["block_0"]["mlp"]["mlp1_weight"].sharding.spec
    assert mlp1 == PartitionSpec("expert" if "expert" in sizes else None, "tensor" if "tensor" in sizes else None, None)

    # float32 logits of a batch of 8 x 160 tokens, and greedy generation for prompts of 1-150 tokens.
    single["exact"].check(gj.forward(config, params, single["tokens"]), "logits")
    # Prompts up to 150 tokens in chunks of 64: three prefill steps chained.
    results = Generator(config, params, max_len=192, prefill_chunk=64).generate(single["prompts"], max_new_tokens=10,
                                                                               sampling=GREEDY)
    assert [r.output_ids for r in results] == single["greedy"]


@pytest.mark.slow
@pytest.mark.parametrize("sizes", [dict(expert=8), dict(expert=4, tensor=2)], ids=_mesh_id)
def test_no_weight_is_gathered_in_a_step(single, sizes):
    """The compiled prefill and decode steps move activations only: their largest collective is no
    bigger than the [tokens, embed] activations or the [batch, vocab] logits, far below any expert weight."""
    config = single["config"]
    mesh = gj.make_mesh(**sizes)
    shardings = param_shardings(config, mesh)
    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            gj.abstract_params(config, "float32"), shardings)
    B, T = 2, 32  # small enough that the tiny model's activations stay below its expert weights
    prefill = _forward.lower(config, abstract, jax.ShapeDtypeStruct((B, T), np.int32), gj.Kernels(), mesh)
    B = 8
    cache = gj.init_cache(config, B, 192, "float32", mesh=mesh)
    token, plan = jax.ShapeDtypeStruct((B,), np.int32), jax.ShapeDtypeStruct((4, B), np.int32)
    settings = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in row_settings(GREEDY, 0, B))
    decode = steps.decode.lower(steps.Decode(steps.Model(config, gj.Kernels(), mesh), 8, "greedy"), abstract, cache,
                                token, plan, settings, jax.ShapeDtypeStruct((config.vocab_size,), bool))  # 8 steps
    smallest_expert_weight = min(config.num_experts * 2 * config.intermediate_size * config.hidden_size,
                                 config.num_experts * config.hidden_size * config.intermediate_size) * 4
    for lowered, activations in ((prefill, B * T * config.hidden_size * 4),
                                 (decode, B * max(config.hidden_size, config.vocab_size) * 4)):
        found = sh.collectives(lowered.compile().as_text())
        assert found, "a sharded step has no collective at all"
        op, size, kind = found[0]
        assert size <= activations < smallest_expert_weight, (op, size, kind)


@pytest.mark.parametrize("sizes, message", [
    (dict(data=3), "spans 3 devices, but there are 8"),
    (dict(expert=3), "expert=3 does not divide the 8 experts"),
    (dict(tensor=16), "tensor=16 does not divide"),
])
def test_bad_meshes_are_refused_with_the_reason(tiny, sizes, message):
    with pytest.raises(ValueError, match=message):
        check_mesh(tiny, {"data": 1, "expert": 1, "tensor": 1, **sizes})
        gj.make_mesh(**sizes)


@pytest.mark.slow
def test_bad_mesh_flags_fail_before_loading(checkpoint, tmp_path):
    """One error line, exit 2, nothing read: the checkpoint has no weights at all, only its JSON, so
    reaching the loader would fail differently."""
    import shutil

    for name in ("gptoss_checkpoint.json", "config.json"):
        shutil.copy(checkpoint / name, tmp_path / name)
    checkpoint = tmp_path
    cases = [("expert=4,tensor=2", "spans 8 devices, but there is 1"), ("expert=3", "expert=3 does not divide"),
             ("gpus=2", "unknown mesh axis 'gpus'"), ("expert=two", "expected an integer")]
    for flag, message in cases:
        env = command_env()
        run = subprocess.run([sys.executable, "run_inference.py", "--checkpoint", str(checkpoint), "--prompt-ids",
                              "1,2", "--mesh", flag], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 2, run.stderr
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: --mesh") and message in lines[0], run.stderr


@pytest.mark.slow
def test_a_batch_that_does_not_split_over_data_is_said(checkpoint, capfd):
    from gptoss_jax.cli.generate import main

    argv = ["--checkpoint", str(checkpoint), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--json",
            "--mesh", "data=2,expert=4"]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "warning: a batch of 1 does not split over data=2" in err
    assert "devices: data=2,expert=4,tensor=1 over 8 cpu devices (1 process)" in err


def test_default_layout_and_flag_parsing(tiny):
    from gptoss_jax.layout import default_sizes, parse_mesh

    assert parse_mesh("tensor=4") == {"data": 1, "expert": 1, "tensor": 4}
    config20b = gj.ModelConfig.gpt_oss_20b()
    assert default_sizes(config20b, 1, 1) == {"data": 1, "expert": 1, "tensor": 1}
    assert default_sizes(config20b, 8, 8) == {"data": 1, "expert": 8, "tensor": 1}
    assert default_sizes(config20b, 64, 8) == {"data": 2, "expert": 32, "tensor": 1}  # 8 hosts of 8
    assert default_sizes(gj.ModelConfig.gpt_oss_120b(), 2, 2) == {"data": 1, "expert": 2, "tensor": 1}
    assert default_sizes(tiny, 16, 16) == {"data": 1, "expert": 8, "tensor": 2}
    assert default_sizes(tiny, 3, 3) == {"data": 3, "expert": 1, "tensor": 1}
    assert dict(gj.make_mesh(config=tiny).shape) == {"data": 1, "expert": 8, "tensor": 1}  # 8 CPU devices
    with pytest.raises(ValueError, match="needs axis sizes"):
        gj.make_mesh()


# Two processes ------------------------------------------------------------------------------------

_WORKER = """
import json, sys
import tensorstore as ts
from gptoss_jax.cli.generate import main
code = main(sys.argv[2:], prog="run_inference.py")
read = sum(v["value"] for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/file/bytes_read")
           for v in m["values"])
with open(sys.argv[1], "w") as f:
    json.dump({"code": code, "bytes_read": read}, f)
sys.exit(code)
"""


@pytest.fixture(scope="module")
def wide_checkpoint(tmp_path_factory, tiny):
    """16 experts of 256 units, so that the experts are most of what is read."""
    config = tiny.replace(num_experts=16, intermediate_size=256)
    root = tmp_path_factory.mktemp("wide")
    write_synthetic_checkpoint(config, root / "source", "original", seed=6)
    assert convert_main([str(root / "source"), str(root / "ckpt"), "--quiet"]) == 0
    return root / "ckpt"


@pytest.mark.slow
def test_two_processes_generate_as_one_and_read_only_their_slices(wide_checkpoint, tmp_path):
    argv = ["--checkpoint", str(wide_checkpoint), "--prompt-ids", ",".join(str(i) for i in range(3, 153)),
            "--temperature", "0", "--dtype", "float32", "--json", "--max-new-tokens", "12", "--quiet"]
    env = command_env()
    one = subprocess.run([sys.executable, "-c", _WORKER, str(tmp_path / "one.json")] + argv, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr
    port = free_port()
    env["JAX_NUM_CPU_DEVICES"] = "4"
    # Process 0 is told by flags, process 1 by the environment variables.
    how = [(["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "0"], env),
           ([], dict(env, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID="1"))]
    procs = [subprocess.Popen([sys.executable, "-c", _WORKER, str(tmp_path / f"p{i}.json")] + argv +
                              ["--mesh", "expert=8"] + flags, cwd=ROOT, env=process_env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i, (flags, process_env) in enumerate(how)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    assert "devices: data=1,expert=8,tensor=1 over 8 cpu devices (2 processes)" in outs[0][1]
    # Only process 0 prints (gloo, the CPU collectives library, announces its connections itself).
    assert outs[1][0] == "" and all(line.startswith("[Gloo]") for line in outs[1][1].splitlines() if line), outs[1][1]
    assert json.loads(outs[0][0])["output_ids"] == json.loads(one.stdout)["output_ids"]

    reads = [json.loads((tmp_path / f"p{i}.json").read_text())["bytes_read"] for i in range(2)]
    whole = json.loads((tmp_path / "one.json").read_text())["bytes_read"]
    expert_share = _expert_share(wide_checkpoint)
    for read in reads:
        # Each process reads what is not expert-split, plus its half of the experts (chunks of one
        # expert), plus metadata (measured: 5% over); reading everything would be 1.0.
        assert read < whole * (1 - expert_share / 2) * 1.10, (reads, whole, expert_share)


def _expert_share(checkpoint) -> float:
    from gptoss_jax.checkpoint import storage_spec
    from gptoss_jax.metadata import read_metadata

    config, meta = read_metadata(checkpoint)
    spec = storage_spec(config, meta["expert_storage"])
    sizes = {path_name(p): leaf.size * np.dtype(leaf.dtype).itemsize
             for p, leaf in jax.tree_util.tree_leaves_with_path(spec)}
    experts = sum(v for k, v in sizes.items() if "/mlp/mlp" in k)
    return experts / sum(sizes.values())


@pytest.mark.slow
def test_extend_on_a_mesh_matches_one_device(single):
    """The library's own cached path: a sharded cache from init_cache(mesh=...), a 150-token prompt
    (past the window), then three one-token steps, each step's logits against one device's."""
    config = single["config"]
    mesh = gj.make_mesh(expert=4, tensor=2)
    params = jax.device_put(single["params"], param_shardings(config, mesh))
    tokens = single["tokens"][:2, :150]
    runs = []
    for p, m in ((single["params"], None), (params, mesh)):
        cache = gj.init_cache(config, 2, 160, "float32", mesh=m)
        logits, cache = gj.extend(config, p, tokens, cache)
        steps = [logits]
        for t in range(3):
            logits, cache = gj.extend(config, p, single["tokens"][:2, 150 + t:151 + t], cache)
            steps.append(logits)
        runs.append(steps)
    kv_on_tensor = jax.sharding.NamedSharding(mesh, PartitionSpec(None, None, "tensor", None))
    assert cache["block_1"]["k"].sharding.is_equivalent_to(kv_on_tensor, 4)
    exact = single["exact"]
    for t, (sharded, one) in enumerate(zip(runs[1], runs[0], strict=True)):
        want = exact[:2, :150] if t == 0 else exact[:2, 149 + t:150 + t]
        want.check(one, f"one device, step {t}")
        want.check(sharded, f"mesh, step {t}")


@pytest.mark.slow
def test_random_weights_are_drawn_in_place(tiny):
    from gptoss_jax.testing import random_params_on_device

    mesh = gj.make_mesh(expert=4, tensor=2)
    params = random_params_on_device(tiny, seed=0, dtype="float32", mesh=mesh)
    want = param_shardings(tiny, mesh)
    for got, expected in zip(jax.tree.leaves(params), jax.tree.leaves(want), strict=True):
        assert got.sharding.is_equivalent_to(expected, got.ndim), (got.sharding, expected)
    mlp1 = params["block_0"]["mlp"]["mlp1_weight"]
    assert {s.data.shape for s in mlp1.addressable_shards} == {(2, 96, 64)}  # 8 experts / 4, 192 units / 2


@pytest.mark.slow
def test_pallas_kernels_run_per_device_on_a_mesh(checkpoint, single):
    # The Triton decode kernels (in interpret mode here) see each device's sequences and KV heads
    # (attention, under shard_map) and experts (the MoE), and give the one-device tokens.
    config = single["config"]
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    _, params = gj.load_checkpoint(checkpoint, dtype="float32", mesh=mesh)
    kernels = gj.Kernels(attention="triton", moe="triton", interpret=True)
    results = Generator(config, params, max_len=192, prefill_chunk=64, kernels=kernels).generate(
        single["prompts"], max_new_tokens=10, sampling=GREEDY)
    assert [r.output_ids for r in results] == single["greedy"]


@pytest.mark.slow
def test_a_vocabulary_that_tensor_does_not_divide_is_replicated(tiny):
    """A fine-tuned model's 283-id vocabulary on expert=4,tensor=2: accepted, embedding and unembedding
    kept whole on every device (said in the devices line), greedy tokens those of one device."""
    from gptoss_jax.testing import random_params

    config = tiny.replace(vocab_size=283)
    mesh = gj.make_mesh(expert=4, tensor=2)
    check_mesh(config, mesh)
    params = random_params(config, seed=5)
    placed = jax.device_put(params, param_shardings(config, mesh))
    assert placed["embedding"].sharding.spec == PartitionSpec(None, None)
    assert placed["unembedding"].sharding.spec == PartitionSpec(None, None)
    assert placed["block_0"]["attn"]["qkv_weight"].sharding.spec != PartitionSpec(None, None, None, None)  # heads split
    assert sh.describe(mesh, config).endswith("; replicated: vocab (283 on tensor=2)")
    assert "replicated" not in sh.describe(mesh, tiny)  # 1024 ids divide
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, 283, n)) for n in (5, 40)]
    one = Generator(config, params, max_len=64).generate(prompts, max_new_tokens=8, sampling=GREEDY)
    many = Generator(config, placed, max_len=64).generate(prompts, max_new_tokens=8, sampling=GREEDY)
    assert [r.output_ids for r in many] == [r.output_ids for r in one]
