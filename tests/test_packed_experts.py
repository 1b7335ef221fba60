"""Experts kept packed in MXFP4 on the device (decoded inside each jitted step) against experts
decoded ahead of time: the jnp decoder bit for bit, the model's logits and greedy tokens, loading a
converted checkpoint (one device and a mesh), random packed weights and the command line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import NamedSharding, PartitionSpec

import gptoss_jax as gj
import run_inference
from gptoss_jax.checkpoint import dtype_name, save_checkpoint
from gptoss_jax.convert.cli import main as convert_main
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.mxfp4 import MXFP4, decode, decode_mxfp4, decode_params, packed
from gptoss_jax.sampling import Sampling
from gptoss_jax.params import check_mesh
from gptoss_jax.testing import random_params, random_params_on_device, write_synthetic_checkpoint
from gptoss_jax.weight import path_name
from noise import Exact, check_typical_tokens
from refs import exact_logits, exact_moe_block, openai_model, t

GREEDY = Sampling(temperature=0.0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_device_decoder_is_bit_exact_for_every_scale_and_byte(dtype):
    """Every (scale, byte) pair: signed zeros, subnormals (scales 0 and 1), inf (scale 255)."""
    blocks = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(256, 16, 16)  # [scale, G=16, 16]
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    want = decode_mxfp4(blocks, scales, dtype)
    got = np.asarray(jax.jit(decode, static_argnums=2)(jnp.asarray(blocks), jnp.asarray(scales), dtype))
    assert got.dtype == want.dtype and got.shape == (256, 16 * 32)
    bits = np.uint16 if dtype == "bfloat16" else np.uint32
    np.testing.assert_array_equal(got.view(bits), want.view(bits))


def test_device_decoder_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        decode(jnp.zeros((1, 16), jnp.uint8), jnp.zeros((1,), jnp.uint8), jnp.float16)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny):
    root = tmp_path_factory.mktemp("packed")
    write_synthetic_checkpoint(tiny, root / "source", "original", seed=11)
    assert convert_main([str(root / "source"), str(root / "packed"), "--quiet"]) == 0
    assert convert_main([str(root / "source"), str(root / "decoded"), "--dtype", "bfloat16", "--quiet"]) == 0
    return root


def _with_packed_experts(params, packed_params):
    """params with the expert matrices of packed_params (held packed)."""
    return jax.tree.map(lambda a, p: p if packed(p) else a, params, packed_params, is_leaf=packed)


@pytest.fixture(scope="module")
def loaded(checkpoints):
    config, mx = gj.load_checkpoint(checkpoints / "packed", dtype="mxfp4")
    _, bf16 = gj.load_checkpoint(checkpoints / "packed", dtype="bfloat16")
    _, f32 = gj.load_checkpoint(checkpoints / "packed", dtype="float32")
    return config, mx, bf16, f32


@pytest.mark.slow
def test_load_keeps_experts_packed_and_the_rest_bfloat16(loaded, tiny):
    config, mx, bf16, _ = loaded
    mlp = mx["block_1"]["mlp"]
    E, D, F = tiny.num_experts, tiny.hidden_size, tiny.intermediate_size
    assert mlp["mlp1_weight"].blocks.shape == (E, 2 * F, D // 32, 16) and mlp["mlp1_weight"].blocks.dtype == jnp.uint8
    assert mlp["mlp2_weight"].scales.shape == (E, D, F // 32) and mlp["mlp2_weight"].scales.dtype == jnp.uint8
    assert mx["embedding"].dtype == jnp.bfloat16 and mlp["mlp1_bias"].dtype == jnp.bfloat16
    assert mx["norm"]["scale"].dtype == jnp.float32
    # Decoded on the device, the packed experts are the bfloat16 load's experts exactly.
    np.testing.assert_array_equal(np.asarray(decode_params(mx)["block_1"]["mlp"]["mlp1_weight"]),
                                  np.asarray(bf16["block_1"]["mlp"]["mlp1_weight"]))
    # Half a byte per value and one scale per 32: about a quarter of bfloat16's bytes.
    packed_bytes = sum(x.nbytes for x in jax.tree.leaves(mlp["mlp1_weight"]))
    assert packed_bytes / bf16["block_1"]["mlp"]["mlp1_weight"].nbytes == pytest.approx(17 / 64)


@pytest.fixture(scope="module")
def exact_long(loaded, long_tokens):
    """Over 300 tokens (past the window), on the decoded weights: transformers' float64 logits with its
    float32 run as the noise (noise.py); OpenAI's float64 and bfloat16 logits on the bf16 weights."""
    config, _, bf16, f32 = loaded
    tokens = torch.from_numpy(long_tokens[0]).long()
    with torch.no_grad():
        want16 = openai_model(config, f32).to(torch.float64)(tokens).numpy()
        theirs16 = openai_model(config, bf16, "bfloat16")(tokens).double().numpy()
    return exact_logits(config, f32, long_tokens)[0], want16, theirs16


