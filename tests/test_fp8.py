"""The FP8 KV cache (fp8.py): e4m3 vectors with a power-of-two scale each, in both cache layouts.

Bounds come from e4m3's rounding, not from a constant: an element x is stored within
fp8.error_bound(x) = 2^-4 |x| + 2^-10 2^e of itself. Attention over rounded keys moves each score by
at most eps = sum_h |q_h| e_k,h / sqrt(H), so each probability by a factor within e^(+-2 eps), and
the output by at most (e^(2 eps) - 1) sum_j p_j |v_j| + e^(2 eps) sum_j p_j e_v,j. The logits of a
step after a cached prompt move, to first order, by at most sum |d logit / d cached| e over every
cached element (the derivative from the float32 model's own gradient). Each check adds the float32
noise of the computation (noise.py). The kernels must also give attention over the dequantized keys
itself within that noise: the only error they may add is the rounding.

Mutations these tests were checked against: the stored values read back at twice their scale
(fp8.dequantize) fails the round trip, the attention over both layouts and the logits; the scale
one power of two off in both directions (fp8.scale) fails the round trip and the attention, whose
stored values are read by the format's definition in numpy; a page's exponents taken one position
late in the gather (kernels/attention/paged.py) fails the attention; the exponents left unwritten
through the page tables fails the writes and the engine's tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax import fp8
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.kernels import Kernels, ring, write_pages
from gptoss_jax.model.cache import cache_bytes, ring_positions
from gptoss_jax.model.paged_cache import page_bytes
from gptoss_jax.model.transformer import Transformer
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, Settings
from conftest import compile_events
from noise import NOISE_FACTOR
from refs import attention_torch, exact_attention, exact_logits

GREEDY = Sampling(temperature=0.0)
E4M3 = jnp.float8_e4m3fn


def _as_stored(a: fp8.Fp8) -> np.ndarray:
    """The values an FP8 storage holds, by the format's definition in numpy (not fp8.dequantize):
    e4m3 bytes times 2^(exponent - 127)."""
    return np.asarray(a.values).astype(np.float64) * 2.0 ** (np.asarray(a.exponents).astype(np.int64) - 127)[..., None]


def test_a_vector_is_read_back_within_its_bound_with_the_smallest_scale_that_holds_it():
    """Magnitudes from 2^-30 to 2^20, zeros and a vector of one nonzero: each element within
    error_bound of itself, each vector's largest |x| / scale in (224, 448] (nothing clipped, no bit of
    e4m3's range wasted), and the storage 65 bytes a vector of 64."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 64)) * 2.0 ** rng.integers(-30, 20, (7, 1))
    x[3] = 0.0
    x[4] = 0.0
    x[4, 5] = -3.0
    x = jnp.asarray(x, jnp.float32)
    stored = fp8.quantize(x)
    assert stored.values.dtype == E4M3 and stored.exponents.dtype == jnp.uint8
    back = _as_stored(stored)
    np.testing.assert_array_equal(np.asarray(fp8.dequantize(stored, jnp.float32)), back)
    assert np.all(np.abs(back - np.asarray(x)) <= np.asarray(fp8.error_bound(x)))
    largest = np.abs(np.asarray(x)).max(-1) / 2.0 ** (np.asarray(stored.exponents).astype(np.int64) - 127)
    assert np.all((largest[x.any(-1)] > 224) & (largest[x.any(-1)] <= 448)), largest
    assert np.all(back[3] == 0)
    assert fp8.vector_bytes(64, E4M3) == 65 and fp8.vector_bytes(64, jnp.bfloat16) == 128


def test_fp8_pages_hold_nearly_twice_the_positions_in_the_same_memory(tiny):
    """A page in FP8 takes (H + 1) / 2H of a bf16 page (65/128 at gpt-oss's H = 64); the contiguous
    cache likewise."""
    H = tiny.head_dim
    assert page_bytes(tiny, 64, E4M3) * 2 * H == page_bytes(tiny, 64, jnp.bfloat16) * (H + 1)
    assert cache_bytes(tiny, 2, 300, E4M3) * 2 * H == cache_bytes(tiny, 2, 300, jnp.bfloat16) * (H + 1)


