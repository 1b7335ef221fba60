"""The whole model against both references, in float32 and bfloat16, and against itself."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import gptoss_jax as gj
from conftest import rel_err
from gptoss_jax.model.attention import AttentionBlock
from gptoss_jax.model.transformer import TransformerBlock
from gptoss_jax.testing import random_params
from noise import Exact, check_typical_tokens
from refs import exact_logits, hf_layer_outputs, hf_model, openai_model

KERNELS = {
    "default": gj.Kernels(),
    "reference-gather": gj.Kernels(attention="reference", moe="gather"),
    "small-blocks-grouped": gj.Kernels(attention_block=16, moe="grouped", moe_block=8),
}


@pytest.fixture(scope="module")
def openai_exact(tiny, tiny_params, long_tokens):
    """OpenAI's reference in float64, with its float32 run as the noise (noise.py)."""
    tokens = torch.from_numpy(long_tokens[0]).long()
    with torch.no_grad():
        ref32 = openai_model(tiny, tiny_params)(tokens).numpy()
        exact = openai_model(tiny, tiny_params).to(torch.float64)(tokens).numpy()
    return Exact.measure(ref32, exact)


@pytest.fixture(scope="module")
def hf_exact(tiny, tiny_params, long_tokens):
    return exact_logits(tiny, tiny_params, long_tokens)[0]


@pytest.mark.slow
@pytest.mark.parametrize("kernels", KERNELS)
def test_float32_logits_match_openai(tiny, tiny_params, long_tokens, openai_exact, kernels):
    """Within NOISE_FACTOR x OpenAI's own float32 error of its float64 logits. Mutation tried: RMSNorm's
    eps 1e-5 -> 1e-6 fails the float32 tests by 26x."""
    logits = gj.forward(tiny, tiny_params, long_tokens, kernels=KERNELS[kernels])
    assert logits.shape == (1, 300, tiny.vocab_size) and logits.dtype == jnp.float32
    openai_exact.check(logits[0], kernels)


@pytest.mark.parametrize("kernels", KERNELS)
def test_float32_logits_match_hf(tiny, tiny_params, long_tokens, hf_exact, kernels):
    hf_exact.check(gj.forward(tiny, tiny_params, long_tokens, kernels=KERNELS[kernels])[0], kernels)


@pytest.mark.slow
def test_every_block_matches_hf_decoder_layers(tiny, tiny_params, long_tokens):
    """Our block i and transformers' decoder layer i on the same input (transformers' float32 hidden
    state i), each layer's update (output - input) against the layer in float64."""
    model = hf_model(tiny, tiny_params)
    with torch.no_grad():
        hidden = model(torch.from_numpy(long_tokens).long(), output_hidden_states=True).hidden_states
    inputs = [h.numpy() for h in hidden[:-1]]
    ref32 = hf_layer_outputs(tiny, tiny_params, long_tokens, inputs, "float32")
    exact = hf_layer_outputs(tiny, tiny_params, long_tokens, inputs, "float64")
    positions = jnp.arange(long_tokens.shape[1])[None]
    for i, x in enumerate(inputs):
        out = jax.jit(TransformerBlock(tiny, i).apply)({"params": tiny_params[f"block_{i}"]}, jnp.asarray(x), positions)
        Exact.measure(ref32[i] - x, exact[i] - x).check(np.asarray(out, np.float64) - x, f"block {i}")


def test_every_block_matches_openai_blocks(tiny, tiny_params):
    model = openai_model(tiny, tiny_params)
    model64 = openai_model(tiny, tiny_params).to(torch.float64)
    x = np.random.default_rng(5).standard_normal((1, 300, tiny.hidden_size)).astype(np.float32)
    positions = jnp.arange(300)[None]
    for i in range(tiny.num_hidden_layers):
        with torch.no_grad():
            ref32 = model.block[i](torch.from_numpy(x[0])).double().numpy() - x[0]
            exact = model64.block[i](torch.from_numpy(x[0]).double()).numpy() - x[0]
        out = jax.jit(TransformerBlock(tiny, i).apply)({"params": tiny_params[f"block_{i}"]}, jnp.asarray(x), positions)
        Exact.measure(ref32, exact).check(np.asarray(out[0], np.float64) - x[0], f"block {i}")


