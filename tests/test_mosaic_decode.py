"""The Pallas Mosaic GPU decode kernels for the experts (kernels/experts/mosaic_decode.py,
kernels/experts/mosaic_pair.py and kernels/experts/mosaic_slots.py) on CPU, in Mosaic GPU's interpret mode (JAX
>= 0.11), and lowered for CUDA there; tests/test_gpu.py runs them compiled on a GPU, at gpt-oss-20b's shapes
too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import EXTREME_ROWS, packed_with_extreme_scales
from noise import Exact

import gptoss_jax as gj
from gptoss_jax.kernels.experts import mosaic_decode, mosaic_mxfp4, mosaic_pair
from gptoss_jax.mxfp4 import decode_mxfp4

pytestmark = pytest.mark.skipif(not mosaic_decode.supported(),
                                reason=f"Mosaic GPU interpret mode of these kernels needs JAX >= 0.11 (this is "
                                       f"{jax.__version__}); tests/run.sh runs them under Python >= 3.12")

BLOCK_EXPERT = jnp.asarray([2, 0, 1, 1], jnp.int32)  # 4 blocks, 3 used (the last is skipped)


def blocks_reference(rows, w, block):
    """Each used block of rows times its expert w [E, F, D] (float32): (bfloat16 run, float64 run)."""
    e = np.repeat(np.asarray(BLOCK_EXPERT)[:3], block)
    x = np.asarray(rows[:3 * block], np.float32)
    low = jnp.einsum("md,mfd->mf", jnp.asarray(x, jnp.bfloat16), jnp.asarray(w[e], jnp.bfloat16),
                     preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    return np.asarray(low, np.float64), np.einsum("md,mfd->mf", x.astype(np.float64), w[e].astype(np.float64))


@pytest.mark.parametrize("settings", [{}, {"splits": 2, "block_f": 64}])
def test_matvec_of_16_bit_experts(settings):
    """Blocks of 8 rows, 192 outputs (with 128-wide tiles the second is cut at the end), the input
    dimension in one range or split in two (float32 partial sums added after): every used block
    against its expert in float64, within the noise of the same product in bfloat16."""
    E, F, D = 3, 192, 128
    w = jax.random.normal(jax.random.key(0), (E, F, D), jnp.bfloat16)
    rows = jax.random.normal(jax.random.key(1), (4 * 8, D), jnp.bfloat16)
    got = jax.jit(lambda r, w: mosaic_decode.grouped_matvec(r, BLOCK_EXPERT, 3, w, interpret=True, **settings))(rows, w)
    low, exact = blocks_reference(rows, np.asarray(w, np.float32), 8)
    Exact.measure(low, exact, precision="bfloat16").check(np.asarray(got[:24], np.float32))


@pytest.mark.parametrize("E, settings", [(3, {}), (5, {"block_f": 128, "gs": 1, "splits": 3})])
def test_matvec_of_mxfp4_experts(E, settings):
    """MXFP4-packed experts with scale extremes (2^-117, 2^73, both in one row, typical), decoded on
    the chip: 320 outputs (a 256-wide tile cut at the end), 3 scale blocks (the second step's last
    two past the end: zeros from the TMA copy) or 3 steps split over 3 programs; with fewer blocks
    than experts (E=5) only the blocks' experts' scales are read, by block."""
    rng = np.random.default_rng(E)
    F, D = 320, 96
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    rows = jax.random.normal(jax.random.key(E), (4 * 8, D), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda r, b, s: mosaic_decode.grouped_matvec_mxfp4(
        r, BLOCK_EXPERT, 3, b, s, interpret=True, **settings))(rows, blocks, scales), np.float32)
    low, exact = blocks_reference(rows, decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32"), 8)
    for cols in EXTREME_ROWS:
        Exact.measure(low[:, cols], exact[:, cols], precision="bfloat16").check(got[:24, cols], str(cols))


@pytest.mark.parametrize("settings", [{}, {"block_f": 128, "gs": 2, "splits": 2}, {"gs": 2}])
def test_pair_matvec_of_mxfp4_experts(settings):
    """One row per pair (kernels/experts/mosaic_pair.py) over MXFP4-packed experts with scale extremes: 320
    outputs (tiles of 64, or of 128 with the last one cut), 4 scale blocks in one step of 6 (the
    last two past the end: zeros from the TMA copy), in 2 steps, or in 2 steps split over 2
    programs; two pairs share an expert.
    Each pair against its expert in float64, within the noise of the same product in bfloat16."""
    rng = np.random.default_rng(4)
    E, F, D = 5, 320, 128
    blocks, scales = packed_with_extreme_scales(rng, E, F, D)
    pair_expert = jnp.asarray([4, 0, 2, 4], jnp.int32)
    rows = jax.random.normal(jax.random.key(4), (4, D), jnp.bfloat16)
    got = np.asarray(jax.jit(lambda r, b, s: mosaic_pair.pair_matvec_mxfp4(
        r, pair_expert, b, s, interpret=True, **settings))(rows, blocks, scales), np.float32)
    w = decode_mxfp4(np.asarray(blocks), np.asarray(scales), "float32")[np.asarray(pair_expert)]  # [4, F, D]
    x = np.asarray(rows, np.float32)
    low = np.asarray(jnp.einsum("pd,pfd->pf", rows, jnp.asarray(w, jnp.bfloat16),
                                preferred_element_type=jnp.float32).astype(jnp.bfloat16), np.float64)
    exact = np.einsum("pd,pfd->pf", x.astype(np.float64), w.astype(np.float64))
    for cols in EXTREME_ROWS:
        Exact.measure(low[:, cols], exact[:, cols], precision="bfloat16").check(got[:, cols], str(cols))


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["mosaic_decode", "mosaic_pair", "mosaic_slots"])
@pytest.mark.parametrize("dtype", ["bfloat16", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 3, 9])
def test_the_kernels_switch_runs_it(dtype, tokens, impl):
    """Kernels(moe="mosaic_decode") in the MoE block, 16-bit and MXFP4-packed experts, for one token
    (its pairs each a block of their own) and for 3 (12 pairs sorted into expert blocks); and
    "mosaic_pair" (every pair over MXFP4 experts a row each, up to 64 pairs here; 16-bit experts as
    "mosaic_decode"); "mosaic_slots" (every token through each expert in use, the weighted sum in
    its second kernel; 9 tokens padded to 16 rows): the jnp gather path's output on the same (decoded) experts within the noise of
    a bfloat16 run of it (measured against float32)."""
    from gptoss_jax.model.moe import MLPBlock
    from gptoss_jax.mxfp4 import decode_params
    from gptoss_jax.testing import random_params

    config = gj.ModelConfig.tiny().replace(hidden_size=128, intermediate_size=128)
    params = random_params(config, seed=tokens, dtype=dtype)["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(tokens), (tokens, 1, config.hidden_size), jnp.bfloat16)
    block = MLPBlock(config, jnp.bfloat16, gj.Kernels(moe=impl, interpret=True, moe_pair_max_pairs=64))
    got = jax.jit(lambda p, x: block.apply({"params": p}, x))(params, x)
    decoded = decode_params(params)  # 16-bit experts as they are
    want = jax.jit(MLPBlock(config, jnp.bfloat16, gj.Kernels(moe="gather")).apply)({"params": decoded}, x)
    f32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, decoded)
    exact = jax.jit(MLPBlock(config, jnp.float32, gj.Kernels(moe="gather")).apply)({"params": f32}, x.astype(jnp.float32))
    flat = lambda a, dtype: np.asarray(a, dtype).reshape(-1, config.hidden_size)  # noqa: E731
    Exact.measure(flat(want, np.float64), flat(exact, np.float64), precision="bfloat16").check(
        flat(got, np.float32), impl)


def test_mxfp4_kernels_name_themselves_in_errors():
    """Rows that do not match the packed experts' input width, or are not bfloat16, and settings the
    pair kernel or the prompt kernel cannot run: a clear error naming the kernel or the setting, before anything is
    compiled."""
    blocks, scales = jnp.zeros((2, 128, 3, 16), jnp.uint8), jnp.zeros((2, 128, 3), jnp.uint8)
    with pytest.raises(ValueError, match="pair matvec takes rows of 96 inputs"):
        mosaic_pair.pair_matvec_mxfp4(jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((2,), jnp.int32), blocks, scales,
                                      gs=2, interpret=True)
    with pytest.raises(ValueError, match=r"output tiles of 96 \(of 64\)"):
        mosaic_pair.pair_matvec_mxfp4(jnp.zeros((2, 96), jnp.bfloat16), jnp.zeros((2,), jnp.int32), blocks, scales,
                                      block_f=96, gs=2, interpret=True)
    with pytest.raises(ValueError, match=r"3 \(an even number of\) scale blocks"):
        mosaic_pair.pair_matvec_mxfp4(jnp.zeros((2, 96), jnp.bfloat16), jnp.zeros((2,), jnp.int32), blocks, scales,
                                      gs=3, interpret=True)
    with pytest.raises(ValueError, match="stages=2: .* needs 3 or more"):
        mosaic_mxfp4.grouped_matmul_mxfp4(jnp.zeros((128, 96), jnp.bfloat16), jnp.zeros((1,), jnp.int32), 1, blocks,
                                          scales, stages=2, interpret=True)
    with pytest.raises(ValueError, match="decode matvec takes bfloat16 rows"):
        mosaic_decode.grouped_matvec_mxfp4(jnp.zeros((8, 96), jnp.float32), jnp.zeros((1,), jnp.int32), 1, blocks,
                                           scales, gs=3, interpret=True)


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow), "mxfp4"])  # (the fast tier: one)
def test_the_slot_kernels_keep_only_this_devices_pairs_over_cut_tiles(dtype):
    """kernels/experts/mosaic_slots.py through `local_experts` as on a device of a mesh holding experts
    4 to 11 of 16: the pairs of other devices' experts (and a dropped one, -1) weigh nothing, and
    widths of 192 cut the second kernel's last tile of 128 outputs and its last step of 6 scale
    blocks; the jnp gather path's result on the same (decoded) experts within the noise of a bfloat16
    run of it (measured against float32)."""
    from gptoss_jax.kernels.experts import EXPERTS, local_experts
    from gptoss_jax.model.moe import SwiGLU
    from gptoss_jax.mxfp4 import MXFP4, decode

    rng = np.random.default_rng(5)
    E, D, F, N = 8, 192, 192, 3

    def weight(out, inp):
        if dtype == "mxfp4":
            return MXFP4(jnp.asarray(rng.integers(0, 256, (E, out, inp // 32, 16), dtype=np.uint8)),
                         jnp.asarray(rng.integers(118, 124, (E, out, inp // 32), dtype=np.uint8)))
        return jnp.asarray(rng.standard_normal((E, out, inp)) * 0.05, jnp.bfloat16)

    w = dict(mlp1_weight=weight(2 * F, D), mlp2_weight=weight(D, F),
             mlp1_bias=jnp.asarray(rng.standard_normal((E, 2 * F)) * 0.1, jnp.bfloat16),
             mlp2_bias=jnp.asarray(rng.standard_normal((E, D)) * 0.1, jnp.bfloat16))
    decoded = {k: decode(v.blocks, v.scales, jnp.bfloat16) if isinstance(v, MXFP4) else v for k, v in w.items()}
    x = jnp.asarray(rng.standard_normal((N, D)), jnp.bfloat16)
    idx = jnp.asarray([[4, 0, 11, 7], [-1, 5, 15, 4], [12, 9, 3, 6]], jnp.int32)  # 4..11 held here
    weights = jnp.asarray(rng.random((N, 4)), jnp.float32)
    act = SwiGLU(1.702, 7.0)
    kernels = gj.Kernels(interpret=True)

    def run(variant, w, x):
        return np.asarray(local_experts(x, weights, idx, w, act, first=4, variant=EXPERTS[variant], kernels=kernels))

    got = run("mosaic_slots", w, x)
    want = run("gather", decoded, x)
    exact = run("gather", jax.tree.map(lambda a: a.astype(jnp.float32), decoded), x.astype(jnp.float32))
    Exact.measure(want.astype(np.float64), exact.astype(np.float64), precision="bfloat16").check(got, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,experts,tokens", [("mxfp4", 32, 1), ("mxfp4", 128, 32), ("bfloat16", 32, 16)])
def test_the_slot_kernels_lower_for_a_gpu_at_gpt_oss_shapes(dtype, experts, tokens):
    """kernels/experts/mosaic_slots.py's two kernels traced and lowered for CUDA on this CPU, at
    gpt-oss's widths: what interpret mode never runs (the SwiGLU epilogue's register shuffles and
    stores, the scales' strided loads, the decoder's PTX, the tensor cores' register operands) reaches
    Mosaic GPU's lowering here, and an error in it fails here rather than on a GPU."""
    from gptoss_jax.kernels.experts import mosaic_slots
    from gptoss_jax.model.moe import SwiGLU
    from gptoss_jax.mxfp4 import MXFP4

    D = F = 2880
    spec = jax.ShapeDtypeStruct

    def weight(out, inp):
        if dtype == "mxfp4":
            return MXFP4(spec((experts, out, inp // 32, 16), jnp.uint8), spec((experts, out, inp // 32), jnp.uint8))
        return spec((experts, out, inp), jnp.bfloat16)

    w = dict(mlp1_weight=weight(2 * F, D), mlp2_weight=weight(D, F), mlp1_bias=spec((experts, 2 * F), jnp.bfloat16),
             mlp2_bias=spec((experts, D), jnp.bfloat16))
    block = jax.jit(lambda x, idx, weights, w: mosaic_slots.weighted_sum(x, idx, weights, w, SwiGLU(1.702, 7.0),
                                                                         kernels=gj.Kernels()))
    lowered = block.trace(spec((tokens, D), jnp.bfloat16), spec((tokens, 4), jnp.int32), spec((tokens, 4), jnp.float32),
                          w).lower(lowering_platforms=("cuda",))
    assert lowered.as_text().count("mosaic_gpu") >= 2  # both kernels, as Mosaic GPU custom calls