@pytest.mark.slow
@pytest.mark.parametrize("moe", ["gather", "grouped"])
def test_logits_match_experts_decoded_ahead_of_time(loaded, long_tokens, exact_long, moe):
    """float32 activations, experts packed or decoded when loaded: each within NOISE_FACTOR x
    transformers' float32 noise of its float64 logits. bfloat16, packed or decoded: each as accurate
    on the typical token as OpenAI's own bfloat16 run (noise.check_typical_tokens). Mutation tried:
    decoding the packed experts with every scale one step too large (x2) fails both."""
    config, mx, bf16, f32 = loaded
    exact32, want16, theirs16 = exact_long
    kernels = gj.Kernels(moe=moe)
    for name, params in (("packed", _with_packed_experts(f32, mx)), ("decoded", f32)):
        exact32.check(gj.forward(config, params, long_tokens, kernels=kernels)[0], f"float32 {name}")
    for name, params in (("packed", mx), ("decoded", bf16)):
        check_typical_tokens(gj.forward(config, params, long_tokens, kernels=kernels)[0], theirs16, want16,
                             f"bfloat16 {name}")


@pytest.mark.slow
def test_greedy_tokens_equal_in_float32(loaded):
    """Generation with packed experts and float32 activations: the tokens of the float32 load, for a
    batch of prompts around the window, decoded on the gather path and prefilled in chunks."""
    config, mx, _, f32 = loaded
    rng = np.random.default_rng(3)
    prompts = [list(rng.integers(0, config.vocab_size, n)) for n in (5, 40, 17, 33)]
    run = lambda params: [r.output_ids for r in Generator(config, params, max_len=80, prefill_chunk=16).generate(
        prompts, max_new_tokens=12, sampling=GREEDY)]
    assert run(_with_packed_experts(f32, mx)) == run(f32)


