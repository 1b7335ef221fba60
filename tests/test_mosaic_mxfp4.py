"""The Pallas Mosaic GPU grouped matmul over MXFP4-packed experts (kernels/experts/mosaic_mxfp4.py) on CPU, in
Mosaic GPU's interpret mode (simulated warpgroups, shared memory, TMA copies and barriers), which
JAX offers from 0.11 on for these kernels; tests/test_gpu.py runs the same kernel compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EXTREME_ROWS, packed_with_extreme_scales
from noise import Exact

import gptoss_jax as gj
from gptoss_jax.kernels.experts import mosaic_mxfp4
from gptoss_jax.model.moe import SwiGLU
from gptoss_jax.mxfp4 import decode_mxfp4

pytestmark = pytest.mark.skipif(not mosaic_mxfp4.supported(),
                                reason=f"Mosaic GPU interpret mode of these kernels needs JAX >= 0.11 (this is "
                                       f"{jax.__version__}); tests/run.sh runs them under Python >= 3.12")


def grouped_reference(rows, block_expert, used, blocks, scales, block):
    """Each used block of rows times its expert decoded first: (bfloat16 run, float64 run), [rows, F]."""
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")  # [E, F, D], exact
    e = np.repeat(np.asarray(block_expert)[:used], block)
    x = np.asarray(rows[:used * block], np.float32)
    low = jnp.einsum("md,mfd->mf", jnp.asarray(x, jnp.bfloat16), jnp.asarray(w[e], jnp.bfloat16),
                     preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return np.asarray(low, np.float64), np.einsum("md,mfd->mf", x.astype(np.float64), w[e].astype(np.float64))


@pytest.mark.parametrize("settings", [{}, {"block_m": 64, "gs": 1, "splits": 3}, {"gs": 1, "stages": 3}])
@pytest.mark.parametrize("F", [256, 320])
def test_grouped_kernel_equals_decoding_then_a_matmul(F, settings):
    """Every used block of rows against its expert decoded first and multiplied in float64, within
    NOISE_FACTOR x the noise of that product in bfloat16, for each group of scale extremes (2^-117,
    2^73, both in one row, typical); 3 scale blocks per row (by default the second step's second
    block lies past the end: zeros from the TMA copy; with splits=3, decode's settings, each of three
    programs takes one block and their float32 partial sums are added; with gs=1, three steps of
    one block alternate between the two buffers of decoded weights), and 320 outputs (the second
    tile cut at the end); blocks past `used` are not computed."""
    rng = np.random.default_rng(F)
    E, D = 3, 96
    block = settings.get("block_m", 128)
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    block_expert = jnp.asarray([2, 0, 1, 1], jnp.int32)
    rows = jax.random.normal(jax.random.key(F), (4 * block, D), jnp.bfloat16)
    got = np.asarray(mosaic_mxfp4.grouped_matmul_mxfp4(rows, block_expert, 3, blocks, scales, interpret=True,
                                                       **{"block_m": block, **settings}), np.float32)
    low, exact = grouped_reference(rows, block_expert, 3, blocks, scales, block)
    for cols in EXTREME_ROWS:
        Exact.measure(low[:, cols], exact[:, cols], precision="bfloat16").check(got[:3 * block, cols], str(cols))


def swiglu64(h, alpha, limit):
    """gpt-oss's clamped SwiGLU of interleaved (gate, linear) columns, in numpy."""
    gate, linear = np.minimum(h[:, 0::2], limit), np.clip(h[:, 1::2], -limit, limit)
    return gate * 0.5 * (1 + np.tanh(0.5 * alpha * gate)) * (linear + 1)  # the sigmoid, without overflow


