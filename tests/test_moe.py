"""Router, clamped SwiGLU and both expert dispatch paths against the references.

Float results are checked against the references run in float64 on the same inputs, within
NOISE_FACTOR x the references' own float32 error (noise.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from noise import Exact
from gptoss_jax.kernels import Kernels
from gptoss_jax.kernels.experts.xla import gather, grouped
from gptoss_jax.model.moe import MLPBlock, route, swiglu
from gptoss_jax.kernels.pairs import group_by_expert, pair_inputs, sort_by_expert, to_blocks, unsort
from refs import hf_model, openai_model, t


def _normed_inputs(config, n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, config.hidden_size)).astype(np.float32)


def test_router_matches_hf(tiny, tiny_params):
    model = hf_model(tiny, tiny_params)
    x = _normed_inputs(tiny, 64)
    m = tiny_params["block_0"]["mlp"]
    weights, idx = route(jnp.asarray(x), m["router_weight"], m["router_bias"], tiny.experts_per_token)
    with torch.no_grad():
        _, ref_w, ref_idx = model.model.layers[0].mlp.router(t(x))
        _, exact_w, exact_idx = model.to(torch.float64).model.layers[0].mlp.router(t(x, torch.float64))
    np.testing.assert_array_equal(np.asarray(idx), ref_idx.numpy())
    np.testing.assert_array_equal(np.asarray(idx), exact_idx.numpy())
    Exact.measure(ref_w.numpy(), exact_w.numpy()).check(weights, "weights")
    # Each row sums to 1 to float32 rounding: k terms of at most 1, so k/2 ulps of 1 at most.
    assert np.abs(np.asarray(weights, np.float64).sum(-1) - 1).max() <= tiny.experts_per_token / 2 * np.finfo(np.float32).eps


def test_router_in_bf16_equals_float32_router(tiny, tiny_params):
    """bf16 inputs and weights: the bf16 product with float32 sums is the float32 product (each
    product of two bf16 numbers is exact in float32), so the same experts and weights to rounding."""
    m = tiny_params["block_0"]["mlp"]
    x = jnp.asarray(_normed_inputs(tiny, 256, seed=3), jnp.bfloat16)
    w16, b = jnp.asarray(m["router_weight"], jnp.bfloat16), m["router_bias"]
    weights, idx = route(x, w16, b, tiny.experts_per_token)
    ref_w, ref_idx = route(x.astype(jnp.float32), w16.astype(jnp.float32), b, tiny.experts_per_token)
    np.testing.assert_array_equal(np.asarray(idx), np.asarray(ref_idx))
    # The exact weights: the float64 logits of the same bf16 numbers, softmax over the chosen k.
    logits = np.asarray(x, np.float64) @ np.asarray(w16, np.float64) + np.asarray(b, np.float64)
    chosen = np.take_along_axis(logits, np.asarray(idx), axis=-1)
    exact = np.exp(chosen - chosen.max(-1, keepdims=True))
    Exact.measure(ref_w, exact / exact.sum(-1, keepdims=True)).check(weights)


def test_swiglu_matches_both_references():
    from gpt_oss.torch.model import swiglu as openai_swiglu

    h = np.linspace(-12, 12, 2 * 241, dtype=np.float32).reshape(1, -1)  # crosses both clamps
    h = np.random.default_rng(0).permutation(h, axis=1)
    ours = swiglu(jnp.asarray(h), alpha=1.702, limit=7.0)
    ref = openai_swiglu(t(h), alpha=1.702, limit=7.0).numpy()
    Exact.measure(ref, openai_swiglu(t(h, torch.float64), alpha=1.702, limit=7.0).numpy()).check(ours)
    # Interleaving matters: swapping the halves gives a different function.
    swapped = h.reshape(1, -1, 2)[..., ::-1].reshape(1, -1)
    assert not np.allclose(swiglu(jnp.asarray(swapped), alpha=1.702, limit=7.0), ref, atol=1e-3)


@pytest.mark.parametrize("path", ["gather", "grouped"])
@pytest.mark.parametrize("n", [1, 5, 64])
def test_expert_paths_match_hf_experts(tiny, tiny_params, path, n):
    model = hf_model(tiny, tiny_params)
    m = tiny_params["block_1"]["mlp"]
    x = 2 * _normed_inputs(tiny, n, seed=n)
    weights, idx = route(jnp.asarray(x), m["router_weight"], m["router_bias"], tiny.experts_per_token)

    def act(h):
        return swiglu(h, alpha=tiny.swiglu_alpha, limit=tiny.swiglu_limit)

    if path == "gather":
        y = gather(jnp.asarray(x), idx, m, act)
    else:
        y = grouped(jnp.asarray(x), idx, m, act, block=4)
    ours = jnp.einsum("nad,na->nd", y, weights)
    experts = model.model.layers[1].mlp.experts
    chosen = torch.from_numpy(np.array(idx)).long()
    with torch.no_grad():
        ref = experts(t(x), chosen, t(weights)).numpy()
        model64 = hf_model(tiny, tiny_params, "float64")
        exact = model64.model.layers[1].mlp.experts(t(x, torch.float64), chosen, t(weights, torch.float64)).numpy()
    Exact.measure(ref, exact).check(ours)
    # The clamp at +-7 is exercised by these inputs.
    h = np.einsum("nd,nafd->naf", x, np.asarray(m["mlp1_weight"])[np.asarray(idx)])
    assert np.mean(np.abs(h) > 7) > 0.01


@pytest.mark.parametrize("impl", ["gather", "grouped", "triton", "megablox"])  # the last two: Pallas interpret mode
def test_mlp_block_matches_openai(tiny, tiny_params, impl):
    ref_model = openai_model(tiny, tiny_params)
    x = np.random.default_rng(3).standard_normal((1, 50, tiny.hidden_size)).astype(np.float32)
    with torch.no_grad():  # it returns x + moe(x)
        ref = ref_model.block[2].mlp(torch.from_numpy(x[0])).double().numpy() - x[0]
        exact = ref_model.to(torch.float64).block[2].mlp(torch.from_numpy(x[0]).double()).numpy() - x[0]
    out = MLPBlock(tiny, kernels=Kernels(moe=impl, moe_block=8, interpret=True))
    out = out.apply({"params": tiny_params["block_2"]["mlp"]}, jnp.asarray(x))
    Exact.measure(ref, exact).check(np.asarray(out[0], np.float64), impl)


def _gather_flops(num_experts, tokens):
    import gptoss_jax as gj

    config = gj.ModelConfig.tiny().replace(num_experts=num_experts, hidden_size=256, intermediate_size=256)
    shapes = jax.eval_shape(lambda: MLPBlock(config, jnp.float32).init(jax.random.key(0),
                                                                       jnp.zeros((1, tokens, 256))))
    fn = jax.jit(lambda p, x: MLPBlock(config, kernels=Kernels(moe="gather")).apply(p, x))
    x = jax.ShapeDtypeStruct((1, tokens, 256), jnp.float32)
    return fn.lower(shapes, x).compile().cost_analysis()["flops"]


def test_gather_work_does_not_scale_with_the_number_of_experts():
    # Dense dispatch would cost ~E/A times the selected work: 8 -> 64 experts would multiply it by ~8.
    small, large = _gather_flops(8, 4), _gather_flops(64, 4)
    assert large < 1.2 * small, (small, large)


@pytest.mark.parametrize("num_experts, n, block", [(8, 1, 4), (8, 50, 4), (32, 300, 16), (128, 7, 64)])
def test_grouped_layout_computes_only_selected_pairs(num_experts, n, block):
    rng = np.random.default_rng(n)
    idx = np.stack([rng.choice(num_experts, 4, replace=False) for _ in range(n)]).astype(np.int32)
    order, dest, block_expert, used_blocks = (np.asarray(a) for a in group_by_expert(jnp.asarray(idx), num_experts, block))
    P = idx.size
    counts = np.bincount(idx.ravel(), minlength=num_experts)
    # The blocks computed (every one of the static bound) hold the selected pairs plus fewer than
    # `block` padding rows per expert: never the dense E x N.
    assert len(block_expert) * block < P + min(num_experts, P) * block  # a few pairs: a few blocks
    # Each expert's pairs fill its blocks from their start; the blocks past the used ones hold none.
    used = sum(-(-c // block) for c in counts)
    assert used_blocks == used  # the count the grouped MXFP4 kernel skips from
    assert dest.max() < used * block <= len(block_expert) * block
    # Every pair lands in a distinct row of a block that belongs to its expert.
    assert len(set(dest.tolist())) == P
    np.testing.assert_array_equal(block_expert[dest // block], idx.ravel()[order])


def check_summed_gradient(grad, exact, dtype):
    """grad (float64 copy of a gradient in dtype) against exact (float64): each token's four pair
    cotangents summed in float32, then rounded once to dtype."""
    if dtype == jnp.bfloat16:  # four bf16 numbers add exactly in float32: one rounding, to bf16
        np.testing.assert_array_equal(grad, np.asarray(jnp.asarray(exact, jnp.float32).astype(dtype), np.float64))
    else:  # three float32 additions, each rounding by at most half an ulp of the partial sum's size
        np.testing.assert_allclose(grad, exact, rtol=0, atol=3 * np.finfo(np.float32).eps * np.abs(exact).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_pair_gathers_have_the_gradients_of_plain_gathers(dtype):
    """pair_inputs and unsort carry backward passes of their own (gathers, not scatter-adds into
    zero buffers). Sorting the pairs and unsorting them gives each pair its token's row back, so
    the gradient is each token's A pair cotangents summed: in float32, rounded once to dtype."""
    N, A, E, D = 37, 4, 8, 16
    key1, key2, key3 = jax.random.split(jax.random.key(5), 3)
    idx = jax.random.randint(key1, (N, A), -2, E + 2)  # some pairs dropped (other devices' experts)
    x = jax.random.normal(key2, (N, D), dtype)
    cot = jax.random.normal(key3, (N, A, D), dtype)
    order, _, _ = sort_by_expert(idx, E)

    y, vjp = jax.vjp(lambda x: unsort(pair_inputs(x, order, A), order).reshape(N, A, D), x)
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.repeat(np.asarray(x, np.float32)[:, None], A, axis=1))
    exact = np.asarray(cot, np.float64).sum(axis=1)
    grad = np.asarray(vjp(cot)[0], np.float64)
    check_summed_gradient(grad, exact, dtype)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_expert_blocks_hold_each_pairs_input_and_carry_its_gradient(dtype):
    """to_blocks gathers each padded row's input from x (no scatter of the sorted pairs): every
    pair's row holds its token's input, every other row zeros, and undo gives each kept pair its
    row's output back (dropped pairs: zeros). The gradient to x is each token's kept pairs'
    cotangents summed, in float32, rounded once to dtype."""
    N, A, E, D, block = 37, 4, 8, 16, 8
    key1, key2, key3 = jax.random.split(jax.random.key(6), 3)
    idx = jax.random.randint(key1, (N, A), -2, E + 2)  # some pairs dropped (other devices' experts)
    x = jax.random.normal(key2, (N, D), dtype)
    order, dest, _, _ = (np.asarray(a) for a in group_by_expert(idx, E, block))
    rows, undo, _, _ = to_blocks(x, idx, E, block)
    M = rows.shape[0]
    kept = np.asarray((idx >= 0) & (idx < E)).reshape(-1)
    want = np.zeros((M, D), np.float32)
    for i, p in enumerate(order):
        if dest[i] < M:
            want[dest[i]] = np.asarray(x, np.float32)[p // A]
    np.testing.assert_array_equal(np.asarray(rows, np.float32), want)
    back = np.asarray(undo(rows), np.float32).reshape(N * A, D)
    np.testing.assert_array_equal(back, np.where(kept[:, None], np.repeat(np.asarray(x, np.float32), A, 0), 0))

    cot = jax.random.normal(key3, (M, D), dtype)
    _, vjp = jax.vjp(lambda x: to_blocks(x, idx, E, block)[0], x)
    grad = np.asarray(vjp(cot)[0], np.float64)
    exact = np.zeros((N, D))
    for i, p in enumerate(order):
        if dest[i] < M:
            exact[p // A] += np.asarray(cot, np.float64)[dest[i]]
    check_summed_gradient(grad, exact, dtype)
