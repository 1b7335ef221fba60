"""Every GPU kernel, and the jnp code it replaces, against float64 definitions (tests/refs.py) within
NOISE_FACTOR x the noise of the same definition run in torch at the kernel's precision (bfloat16 for
16-bit kernels, float32 otherwise; tests/noise.py), on a reduced config: `pytest -m gpu` on a machine
with an NVIDIA GPU (tokamax installed for its attention: pip install -e ".[cuda]").

Deselected by default (pyproject's addopts); on a machine without a GPU these tests fail rather than
pass vacuously.
"""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gptoss_jax as gj
from gptoss_jax import fp8
from conftest import EXTREME_ROWS, packed_with_extreme_scales
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.kernels import needs, tokamax
from gptoss_jax.kernels.attention import flash
from gptoss_jax.kernels.experts import ragged
from gptoss_jax.kernels.triton import attention as triton_attention
from gptoss_jax.kernels.attention import mosaic_cache, paged, xla
from gptoss_jax.kernels.experts import mosaic_mxfp4
from gptoss_jax.kernels.combine import combine
from gptoss_jax.model.moe import MLPBlock, SwiGLU
from gptoss_jax.sampling import Sampling
from gptoss_jax.testing import random_params
from noise import Exact
from refs import exact_attention, exact_moe_block, grouped_torch, swiglu_torch, t

pytestmark = pytest.mark.gpu

# The tiny model's features at head and feature sizes the kernels tile (head_dim 64, multiples of 64).
CONFIG = gj.ModelConfig.tiny().replace(hidden_size=256, intermediate_size=320, head_dim=64)


@pytest.fixture(scope="module", autouse=True)
def _on_gpu():
    assert jax.default_backend() == "gpu", "these tests need an NVIDIA GPU"


def named_triton(named: bool = True):
    """Around code that runs a Pallas Triton kernel, named explicitly: JAX warns, as it compiles the
    kernel, that the backend is deprecated; the test expects that warning. ("auto" picks one only for
    MXFP4 experts at small decode batches on Hopper, where it measured fastest: kernels/experts/__init__.py.)
    JAX's caches are cleared first: a kernel an earlier test compiled (through "auto") would not
    compile, nor warn, again."""
    if not named:
        return contextlib.nullcontext()
    jax.clear_caches()
    return pytest.warns(DeprecationWarning, match="Pallas Triton backend is deprecated")


def _qkv(T, S, dtype, seed=0):
    r = [jax.random.normal(k, s, dtype) for k, s in zip(jax.random.split(jax.random.key(seed), 4), [
        (2, T, 2, 4, 64), (2, S, 2, 64), (2, S, 2, 64), (2, 4)])]
    return r[0], r[1], r[2], r[3].astype(jnp.float32)


def _precision(dtype) -> str:
    return "float32" if dtype == jnp.float32 else "bfloat16"


@pytest.mark.parametrize("window", [None, 16])
def test_flash_attention_and_its_statistics(window):
    q, k, v, sinks = _qkv(300, 300, jnp.bfloat16)
    o, lse = flash.causal(q, k, v, window=window)
    o_ref, lse_ref = xla.causal(q, k, v, window=window, block=64)
    # The statistics: float32, natural log, every row saw its own key.
    assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
    pos = np.broadcast_to(np.arange(300), (2, 300))
    exact_o, exact_lse = exact_attention(q, k, v, None, pos, pos, window, with_lse=True, precision="bfloat16")
    exact = exact_attention(q, k, v, sinks, pos, pos, window, precision="bfloat16")
    for name, (out, out_lse) in (("flash", (o, lse)), ("jnp", (o_ref, lse_ref))):
        exact_o.check(out, f"o, {name}")
        exact_lse.check(out_lse, f"lse, {name}")
        exact.check(combine([(out, out_lse)], sinks, jnp.float32), f"with sinks, {name}")