def test_window_and_long_context_matter(tiny, tiny_params, long_tokens):
    # Changing the first token changes late logits only through full-attention layers: the result
    # differs from the original, and a model with every layer sliding ignores it beyond the window reach.
    changed = long_tokens.copy()
    changed[0, 0] = (changed[0, 0] + 1) % tiny.vocab_size
    base, moved = gj.forward(tiny, tiny_params, long_tokens), gj.forward(tiny, tiny_params, changed)
    assert rel_err(moved[0, -1], base[0, -1]) > 1e-4
    all_sliding = tiny.replace(layer_types=("sliding_attention",) * tiny.num_hidden_layers)
    base, moved = gj.forward(all_sliding, tiny_params, long_tokens), gj.forward(all_sliding, tiny_params, changed)
    reach = tiny.num_hidden_layers * (tiny.sliding_window - 1)  # receptive field of stacked windows
    np.testing.assert_array_equal(np.asarray(base[0, reach + 1:]), np.asarray(moved[0, reach + 1:]))


@pytest.mark.slow
def test_batched_equals_single(tiny, tiny_params):
    """A batch of 3 and each sequence alone, both against transformers' float64 logits."""
    tokens = np.random.default_rng(7).integers(0, tiny.vocab_size, size=(3, 70)).astype(np.int32)
    exact = exact_logits(tiny, tiny_params, tokens)
    batched = gj.forward(tiny, tiny_params, tokens, kernels=gj.Kernels(attention_block=32))
    for b in range(3):
        single = gj.forward(tiny, tiny_params, tokens[b:b + 1], kernels=gj.Kernels(attention_block=32))
        exact[b].check(batched[b], f"sequence {b} in the batch")
        exact[b].check(single[0], f"sequence {b} alone")


def _bf16_setup(config, seed=0):
    """bf16 weights; OpenAI's reference on exactly those weights in float64 (the exact side: only
    arithmetic differs) and in bfloat16 (the noise of a bf16 implementation)."""
    params = random_params(config, seed=seed, dtype=jnp.bfloat16)
    params32 = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    return params, openai_model(config, params32).to(torch.float64), openai_model(config, params, "bfloat16")


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_bfloat16_attention_block(tiny, layer):
    """Our bf16 attention (q, k, v, the rotated q and k, the probabilities and the output each rounded
    to bf16) within NOISE_FACTOR x the error of OpenAI's own bf16 attention, against float64."""
    params, ref64, ref16 = _bf16_setup(tiny)
    x = np.asarray(jnp.asarray(np.random.default_rng(0).standard_normal((1, 300, tiny.hidden_size)),
                               jnp.bfloat16).astype(jnp.float32))
    with torch.no_grad():
        exact = ref64.block[layer].attn(torch.tensor(x[0]).double()).numpy() - x[0]
        theirs = ref16.block[layer].attn(torch.tensor(x[0]).bfloat16()).double().numpy() - x[0]
    ours = AttentionBlock(tiny, layer, kernels=gj.Kernels(attention_block=32)).apply(
        {"params": params[f"block_{layer}"]["attn"]}, jnp.asarray(x, jnp.bfloat16), jnp.arange(300)[None])
    assert ours.dtype == jnp.bfloat16
    Exact.measure(theirs, exact, precision="bfloat16").check(ours[0], "bf16 attention")


@pytest.mark.slow
def test_bfloat16_model_is_as_accurate_as_openai_bfloat16(tiny):
    """On the typical token, as OpenAI's own bf16 run on the same weights (noise.check_typical_tokens)."""
    params, ref64, ref16 = _bf16_setup(tiny)
    tokens = np.random.default_rng(0).integers(0, tiny.vocab_size, size=(1, 300)).astype(np.int32)
    with torch.no_grad():
        want = ref64(torch.from_numpy(tokens[0]).long()).numpy()
        theirs = ref16(torch.from_numpy(tokens[0]).long()).double().numpy()
    check_typical_tokens(gj.forward(tiny, params, tokens)[0], theirs, want, "bf16 model")


def test_forward_rejects_bad_tokens(tiny, tiny_params):
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        gj.forward(tiny, tiny_params, np.array([[1, 2, 1024]], np.int32))
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        gj.forward(tiny, tiny_params, np.array([[-1, 2]], np.int32))
    with pytest.raises(ValueError, match=r"\[batch, seq\]"):
        gj.forward(tiny, tiny_params, np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="integers"):
        gj.forward(tiny, tiny_params, np.array([[1.0, 2.0]], np.float32))


@pytest.mark.slow
def test_init_params_dtypes(tiny):
    params = gj.init_params(tiny, jax.random.key(0), dtype=jnp.bfloat16)
    assert params["embedding"].dtype == jnp.bfloat16
    assert params["block_0"]["attn"]["norm"]["scale"].dtype == jnp.float32  # norms stay float32
    logits = gj.forward(tiny, params, np.zeros((1, 3), np.int32))
    assert logits.dtype == jnp.float32 and np.all(np.isfinite(np.asarray(logits)))