def _bound(q, k, v, exact_p):
    """The output bound of attention over rounded keys and values (the module's docstring), per
    query [B, T, K, G, H]: q [B, T, K, G, H], k, v [B, S, K, H] (float64 numpy), exact_p [B, K, G, T, S]."""
    ek, ev = (np.asarray(fp8.error_bound(jnp.asarray(a, jnp.float32)), np.float64) for a in (k, v))
    eps = np.einsum("btkgh,bskh->bkgts", np.abs(q), ek).max(-1) / np.sqrt(q.shape[-1])  # [B, K, G, T]
    grow = np.exp(2 * eps)[..., None]
    spread = (grow - 1) * np.einsum("bkgts,bskh->bkgth", exact_p, np.abs(v)) + grow * np.einsum(
        "bkgts,bskh->bkgth", exact_p, ev)
    return spread.transpose(0, 3, 1, 2, 4)  # [B, T, K, G, H]


def _probabilities(q, k, q_pos, k_pos, window):
    """The float64 softmax weights of sink-free attention [B, K, G, T, S] (zeros where masked)."""
    s = np.einsum("btkgh,bskh->bkgts", q, k) / np.sqrt(q.shape[-1])
    keep = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window is not None:
        keep &= k_pos[:, None, :] > q_pos[:, :, None] - window
    s = np.where(keep[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.nan_to_num(p / p.sum(-1, keepdims=True))


def _check_attention(o, q, k, v, q_pos, k_pos, window, what):
    """o [B, T, K, G, H] of attention over FP8 storage of k, v: against float64 attention over the
    dequantized keys (the kernels add nothing to the rounding) and over the original keys (within the
    rounding's bound)."""
    stored = [_as_stored(fp8.quantize(jnp.asarray(a, jnp.float32))) for a in (k, v)]
    exact_rounded = exact_attention(q, *stored, None, q_pos, k_pos, window)
    exact_rounded.check(o, f"{what}: over the keys as stored")
    exact = attention_torch(q, k, v, None, q_pos, k_pos, window).numpy()
    bound = _bound(q, k, v, _probabilities(q, k, q_pos, k_pos, window)) + NOISE_FACTOR * exact_rounded.noise
    seen = (k_pos[:, None, :] >= 0).any(-1)[:, :, None, None, None]  # queries with some key
    err = np.where(seen, np.abs(np.asarray(o, np.float64) - exact), 0)
    assert np.all(err <= bound), f"{what}: {float((err / bound).max()):.3g} x the bound of e4m3's rounding"
    return float((err / bound).max())


def _qkv(rng, B, T, S, K=2, G=4, H=64):
    q = rng.standard_normal((B, T, K, G, H))
    k = rng.standard_normal((B, S, K, H)) * 2.0 ** rng.integers(-4, 1, (B, S, K, 1))  # scores of a few units
    v = rng.standard_normal((B, S, K, H)) * 2.0 ** rng.integers(-3, 4, (B, S, K, 1))
    return q, k, v


@pytest.mark.parametrize("T", [1, 40])  # dense decode, and the blockwise loop over key blocks
def test_attention_to_an_fp8_cache_is_within_the_bound_of_e4m3_rounding(T):
    """Both layouts' reads (the contiguous cache's prefix and a sliding layer's ring; the paged pool's
    full layers and sliding window through page tables), decode-sized and prompt-sized queries."""
    rng = np.random.default_rng(T)
    B, S, P = 2, 96, 8
    q, k, v = _qkv(rng, B, T, S)
    lengths = np.array([S - 7, 37])
    ops = Kernels(attention_block=32).attention_ops(T, jnp.float32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    ks, vs = fp8.quantize(f32(k)), fp8.quantize(f32(v))
    k_pos = np.where(np.arange(S)[None] < lengths[:, None], np.arange(S)[None], -1)
    after = np.broadcast_to(np.full((1, T), S), (B, T))

    o, _ = ops.prefix(f32(q), ks, vs, jnp.asarray(lengths))
    _check_attention(o, q, k, v, after, k_pos, None, "contiguous, full")

    # Paged: sequence b's position j in page table[b, j // P], the pages shuffled over a pool.
    W = S // P
    order = rng.permutation(B * W)
    table = order.reshape(B, W)
    def paged(stored):  # [B, S, ...] -> pages [B W, P, ...] in the table's order
        return stored.map(lambda a: jnp.zeros_like(a.reshape(B * W, P, *a.shape[2:])).at[order].set(
            a.reshape(B * W, P, *a.shape[2:])))

    pool_k, pool_v = paged(ks), paged(vs)
    o, _ = ops.paged_full(f32(q), pool_k, pool_v, jnp.asarray(table), jnp.asarray(lengths))
    _check_attention(o, q, k, v, after, k_pos, None, "paged, full")

    window = 16
    positions = lengths[:, None] + np.arange(T)[None]
    o, _ = ops.paged_window(f32(q), pool_k, pool_v, jnp.asarray(table), jnp.asarray(lengths), jnp.asarray(positions),
                            window, -(-(window - 1) // P) + 1)
    _check_attention(o, q, k, v, positions, k_pos, window, "paged, sliding window")

    # A sliding layer's ring of `window` slots: slot s holds the latest position p < length, p % window = s.
    ring_pos = np.asarray(ring_positions(jnp.asarray(lengths), window))
    gathered = lambda a: np.take_along_axis(a, np.maximum(ring_pos, 0)[..., None, None], axis=1)  # noqa: E731
    ring_k, ring_v = gathered(k), gathered(v)
    o, _ = ring(f32(q), fp8.quantize(f32(ring_k)), fp8.quantize(f32(ring_v)), jnp.asarray(ring_pos),
                           jnp.asarray(positions), window)
    _check_attention(o, q, ring_k, ring_v, positions, ring_pos, window, "contiguous, sliding ring")


def test_writes_through_page_tables_store_each_vector_quantized():
    """write_pages into an FP8 pool stores exactly fp8.quantize of each new vector, where valid."""
    rng = np.random.default_rng(1)
    pool = fp8.Fp8(jnp.zeros((6, 4, 2, 64), E4M3), jnp.zeros((6, 4, 2), jnp.uint8))
    table = jnp.array([[3, 1, 5], [0, 2, 4]])
    new = jnp.asarray(rng.standard_normal((2, 5, 2, 64)) * 100, jnp.float32)
    positions = jnp.array([[2, 3, 4, 5, 6], [7, 8, 9, 10, 11]])
    valid = jnp.array([[True] * 5, [True, True, True, False, False]])
    written = write_pages(pool, table, positions, valid, new)
    want = fp8.quantize(new)
    for b, t in np.argwhere(np.asarray(valid)):
        page, slot = int(table[b, positions[b, t] // 4]), int(positions[b, t] % 4)
        np.testing.assert_array_equal(np.asarray(written.values[page, slot], np.float32), np.asarray(want.values[b, t], np.float32))
        np.testing.assert_array_equal(written.exponents[page, slot], want.exponents[b, t])
    assert int((np.asarray(written.exponents) != 0).any(-1).sum()) == int(valid.sum())


@pytest.mark.slow
def test_the_logits_after_an_fp8_cache_are_within_the_first_order_bound_of_its_rounding(tiny_f32, monkeypatch):
    """The tiny model in float32, a 40-token prompt (past the 16-token window) then one step: each of
    a few logits against transformers' float64 logits within sum |d logit / d stored| e over every
    element the step reads rounded (the cached ones, and the step's own keys and values), by the
    model's own float32 gradient, plus the float32 noise; over a float32 cache, within the noise."""
    config, params = tiny_f32
    tokens = np.random.default_rng(7).integers(0, config.vocab_size, (1, 41)).astype(np.int32)
    exact = exact_logits(config, params, tokens)[0, 40]

    def step(dtype):
        _, cache = gj.extend(config, params, tokens[:, :40], gj.init_cache(config, 1, 64, dtype))
        return cache, gj.extend(config, params, tokens[:, 40:], jax.tree.map(jnp.copy, cache))[0][0, 0]

    cache, logits32 = step(jnp.float32)
    exact.check(logits32, "float32 cache")
    _, logits8 = step(E4M3)

    # The step over the float32 cache, with a perturbation added where each layer's new keys and values
    # are rounded for the cache (attention.py calls fp8.rounded for k, then v, layer by layer).
    own = []  # the new keys and values, in call order
    shifts = []  # the perturbations of this trace, in call order

    def rounded(stored, x):
        own.append(jax.lax.stop_gradient(x))
        return x.astype(stored.dtype) + shifts[len(own) - 1]

    monkeypatch.setattr(fp8, "rounded", rounded)
    model, valid = Transformer(config), jnp.ones((1, 1), bool)
    layers = {name: layer for name, layer in cache.items() if name != "lengths"}
    H = config.head_dim
    zeros = [jnp.zeros((1, 1, config.num_key_value_heads, H), jnp.float32)] * (2 * config.num_hidden_layers)

    def logit(layers, deltas, i):
        own.clear()
        shifts[:] = deltas
        return model.apply({"params": params}, jnp.asarray(tokens[:, 40:]), {**cache, **layers}, valid)[0][0, 0, i]

    picked = list(np.argsort(exact.value)[-3:]) + list(np.random.default_rng(8).integers(0, config.vocab_size, 3))
    for i in picked:
        g_cached, g_own = jax.grad(logit, argnums=(0, 1))(layers, zeros, int(i))
        rounding = [fp8.error_bound(a) for a in jax.tree.leaves(layers)] + [fp8.error_bound(x) for x in own]
        first_order = sum(float(jnp.sum(jnp.abs(g) * e)) for g, e in zip(jax.tree.leaves(g_cached) + list(g_own),
                                                                          rounding, strict=True))
        err = abs(float(logits8[i]) - float(exact.value[i]))
        assert err <= first_order + NOISE_FACTOR * exact.noise, f"logit {i}: {err:.3g} over the bound {first_order:.3g}"
    assert float(np.abs(np.asarray(logits8) - exact.value).max()) > 10 * exact.noise  # the rounding is there


@pytest.fixture(scope="module")
def generators(tiny_f32):
    config, params = tiny_f32
    return {kv: Generator(config, params, max_len=256, kv_dtype=kv) for kv in ("fp8", "bf16", None)}


@pytest.mark.slow
def test_greedy_tokens_of_200_steps_with_the_fp8_cache_beside_the_bf16_cache(tiny_f32, generators):
    """Reported, not tuned (docs/serving.md has the figures): where the greedy tokens of four prompts
    first differ, the FP8 cache's from the bf16 cache's, beside the bf16 cache's from the float32
    cache's (the tiny random model's logits are nearly flat, so a small change soon picks another
    token)."""
    config, _ = tiny_f32
    prompts = [np.random.default_rng(20 + i).integers(0, config.vocab_size, 20 + 9 * i).tolist() for i in range(4)]
    runs = {kv: [r.output_ids for r in g.generate(prompts, max_new_tokens=200, sampling=GREEDY)]
            for kv, g in generators.items()}

    def first_difference(a, b):
        return [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), 200) for p, q in zip(runs[a], runs[b])]

    print(f"200 greedy steps, first difference: FP8 from bf16 cache at {first_difference('fp8', 'bf16')}, "
          f"bf16 from float32 cache at {first_difference('bf16', None)}")
    assert all(len(r) == 200 for r in runs["fp8"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [None, dict(data=2, expert=2, tensor=2)], ids=["one device", "8 devices"])
def test_the_engine_over_fp8_pages_gives_generator_tokens_with_prefix_reuse_and_preemption(tiny_f32, generators,
                                                                                         mesh):
    """The paged pool in FP8: a shared system prompt found in the cache, then a pool too small for
    every request (preemption): each request's greedy tokens are those the contiguous FP8 cache gives
    it alone, and no step compiles after warm-up. On a mesh of 8 CPU devices (sequences over `data`,
    experts over `expert`, heads over `tensor`), against the contiguous cache on the same mesh (one
    device sums in another order, and a sum one float32 step apart can round to another e4m3 value),
    and the values and their exponents of every layer group stay split over `tensor` by KV head."""
    from gptoss_jax.params import param_shardings

    config, params = tiny_f32
    alone = generators["fp8"]
    if mesh is not None:
        mesh = gj.make_mesh(**mesh)
        params = jax.device_put(params, param_shardings(config, mesh))
        alone = Generator(config, params, max_len=256, kv_dtype="fp8")
    engine = Engine(config, params, EngineConfig(slots=4, max_len=256, prefill_chunk=16, page_size=8, pages=30,
                                                 kv_dtype="fp8"))
    assert fp8.is_fp8(engine.device.kv_dtype) and engine.mesh is mesh

    def split_by_kv_head():  # values [pages, page positions, KV heads, head dim], exponents [pages, positions, KV heads]
        return all(x.values.sharding.spec[:3] == x.exponents.sharding.spec[:3] == (None, None, "tensor")
                   for group in engine.device.pool["pages"] for x in (group["k"], group["v"]))

    assert mesh is None or split_by_kv_head()
    engine.warm_up()
    system = np.random.default_rng(30).integers(0, config.vocab_size, 40).tolist()
    prompts = [system + np.random.default_rng(31 + i).integers(0, config.vocab_size, 5 + 6 * i).tolist()
               for i in range(4)]
    with compile_events() as compiled:
        first = engine.submit(prompts[0], Settings(max_new_tokens=30, sampling=GREEDY))
        engine.run_until_idle()
        rest = [engine.submit(p, Settings(max_new_tokens=40, sampling=GREEDY)) for p in prompts[1:]]
        engine.run_until_idle()
    assert not compiled, compiled
    assert first.output_ids == alone.generate([prompts[0]], max_new_tokens=30, sampling=GREEDY)[0].output_ids
    for r in rest:
        assert r.output_ids == alone.generate([r.prompt_ids], max_new_tokens=40, sampling=GREEDY)[0].output_ids
        assert r.cached_tokens == 40
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0
    assert mesh is None or split_by_kv_head()  # (after the steps, which donate and return the pool)