def _check_prefix(q, k, v, sinks, kv_len, outputs, precision):
    """Outputs (o, lse) of attention over each sequence's first kv_len keys (the first sequence has
    none), with the sinks combined in, against the definition (refs.exact_attention)."""
    B, T = q.shape[:2]
    S = k.shape[1]
    q_pos = np.full((B, T), S)
    k_pos = np.where(np.arange(S)[None] < np.asarray(kv_len)[:, None], np.arange(S)[None], -1)
    exact = exact_attention(q, k, v, sinks, q_pos, k_pos, None, precision=precision)
    # lse of the sequence that has keys (an empty one's is -inf, which has no noise to measure)
    _, exact_lse = exact_attention(q[1:], k[1:], v[1:], None, q_pos[1:], k_pos[1:], None, with_lse=True,
                                   precision=precision)
    for name, (o, lse) in outputs.items():
        # No key: lse is -inf (the kernels) or the jnp code's MASKED (-1e30), and the output with the
        # sinks is exactly zero.
        assert bool(jnp.all(lse[0] <= xla.MASKED)), name
        combined = combine([(o, lse)], sinks, jnp.float32)
        assert not np.any(np.asarray(combined[0])), name
        exact_lse.check(lse[1:], f"lse, {name}")
        exact.check(combined, f"with sinks, {name}")


def test_flash_attention_over_a_cache_prefix():
    q, k, v, sinks = _qkv(40, 384, jnp.bfloat16, seed=1)
    kv_len = jnp.array([0, 250], jnp.int32)  # an empty prefix gives lse = -inf and no contribution
    _check_prefix(q, k, v, sinks, kv_len, {"flash": flash.prefix(q, k, v, kv_len),
                                           "jnp": xla.prefix(q, k, v, kv_len, block=64)}, "bfloat16")


