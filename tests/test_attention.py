"""Attention kernels against each other and the attention block against OpenAI's.

Every check is against attention computed in float64 by its definition (refs.exact_attention), within
NOISE_FACTOR x the float32 error of the same definition run in float32 (noise.py); the readable jnp
definition (attention_reference) is checked alongside the blockwise path. Mutation tried: the sink left out of the blockwise denominator fails every
blockwise case by more than 10^6 x."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from noise import Exact
from gptoss_jax.kernels import Kernels
from gptoss_jax.model.attention import AttentionBlock, attention_blockwise, attention_reference
from gptoss_jax.kernels.attention.xla import key_block_range
from refs import exact_attention, openai_model


def _qkv(rng, B, T, K, G, H, dtype=np.float32):
    q = rng.standard_normal((B, T, K, G, H)).astype(dtype)
    k = rng.standard_normal((B, T, K, H)).astype(dtype)
    v = rng.standard_normal((B, T, K, H)).astype(dtype)
    sinks = rng.standard_normal((K, G)).astype(dtype)
    return q, k, v, sinks


@pytest.mark.parametrize("T, window, block", [
    (1, None, 8), (1, 4, 8),
    (37, None, 8), (37, 5, 8), (37, 16, 8),  # T not a multiple of the block; windows below and at 2x block
    (100, 16, 16), (100, 3, 32), (100, None, 128),  # one block holding everything
    (130, 128, 32),  # window longer than several blocks
])
def test_blockwise_equals_reference(T, window, block):
    rng = np.random.default_rng(T + (window or 0) + block)
    q, k, v, sinks = _qkv(rng, 2, T, 2, 3, 8)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (2, T))
    exact = exact_attention(q, k, v, sinks, positions, positions, window)
    exact.check(attention_reference(q, k, v, sinks, positions, positions, window=window), "reference")
    exact.check(attention_blockwise(q, k, v, sinks, window=window, q_block=block, kv_block=block), "blockwise")


def test_blockwise_with_later_queries_equals_reference_rows():
    # Queries that start later (as in a chunked prompt) see the same keys as those rows of the full result.
    rng = np.random.default_rng(0)
    q, k, v, sinks = _qkv(rng, 1, 90, 2, 2, 8)
    positions = np.arange(90, dtype=np.int32)[None]
    exact = exact_attention(q, k, v, sinks, positions, positions, 7)
    out = attention_blockwise(q[:, 50:], k, v, sinks, window=7, q_pos=positions[:, 50:], q_block=16, kv_block=16)
    exact[:, 50:].check(out)


def test_blockwise_with_per_sequence_positions_and_lengths_equals_reference():
    # A KV cache's view: each sequence's queries sit at its own positions, keys past its length are empty.
    rng = np.random.default_rng(1)
    q, k, v, sinks = _qkv(rng, 3, 64, 2, 2, 8)
    q = q[:, :5]
    lengths = np.array([5, 33, 64])
    q_pos = (lengths[:, None] - 5 + np.arange(5)).astype(np.int32)  # the last 5 positions of each
    k_pos = np.where(np.arange(64)[None] < lengths[:, None], np.arange(64)[None], -1).astype(np.int32)
    for window in (None, 9):
        exact = exact_attention(q, k, v, sinks, q_pos, k_pos, window)
        exact.check(attention_reference(q, k, v, sinks, q_pos, k_pos, window=window), f"reference, window {window}")
        exact.check(attention_blockwise(q, k, v, sinks, window=window, q_pos=q_pos, kv_len=lengths, q_block=2,
                                        kv_block=8), f"window {window}")


@pytest.mark.parametrize("window", [None, 1, 5, 16, 40])
@pytest.mark.parametrize("bq, bk", [(8, 8), (16, 8), (8, 32)])
def test_blockwise_visits_exactly_the_key_blocks_with_visible_keys(window, bq, bk):
    # Brute force over positions: a skipped block must hold no visible key (else results would be
    # wrong, which the equality tests catch) and a visited block must hold one (else sliding layers
    # would do work outside the window, which only this test catches).
    S = 100
    for first_q in range(0, S, bq):
        lo, hi = (int(x) for x in key_block_range(first_q, first_q + bq - 1, bk, S, window))
        queries = np.arange(first_q, first_q + bq)[:, None]
        keys = np.arange(S)[None, :]
        visible = (keys <= queries) & ((keys > queries - window) if window else True)
        needed = sorted(set((np.nonzero(visible.any(axis=0))[0] // bk).tolist()))
        assert list(range(lo, hi + 1)) == needed, (first_q, lo, hi, needed)


def test_sink_only_enlarges_the_denominator():
    # One visible key (the first query): out = v0 * 1 / (1 + exp(sink - s00)) = v0 * sigmoid(s00 - sink).
    rng = np.random.default_rng(0)
    q, k, v, sinks = _qkv(rng, 1, 1, 1, 1, 4)
    pos = np.zeros((1, 1), np.int32)
    out = attention_reference(q, k, v, sinks, pos, pos, window=None)

    def formula(dtype):
        q0, k0, v0, sink = (np.asarray(x, dtype) for x in (q[0, 0, 0, 0], k[0, 0, 0], v[0, 0, 0], sinks[0, 0]))
        return v0 / (1 + np.exp(sink - (q0 @ k0) / dtype(2)))

    Exact.measure(formula(np.float32), formula(np.float64)).check(np.asarray(out)[0, 0, 0, 0])


def _temp_bytes(fn, T, K=2, G=4, H=32):
    q = jax.ShapeDtypeStruct((1, T, K, G, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, T, K, H), jnp.float32)
    s = jax.ShapeDtypeStruct((K, G), jnp.float32)
    return jax.jit(fn).lower(q, kv, kv, s).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("window", [None, 128])
def test_blockwise_memory_grows_linearly(window):
    pos = lambda T: jnp.arange(T)[None]  # noqa: E731
    ref = [_temp_bytes(lambda q, k, v, s: attention_reference(q, k, v, s, pos(q.shape[1]), pos(q.shape[1]),
                                                              window=window), T) for T in (1024, 2048, 4096)]
    blk = [_temp_bytes(lambda q, k, v, s: attention_blockwise(q, k, v, s, window=window, q_block=256,
                                                              kv_block=256), T) for T in (1024, 2048, 4096)]
    # Doubling T: quadratic growth multiplies the increment by ~4, linear growth by ~2.
    assert (ref[2] - ref[1]) / (ref[1] - ref[0]) > 3.5
    assert (blk[2] - blk[1]) / (blk[1] - blk[0]) < 2.5
    assert blk[2] < ref[2] / 10


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
@pytest.mark.parametrize("impl", ["reference", "blockwise"])
def test_attention_block_matches_openai(tiny, tiny_params, long_tokens, layer, impl):
    ref_model = openai_model(tiny, tiny_params)
    x = np.random.default_rng(layer).standard_normal((1, 300, tiny.hidden_size)).astype(np.float32)
    with torch.no_grad():  # it returns x + attention
        ref = ref_model.block[layer].attn(torch.from_numpy(x[0])).double().numpy() - x[0]
        exact = ref_model.to(torch.float64).block[layer].attn(torch.from_numpy(x[0]).double()).numpy() - x[0]
    positions = jnp.arange(300)[None]
    block = AttentionBlock(tiny, layer, kernels=Kernels(attention=impl, attention_block=32))
    out = block.apply({"params": tiny_params[f"block_{layer}"]["attn"]}, jnp.asarray(x), positions)
    Exact.measure(ref, exact).check(np.asarray(out[0], np.float64))