@pytest.mark.slow
def test_packed_experts_on_a_mesh_match_one_device(checkpoints, loaded):
    """Loaded straight into a mesh: blocks and scales split over `expert` as their weight is and equal
    to the one-device load; float32 logits with them are the one-device run's."""
    config, mx, _, f32 = loaded
    tokens = np.random.default_rng(5).integers(0, config.vocab_size, size=(4, 40)).astype(np.int32)
    exact = exact_logits(config, f32, tokens)  # float64, float32 noise (noise.py)
    exact.check(gj.forward(config, _with_packed_experts(f32, mx), tokens), "one device")
    for sizes in (dict(expert=8), dict(data=2, expert=4)):
        mesh = gj.make_mesh(**sizes)
        _, params = gj.load_checkpoint(checkpoints / "packed", dtype="mxfp4", mesh=mesh)
        w = params["block_0"]["mlp"]["mlp1_weight"]
        assert w.blocks.sharding.spec == PartitionSpec("expert", None, None, None)
        assert w.scales.sharding.spec == PartitionSpec("expert", None, None)
        for got, ref in zip(jax.tree.leaves(params), jax.tree.leaves(mx), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
        _, f32_mesh = gj.load_checkpoint(checkpoints / "packed", dtype="float32", mesh=mesh)
        # float32 activations: in bfloat16 a rounding difference can flip a tiny model's expert choice.
        exact.check(gj.forward(config, _with_packed_experts(f32_mesh, params), tokens), str(sizes))


def test_packed_blocks_must_split_whole(tiny):
    """The tiny model's intermediate size holds 3 blocks of 32: tensor=2 cannot split them (checked
    from the axis sizes alone, before anything is loaded)."""
    with pytest.raises(ValueError, match="tensor=2 does not divide the 3 MXFP4 blocks"):
        check_mesh(tiny, {"data": 1, "expert": 1, "tensor": 2}, dtype="mxfp4")
    check_mesh(tiny, {"data": 1, "expert": 1, "tensor": 2})  # decoded experts split fine


def test_decoded_storage_cannot_stay_packed(checkpoints):
    with pytest.raises(ValueError, match="stores its experts decoded .*--dtype mxfp4"):
        gj.load_checkpoint(checkpoints / "decoded", dtype="mxfp4")
    with pytest.raises(ValueError, match="mxfp4 is for the experts only"):
        dtype_name("mxfp4")


@pytest.mark.slow
def test_random_packed_weights_look_like_the_published_ones(tiny):
    """Packed random weights, on the host or drawn on the device: uint8 blocks and scales, decoded
    magnitudes near the dense draw's, and the same tree as a packed load."""
    host = random_params(tiny, seed=1, dtype="mxfp4")
    device = random_params_on_device(tiny, seed=1, dtype="mxfp4")
    want = gj.abstract_params(tiny, "mxfp4")
    dense = random_params(tiny, seed=1, dtype=jnp.float32)
    for params in (host, device):
        assert jax.tree.map(lambda x: (x.shape, x.dtype), params) == jax.tree.map(lambda x: (x.shape, x.dtype), want)
        w = np.asarray(decode_params(params, jnp.float32)["block_0"]["mlp"]["mlp1_weight"])
        rms, dense_rms = np.sqrt(np.mean(w ** 2)), np.sqrt(np.mean(np.asarray(dense["block_0"]["mlp"]["mlp1_weight"]) ** 2))
        assert 0.5 < rms / dense_rms < 2, (rms, dense_rms)
    # Drawn straight into a mesh's layout, equal to the one-device draw.
    mesh = gj.make_mesh(expert=8)
    sharded = random_params_on_device(tiny, seed=1, dtype="mxfp4", mesh=mesh)
    blocks = sharded["block_0"]["mlp"]["mlp2_weight"].blocks
    assert blocks.sharding.is_equivalent_to(NamedSharding(mesh, PartitionSpec("expert", None, None, None)), 4)
    assert blocks.addressable_shards[0].data.shape[0] == tiny.num_experts // 8
    for got, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(device), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.slow
def test_packed_weights_are_a_type_of_their_own(tiny, loaded, tmp_path):
    """dtype "mxfp4" (drawn, or loaded) holds exactly every block's two expert matrices as MXFP4,
    which jax.tree.map and jax.jit pass through as MXFP4 and a checkpoint saved from gives back;
    a {"blocks", "scales"} dict (the on-disk form) is not a packed weight."""
    def packed_paths(params):
        return {path_name(p) for p, x in jax.tree_util.tree_leaves_with_path(params, is_leaf=packed) if packed(x)}

    experts = {f"block_{i}/mlp/{n}" for i in range(tiny.num_hidden_layers) for n in ("mlp1_weight", "mlp2_weight")}
    params = random_params(tiny, seed=2, dtype="mxfp4")
    assert packed_paths(params) == packed_paths(loaded[1]) == experts
    assert packed_paths(jax.tree.map(lambda x: x + 0, params)) == experts
    assert packed_paths(jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p))(params)) == experts
    w = params["block_0"]["mlp"]["mlp1_weight"]
    assert type(w) is MXFP4 and [x.dtype for x in jax.tree.leaves(w)] == [jnp.uint8, jnp.uint8]
    group = {"blocks": w.blocks, "scales": w.scales}
    assert not packed(group) and not packed(w.blocks) and not packed((w.blocks, w.scales))
    assert decode_params({"w": group}) == {"w": group}  # not decoded: not a packed weight
    save_checkpoint(tmp_path, tiny, params)
    _, back = gj.load_checkpoint(tmp_path, dtype="mxfp4")
    assert packed_paths(back) == experts
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_packed_experts_beside_float32_weights_are_not_saved(tiny, tmp_path):
    """A checkpoint stores packed experts beside bfloat16 weights only (what dtype "mxfp4" loads): packed
    experts in a float32 tree are refused before anything is written, naming the weight and the fix."""
    mixed = _with_packed_experts(random_params(tiny, seed=3, dtype=jnp.float32), random_params(tiny, seed=3,
                                                                                              dtype="mxfp4"))
    with pytest.raises(ValueError, match="embedding is float32: cast the other weights to bfloat16"):
        save_checkpoint(tmp_path / "ckpt", tiny, mixed)
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 3])
def test_triton_matvec_reads_packed_experts(loaded, tokens):
    """The decode kernel for packed experts (Pallas interpret mode), float32 activations: decoding in
    registers gives the MoE output of the experts' definition in float64 (refs.exact_moe_block, for
    the experts our router picks), within NOISE_FACTOR x its float32 run's noise; so does the gather
    path on the experts decoded ahead of time."""
    from gptoss_jax.model.moe import MLPBlock

    config, mx, _, f32 = loaded
    mixed = _with_packed_experts(f32, mx)["block_1"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, config.hidden_size), jnp.float32)
    exact = exact_moe_block(config, f32["block_1"]["mlp"], x)
    got = jax.jit(MLPBlock(config, jnp.float32, gj.Kernels(moe="triton", interpret=True)).apply)({"params": mixed}, x)
    want = jax.jit(MLPBlock(config, jnp.float32, gj.Kernels(moe="gather")).apply)({"params": f32["block_1"]["mlp"]}, x)
    exact.check(got[0], "triton, packed")
    exact.check(want[0], "gather, decoded")


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [5, 40])
def test_triton_grouped_matmul_reads_packed_experts(loaded, tokens):
    """The prompt kernel for packed experts (Pallas interpret mode), bfloat16 activations: the MoE
    output of the experts' definition in float64 (refs.exact_moe_block), within NOISE_FACTOR x the
    noise of that definition run in bfloat16; so does the gather path on the experts decoded ahead of
    time. 40 tokens give experts more than one block of rows; the tiny model's mlp2 rows hold an odd
    number of blocks (3)."""
    from gptoss_jax.model.moe import MLPBlock

    config, mx, bf16, _ = loaded
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, config.hidden_size), jnp.bfloat16)
    exact = exact_moe_block(config, bf16["block_1"]["mlp"], x, precision="bfloat16")
    got = jax.jit(MLPBlock(config, kernels=gj.Kernels(moe="triton_grouped", interpret=True)).apply)(
        {"params": mx["block_1"]["mlp"]}, x)
    want = jax.jit(MLPBlock(config, kernels=gj.Kernels(moe="gather")).apply)({"params": bf16["block_1"]["mlp"]}, x)
    exact.check(got[0], "triton_grouped, packed")
    exact.check(want[0], "gather, decoded")


