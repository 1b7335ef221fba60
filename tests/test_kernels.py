"""The kernel layer on CPU: sinks folded in through the statistics, and the TPU and Triton kernels in
Pallas interpret mode against the jnp code.

Results are checked against float64 definitions (refs.exact_attention, numpy einsum), within
NOISE_FACTOR x the float32 error of the same definitions run in float32 (noise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from noise import Exact
from gptoss_jax.kernels import experts as experts_registry
from gptoss_jax.kernels.attention import splash
from gptoss_jax.kernels.triton import attention as triton_attention, matvec
from gptoss_jax.kernels.attention import xla
from gptoss_jax.kernels.combine import combine
from refs import exact_attention


def _qkv(rng, B, T, K, G, H):
    q = rng.standard_normal((B, T, K, G, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, H)).astype(np.float32)
    return q, k, v, rng.standard_normal((K, G)).astype(np.float32)


@pytest.mark.slow
@pytest.mark.parametrize("window", [None, 7])
def test_parts_with_sinks_equal_the_whole(window):
    # A cache's first 50 positions as one part and the next 40 as another equal attention over all 90.
    rng = np.random.default_rng(0)
    q, k, v, sinks = _qkv(rng, 2, 90, 2, 3, 8)
    pos = np.broadcast_to(np.arange(90), (2, 90))
    exact = exact_attention(q, k, v, sinks, pos, pos, window)[:, 50:]
    old_mask = xla.visible(pos[:, 50:], pos[:, :50], window)
    old = xla.dense(q[:, 50:], k[:, :50], v[:, :50], old_mask)
    new = xla.causal(q[:, 50:], k[:, 50:], v[:, 50:], window=window, block=16)
    exact.check(combine([old, new], sinks, jnp.float32))


def test_a_part_that_sees_nothing_contributes_nothing():
    rng = np.random.default_rng(1)
    q, k, v, sinks = _qkv(rng, 2, 20, 1, 2, 8)
    empty = xla.prefix(q, k, v, jnp.array([0, 0]), block=8)
    assert bool(jnp.all(jnp.isneginf(empty[1])))
    alone = xla.causal(q, k, v, window=None, block=8)
    # exp(-inf) = 0 exactly: the empty part adds zeros to the sum and the denominator.
    np.testing.assert_array_equal(np.asarray(combine([empty, alone], sinks, jnp.float32)),
                                  np.asarray(combine([alone], sinks, jnp.float32)))


@pytest.mark.parametrize("window", [None, 16])
def test_splash_attention_in_interpret_mode(window):
    rng = np.random.default_rng(2)
    q, k, v, _ = _qkv(rng, 1, 256, 2, 2, 64)
    o, lse = splash.causal(q, k, v, window=window, interpret=True)
    pos = np.arange(256)[None]
    exact_o, exact_lse = exact_attention(q, k, v, None, pos, pos, window, with_lse=True)
    for name, (out, out_lse) in (("splash", (o, lse)), ("jnp", xla.causal(q, k, v, window=window, block=64))):
        exact_o.check(out, f"o, {name}")
        exact_lse.check(out_lse, f"lse, {name}")


@pytest.mark.parametrize("splits", [1, 2])
def test_triton_matvec_in_interpret_mode(splits):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    w = rng.standard_normal((4, 192, 128)).astype(np.float32)
    idx = np.array([3, 0, 2, 2, 1, 0])
    got = matvec.pair_matvec(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), interpret=True, splits=splits)
    exact = Exact.measure(np.einsum("pd,pfd->pf", x, w[idx]), np.einsum("pd,pfd->pf", x.astype(np.float64), w[idx]))
    exact.check(got)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3])
def test_triton_cache_attention_reads_the_filled_part(T):
    # Garbage past each sequence's length must not leak in; an empty cache gives lse = -inf.
    rng = np.random.default_rng(4)
    q = rng.standard_normal((3, T, 2, 4, 16)).astype(np.float32)
    k = rng.standard_normal((3, 256, 2, 16)).astype(np.float32)
    v = rng.standard_normal((3, 256, 2, 16)).astype(np.float32)
    kv_len = jnp.array([0, 70, 256])
    k[1, 70:], v[1, 70:] = 1e4, -1e4
    k_pos = np.where(np.arange(256)[None] < np.asarray(kv_len)[:, None], np.arange(256)[None], -1)
    # Rows 1 and 2 (row 0 sees no key: its output is checked below to be zero, its lse -inf).
    exact_o, exact_lse = exact_attention(q[1:], k[1:], v[1:], None, np.full((2, T), 256), k_pos[1:], None,
                                         with_lse=True)
    o_ref, lse_ref = xla.prefix(q, k, v, kv_len, block=64)
    exact_o.check(o_ref[1:], "o, jnp")
    exact_lse.check(lse_ref[1:], "lse, jnp")
    for splits in (None, 3):
        o, lse = triton_attention.cache_attention(q, k, v, kv_len, interpret=True, block_k=32, splits=splits)
        assert bool(jnp.all(jnp.isneginf(lse[0]))) and bool(jnp.all(o[0] == 0))
        exact_o.check(o[1:], f"o, splits={splits}")
        exact_lse.check(lse[1:], f"lse, splits={splits}")


@pytest.mark.slow
def test_triton_decode_attention_in_the_model():
    # The cached model with the Triton cache attention (interpret mode) gives the jnp kernels' tokens,
    # with prompts longer than the sliding window.
    from gptoss_jax.decoding.generator import Generator
    from gptoss_jax.sampling import Sampling
    from gptoss_jax.testing import random_params

    config = gj.ModelConfig.tiny()
    params = random_params(config, seed=2, dtype=jnp.float32)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (3, 40)]

    def tokens(kernels):
        gen = Generator(config, params, max_len=64, kernels=kernels, prefill_chunk=16)
        return [r.output_ids for r in gen.generate(prompts, max_new_tokens=6, sampling=Sampling(temperature=0))]

    assert tokens(gj.Kernels(attention="triton", interpret=True)) == tokens(gj.Kernels())


def test_kernel_choice_on_cpu_and_bad_names():
    k = gj.Kernels()
    assert (k.attention_for(4096), k.attention_for(1), k.moe_for(1 << 16), k.moe_for(4)) == (
        "blockwise", "blockwise", "grouped", "gather")
    assert (k.moe_for(1 << 16, packed=True), k.moe_for(4, packed=True)) == ("grouped", "gather")  # MXFP4: jnp decode
    with pytest.raises(ValueError, match="'triton_grouped' kernel runs on NVIDIA GPUs only"):
        gj.Kernels(moe="triton_grouped").moe_for(1 << 16, packed=True)
    with pytest.raises(ValueError, match="unknown MoE kernel 'fast'"):
        gj.Kernels(moe="fast")
    with pytest.raises(ValueError, match="unknown attention kernel"):
        gj.Kernels(attention="flash")
    # A kernel for another backend is refused by name, unless it can run in interpret mode.
    with pytest.raises(ValueError, match="'triton' kernel runs on NVIDIA GPUs only.*interpret=True"):
        gj.Kernels(moe="triton").moe_for(4)
    with pytest.raises(ValueError, match="'tokamax' kernel runs on NVIDIA GPUs only, and this JAX's backend is 'cpu'"):
        gj.Kernels(attention="tokamax").attention_for(4096)
    assert gj.Kernels(attention="splash", interpret=True).attention_for(4096) == "splash"


def test_mosaic_ragged_dot_tiles_by_rows_and_width():
    from gptoss_jax.kernels.experts.ragged import mosaic_tiles

    prompt, decode = mosaic_tiles(16384, 2880), mosaic_tiles(256, 5760)
    assert (prompt["block_m"], prompt["block_n"], prompt["grid_block_n"]) == (128, 192, 4)
    assert (decode["block_m"], decode["block_n"], decode["grid_block_n"]) == (64, 192, 1)
    assert mosaic_tiles(256, 320)["block_n"] == 64 and mosaic_tiles(256, 100) is None  # 100: no tile fits


def test_late_map_equals_lax_map():
    from gptoss_jax.kernels.loops import late_map

    xs = (jnp.arange(24.0).reshape(4, 6), jnp.arange(4, dtype=jnp.int32))

    def f(args):
        row, i = args
        return {"sum": row.sum() * i, "rows": jnp.stack([row, -row]).astype(jnp.bfloat16)}

    ours = jax.jit(lambda xs: late_map(f, xs, anchor=xs[0]))(xs)
    ref = jax.lax.map(f, xs)
    for name in ("sum", "rows"):
        assert ours[name].dtype == ref[name].dtype and ours[name].shape == ref[name].shape
        np.testing.assert_array_equal(np.asarray(ours[name], np.float32), np.asarray(ref[name], np.float32))


def _on_a_gpu(monkeypatch, hopper: bool, triton: bool):
    """This process seen as an NVIDIA GPU machine with tokamax installed: Hopper or older, its JAX
    shipping Pallas Triton or not."""
    import gptoss_jax.kernels as kernels

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels.needs, "is_hopper", lambda: hopper)
    monkeypatch.setattr(kernels.tokamax, "available", lambda: True)
    monkeypatch.setattr(kernels.mosaic, "supported", lambda: True)
    monkeypatch.setattr(kernels.triton.mxfp4, "pltriton", object() if triton else None)
    return kernels


@pytest.mark.parametrize("hopper,triton", [(True, True), (True, False), (False, True)])
def test_auto_on_a_gpu(monkeypatch, hopper, triton):
    """What "auto" picks on an NVIDIA GPU, Hopper or older, with or without Pallas Triton (deprecated):
    Pallas Mosaic GPU on Hopper, the jnp paths before it, and a Triton kernel only for MXFP4 decode
    on Hopper below one pair per expert for 32 experts (the 20b; from one to two the slots kernel)
    and up to one for 128 (the 120b), while JAX ships it."""
    kernels = _on_a_gpu(monkeypatch, hopper, triton)
    k = gj.Kernels()
    picks = (k.moe_for(4), k.moe_for(64), k.moe_for(4, jnp.float32), k.moe_for(4096))
    assert picks == (("mosaic_slots", "mosaic_slots", "gather", "mosaic_gpu") if hopper
                     else ("gather", "gather", "gather", "tokamax"))
    packed = [k.moe_for(pairs, packed=True) for pairs in (4, 31, 32, 64, 65, 256, 1023, 1024)]
    fused = ["triton"] * 2 if triton else ["mosaic_pair", "mosaic_decode"]
    assert packed == (fused + ["mosaic_slots"] * 2 + ["mosaic_decode"] * 3 + ["mosaic_grouped"] if hopper
                      else ["gather"] * 4 + ["grouped"] * 4)
    big = [k.moe_for(pairs, packed=True, num_experts=128) for pairs in (128, 129, 256)]
    assert big == ((["triton"] if triton else ["mosaic_decode"]) + ["mosaic_decode"] * 2 if hopper
                   else ["grouped"] * 3)
    assert k.moe_for(4, jnp.float32, packed=True) == "gather"  # float32 activations: no 16-bit kernel
    # On a mesh the MoE runs per device (no fused block), where the Triton block was not measured.
    on_mesh = [experts_registry.pick(k, p, jnp.bfloat16, True, experts=32, sharded=True).name for p in (4, 32)]
    assert on_mesh == (["mosaic_pair", "mosaic_decode"] if hopper else ["gather"] * 2)
    assert (k.attention_for(1), k.attention_for(4096)) == ("mosaic" if hopper else "blockwise", "tokamax")
    assert k.moe_for(65) == ("mosaic_gpu" if hopper else "tokamax")
    # Without tokamax, a large decode batch's 16-bit experts stay on Mosaic GPU (not the jnp grouped
    # path, four times slower at batch 256 on one H200); prompts beyond that go to the jnp path.
    monkeypatch.setattr(kernels.tokamax, "available", lambda: False)
    assert (k.moe_for(1024), k.moe_for(1025)) == (("mosaic_decode", "grouped") if hopper else ("grouped", "grouped"))


@pytest.mark.parametrize("case", sorted(experts_registry.MEASURED))
def test_auto_picks_the_fastest_measured_variant(monkeypatch, case):
    """For each decode class measured on one H100 80GB (kernels/experts/__init__.py, MEASURED: gpt-oss-20b's 32
    and gpt-oss-120b's 128 experts, batches 1 to 64, MXFP4 experts), "auto" on that machine (Hopper,
    tokamax, Pallas Triton) picks the variant that decoded fastest there."""
    _on_a_gpu(monkeypatch, hopper=True, triton=True)
    num_experts, batch = case
    rates = experts_registry.MEASURED[case]
    fastest = max(rates, key=rates.get)
    picked = gj.Kernels().moe_for(batch * 4, packed=True, num_experts=num_experts)
    assert picked == fastest, f"{num_experts} experts, batch {batch}: auto picks {picked}, measured {rates}"


@pytest.mark.slow
def test_the_package_runs_without_pallas_triton():
    """Once JAX drops Pallas's deprecated Triton backend, the package still imports and runs (here:
    a fresh interpreter where importing it fails), "auto" no longer counts on it, and a Triton
    kernel picked by name says why it cannot run."""
    import subprocess
    import sys

    script = """
