"""Cached generation against the uncached model: prompts around and past the real 128-token window.

Each cached result is checked against transformers' float64 logits of the whole sequence, within
NOISE_FACTOR x transformers' own float32 error (noise.py); the uncached model is held to the same
bound in test_model.py, so the two agree to within twice that."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax.model.cache import cache_bytes, ring_positions
from gptoss_jax.testing import random_params
from refs import exact_logits


@pytest.fixture(scope="module")
def setup():
    config = gj.ModelConfig.tiny().replace(sliding_window=128)  # the real window
    params = random_params(config, seed=4)
    tokens = np.random.default_rng(4).integers(0, config.vocab_size, size=(3, 320)).astype(np.int32)
    return config, params, tokens, exact_logits(config, params, tokens[:, :310])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", [1, 127, 128, 129, 300])
def test_prefill_then_decode_equals_forward(setup, prompt):
    config, params, tokens, exact = setup
    cache = gj.init_cache(config, 1, 320, jnp.float32)
    logits, cache = gj.extend(config, params, tokens[:1, :prompt], cache)
    exact[0, :prompt].check(logits[0], "prefill")
    for pos in range(prompt, prompt + 6):  # decode steps cross the window edge for prompts 127..129
        logits, cache = gj.extend(config, params, tokens[:1, pos:pos + 1], cache)
        exact[0, pos].check(logits[0, 0], f"decode at {pos}")
    assert int(cache["lengths"][0]) == prompt + 6


@pytest.mark.slow
@pytest.mark.parametrize("size", [70, 200])  # shorter and longer than the 128-token window
def test_chunked_prefill_equals_forward(setup, size):
    config, params, tokens, exact = setup
    cache = gj.init_cache(config, 1, 320, jnp.float32)
    for start in range(0, 300, size):
        chunk = tokens[:1, start:min(start + size, 300)]
        logits, cache = gj.extend(config, params, chunk, cache)
        exact[0, start:start + chunk.shape[1]].check(logits[0], f"chunk at {start}")


@pytest.mark.slow
def test_batch_of_different_lengths_equals_each_alone(setup):
    config, params, tokens, exact = setup
    lengths = np.array([5, 140, 260])
    valid = np.arange(260)[None] < lengths[:, None]
    prompts = np.where(valid, tokens[:, :260], 0)  # right-padded
    cache = gj.init_cache(config, 3, 320, jnp.float32)
    logits, cache = gj.extend(config, params, prompts, cache, valid)
    for b, n in enumerate(lengths):
        exact[b, :n].check(logits[b, :n], f"prompt {b}")
    np.testing.assert_array_equal(np.asarray(cache["lengths"]), lengths)
    for step in range(4):  # every sequence decodes at its own position
        nxt = tokens[np.arange(3), lengths + step][:, None]
        logits, cache = gj.extend(config, params, nxt, cache)
        for b, n in enumerate(lengths):
            exact[b, n + step].check(logits[b, 0], f"sequence {b} step {step}")


def test_sliding_layers_keep_a_ring_of_window_slots():
    config = gj.ModelConfig.gpt_oss_20b()
    cache = jax.eval_shape(lambda: gj.init_cache(config, 1, 131072))
    assert cache["block_0"]["k"].shape == (1, 128, 8, 64)  # sliding
    assert cache["block_1"]["k"].shape == (1, 131072, 8, 64)  # full
    total = cache_bytes(config, 1, 131072)
    assert total == 12 * 131072 * 2048 + 12 * 128 * 2048  # 2 KiB per position per layer
    assert abs(total / 2**30 - 3.0) < 0.01
    # Ring slot s holds the latest position p < length with p % 4 == s.
    np.testing.assert_array_equal(np.asarray(ring_positions(jnp.array([0, 3, 4, 10]), 4)),
                                  [[-1, -1, -1, -1], [0, 1, 2, -1], [0, 1, 2, 3], [8, 9, 6, 7]])