def test_flash_attention_over_a_paged_prefix_a_piece_at_a_time():
    """kernels/attention/paged.in_pieces with the flash kernel (a prompt chunk after a long cached prefix): pages
    of 16 in shuffled order, pieces of 5 pages (the last one past the table), merged by their lse."""
    q, k, v, sinks = _qkv(40, 384, jnp.bfloat16, seed=1)
    kv_len = jnp.array([0, 250], jnp.int32)
    B, S, P = k.shape[0], k.shape[1], 16
    table = jax.random.permutation(jax.random.key(7), B * S // P).reshape(B, S // P).astype(jnp.int32)
    pool_k, pool_v = (jnp.zeros((B * S // P, P) + a.shape[2:], a.dtype).at[table].set(
        a.reshape(B, S // P, P, *a.shape[2:])) for a in (k, v))
    o, lse = paged.in_pieces(q, pool_k, pool_v, table, kv_len, flash.prefix, pages=5)
    _check_prefix(q, k, v, sinks, kv_len, {"flash in pieces": (o, lse), "flash": flash.prefix(q, k, v, kv_len)},
                  "bfloat16")


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("T", [1, 4])
def test_cache_attention(dtype, T):
    q, k, v, sinks = _qkv(T, 4224, dtype, seed=2)
    kv_len = jnp.array([0, 4100], jnp.int32)
    with jax.default_matmul_precision("highest"):  # the jnp code in float32 in full, not TF32
        ref = xla.prefix(q, k, v, kv_len, block=512)
    with named_triton():
        outputs = {"triton": triton_attention.cache_attention(q, k, v, kv_len), "jnp": ref}
    if needs.is_hopper() and mosaic_cache.fits(q.shape, k.shape[1], dtype):
        # 33 blocks of 128 keys, the last one cut at 4100; by default 66 ranges (half of them empty),
        # and 5 ranges of 7 blocks (the last one short)
        outputs["mosaic"] = mosaic_cache.cache_attention(q, k, v, kv_len)
        outputs["mosaic, 5 ranges"] = mosaic_cache.cache_attention(q, k, v, kv_len, splits=5)
        outputs["mosaic, blocks of 64"] = mosaic_cache.cache_attention(q, k, v, kv_len, block_k=64, splits=3)
    _check_prefix(q, k, v, sinks, kv_len, outputs, _precision(dtype))


def test_mosaic_cache_attention_reads_only_the_filled_part():
    """Slots past each sequence's length hold huge values that would show in any output that read
    them; 16 query rows (T = 2, G = 8), sequences of 1, 127, 128 and 129 keys (block edges)."""
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    B, S = 4, 512
    q = jax.random.normal(kq, (B, 2, 2, 8, 64), jnp.bfloat16)
    kv_len = jnp.array([1, 127, 128, 129], jnp.int32)
    beyond = (jnp.arange(S)[None] >= kv_len[:, None])[..., None, None]
    k = jnp.where(beyond, 3e4, jax.random.normal(kk, (B, S, 2, 64), jnp.bfloat16)).astype(jnp.bfloat16)
    v = jnp.where(beyond, -3e4, jax.random.normal(kv, (B, S, 2, 64), jnp.bfloat16)).astype(jnp.bfloat16)
    sinks = jnp.zeros((2, 8), jnp.float32)
    exact = exact_attention(q, k, v, sinks, np.full((B, 2), S), np.where(beyond[..., 0, 0], -1, np.arange(S)[None]),
                            None, precision="bfloat16")
    for splits in (None, 1, 2):
        o, lse = mosaic_cache.cache_attention(q, k, v, kv_len, splits=splits)
        exact.check(combine([(o, lse)], sinks, jnp.float32), f"splits={splits}")


@pytest.mark.parametrize("layout", ["contiguous", "pages of 64", "pages of 16"])
def test_mosaic_cache_attention_reads_fp8_storage(layout):
    """A cache in FP8 storage (fp8.py), read by the kernel as stored, gives exactly the kernel's
    result over the same cache read back in bfloat16: the tensor cores get the same operands.
    gpt-oss-20b's heads (8 KV heads of 64, 8 queries each); pages of 16 put 4 pages in a block."""
    kq, kk, kv, kp = jax.random.split(jax.random.key(5), 4)
    B, S, K, G, H = 4, 1024, 8, 8, 64
    kv_len = jnp.array([1, 300, 1000, 1024], jnp.int32)
    q = jax.random.normal(kq, (B, 1, K, G, H), jnp.bfloat16)
    k = fp8.quantize(jax.random.normal(kk, (B, S, K, H)) * 4)
    v = fp8.quantize(jax.random.normal(kv, (B, S, K, H)) / 4)
    k16, v16 = fp8.read(k, jnp.bfloat16), fp8.read(v, jnp.bfloat16)
    options = {}
    if layout != "contiguous":
        P = int(layout.split()[-1])
        W = S // P
        table = jax.random.permutation(kp, B * W).reshape(B, W).astype(jnp.int32)
        pool = lambda x: fp8.apply(lambda a: jnp.zeros((B * W, P) + a.shape[2:], a.dtype).at[table].set(  # noqa: E731
            a.reshape(B, W, P, *a.shape[2:])), x)
        k, v, k16, v16, options = pool(k), pool(v), pool(k16), pool(v16), {"table": table}
    o, lse = mosaic_cache.cache_attention(q, k, v, kv_len, **options)
    o16, lse16 = mosaic_cache.cache_attention(q, k16, v16, kv_len, **options)
    assert bool(jnp.all(jnp.isfinite(o)))
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o16))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse16))


@pytest.mark.parametrize("impl", ["mosaic_decode", "triton", "mosaic_gpu", "tokamax"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_expert_kernels_equal_the_gather_path(impl, tokens):
    """The MoE block in bfloat16 by each expert kernel, and by the gather path, against the experts'
    definition for the experts our router picks (refs.exact_moe_block)."""
    params = random_params(CONFIG, seed=0, dtype=jnp.bfloat16)["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, CONFIG.hidden_size), jnp.bfloat16)
    exact = exact_moe_block(CONFIG, params, x, precision="bfloat16")
    exact.check(MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe="gather")).apply({"params": params}, x)[0], "gather")
    with named_triton(impl == "triton"):
        got = MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe=impl)).apply({"params": params}, x)[0]
    exact.check(got, impl)