@pytest.mark.parametrize("scale", [10, 127, 200])
def test_grouped_mxfp4_kernel_equals_decoding_then_a_matmul(scale):
    """grouped_matmul_mxfp4 (interpret mode) on random bytes around one scale: every used block against
    its expert decoded then multiplied in float64, within NOISE_FACTOR x the noise of that product in
    torch bfloat16 (bfloat16 output, as the kernel's); blocks past `used` are not computed."""
    from gptoss_jax.kernels.triton.mxfp4 import grouped_matmul_mxfp4

    rng = np.random.default_rng(scale)
    E, F, G, block = 3, 64, 4, 16
    blocks = jnp.asarray(rng.integers(0, 256, (E, F, G, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(scale - 2, scale + 3, (E, F, G), dtype=np.uint8))
    block_expert = jnp.asarray([2, 0, 0, 1, 1], jnp.int32)
    rows = jnp.asarray(rng.standard_normal((5 * block, 32 * G)), jnp.bfloat16)
    got = np.asarray(grouped_matmul_mxfp4(rows, block_expert, 4, blocks, scales, block_m=block, interpret=True),
                     np.float32)
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")  # [E, F, 32 G], exact
    e = np.repeat(np.asarray(block_expert)[:4], block)  # each used row's expert
    used = np.asarray(rows[:4 * block], np.float32)
    want = [torch.einsum("nd,nfd->nf", t(used, d), t(w[e], d)).double().numpy() for d in (torch.bfloat16, torch.float64)]
    Exact.measure(*want, precision="bfloat16").check(got[:4 * block], f"scale {scale}")


@pytest.mark.slow
def test_command_line_runs_with_packed_experts(checkpoints, capsys):
    args = ["--prompt-ids", "5,6,7", "--max-new-tokens", "3", "--temperature", "0", "--json", "--quiet"]
    assert run_inference.main(["--checkpoint", str(checkpoints / "packed"), "--dtype", "mxfp4"] + args) == 0
    captured = capsys.readouterr()
    assert "experts packed in MXFP4" in captured.err and '"output_ids"' in captured.out
    assert run_inference.main(["--checkpoint", str(checkpoints / "decoded"), "--dtype", "mxfp4"] + args) != 0
    assert "stores its experts decoded" in capsys.readouterr().err
    assert run_inference.main(["--dtype", "mxfp4"] + args) == 0  # the demo model, packed

