"""The Pallas Mosaic GPU decode attention to the cache (kernels/attention/mosaic_cache.py) on CPU, in Mosaic
GPU's interpret mode (simulated warpgroup, shared memory, TMA copies and barriers), which JAX offers
from 0.11 on for these kernels; tests/test_gpu.py runs the same kernel compiled on a GPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from noise import Exact

import gptoss_jax as gj
from gptoss_jax import fp8
from gptoss_jax.model.attention import AttentionBlock
from gptoss_jax.kernels.attention import mosaic_cache, paged, xla
from gptoss_jax.kernels.combine import combine
from gptoss_jax.testing import random_params

pytestmark = pytest.mark.skipif(not mosaic_cache.supported(),
                                reason=f"Mosaic GPU interpret mode of these kernels needs JAX >= 0.11 (this is "
                                       f"{jax.__version__}); tests/run.sh runs them under Python >= 3.12")


@pytest.mark.parametrize("T", [1, pytest.param(2, marks=pytest.mark.slow)])  # (the fast tier: one)
def test_cache_attention_reads_only_the_filled_part(T):
    """Sequences of 0, 70 (a block cut short) and 256 keys (all 4 blocks of 64) in 256 slots; the slots
    past a sequence's length hold huge keys and values, which would show in any output that read them.
    Against the definition in float64 (numpy), within the noise of the jnp pass in bfloat16; the empty sequence
    gives lse -inf and, with the sinks, an output of exactly zero."""
    kq, kk, kv, ks = jax.random.split(jax.random.key(T), 4)
    B, S, K, G, H = 3, 256, 2, 4, 64
    kv_len = jnp.array([0, 70, 256], jnp.int32)
    beyond = (jnp.arange(S)[None] >= kv_len[:, None])[..., None, None]  # [B, S, 1, 1]
    q = jax.random.normal(kq, (B, T, K, G, H), jnp.bfloat16)
    k = jnp.where(beyond, 3e4, jax.random.normal(kk, (B, S, K, H))).astype(jnp.bfloat16)
    v = jnp.where(beyond, -3e4, jax.random.normal(kv, (B, S, K, H))).astype(jnp.bfloat16)
    sinks = jax.random.normal(ks, (K, G), jnp.float32)
    # The noise: the jnp pass over the cache in bfloat16, against the definition in float64.
    low_o, low_lse = xla.prefix(q[1:], k[1:], v[1:], kv_len[1:], block=64)
    exact_o, exact_lse = _attention64(q[1:], k[1:], v[1:], kv_len[1:])
    exact = Exact.measure(np.asarray(combine([(low_o, low_lse)], sinks, jnp.float32), np.float64),
                          _with_sinks64(exact_o, exact_lse, sinks), precision="bfloat16")
    exact_lse = Exact.measure(np.asarray(low_lse, np.float64), exact_lse, precision="bfloat16")
    for splits in (None, 3):  # by default 4 ranges of one block each; 3 ranges: 2, 2 and 0 blocks for 256 keys
        o, lse = mosaic_cache.cache_attention(q, k, v, kv_len, block_k=64, splits=splits, interpret=True)
        assert bool(jnp.all(jnp.isneginf(lse[0])))
        assert not np.any(np.asarray(combine([(o, lse)], sinks, jnp.float32)[0]))
        exact_lse.check(lse[1:], f"lse, splits={splits}")
        exact.check(combine([(o[1:], lse[1:])], sinks, jnp.float32), f"o with sinks, splits={splits}")


@pytest.mark.parametrize("page", [64, 32])
def test_cache_attention_reads_a_paged_cache_through_its_table(page):
    """The same sequences (0, 70 and 256 keys) in pages of a pool, in shuffled order among pages of
    huge keys and values that no table names: the result is the contiguous cache's, within the
    noise; pages of 32 put two pages in each 64-key block."""
    kq, kk, kv, kp = jax.random.split(jax.random.key(7), 4)
    B, S, K, G, H = 3, 256, 2, 4, 64
    kv_len = jnp.array([0, 70, 256], jnp.int32)
    beyond = (jnp.arange(S)[None] >= kv_len[:, None])[..., None, None]
    q = jax.random.normal(kq, (B, 1, K, G, H), jnp.bfloat16)
    k = jnp.where(beyond, 3e4, jax.random.normal(kk, (B, S, K, H))).astype(jnp.bfloat16)
    v = jnp.where(beyond, -3e4, jax.random.normal(kv, (B, S, K, H))).astype(jnp.bfloat16)
    W = S // page
    spare = 5  # pages no table names
    order = np.asarray(jax.random.permutation(kp, B * W + spare))
    table = jnp.asarray(order[:B * W].reshape(B, W), jnp.int32)
    pool_k = jnp.full((B * W + spare, page, K, H), 3e4, jnp.bfloat16).at[table].set(k.reshape(B, W, page, K, H))
    pool_v = jnp.full((B * W + spare, page, K, H), -3e4, jnp.bfloat16).at[table].set(v.reshape(B, W, page, K, H))
    low_o, low_lse = xla.prefix(q[1:], k[1:], v[1:], kv_len[1:], block=64)
    exact_o, exact_lse = _attention64(q[1:], k[1:], v[1:], kv_len[1:])
    exact_o = Exact.measure(np.asarray(low_o, np.float64), exact_o, precision="bfloat16")
    exact_lse = Exact.measure(np.asarray(low_lse, np.float64), exact_lse, precision="bfloat16")
    for block_k in (64, 128):
        o, lse = mosaic_cache.cache_attention(q, pool_k, pool_v, kv_len, table=table, block_k=block_k,
                                                  interpret=True)
        assert bool(jnp.all(jnp.isneginf(lse[0])))
        exact_lse.check(lse[1:], f"lse, pages of {page}, blocks of {block_k}")
        exact_o.check(o[1:], f"o, pages of {page}, blocks of {block_k}")


@pytest.mark.parametrize("layout, K, page", [  # (the fast tier: one of each layout)
    pytest.param("contiguous", 2, None, marks=pytest.mark.slow), ("contiguous", 1, None),
    pytest.param("paged", 2, 64, marks=pytest.mark.slow), ("paged", 4, 32)])
def test_cache_attention_reads_fp8_storage(layout, K, page):
    """A cache in FP8 storage (fp8.py) gives exactly what the kernel gives over the same cache read
    back in bfloat16 (e4m3 values times a power of two are exact there, and the tensor cores get the
    same operands), and so agrees with float64 within the noise; slots past each length hold huge
    vectors with scales of their own, which would show. One KV head makes the kernel take blocks of
    128 keys (a block's exponents a whole row of 128 bytes); pages of 32 put two pages in a block."""
    kq, kk, kv, kp = jax.random.split(jax.random.key(K), 4)
    B, S, G, H = 3, 256, 4, 64
    kv_len = jnp.array([0, 70, 256], jnp.int32)
    beyond = (jnp.arange(S)[None] >= kv_len[:, None])[..., None, None]
    q = jax.random.normal(kq, (B, 1, K, G, H), jnp.bfloat16)
    k = fp8.quantize(jnp.where(beyond, 3e4, jax.random.normal(kk, (B, S, K, H))))
    v = fp8.quantize(jnp.where(beyond, -3e4, jax.random.normal(kv, (B, S, K, H)) * 3))
    k16, v16 = fp8.read(k, jnp.bfloat16), fp8.read(v, jnp.bfloat16)
    args, options = (k, v), {}
    if layout == "paged":
        W, spare = S // page, 3
        table = jnp.asarray(np.asarray(jax.random.permutation(kp, B * W + spare))[:B * W].reshape(B, W), jnp.int32)
        pool = lambda x: fp8.apply(lambda a: jnp.zeros((B * W + spare, page) + a.shape[2:], a.dtype).at[table].set(  # noqa: E731
            a.reshape(B, W, page, *a.shape[2:])), x)
        args, options = (pool(k), pool(v)), {"table": table}
    o, lse = mosaic_cache.cache_attention(q, *args, kv_len, block_k=64, interpret=True, **options)
    o16, lse16 = mosaic_cache.cache_attention(q, k16, v16, kv_len, block_k=64 if K > 1 else 128,
                                              interpret=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o16))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse16))
    low_o, _ = xla.prefix(q[1:], k16[1:], v16[1:], kv_len[1:], block=64)
    exact_o, _ = _attention64(q[1:], k16[1:], v16[1:], kv_len[1:])
    Exact.measure(np.asarray(low_o, np.float64), exact_o, precision="bfloat16").check(o[1:], f"o, {layout}, K={K}")


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 3])
def test_cache_attention_over_a_sliding_window_of_pages(T):
    """A sliding layer's decode through the pages of its window (the table's columns from the page
    holding position len - window + 1, positions counted from that page): query t sees keys
    [len + t - window + 1, len) only; keys before the window are huge and would show, and so would the
    large values of the keys that only the earlier queries see. Sequences of 1, 70, 127, 128, 129,
    190 (a key block that the later queries see none of) and 250 keys, a window of 128 over pages of
    64 (3 pages)."""
    kq, kk, kv, kp = jax.random.split(jax.random.key(11), 4)
    window, P, S, K, G, H = 128, 64, 256, 2, 4, 64
    lengths = jnp.array([1, 70, 127, 128, 129, 190, 250], jnp.int32)
    B, W, n = lengths.shape[0], S // P, -(-(window - 1) // P) + 1
    pos = jnp.arange(S)[None]
    q_pos = lengths[:, None] + jnp.arange(T)  # [B, T]
    before = pos < lengths[:, None] - window + 1  # out of every query's window
    k = jnp.where(before[..., None, None], 3e4, jax.random.normal(kk, (B, S, K, H))).astype(jnp.bfloat16)
    edge = (pos >= lengths[:, None] - window + 1) & (pos < lengths[:, None] - window + T)  # seen by t < T-1 only
    v = jnp.where(before[..., None, None], -3e4, jax.random.normal(kv, (B, S, K, H)))
    v = jnp.where(edge[..., None, None], 50.0, v).astype(jnp.bfloat16)
    q = jax.random.normal(kq, (B, T, K, G, H), jnp.bfloat16)
    order = np.asarray(jax.random.permutation(kp, B * W))
    table = jnp.asarray(order.reshape(B, W), jnp.int32)
    pool_k = jnp.zeros((B * W, P, K, H), jnp.bfloat16).at[table].set(k.reshape(B, W, P, K, H))
    pool_v = jnp.zeros((B * W, P, K, H), jnp.bfloat16).at[table].set(v.reshape(B, W, P, K, H))
    first = jnp.maximum(lengths - window + 1, 0) // P
    ids = jnp.take_along_axis(table, jnp.minimum(first[:, None] + jnp.arange(n), W - 1), axis=1)
    o, lse = mosaic_cache.cache_attention(q, pool_k, pool_v, lengths - first * P, table=ids,
                                              start=lengths - window + 1 - first * P, block_k=64, interpret=True)
    # float64: every query's keys in its window; bfloat16 jnp (the same window through the pages) for the noise
    qq, kk64, vv = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("btkgh,bskh->btkgs", qq, kk64) / np.sqrt(H)
    seen = (np.asarray(pos)[:, None] < np.asarray(lengths)[:, None, None]) & (
        np.asarray(pos)[:, None] > np.asarray(q_pos)[..., None] - window)  # [B, T, S]
    s = np.where(seen[:, :, None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p_ = np.exp(s - m)
    exact_lse = (m + np.log(p_.sum(axis=-1, keepdims=True)))[..., 0]
    exact_o = np.einsum("btkgs,bskh->btkgh", p_ / p_.sum(axis=-1, keepdims=True), vv)
    low_o, low_lse = paged.window(q, pool_k, pool_v, table, lengths, q_pos, window=window, pages=n)
    Exact.measure(np.asarray(low_lse, np.float64), exact_lse, precision="bfloat16").check(lse, f"lse, T={T}")
    Exact.measure(np.asarray(low_o, np.float64), exact_o, precision="bfloat16").check(o, f"o, T={T}")


def _attention64(q, k, v, kv_len):
    """Sink-free attention of every query to keys [0, kv_len[b]) in float64 numpy: (o [B, T, K, G, H],
    lse [B, T, K, G])."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    s = np.einsum("btkgh,bskh->btkgs", q, k) / np.sqrt(q.shape[-1])
    seen = np.arange(k.shape[1])[None] < np.asarray(kv_len)[:, None]  # [B, S]
    s = np.where(seen[:, None, None, None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)
    lse = (m + np.log(p.sum(axis=-1, keepdims=True)))[..., 0]
    return np.einsum("btkgs,bskh->btkgh", p / p.sum(axis=-1, keepdims=True), v), lse


def _with_sinks64(o, lse, sinks):
    """The sinks folded in (each row's sink one more logit whose value is dropped), in float64."""
    sink = np.asarray(sinks, np.float64)
    return o / (1 + np.exp(sink - lse))[..., None]


def _decode_step(config, layer, params, x, cache, lengths, kernels, dtype):
    """One layer's attention block in a cached decode step (x [B, 1, D], every sequence one token)
    with its parameters and cache cast to dtype -> its output in float64."""
    cast = lambda a: a.astype(dtype) if a.dtype in (jnp.float32, jnp.bfloat16) else a  # noqa: E731
    block = AttentionBlock(config, layer, param_dtype=dtype, kernels=kernels)
    out, _ = jax.jit(block.apply)({"params": jax.tree.map(cast, params)}, x.astype(dtype), lengths[:, None],
                                  jax.tree.map(cast, cache), lengths, jnp.ones((x.shape[0], 1), bool))
    return np.asarray(out, np.float64)


@pytest.mark.slow
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_the_kernels_switch_runs_it_for_decode(storage, monkeypatch):
    """Kernels(attention="mosaic") in a full-attention layer's cached decode step: the output of the
    jnp path within the noise of a bfloat16 run (measured against the same layer in float32); the
    cache in bfloat16 or in FP8 storage (fp8.py), contiguous and paged."""
    config = gj.ModelConfig.tiny().replace(head_dim=64)
    layer = next(n for n in range(config.num_hidden_layers) if not config.is_sliding(n))
    params = random_params(config, seed=3, dtype=jnp.bfloat16)[f"block_{layer}"]["attn"]
    B, S = 2, 128
    lengths = jnp.array([37, 128 - 1], jnp.int32)
    kk, kv, kx = jax.random.split(jax.random.key(0), 3)
    cache = {"k": jax.random.normal(kk, (B, S, config.num_key_value_heads, config.head_dim)),
             "v": jax.random.normal(kv, (B, S, config.num_key_value_heads, config.head_dim))}
    if storage == "fp8":
        cache = {name: fp8.quantize(a) for name, a in cache.items()}
    x = jax.random.normal(kx, (B, 1, config.hidden_size))

    def run(kernels, dtype):
        return _decode_step(config, layer, params, x, cache, lengths, kernels, dtype)

    assert gj.Kernels(attention="mosaic", interpret=True).attention_for(1) == "mosaic"
    calls = []
    kernel = mosaic_cache.cache_attention
    monkeypatch.setattr(mosaic_cache, "cache_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    got = run(gj.Kernels(attention="mosaic", interpret=True), jnp.bfloat16)
    exact = Exact.measure(run(gj.Kernels(), jnp.bfloat16), run(gj.Kernels(), jnp.float32), precision="bfloat16")
    exact.check(got, "mosaic")
    # The same cache as pages of a pool (paged_cache.py), the sequences' pages interleaved: the
    # serving engine's decode step, through the page table.
    P = 64
    table = jnp.arange(B * S // P, dtype=jnp.int32).reshape(S // P, B).T  # [B, W]: page 2i + b
    pages = {name: fp8.apply(lambda a: jnp.zeros((B * S // P, P) + a.shape[2:], a.dtype).at[table].set(
        a.reshape(B, S // P, P, *a.shape[2:])), x) for name, x in cache.items()}
    cache = {**pages, "table": table}
    exact.check(run(gj.Kernels(attention="mosaic", interpret=True), jnp.bfloat16), "mosaic, paged")
    assert len(calls) == 2  # both ran on the kernel
    exact.check(run(gj.Kernels(), jnp.bfloat16), "jnp, paged")


@pytest.mark.slow
@pytest.mark.parametrize("page, storage", [(8, "bf16"), (64, "bf16"), (64, "fp8")])
def test_the_kernels_switch_runs_it_for_a_sliding_layers_paged_decode(page, storage, monkeypatch):
    """Kernels(attention="mosaic") in a sliding layer's decode step over the paged cache (the serving
    engine's): the jnp path's output within the noise of a bfloat16 run (measured against float32);
    sequences shorter than the window, at it and past it; the pool in bfloat16 or in FP8 storage
    (fp8.py), which the kernel reads as stored."""
    config = gj.ModelConfig.tiny().replace(head_dim=64)
    layer = next(n for n in range(config.num_hidden_layers) if config.is_sliding(n))
    params = random_params(config, seed=4, dtype=jnp.bfloat16)[f"block_{layer}"]["attn"]
    B, S, K, H = 3, 128, config.num_key_value_heads, config.head_dim
    lengths = jnp.array([5, config.sliding_window, 100], jnp.int32)
    kk, kv, kx = jax.random.split(jax.random.key(1), 3)
    W = S // page
    table = jnp.arange(B * W, dtype=jnp.int32).reshape(W, B).T  # [B, W]: sequences' pages interleaved
    cache = {name: jnp.zeros((B * W, page, K, H)).at[table].set(jax.random.normal(key, (B, W, page, K, H)))
             for name, key in (("k", kk), ("v", kv))}
    if storage == "fp8":
        cache = {name: fp8.quantize(a) for name, a in cache.items()}
    cache["table"] = table
    x = jax.random.normal(kx, (B, 1, config.hidden_size))

    def run(kernels, dtype):
        return _decode_step(config, layer, params, x, cache, lengths, kernels, dtype)

    exact = Exact.measure(run(gj.Kernels(), jnp.bfloat16), run(gj.Kernels(), jnp.float32), precision="bfloat16")
    windows = []
    kernel = mosaic_cache.cache_attention
    monkeypatch.setattr(mosaic_cache, "cache_attention",
                        lambda *a, **kw: windows.append(kw.get("start") is not None) or kernel(*a, **kw))
    exact.check(run(gj.Kernels(attention="mosaic", interpret=True), jnp.bfloat16), f"mosaic, pages of {page}, {storage}")
    assert windows == [True]  # the sliding layer's window ran on the kernel