@pytest.mark.parametrize("rows,F", [(320, 384), (320, 320), (2112, 960), (2112, 384)])
def test_mosaic_ragged_dot_tiles(rows, F):
    """Decode-sized rows (64-row tiles; 192- or 64-wide as F allows) and prompt-sized rows (128-row
    tiles walked four output tiles at a time, also where F has fewer or not a multiple of four)."""
    sizes = jnp.array([0, 100, 7, 149], jnp.int32) * (rows // 320)  # an empty expert; the last rows unused
    used = int(sizes.sum())
    x = jax.random.normal(jax.random.key(0), (rows, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, F, 256), jnp.bfloat16)
    got = ragged.mosaic_ragged_dot(x, w, sizes)[:used]
    Exact.measure(grouped_torch(x, w, sizes, "bfloat16"), grouped_torch(x, w, sizes, "float64"),
                  precision="bfloat16").check(got)


def test_greedy_tokens_equal_the_jnp_kernels_in_float32():
    params = random_params(CONFIG, seed=1, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (5, 150, 300)]  # beyond the window

    def tokens(kernels):
        gen = Generator(CONFIG, params, max_len=400, kernels=kernels, prefill_chunk=128)
        return [r.output_ids for r in gen.generate(prompts, max_new_tokens=12, sampling=Sampling(temperature=0))]

    reference = tokens(gj.Kernels(attention="blockwise", moe="grouped"))
    # The kernels that take float32: the Triton experts (tokamax's attention and the Mosaic GPU ragged
    # dot take 16-bit inputs; their bf16 parity is checked above), and "auto", which picks by dtype.
    with named_triton():
        assert tokens(gj.Kernels(attention="blockwise", moe="triton")) == reference
    assert tokens(gj.Kernels()) == reference


def test_auto_picks_the_gpu_kernels():
    """What "auto" picks on this GPU: Pallas Mosaic GPU on Hopper, the jnp paths before it, and a
    Pallas Triton kernel (a deprecated backend) only for MXFP4 decode on Hopper while JAX ships it."""
    from gptoss_jax.kernels.triton import mxfp4

    k = gj.Kernels()
    mosaic = needs.is_hopper() and mosaic_mxfp4.supported()
    triton = needs.is_hopper() and mxfp4.pltriton is not None
    assert k.moe_for(4) == ("mosaic_slots" if mosaic else "gather")
    assert k.moe_for(4, jnp.float32) == "gather"
    fused = tokamax.available()
    assert k.moe_for(4096) == (("mosaic_gpu" if needs.is_hopper() else "tokamax") if fused else "grouped")
    assert k.moe_for(4096, jnp.float32) == "grouped"
    assert k.moe_for(4096, packed=True) == ("mosaic_grouped" if mosaic else "grouped")
    assert k.moe_for(512, packed=True) == ("mosaic_decode" if mosaic else "grouped")
    assert k.moe_for(4, packed=True) == ("triton" if triton else "mosaic_pair" if mosaic else "gather")
    assert k.moe_for(64, packed=True) == ("mosaic_slots" if mosaic else "gather")
    assert k.moe_for(65, packed=True) == ("mosaic_decode" if mosaic else "gather")
    assert k.moe_for(4096, jnp.float32, packed=True) == "grouped"
    assert k.attention_for(4096) == ("tokamax" if fused else "blockwise")
    decode = "mosaic" if needs.is_hopper() and mosaic_cache.supported() else "blockwise"
    assert k.attention_for(4096, jnp.float32) == "blockwise" and k.attention_for(1) == decode
    assert k.attention_for(1, jnp.float32) == "blockwise"  # the Mosaic GPU kernel takes 16-bit inputs


@pytest.mark.parametrize("impl", ["auto", "mosaic_decode", "mosaic_pair", "mosaic_slots", "mosaic_gpu", "triton_grouped",
                                  "mosaic_grouped"])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_packed_experts_decode_on_the_gpu(impl, tokens):
    """MXFP4 experts decoded inside the step on the GPU (bits assembled with integer operations, so
    no flush of tiny values), and the same experts decoded ahead of time: the experts' definition for
    the experts our router picks (refs.exact_moe_block)."""
    from gptoss_jax.mxfp4 import decode_params

    packed = random_params(CONFIG, seed=2, dtype="mxfp4")["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, CONFIG.hidden_size), jnp.bfloat16)
    with named_triton(impl.startswith("triton")):
        got = MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe=impl)).apply({"params": packed}, x)
    dense = gj.Kernels(moe="auto" if impl.endswith("_grouped") else impl)  # packed experts only
    want = MLPBlock(CONFIG, jnp.bfloat16, dense).apply({"params": decode_params(packed)}, x)
    exact = exact_moe_block(CONFIG, packed, x, precision="bfloat16")
    exact.check(got[0], f"{impl}, packed")
    exact.check(want[0], f"{dense.moe}, decoded")