import sys
class NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "jax.experimental.pallas.triton":
            raise ImportError("no Pallas Triton in this JAX")
sys.meta_path.insert(0, NoTriton())
import jax, jax.numpy as jnp
import gptoss_jax as gj
from gptoss_jax.kernels.triton import common, matvec
from gptoss_jax.model.moe import MLPBlock
from gptoss_jax.testing import random_params
assert common.pltriton is None
config = gj.ModelConfig.tiny()
params = random_params(config, seed=0, dtype=jnp.float32)["block_0"]["mlp"]
x = jnp.ones((1, 1, config.hidden_size))
MLPBlock(config, jnp.float32, gj.Kernels()).apply({"params": params}, x)
try:
    matvec.pair_matvec(x[0], jnp.zeros(1, jnp.int32), params["mlp1_weight"], interpret=True)
except RuntimeError as e:
    assert "no longer has Pallas's Triton backend" in str(e), e
    print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_packed_only_variant_named_for_16_bit_experts():
    """A variant that takes MXFP4-packed experts only, named over 16-bit ones: an error naming it when
    the block runs; with adapters (training) the jnp paths run instead, as for any variant named
    that does not add them."""
    from gptoss_jax.model.moe import MLPBlock
    from gptoss_jax.testing import random_params

    tiny = gj.ModelConfig.tiny()
    kernels = gj.Kernels(moe="triton_grouped", interpret=True)
    assert kernels.moe_for(4096) == "triton_grouped"
    mlp = random_params(tiny, seed=0, dtype=jnp.float32)["block_0"]["mlp"]
    x = jnp.ones((1, 40, tiny.hidden_size), jnp.float32)
    with pytest.raises(ValueError, match="triton_grouped expert kernel takes MXFP4-packed experts only"):
        MLPBlock(tiny, jnp.float32, kernels).apply({"params": mlp}, x)
    pairs = 40 * tiny.experts_per_token
    assert kernels.experts_for(pairs, jnp.float32, mlp["mlp1_weight"], adapters=True).name == "grouped"
    assert kernels.experts_for(4, jnp.float32, mlp["mlp1_weight"], adapters=True).name == "gather"
