"""Every GPU kernel against the jnp code it replaces, on a reduced config: `pytest -m gpu` on a machine
with an NVIDIA GPU (tokamax installed for its attention: pip install -e ".[cuda]").

Deselected by default (pyproject's addopts); on a machine without a GPU these tests fail rather than
pass vacuously.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from conftest import EXTREME_ROWS, packed_with_extreme_scales, rel_err
from gptoss_jax.generate import Generator
from gptoss_jax.kernels import gpu, triton, xla
from gptoss_jax.kernels.combine import combine
from gptoss_jax.moe import MLPBlock
from gptoss_jax.sampling import Sampling
from gptoss_jax.testing import random_params

pytestmark = pytest.mark.gpu
BF16_RTOL = 2e-2  # as the bf16 tests of test_model.py: a few roundings of 2^-9

# The tiny model's features at head and feature sizes the kernels tile (head_dim 64, multiples of 64).
CONFIG = gj.ModelConfig.tiny().replace(hidden_size=256, intermediate_size=320, head_dim=64)


@pytest.fixture(scope="module", autouse=True)
def _on_gpu():
    assert jax.default_backend() == "gpu", "these tests need an NVIDIA GPU"


def _qkv(T, S, dtype, seed=0):
    r = [jax.random.normal(k, s, dtype) for k, s in zip(jax.random.split(jax.random.key(seed), 4), [
        (2, T, 2, 4, 64), (2, S, 2, 64), (2, S, 2, 64), (2, 4)])]
    return r[0], r[1], r[2], r[3].astype(jnp.float32)


@pytest.mark.parametrize("window", [None, 16])
def test_flash_attention_and_its_statistics(window):
    q, k, v, sinks = _qkv(300, 300, jnp.bfloat16)
    o, lse = gpu.causal(q, k, v, window=window)
    o_ref, lse_ref = xla.causal(q, k, v, window=window, block=64)
    # The statistics: float32, natural log, every row saw its own key.
    assert lse.dtype == jnp.float32 and lse.shape == lse_ref.shape
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_ref), atol=0.05)
    assert rel_err(o.astype(jnp.float32), o_ref) <= BF16_RTOL
    with_sinks = combine([(o, lse)], sinks, jnp.float32)
    assert rel_err(with_sinks, combine([(o_ref, lse_ref)], sinks, jnp.float32)) <= BF16_RTOL


def test_flash_attention_over_a_cache_prefix():
    q, k, v, sinks = _qkv(40, 384, jnp.bfloat16, seed=1)
    kv_len = jnp.array([0, 250], jnp.int32)  # an empty prefix gives lse = -inf and no contribution
    o, lse = gpu.prefix(q, k, v, kv_len)
    o_ref, lse_ref = xla.prefix(q, k, v, kv_len, block=64)
    assert bool(jnp.all(jnp.isneginf(lse[0])))
    got, want = combine([(o, lse)], sinks, jnp.float32), combine([(o_ref, lse_ref)], sinks, jnp.float32)
    assert rel_err(got, want) <= BF16_RTOL


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("T", [1, 4])
def test_triton_cache_attention(dtype, T):
    q, k, v, sinks = _qkv(T, 4224, dtype, seed=2)
    kv_len = jnp.array([0, 4100], jnp.int32)
    o, lse = triton.cache_attention(q, k, v, kv_len)
    with jax.default_matmul_precision("highest"):  # the float32 reference in full, not TF32
        o_ref, lse_ref = xla.prefix(q, k, v, kv_len, block=512)
    assert bool(jnp.all(jnp.isneginf(lse[0])))
    np.testing.assert_allclose(np.asarray(lse[1]), np.asarray(lse_ref[1]), atol=0.05 if dtype == jnp.bfloat16 else 1e-4)
    got, want = combine([(o, lse)], sinks, jnp.float32), combine([(o_ref, lse_ref)], sinks, jnp.float32)
    assert rel_err(got, want) <= (BF16_RTOL if dtype == jnp.bfloat16 else 1e-4)


@pytest.mark.parametrize("impl", ["triton", "mosaic_gpu", "tokamax"])
@pytest.mark.parametrize("tokens", [1, 8, 300])
def test_expert_kernels_equal_the_gather_path(impl, tokens):
    params = random_params(CONFIG, seed=0, dtype=jnp.bfloat16)["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, CONFIG.hidden_size), jnp.bfloat16)
    want = MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe="gather")).apply({"params": params}, x)
    got = MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe=impl)).apply({"params": params}, x)
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) <= BF16_RTOL


@pytest.mark.parametrize("rows,F", [(320, 384), (320, 320), (2112, 960), (2112, 384)])
def test_mosaic_ragged_dot_tiles(rows, F):
    """Decode-sized rows (64-row tiles; 192- or 64-wide as F allows) and prompt-sized rows (128-row
    tiles walked four output tiles at a time, also where F has fewer or not a multiple of four)."""
    sizes = jnp.array([0, 100, 7, 149], jnp.int32) * (rows // 320)  # an empty expert; the last rows unused
    used = int(sizes.sum())
    x = jax.random.normal(jax.random.key(0), (rows, 256), jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (4, F, 256), jnp.bfloat16)
    groups = jnp.repeat(jnp.arange(4), sizes, total_repeat_length=used)
    got = gpu.mosaic_ragged_dot(x, w, sizes)[:used]
    want = jnp.einsum("md,mfd->mf", x[:used], w[groups], preferred_element_type=jnp.float32)
    assert rel_err(got.astype(jnp.float32), want) <= BF16_RTOL


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
    assert tokens(gj.Kernels(attention="blockwise", moe="triton")) == reference
    assert tokens(gj.Kernels()) == reference


def test_auto_picks_the_gpu_kernels():
    k = gj.Kernels()
    assert k.moe_for(4) == "triton"
    fused = gpu.available()
    assert k.moe_for(4096) == (("mosaic_gpu" if gpu.is_hopper() else "tokamax") if fused else "grouped")
    assert k.moe_for(4096, jnp.float32) == "grouped"
    assert k.moe_for(4096, packed=True) == "triton_grouped" and k.moe_for(4, packed=True) == "triton"
    assert k.moe_for(4096, jnp.float32, packed=True) == "grouped"
    assert k.attention_for(4096) == ("tokamax" if fused else "blockwise")
    assert k.attention_for(4096, jnp.float32) == "blockwise" and k.attention_for(1) == "triton"


@pytest.mark.parametrize("impl", ["auto", "mosaic_gpu", "triton_grouped"])
@pytest.mark.parametrize("tokens", [1, 300])
def test_packed_experts_decode_on_the_gpu(impl, tokens):
    """MXFP4 experts decoded inside the step on the GPU (bits assembled with integer operations, so
    no flush of tiny values): the MoE output of the same experts decoded ahead of time."""
    from gptoss_jax.mxfp4 import decode_params

    packed = random_params(CONFIG, seed=2, dtype=jnp.bfloat16, experts="mxfp4")["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, CONFIG.hidden_size), jnp.bfloat16)
    got = MLPBlock(CONFIG, jnp.bfloat16, gj.Kernels(moe=impl)).apply({"params": packed}, x)
    dense = gj.Kernels(moe="auto" if impl == "triton_grouped" else impl)  # triton_grouped: packed experts only
    want = MLPBlock(CONFIG, jnp.bfloat16, dense).apply({"params": decode_params(packed)}, x)
    assert rel_err(got.astype(jnp.float32), want.astype(jnp.float32)) <= BF16_RTOL


def test_mxfp4_decoder_is_bit_exact_on_the_gpu():
    from gptoss_jax.mxfp4 import decode, decode_mxfp4

    blocks = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(256, 16, 16)  # every (scale, byte)
    scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
    for dtype, bits in (("bfloat16", np.uint16), ("float32", np.uint32)):
        got = np.asarray(jax.jit(decode, static_argnums=2)(jnp.asarray(blocks), jnp.asarray(scales), dtype))
        np.testing.assert_array_equal(got.view(bits), decode_mxfp4(blocks, scales, dtype).view(bits))




@pytest.mark.parametrize("decoder", ["jnp", "ptx"])
@pytest.mark.parametrize("block_m", [16, 128])
def test_grouped_mxfp4_matmul_equals_decoding_then_a_plain_matmul(block_m, decoder):
    """The prompt kernel for packed experts on gpt-oss's input width (90 blocks a row), every used
    block of rows against its expert decoded first and a float32 matmul, with scale extremes; blocks
    past `used` are left alone."""
    from gptoss_jax.kernels.triton_mxfp4 import grouped_matmul_mxfp4
    from gptoss_jax.mxfp4 import decode

    rng = np.random.default_rng(block_m)
    E, F, D = 4, 256, 2880
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    block_expert = jnp.asarray([3, 0, 0, 2, 3, 3], jnp.int32)
    rows = jax.random.normal(jax.random.key(block_m), (6 * block_m, D), jnp.bfloat16)
    got = np.asarray(grouped_matmul_mxfp4(rows, block_expert, 5, blocks, scales, block_m=block_m, decoder=decoder),
                     np.float32)
    w = decode(blocks, scales, jnp.float32)
    for b, e in enumerate(np.asarray(block_expert)[:5]):
        m = slice(b * block_m, (b + 1) * block_m)
        want = np.asarray(jnp.einsum("md,fd->mf", rows[m].astype(jnp.float32), w[e], precision=jax.lax.Precision.HIGHEST))
        for cols in EXTREME_ROWS:
            assert rel_err(got[m, cols], want[:, cols]) <= 1e-2, (b, cols)


@pytest.mark.parametrize("decoder", ["jnp", "ptx"])
@pytest.mark.parametrize("P", [1, 4, 32])
def test_mxfp4_matvec_equals_decoding_then_a_plain_matmul(P, decoder):
    """The packed decode kernel on gpt-oss's input width (90 blocks a row) against decoding first and
    a float32 matmul, row by row, with rows of tiny (2^-117) and large (2^73) scales among typical ones."""
    from gptoss_jax.kernels.triton_mxfp4 import pair_matvec_mxfp4
    from gptoss_jax.mxfp4 import decode

    rng = np.random.default_rng(P)
    E, F, D = 8, 192, 2880
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    x = jax.random.normal(jax.random.key(P), (P, D), jnp.float32)
    idx = jnp.asarray(rng.integers(0, E, P), jnp.int32)
    got = np.asarray(pair_matvec_mxfp4(x, idx, blocks, scales, decoder=decoder))
    want = np.asarray(jnp.einsum("pd,pfd->pf", x, decode(blocks, scales, jnp.float32)[idx],
                                 precision=jax.lax.Precision.HIGHEST))
    for rows in EXTREME_ROWS:
        assert rel_err(got[:, rows], want[:, rows]) <= 1e-5, rows


@pytest.mark.parametrize("tokens", [1, 8])
def test_fused_decode_moe_on_the_gpu(tokens):
    """kernels/decode_moe.py's PTX: the route kernel against RMSNorm and the jnp router, and the
    MoE block (which takes the fused path at decode) against the gather path."""
    from test_decode_moe import check_block, check_route

    packed = random_params(CONFIG, seed=3, dtype=jnp.bfloat16, experts="mxfp4")["block_0"]["mlp"]
    check_route(CONFIG, packed, tokens, interpret=False)
    check_block(CONFIG, packed, tokens, interpret=False, rtol=BF16_RTOL)


def test_fused_decode_expert_kernels_with_extreme_scales_on_the_gpu():
    """The two fused expert kernels at gpt-oss's widths (90 blocks a row), with tiny and large scales."""
    from test_decode_moe import check_expert_kernels

    check_expert_kernels(E=8, F=2880, D=2880, pairs=8, interpret=False)