def test_mosaic_decode_settings_at_gpt_oss_shapes():
    """The Mosaic GPU decode kernels at gpt-oss-20b's expert shapes (the last output tile cut)
    against the definition in float64 (noise: the same in torch bfloat16): the MXFP4 grouped matmul
    with decode's settings (blocks of 64 rows, the input dimension split over several programs),
    scale extremes; the MXFP4 decode kernel (blocks of 8 rows, weights handed to the tensor cores
    from registers and through shared memory) and the row-per-pair kernel, split likewise; the
    16-bit decode kernel, blocks of 8 rows."""
    from gptoss_jax.kernels.experts import mosaic_decode, mosaic_pair
    from gptoss_jax.mxfp4 import decode_mxfp4

    rng = np.random.default_rng(11)
    E, D = 4, 2880
    block_expert = jnp.asarray([3, 1, 2, 0], jnp.int32)
    rows = jax.random.normal(jax.random.key(11), (4 * 64, D), jnp.bfloat16)
    x = np.asarray(rows[:3 * 64], np.float32).reshape(3, 64, D)  # the 3 used blocks

    def definition(w):  # w [E, F, D] float32 -> (bfloat16 run, float64 run) [192, F], block by block
        return [np.concatenate([(t(x[b], d) @ t(w[int(block_expert[b])], d).T).double().numpy() for b in range(3)])
                for d in (torch.bfloat16, torch.float64)]

    for F in (5760, 2880):
        blocks, scales = packed_with_extreme_scales(rng, E, F, D)
        low, exact = definition(decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32"))
        settings = mosaic_mxfp4.decode_settings(4, F, D // 32)
        got = np.asarray(mosaic_mxfp4.grouped_matmul_mxfp4(rows, block_expert, 3, blocks, scales, **settings), np.float32)
        for cols in EXTREME_ROWS:
            Exact.measure(low[:, cols], exact[:, cols], precision="bfloat16").check(got[:3 * 64, cols],
                                                                                  f"MXFP4, F={F}, {cols}")
        rows8 = rows.reshape(4, 64, D)[:, :8].reshape(32, D)  # blocks of 8: each block's first 8 rows
        low8, exact8 = (a.reshape(3, 64, F)[:, :8].reshape(24, F) for a in (low, exact))
        for weights in ("registers", "smem"):
            settings = mosaic_decode.decode_settings_mxfp4(4, F, D // 32)
            assert settings["splits"] > 1
            got = np.asarray(mosaic_decode.grouped_matvec_mxfp4(rows8, block_expert, 3, blocks, scales, block_m=8,
                                                                weights=weights, **settings)[:24], np.float32)
            for cols in EXTREME_ROWS:
                Exact.measure(low8[:, cols], exact8[:, cols], precision="bfloat16").check(
                    got[:, cols], f"MXFP4 decode, {weights}, F={F}, {cols}")
        settings = mosaic_pair.pair_settings(D // 32)
        assert settings["splits"] > 1
        got = np.asarray(mosaic_pair.pair_matvec_mxfp4(rows8[:24], jnp.repeat(block_expert[:3], 8), blocks, scales,
                                                        **settings), np.float32)
        for cols in EXTREME_ROWS:
            Exact.measure(low8[:, cols], exact8[:, cols], precision="bfloat16").check(got[:, cols],
                                                                                    f"MXFP4 pairs, F={F}, {cols}")
        w16 = jax.random.normal(jax.random.key(F), (E, F, D), jnp.bfloat16)
        low, exact = (a.reshape(3, 64, F)[:, :8].reshape(24, F) for a in definition(np.asarray(w16, np.float32)))
        settings = mosaic_decode.decode_settings(4, F, D)
        assert settings["splits"] > 1
        got = mosaic_decode.grouped_matvec(rows8, block_expert, 3, w16, block_m=8, **settings)
        Exact.measure(low, exact, precision="bfloat16").check(np.asarray(got[:24], np.float32), f"bf16, F={F}")


def test_mxfp4_decoder_is_bit_exact_on_the_gpu():
    from gptoss_jax.mxfp4 import decode, decode_mxfp4

    blocks = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(256, 16, 16)  # every (scale, byte)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    for dtype, bits in (("bfloat16", np.uint16), ("float32", np.uint32)):
        got = np.asarray(jax.jit(decode, static_argnums=2)(jnp.asarray(blocks), jnp.asarray(scales), dtype))
        np.testing.assert_array_equal(got.view(bits), decode_mxfp4(blocks, scales, dtype).view(bits))




@pytest.mark.parametrize("decoder", ["ptx", "jnp"])
@pytest.mark.parametrize("kernel", ["prompt", "decode", "pair"])
def test_mosaic_mxfp4_kernels_decode_every_byte_and_scale_exactly(kernel, decoder):
    """The three Mosaic GPU MXFP4 kernels, both decoders, multiplying one-hot rows (row k: input k), so
    that each output is one decoded weight times 1, exactly: every byte value and every scale from
    2^-125 to 2^113 (the range both decoders are exact in), equal to the table decoder's values. A
    wrong code, sign, nibble order or scale changes a value."""
    from gptoss_jax.kernels.experts import mosaic_decode, mosaic_pair
    from gptoss_jax.mxfp4 import decode_mxfp4

    F, G = 256, 16
    D = 32 * G
    scale_values = np.arange(2, 241, dtype=np.uint8)  # 2^(s - 127), s = 2 .. 240
    scales = np.resize(scale_values, F * G).reshape(1, F, G)
    blocks = ((np.arange(F * G * 16).reshape(1, F, G, 16) * 7 + np.arange(F)[None, :, None, None]) % 256).astype(np.uint8)
    assert len(np.unique(blocks)) == 256 and len(np.unique(scales)) == len(scale_values)
    eye = jnp.eye(D, dtype=jnp.bfloat16)
    if kernel == "prompt":
        block_expert = jnp.zeros((D // 128,), jnp.int32)
        got = mosaic_mxfp4.grouped_matmul_mxfp4(eye, block_expert, D // 128, jnp.asarray(blocks), jnp.asarray(scales),
                                                decoder=decoder)
    elif kernel == "decode":
        block_expert = jnp.zeros((D // 8,), jnp.int32)
        got = mosaic_decode.grouped_matvec_mxfp4(eye, block_expert, D // 8, jnp.asarray(blocks), jnp.asarray(scales),
                                                 block_m=8, splits=2, gs=2, decoder=decoder)
    else:  # a pair per input
        got = mosaic_pair.pair_matvec_mxfp4(eye, jnp.zeros((D,), jnp.int32), jnp.asarray(blocks), jnp.asarray(scales),
                                            splits=2, gs=4, decoder=decoder)
    want = decode_mxfp4(blocks, scales, "float32")[0]  # [F, D]; its -0.0 are sums' +0.0, equal as values
    np.testing.assert_array_equal(np.asarray(got, np.float32).T, want)


@pytest.mark.parametrize("settings", [{}, {"block_n": 128, "gs": 4, "stages": 3}])
def test_mosaic_grouped_mxfp4_matmul_equals_decoding_then_a_plain_matmul(settings):
    """The Mosaic GPU prompt kernel for packed experts on gpt-oss's shapes (90 blocks a row; 2,880
    outputs, so the last 256-output tile is cut), every used block of rows against its expert decoded
    first and a matmul in float64 (noise: in torch bfloat16), with scale extremes; by default
    (45 steps of 2 scale blocks) and in tiles of 128 outputs with 4 scale blocks a step (the last
    tile and step cut)."""
    rng = np.random.default_rng(7)
    E, F, D, block = 4, 2880, 2880, 128
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    block_expert = jnp.asarray([3, 0, 0, 2, 3, 3], jnp.int32)
    rows = jax.random.normal(jax.random.key(7), (6 * block, D), jnp.bfloat16)
    got = np.asarray(mosaic_mxfp4.grouped_matmul_mxfp4(rows, block_expert, 5, blocks, scales, block_m=block,
                                                       **settings), np.float32)
    from gptoss_jax.mxfp4 import decode_mxfp4

    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")
    e = np.repeat(np.asarray(block_expert)[:5], block)
    used = np.asarray(rows[:5 * block], np.float32)
    runs = [torch.einsum("md,mfd->mf", t(used, d), t(w[e], d)).double().numpy() for d in (torch.bfloat16, torch.float64)]
    for cols in EXTREME_ROWS:
        Exact.measure(runs[0][:, cols], runs[1][:, cols], precision="bfloat16").check(got[:5 * block, cols], str(cols))


@pytest.mark.parametrize("F, swiglu", [(5760, SwiGLU(1.702, 7.0)), (2880, None)])
def test_mosaic_grouped_mxfp4_epilogue_at_gpt_oss_shapes(F, swiglu):
    """The prompt kernel's epilogue on the GPU at gpt-oss-20b's mlp1 (5,760 interleaved gate and
    linear outputs -> 2,880, the last tile's second warpgroup wholly past the end) and mlp2 (2,880
    outputs, bias only): each used block's expert bias added to the float32 sums, then the clamped
    SwiGLU, against the same in float64 (noise: the product in torch bfloat16, bias and SwiGLU in
    float32, rounded to bfloat16). Typical scales, so that outputs lie on both sides of the clamp."""
    from gptoss_jax.mxfp4 import decode_mxfp4

    rng = np.random.default_rng(F)
    E, D, block = 4, 2880, 128
    blocks = jnp.asarray(rng.integers(0, 256, (E, F, D // 32, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(117, 122, (E, F, D // 32), dtype=np.uint8))
    bias = jnp.asarray(rng.uniform(-8, 8, (E, F)), jnp.bfloat16)
    block_expert = jnp.asarray([3, 0, 0, 2, 3, 3], jnp.int32)
    rows = jax.random.normal(jax.random.key(F), (6 * block, D), jnp.bfloat16)
    got = np.asarray(mosaic_mxfp4.grouped_matmul_mxfp4(rows, block_expert, 5, blocks, scales, bias, block_m=block,
                                                       swiglu=swiglu), np.float32)[:5 * block]
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")
    x = np.asarray(rows[:5 * block], np.float32).reshape(5, block, D)  # the used blocks
    low, exact = (np.concatenate([(t(x[i], d) @ t(w[int(block_expert[i])], d).T).double().numpy()
                                  + np.asarray(bias, np.float64)[int(block_expert[i])] for i in range(5)])
                  for d in (torch.bfloat16, torch.float64))
    if swiglu is not None:
        low = swiglu_torch(torch.from_numpy(low.astype(np.float32)), swiglu.alpha, swiglu.limit)
        low = low.to(torch.bfloat16).double().numpy()
        exact = swiglu_torch(torch.from_numpy(exact), swiglu.alpha, swiglu.limit).numpy()
        assert (np.abs(exact) > 1).mean() > 0.3  # the clamp and the sigmoid both at work
    assert got.shape == exact.shape
    Exact.measure(low, exact, precision="bfloat16").check(got, f"F={F}, swiglu={swiglu}")


@pytest.mark.parametrize("decoder", ["jnp", "ptx"])
@pytest.mark.parametrize("block_m", [16, 128])
def test_grouped_mxfp4_matmul_equals_decoding_then_a_plain_matmul(block_m, decoder):
    """The prompt kernel for packed experts on gpt-oss's input width (90 blocks a row), every used
    block of rows against its expert decoded first and a matmul in float64 (noise: in torch
    bfloat16, the kernel's output dtype), with scale extremes; blocks past `used` are left alone."""
    from gptoss_jax.kernels.triton.mxfp4 import grouped_matmul_mxfp4
    from gptoss_jax.mxfp4 import decode_mxfp4

    rng = np.random.default_rng(block_m)
    E, F, D = 4, 256, 2880
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    block_expert = jnp.asarray([3, 0, 0, 2, 3, 3], jnp.int32)
    rows = jax.random.normal(jax.random.key(block_m), (6 * block_m, D), jnp.bfloat16)
    with named_triton():
        got = np.asarray(grouped_matmul_mxfp4(rows, block_expert, 5, blocks, scales, block_m=block_m,
                                              decoder=decoder), np.float32)
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")  # [E, F, D], exact
    e = np.repeat(np.asarray(block_expert)[:5], block_m)  # each used row's expert
    used = np.asarray(rows[:5 * block_m], np.float32)
    runs = [torch.einsum("md,mfd->mf", t(used, d), t(w[e], d)).double().numpy() for d in (torch.bfloat16, torch.float64)]
    for cols in EXTREME_ROWS:  # each group of scales on its own bound
        Exact.measure(runs[0][:, cols], runs[1][:, cols], precision="bfloat16").check(got[:5 * block_m, cols], str(cols))


@pytest.mark.parametrize("decoder", ["jnp", "ptx"])
@pytest.mark.parametrize("P", [1, 4, 32])
def test_mxfp4_matvec_equals_decoding_then_a_plain_matmul(P, decoder):
    """The packed decode kernel on gpt-oss's input width (90 blocks a row) against decoding first and
    a float64 matmul (noise: in torch float32), with rows of tiny (2^-117) and large (2^73) scales
    among typical ones, each group of rows on its own bound."""
    from gptoss_jax.kernels.triton.mxfp4 import pair_matvec_mxfp4
    from gptoss_jax.mxfp4 import decode_mxfp4

    rng = np.random.default_rng(P)
    E, F, D = 8, 192, 2880
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    x = jax.random.normal(jax.random.key(P), (P, D), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, P), jnp.int32)
    with named_triton():
        got = np.asarray(pair_matvec_mxfp4(x, idx, blocks, scales, decoder=decoder))
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")[np.asarray(idx)]  # exact
    runs = [torch.einsum("pd,pfd->pf", t(x, d), t(w, d)).double().numpy() for d in (torch.float32, torch.float64)]
    for rows in EXTREME_ROWS:
        Exact.measure(runs[0][:, rows], runs[1][:, rows]).check(got[:, rows], str(rows))


@pytest.mark.parametrize("tokens", [1, 8])
def test_fused_decode_moe_on_the_gpu(tokens):
    """kernels/triton/decode_moe.py's PTX: the route kernel against RMSNorm and the jnp router, and the
    MoE block (which takes the fused path at decode) and the gather path against the experts'
    definition (test_decode_moe.check_block)."""
    from test_decode_moe import check_block, check_route

    packed = random_params(CONFIG, seed=3, dtype="mxfp4")["block_0"]["mlp"]
    with named_triton():
        check_route(CONFIG, packed, tokens, interpret=False)
        check_block(CONFIG, packed, tokens, interpret=False)


@pytest.mark.parametrize("chunk", [None, 32])
def test_fused_decode_expert_kernels_with_extreme_scales_on_the_gpu(chunk):
    """The two fused expert kernels at gpt-oss's widths (90 blocks a row), with tiny and large scales;
    rows read whole (padded to 128 blocks) or 32 blocks a load (the last masked past 90)."""
    from test_decode_moe import check_expert_kernels

    with named_triton():
        check_expert_kernels(E=8, F=2880, D=2880, pairs=8, interpret=False, chunk=chunk)


@pytest.mark.parametrize("E, F, D, M", [(8, 640, 256, 1200), (8, 256, 320, 1200), (32, 5760, 2880, 4096)])
def test_mosaic_ragged_dot_backward_pass_equals_its_definition(E, F, D, M):
    """The expert kernel's own VJP (training): output, input gradient and weight gradient against
    their definitions per group in float64 (noise: in torch bfloat16, the dtype of the kernel's output
    and gradients), at the model's shapes and a tiling fallback's."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, D), jnp.bfloat16)
    w = (jax.random.normal(k[1], (E, F, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(k[2], (M, F), jnp.float32)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(M, np.ones(E) / E), jnp.int32)

    def kernel(x, w):
        return ragged.mosaic_ragged_dot(x, w, sizes).astype(jnp.float32)

    got, got_vjp = jax.vjp(kernel, x, w)
    dx, dw = got_vjp(dy)
    # The definition per group in torch: y = x_g w_g^T, dx_g = dy_g w_g, dw_g = dy_g^T x_g.
    ends = np.cumsum(np.asarray(sizes))

    def runs(dtype):
        xs, ws, dys = t(x, dtype), t(w, dtype), t(dy, dtype)
        y, dxs, dws = [], [], []
        for g, (n, end) in enumerate(zip(np.asarray(sizes), ends)):
            xg, dyg = xs[end - n:end], dys[end - n:end]
            y.append(xg @ ws[g].T)
            dxs.append(dyg @ ws[g])
            dws.append(dyg.T @ xg)
        return [r.double().numpy() for r in (torch.cat(y), torch.cat(dxs), torch.stack(dws))]

    for name, low, exact, ours in zip(("y", "dx", "dw"), runs(torch.bfloat16), runs(torch.float64), (got, dx, dw)):
        Exact.measure(low, exact, precision="bfloat16").check(ours, name)
