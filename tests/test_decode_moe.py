"""The fused decode MoE over MXFP4 experts (kernels/triton/decode_moe.py) in Pallas interpret mode on CPU:
each kernel against decoding the experts first and plain float32 products, and the MoE block that
uses them against the gather path. tests/test_gpu.py runs the same checks on the GPU's PTX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gptoss_jax as gj
import refs
from conftest import EXTREME_ROWS, packed_with_extreme_scales
from gptoss_jax.kernels.triton import decode_moe
from gptoss_jax.model.layers import RMSNorm
from gptoss_jax.model.moe import MLPBlock, route
from gptoss_jax.mxfp4 import decode_mxfp4
from gptoss_jax.testing import random_params
from noise import Exact

CONFIG = gj.ModelConfig.tiny()  # hidden 64, intermediate 96: 2 and 3 blocks a row


def pair_order(t):
    """[R, D] -> [R, D]: each group of 8 as x0 x2 x4 x6 x1 x3 x5 x7 (the kernels' input order)."""
    R, D = t.shape
    return t.reshape(R, D // 8, 4, 2).swapaxes(-1, -2).reshape(R, D)


def check_route(config, params, tokens, interpret):
    x = (jax.random.normal(jax.random.key(tokens), (tokens, config.hidden_size), jnp.float32) * 3).astype(jnp.bfloat16)
    scale = params["norm"]["scale"]
    w, e, t, m = decode_moe.route(x, scale, params["router_weight"], params["router_bias"],
                                  k=config.experts_per_token, eps=config.rms_norm_eps, interpret=interpret)
    normed = RMSNorm(config).apply({"params": {"scale": scale}}, x)  # bf16, as the model
    want_w, want_e = route(normed, params["router_weight"], params["router_bias"], config.experts_per_token)
    np.testing.assert_array_equal(np.asarray(e), np.asarray(want_e))
    # The weights of those experts: softmax of their logits, against float64 (the normed input as the
    # kernel and the model round it) within NOISE_FACTOR x a numpy float32 run's noise.
    picked = np.asarray(e)
    logits = [np.take_along_axis(np.asarray(normed, d) @ np.asarray(params["router_weight"], d)
                                 + np.asarray(params["router_bias"], d), picked, axis=1) for d in (np.float32, np.float64)]
    softmax = [np.exp(z - z.max(1, keepdims=True)) / np.exp(z - z.max(1, keepdims=True)).sum(1, keepdims=True)
               for z in logits]
    exact = Exact.measure(*softmax)
    exact.check(w, "route kernel's weights")
    exact.check(want_w, "route's weights")
    # m: the least power of two at or above max |t|; t in pair order, scaled by 2^14 / m, exactly.
    top = np.abs(np.asarray(normed, np.float32)).max(axis=1)
    np.testing.assert_array_equal(np.asarray(m), 2.0 ** np.ceil(np.log2(top)))
    want_t = np.asarray(pair_order(normed.astype(jnp.float32)) * (2.0 ** 14 / m[:, None]))
    np.testing.assert_array_equal(np.asarray(t, np.float32), want_t)


def check_expert_kernels(E, F, D, pairs, interpret, seed=0, chunk=None):
    """up_swiglu, then down on its output: each against the experts decoded and its definition in float64
    (chunk: the blocks each load of a row spans, None: the whole row)."""
    rng = np.random.default_rng(seed)
    cfg = CONFIG
    b1, s1 = packed_with_extreme_scales(rng, E, 2 * F, D)
    b2, s2 = packed_with_extreme_scales(rng, E, D, F)
    bias1 = jnp.asarray(rng.standard_normal((E, 2 * F)), jnp.bfloat16)
    bias2 = jnp.asarray(rng.standard_normal((E, D)), jnp.bfloat16)
    tokens = pairs // cfg.experts_per_token
    t = jax.random.normal(jax.random.key(seed), (tokens, D), jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    m = 2.0 ** jnp.ceil(jnp.log2(jnp.abs(t).max(axis=1)))
    t16 = (pair_order(t) * (2.0 ** 14 / m[:, None])).astype(jnp.float16)
    experts = jnp.asarray(rng.integers(0, E, pairs), jnp.int32)
    pair_w = jnp.asarray(rng.random(pairs), jnp.float32)
    a = decode_moe.up_swiglu(t16, m, experts, b1, s1, bias1, tokens_per_pair=cfg.experts_per_token,
                             alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, interpret=interpret, chunk=chunk)
    # Against the definition in float64 (refs.swiglu_torch), within NOISE_FACTOR x the noise of that
    # definition run in bfloat16 (the model's precision; the kernels multiply in float16 and sum 8 at
    # a time in float16, then in float32). Rows of tiny scales round to zero in float16: errors are
    # measured over the whole result, absolute, as noise.py does.
    tok = np.arange(pairs) // cfg.experts_per_token
    w1, w2 = decode_mxfp4(np.asarray(b1), np.asarray(s1), "float32"), decode_mxfp4(np.asarray(b2), np.asarray(s2), "float32")
    e = np.array(experts)

    def up(dtype):
        h = torch.einsum("pd,pfd->pf", refs.t(t[tok], dtype), refs.t(w1[e], dtype)) + refs.t(bias1, dtype)[e]
        return refs.swiglu_torch(h, cfg.swiglu_alpha, cfg.swiglu_limit).double().numpy()

    exact_a = Exact.measure(up(torch.bfloat16), up(torch.float64), precision="bfloat16")
    bound = decode_moe.swiglu_bound(cfg.swiglu_limit)
    got_a = np.asarray(a, np.float32) * bound / 2.0 ** 14  # in pair order
    act = got_a.reshape(pairs, F // 8, 2, 4).swapaxes(-1, -2).reshape(pairs, F)  # natural order
    exact_a.check(act, "up_swiglu")
    y = decode_moe.down(a, experts, pair_w, b2, s2, bias2, limit=cfg.swiglu_limit, interpret=interpret, chunk=chunk)

    def down(dtype):
        y = torch.einsum("pf,pdf->pd", refs.t(act, dtype), refs.t(w2[e], dtype)) + refs.t(bias2, dtype)[e]
        return (y * refs.t(pair_w, dtype)[:, None]).double().numpy()

    # Against the kernel's own activations: each group of rows of extreme scales on its own bound.
    ref16, exact_y = down(torch.bfloat16), down(torch.float64)
    for rows in EXTREME_ROWS:
        Exact.measure(ref16[:, rows], exact_y[:, rows], precision="bfloat16").check(np.asarray(y)[:, rows], f"down {rows}")


def check_block(config, params, tokens, interpret):
    """The fused MoE block in bfloat16 against the experts' definition in float64 for the experts our
    router picks (refs.exact_moe_block), within NOISE_FACTOR x that definition's bfloat16 noise; the
    gather path too."""
    x = jax.random.normal(jax.random.key(tokens), (1, tokens, config.hidden_size), jnp.float32).astype(jnp.bfloat16)
    fused = MLPBlock(config, kernels=gj.Kernels(moe="triton", interpret=interpret))
    jaxpr = str(jax.make_jaxpr(lambda x: fused.apply({"params": params}, x))(x))
    assert "gptoss_decode_up_swiglu" in jaxpr  # the fused path ran
    exact = refs.exact_moe_block(config, params, x, precision="bfloat16")
    exact.check(jax.jit(fused.apply)({"params": params}, x)[0], "fused")
    exact.check(jax.jit(MLPBlock(config, kernels=gj.Kernels(moe="gather")).apply)({"params": params}, x)[0], "gather")


@pytest.fixture(scope="module")
def packed_mlp():
    return random_params(CONFIG, seed=3, dtype="mxfp4")["block_0"]["mlp"]


@pytest.mark.parametrize("tokens", [1, 3])
def test_route_kernel(packed_mlp, tokens):
    check_route(CONFIG, packed_mlp, tokens, interpret=True)


def test_route_kernel_with_experts_not_a_power_of_two():
    """40 experts: logits padded to 64 with -inf, expert blocks wholly past the experts included."""
    config = CONFIG.replace(num_experts=40)
    params = random_params(config, seed=4, dtype="mxfp4")["block_0"]["mlp"]
    check_route(config, params, 2, interpret=True)


@pytest.mark.parametrize("num_experts", [6, 8])
def test_a_token_that_is_not_finite_picks_real_experts(num_experts):
    """A token holding a NaN or an inf has NaN logits: the fused router picks the experts that
    jax.lax.top_k picks for it (the lowest ones), all real. (It used to pick the expert past the
    last, whose weights the expert kernels then read past the end of the arrays.)"""
    config = CONFIG.replace(num_experts=num_experts)
    params = random_params(config, seed=6, dtype="mxfp4")["block_0"]["mlp"]
    x = jax.random.normal(jax.random.key(6), (3, config.hidden_size), jnp.bfloat16)
    x = x.at[1, 5].set(jnp.nan).at[2].set(jnp.inf)
    _, experts, _, _ = decode_moe.route(x, params["norm"]["scale"], params["router_weight"], params["router_bias"],
                                        k=config.experts_per_token, eps=config.rms_norm_eps, interpret=True)
    normed = RMSNorm(config).apply({"params": {"scale": params["norm"]["scale"]}}, x)
    _, want = route(normed, params["router_weight"], params["router_bias"], config.experts_per_token)
    np.testing.assert_array_equal(np.asarray(experts), np.asarray(want))
    assert int(jnp.max(experts)) < num_experts


@pytest.mark.parametrize("chunk", [None, 1, 2])
def test_expert_kernels_with_extreme_scales(chunk):
    """Rows read whole (padded to a power of two), or `chunk` blocks a load: 2 and 3 blocks a row (up's
    and down's) in chunks of 1, and of 2 with down's last chunk masked past the row."""
    check_expert_kernels(E=4, F=96, D=64, pairs=8, interpret=True, chunk=chunk)


def test_a_chunk_is_a_power_of_two_and_spans_the_row():
    """Loads of 32 blocks over gpt-oss's 90: three, the last masked past the row; a chunk that covers
    the padded row is one load; a chunk that is not a power of two is refused."""
    assert [(width, bound) for _, width, bound in decode_moe._spans(90, 32, 0)] == [(32, 90), (32, 58), (32, 26)]
    assert [(width, bound) for _, width, bound in decode_moe._spans(90, 128, 0)] == [(128, 90)]
    with pytest.raises(ValueError, match="power of two"):
        decode_moe._spans(90, 3, 0)


def test_expert_kernel_check_catches_a_wrong_order():
    """The check above fails when the activations' pair order is ignored (it can fail)."""
    real = decode_moe._pairs_of
    decode_moe._pairs_of = lambda t: real(t.reshape(t.shape[0], -1, 2, 4).swapaxes(-1, -2).reshape(t.shape))
    jax.clear_caches()  # the kernels' wrappers are jitted: trace them again with the wrong order
    try:
        with pytest.raises(AssertionError):
            check_expert_kernels(E=4, F=96, D=64, pairs=8, interpret=True, seed=1)
    finally:
        decode_moe._pairs_of = real
        jax.clear_caches()


@pytest.mark.slow
@pytest.mark.parametrize("tokens", [1, 2])
def test_fused_block_equals_the_gather_path(packed_mlp, tokens):
    check_block(CONFIG, packed_mlp, tokens, interpret=True)


def test_fused_path_only_where_it_applies(packed_mlp):
    """float32 activations, bf16 experts and prompt-sized calls keep the other paths (a mesh does too:
    `kernels.experts.fused_block`)."""
    block = MLPBlock(CONFIG, kernels=gj.Kernels(moe="triton", interpret=True))

    def fused(params, dtype, tokens=1):
        x = jnp.ones((1, tokens, CONFIG.hidden_size), dtype)
        return "gptoss_decode_up_swiglu" in str(jax.make_jaxpr(lambda x: block.apply({"params": params}, x))(x))

    params32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, packed_mlp)
    dense = random_params(CONFIG, seed=3, dtype=jnp.bfloat16)["block_0"]["mlp"]
    auto = MLPBlock(CONFIG, kernels=gj.Kernels(interpret=True))  # CPU: "auto" picks the gather path
    x = jnp.ones((1, 1, CONFIG.hidden_size), jnp.bfloat16)
    assert fused(packed_mlp, jnp.bfloat16)  # the control: this one does take it
    assert not fused(params32, jnp.float32) and not fused(dense, jnp.bfloat16)
    assert "gptoss_decode" not in str(jax.make_jaxpr(lambda x: auto.apply({"params": packed_mlp}, x))(x))