@pytest.mark.parametrize("swiglu", [None, SwiGLU(1.702, 7.0)])
def test_grouped_kernel_epilogue_adds_the_bias_and_applies_swiglu(swiglu):
    """The epilogue: each used block's expert bias added to the float32 sums, then (mlp1) the clamped
    SwiGLU of each (gate, linear) pair of outputs, [rows, F / 2]; against the same in float64, within
    the noise of a bfloat16 run (product rounded to bfloat16, bias and SwiGLU in float32). Typical
    scales and a bias of +-8 put gates and linears on both sides of the clamp (limit 7). 320 outputs:
    the second tile cut at the end (its second warpgroup's outputs all past it). Mutations caught:
    the bias of another expert, gate and linear swapped, the linear's +1 left out."""
    rng = np.random.default_rng(7)
    E, F, D, block = 3, 320, 96, 128
    blocks = jnp.asarray(rng.integers(0, 256, (E, F, D // 32, 16), dtype=np.uint8))
    scales = jnp.asarray(rng.integers(122, 128, (E, F, D // 32), dtype=np.uint8))
    bias = jnp.asarray(rng.uniform(-8, 8, (E, F)), jnp.bfloat16)
    block_expert = jnp.asarray([2, 0, 1, 1], jnp.int32)
    rows = jax.random.normal(jax.random.key(3), (4 * block, D), jnp.bfloat16)
    got = np.asarray(mosaic_mxfp4.grouped_matmul_mxfp4(rows, block_expert, 3, blocks, scales, bias, swiglu=swiglu,
                                                       interpret=True), np.float32)[:3 * block]
    low, exact = grouped_reference(rows, block_expert, 3, blocks, scales, block)
    b = np.asarray(bias, np.float64)[np.repeat(np.asarray(block_expert)[:3], block)]
    low, exact = low + b, exact + b
    if swiglu is not None:
        low = np.asarray(jnp.asarray(swiglu64(low.astype(np.float32), swiglu.alpha, swiglu.limit), jnp.bfloat16),
                         np.float64)
        exact = swiglu64(exact, swiglu.alpha, swiglu.limit)
        assert (np.abs(exact) > 1).mean() > 0.3  # not all near zero: the clamp and sigmoid both at work
    assert got.shape == exact.shape
    Exact.measure(low, exact, precision="bfloat16").check(got, f"epilogue {swiglu}")


def test_grouped_kernel_epilogue_errors():
    """An epilogue needs whole sums (splits=1), a bias of [experts, outputs], and even outputs for SwiGLU."""
    blocks, scales = jnp.zeros((2, 256, 3, 16), jnp.uint8), jnp.zeros((2, 256, 3), jnp.uint8)
    rows, be = jnp.zeros((128, 96), jnp.bfloat16), jnp.zeros((1,), jnp.int32)
    with pytest.raises(ValueError, match="splits=1"):
        mosaic_mxfp4.grouped_matmul_mxfp4(rows, be, 1, blocks, scales, swiglu=SwiGLU(1.0, 7.0), gs=1, splits=3)
    with pytest.raises(ValueError, match=r"\[2, 256\]"):
        mosaic_mxfp4.grouped_matmul_mxfp4(rows, be, 1, blocks, scales, jnp.zeros((2, 255)))
    with pytest.raises(ValueError, match="even"):
        mosaic_mxfp4.grouped_matmul_mxfp4(rows, be, 1, blocks[:, :255], scales[:, :255], swiglu=SwiGLU(1.0, 7.0))


@pytest.mark.slow
@pytest.mark.parametrize("hidden, shape, reference", [(128, (1, 40), "grouped"), (256, (3, 1), "gather")])
def test_the_kernels_switch_runs_it(hidden, shape, reference):
    """Kernels(moe="mosaic_grouped") is the MoE block's path, for a prompt of 40 tokens (160 pairs)
    and for a decode batch of 3 (12 pairs; both under 1,024 pairs: blocks of 64 rows with the input
    dimension split, split over 3 programs at hidden 256): the jnp path's output on the experts
    decoded first, within the noise of a bfloat16 run of it (measured against float32)."""
    from gptoss_jax.model.moe import MLPBlock
    from gptoss_jax.mxfp4 import decode_params
    from gptoss_jax.testing import random_params

    config = gj.ModelConfig.tiny().replace(hidden_size=hidden, intermediate_size=128)
    packed = random_params(config, seed=hidden, dtype="mxfp4")["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(1), shape + (config.hidden_size,), jnp.bfloat16)
    got = jax.jit(MLPBlock(config, jnp.bfloat16, gj.Kernels(moe="mosaic_grouped", interpret=True)).apply)({"params": packed}, x)
    decoded = decode_params(packed)
    want = jax.jit(MLPBlock(config, jnp.bfloat16, gj.Kernels(moe=reference)).apply)({"params": decoded}, x)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, decoded)
    exact = jax.jit(MLPBlock(config, jnp.float32, gj.Kernels(moe=reference)).apply)({"params": f32}, x.astype(jnp.float32))
    flat = lambda a, dtype: np.asarray(a, dtype).reshape(-1, hidden)  # noqa: E731
    Exact.measure(flat(want, np.float64), flat(exact, np.float64), precision="bfloat16").check(
        flat(got, np.float32), "mosaic_grouped")