@pytest.mark.parametrize("E, F, D, M", [(8, 640, 256, 1200), (8, 256, 320, 1200), (32, 5760, 2880, 4096)])
def test_mosaic_ragged_dot_backward_pass_equals_xla_ragged_dot(E, F, D, M):
    """The expert kernel's own VJP (training): output, input gradient and weight gradient against
    XLA's ragged dot differentiated by JAX, at the model's shapes and a tiling fallback's."""
    k = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(k[0], (M, D), jnp.bfloat16)
    w = (jax.random.normal(k[1], (E, F, D), jnp.float32) * 0.05).astype(jnp.bfloat16)
    dy = jax.random.normal(k[2], (M, F), jnp.float32)
    sizes = jnp.asarray(np.random.default_rng(0).multinomial(M, np.ones(E) / E), jnp.int32)

    def reference(x, w):
        return jax.lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=jnp.float32)

    def kernel(x, w):
        return gpu.mosaic_ragged_dot(x, w, sizes).astype(jnp.float32)

    want, want_vjp = jax.vjp(reference, x, w)
    got, got_vjp = jax.vjp(kernel, x, w)
    assert rel_err(got, want) < BF16_RTOL
    for g, r in zip(got_vjp(dy), want_vjp(dy)):
        assert rel_err(g.astype(jnp.float32), r.astype(jnp.float32)) < BF16_RTOL
