"""The paged KV cache with prefix reuse (paged_cache.py, serving/pages.py, serving/engine.py).

The model is the tiny config in float32 with its 16-token sliding window, shorter than the prompts.
Every request's greedy tokens must equal those `Generator` gives it alone, whatever it found in the
cache: prefixes shorter than a page, page-aligned, longer than the window, a whole earlier
conversation; pages reused by a later request, freed and taken by another, a pool too small for
everything running (preemption). The tests can fail: a broken page name (one token of each page left
out) makes requests reuse a wrong page, and an attention that reads one position past a sequence's
length sees a freed page's old contents, which the tests fill with large values first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gptoss_jax.decoding.generator import Generator
from gptoss_jax.model.paged_cache import FULL, SLIDING, page_bytes, window_pages
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, Settings
from gptoss_jax.serving import pages as pages_module
from gptoss_jax.serving.pages import Pages, chain, extend_hashes
from gptoss_jax.testing import KnownReplies

MAX_LEN = 256
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_f32):
    return tiny_f32


@pytest.fixture(scope="module")
def alone(model):
    """The greedy tokens of a prompt alone, from `Generator` (memoized)."""
    config, params = model
    generator = Generator(config, params, max_len=MAX_LEN)
    memo = {}

    def run(prompt, new_tokens):
        key = (tuple(prompt), new_tokens)
        if key not in memo:
            memo[key] = generator.generate([prompt], max_new_tokens=new_tokens, sampling=GREEDY)[0].output_ids
        return memo[key]

    return run


def _tokens(config, seed, n):
    return np.random.default_rng(seed).integers(0, config.vocab_size, n).tolist()


def _run(engine, prompts, new_tokens, together=False):
    """Submit the prompts (one at a time, each run to its end, or all together) -> their requests."""
    requests = []
    for prompt in prompts:
        requests.append(engine.submit(prompt, Settings(max_new_tokens=new_tokens, sampling=GREEDY)))
        if not together:
            engine.run_until_idle()
    engine.run_until_idle()
    return requests


# The pages on the host ------------------------------------------------------------------------------

def test_page_names_are_chained_over_the_whole_prefix():
    a = extend_hashes([], list(range(20)), 8)
    assert len(a) == 2  # full pages only
    b = extend_hashes([], [99] + list(range(1, 20)), 8)
    assert a[0] != b[0] and a[1] != b[1]  # the same second page after another first page: another name
    assert extend_hashes(a[:1], list(range(24)), 8) == extend_hashes([], list(range(24)), 8)  # extended in place
    assert chain(b"", [1, 2]) != chain(b"", [2, 1])


def test_pages_are_shared_cached_and_evicted_least_recently_released_first():
    pool = Pages(3)
    a, b, c = pool.take(), pool.take(), pool.take()
    assert pool.take() is None and pool.available == 0
    pool.name(a, FULL, b"x")
    pool.name(b, SLIDING, b"x")  # the same name in the other group is another page
    pool.name(c, FULL, b"x")  # the name is taken: c stays unnamed
    assert pool.find(FULL, b"x") == a and pool.find(SLIDING, b"x") == b
    pool.share(a)
    pool.release(a)
    assert pool.available == 0  # still held once
    pool.release(b)
    pool.release(a)
    pool.release(c)  # unnamed: free at once
    assert (pool.available, pool.cached, pool.held) == (3, 2, 0)
    assert pool.take() == c  # free pages before cached ones
    assert pool.take() == b and pool.find(SLIDING, b"x") is None  # then the least recently released
    assert pool.find(FULL, b"x") == a and pool.evicted == 1
    pool.share(a)  # a cached page held again
    assert pool.available == 0 and pool.refs(a) == 1


@pytest.mark.slow
def test_attention_through_page_tables_is_the_contiguous_caches(model):
    """kernels/attention/paged.py: prompt chunks and decode over pages in shuffled order (gathered whole, or a
    block of pages at a time up to the longest sequence) against the definition in float64, within the
    noise of the contiguous cache's jnp attention in float32; positions past a length hold huge values."""
    from gptoss_jax.kernels.attention import paged, xla
    from noise import Exact

    B, S, K, G, H, P = 3, 128, 2, 4, 16, 8
    keys = jax.random.split(jax.random.key(0), 4)
    lengths = jnp.array([0, 37, 128], jnp.int32)
    beyond = (jnp.arange(S)[None] >= lengths[:, None])[..., None, None]
    k = jnp.where(beyond, 1e4, jax.random.normal(keys[0], (B, S, K, H)))
    v = jnp.where(beyond, -1e4, jax.random.normal(keys[1], (B, S, K, H)))
    table = jax.random.permutation(keys[2], B * S // P).reshape(B, S // P).astype(jnp.int32)
    pool_k = jnp.zeros((B * S // P, P, K, H)).at[table].set(k.reshape(B, S // P, P, K, H))
    pool_v = jnp.zeros((B * S // P, P, K, H)).at[table].set(v.reshape(B, S // P, P, K, H))
    for T in (1, 20):
        q = jax.random.normal(keys[3], (B, T, K, G, H))
        s = np.einsum("btkgh,bskh->btkgs", np.asarray(q, np.float64), np.asarray(k, np.float64)) / np.sqrt(H)
        s = np.where((np.arange(S)[None] < np.asarray(lengths)[:, None])[:, None, None, None], s, -np.inf)
        p = np.exp(s[1:] - s[1:].max(-1, keepdims=True))
        exact_o = np.einsum("btkgs,bskh->btkgh", p / p.sum(-1, keepdims=True), np.asarray(v, np.float64)[1:])
        low_o, _ = xla.prefix(q, k, v, lengths, block=16)
        exact = Exact.measure(np.asarray(low_o[1:], np.float64), exact_o)
        for dense_keys in (4096, 0):  # every page at once; a block of pages at a time
            o, lse = paged.prefix(q, pool_k, pool_v, table, lengths, block=16, dense_keys=dense_keys)
            exact.check(o[1:], f"T={T}, dense_keys={dense_keys}")
            assert bool(jnp.all(lse[0] <= -1e30))  # the empty sequence saw no key
        # A piece of columns at a time for a kernel of contiguous keys (here the jnp one): pieces that
        # do not divide the table (3 pages: the last piece past W), and the whole table in one piece.
        attend = lambda q, k, v, n: xla.prefix(q, k, v, n, block=16)  # noqa: E731
        for pages in (3, 16):
            o, lse = paged.in_pieces(q, pool_k, pool_v, table, lengths, attend, pages=pages)
            exact.check(o[1:], f"T={T}, in pieces of {pages} pages")
            assert bool(jnp.all(lse[0] <= -1e30))  # nothing seen (the jnp code's MASKED: -1e30, not -inf)


@pytest.mark.slow
def test_a_prompt_after_a_long_cached_prefix_runs_the_flash_kernel_a_piece_at_a_time(monkeypatch):
    """kernels/attention/flash.py: the flash kernel's path over a paged prefix gathers the whole table where
    sequences x width x page <= GATHER_FOR_FLASH, else pieces of a power of two columns under that
    bound; either way the jnp path's output (the kernel stood in for by the jnp attention, which it
    matches on GPUs: tests/test_gpu.py)."""
    from gptoss_jax.kernels.attention import flash
    from gptoss_jax.kernels.attention import paged, xla
    from noise import Exact

    B, T, W, P, K, G, H = 2, 20, 16, 8, 2, 4, 16
    keys = jax.random.split(jax.random.key(5), 4)
    pool_k, pool_v = (jax.random.normal(k, (B * W, P, K, H)) for k in keys[:2])
    table = jax.random.permutation(keys[2], B * W).reshape(B, W).astype(jnp.int32)
    q = jax.random.normal(keys[3], (B, T, K, G, H))
    lengths = jnp.array([3, 101], jnp.int32)
    k, v = (np.asarray(paged.gather(pool, table, jnp.float32), np.float64) for pool in (pool_k, pool_v))  # [B, W P, K, H]
    s = np.einsum("btkgh,bskh->btkgs", np.asarray(q, np.float64), k) / np.sqrt(H)
    s = np.where((np.arange(W * P)[None] < np.asarray(lengths)[:, None])[:, None, None, None], s, -np.inf)
    m = s.max(-1, keepdims=True)
    exact_lse = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]
    exact_o = np.einsum("btkgs,bskh->btkgh", np.exp(s - exact_lse[..., None]), v)
    low = paged.prefix(q, pool_k, pool_v, table, lengths, block=16, dense_keys=0)
    exact = Exact.measure(low[0], exact_o), Exact.measure(low[1], exact_lse)
    spans = []
    monkeypatch.setattr(flash, "prefix", lambda q, k, v, n: spans.append(k.shape[1]) or xla.prefix(q, k, v, n, block=16))
    for bound, span in ((B * W * P, W * P), (B * W * P - 1, 8 * P), (5 * B * P, 4 * P)):
        monkeypatch.setattr(flash, "GATHER_FOR_FLASH", bound)
        spans.clear()
        o, lse = flash.tokamax_paged_full(q, pool_k, pool_v, table, lengths, kernels=None, mesh=None)
        assert spans == [span], (bound, spans)  # whole, then pieces of 8 and 4 pages
        exact[0].check(o, f"o, bound {bound}")
        exact[1].check(lse, f"lse, bound {bound}")


# Prefix reuse ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(model):
    """Pages of 8 positions (the window spans 2 of them), prompts prefilled 16 tokens a step."""
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
    engine.warm_up()
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [8, 32])
def test_shared_prefixes_of_every_kind_give_each_request_its_tokens_alone(model, alone, engine, page_size):
    """A system prompt of 50 tokens, then requests that share 5 of its tokens (less than a page), 16
    (whole pages), all 50 (past the window), and a whole earlier conversation (prompt and reply),
    one after another and then all at once: each request's tokens are its tokens alone, and the
    cache served exactly the whole pages of the shared prefix (the last prompt token is always
    computed)."""
    config, params = model
    if page_size != engine.page_size:  # pages larger than the window
        engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=page_size))
    P = page_size
    system = _tokens(config, 100 + P, 50)
    first = system + _tokens(config, 1, 20)
    prompts = [first, system[:5] + _tokens(config, 2, 9), system[:16] + _tokens(config, 3, 7),
               system + _tokens(config, 4, 30)]
    requests = _run(engine, prompts, 12)
    conversation = first + requests[0].output_ids + _tokens(config, 5, 10)
    requests += _run(engine, [conversation], 12)
    for r in requests:
        assert r.output_ids == alone(r.prompt_ids, 12)
    written = len(first) + 11  # the first request's positions in the cache (its last token never went in)
    assert [r.cached_tokens for r in requests] == [0, 0, 16 // P * P, 48 // P * P, written // P * P]
    # All at once, arriving together: each still gets its own tokens.
    crowd = _run(engine, [system + _tokens(config, 10 + i, 5 + 7 * i) for i in range(6)], 8, together=True)
    for r in crowd:
        assert r.output_ids == alone(r.prompt_ids, 8)
    assert all(r.cached_tokens == 48 // P * P for r in crowd)  # the system prompt's pages, cached above
    stats = engine.stats()
    assert stats["cached_prompt_tokens"] > 0 and stats["pages_in_use"] == 0 and stats["running"] == 0


@pytest.mark.slow
def test_a_broken_page_name_reuses_a_wrong_page_and_the_tokens_show_it(model, alone, monkeypatch):
    """Names that leave out each page's last token make prompts that differ only there share a page:
    the second prompt then computes on the first's keys, and its tokens part from its tokens alone
    (checked over five such pairs, so that the test does not hang on one argmax)."""
    config, params = model
    monkeypatch.setattr(pages_module, "chain", lambda previous, tokens: chain(previous, tokens[:-1]))
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
    wrong = 0
    for seed in range(5):
        a = _tokens(config, 200 + seed, 40)
        b = list(a)
        b[7] = (a[7] + 1) % config.vocab_size  # the last token of the first page
        first, second = _run(engine, [a, b], 8)
        assert first.output_ids == alone(a, 8) and second.cached_tokens == 32  # the broken name matched
        wrong += second.output_ids != alone(b, 8)
    assert wrong > 0


def _poison(engine) -> None:
    """Large keys and values in every free page: a read of a freed page's old contents is seen."""
    free = jnp.asarray(engine.scheduler.pages.free_pages(), jnp.int32)
    engine.device.pool = jax.tree.map(lambda a: a.at[free].set(50.0), engine.device.pool)


@pytest.mark.slow
def test_a_freed_page_never_reaches_another_sequence(model, alone, engine):
    """Pages freed by finished requests, filled with large values, taken by new requests (prefix hits
    and misses): the tokens stay each request's alone."""
    config, _ = model
    _run(engine, [_tokens(config, 300 + i, 30 + 9 * i) for i in range(4)], 10, together=True)
    _poison(engine)
    shared = _tokens(config, 310, 35)
    requests = _run(engine, [shared + _tokens(config, 320 + i, 3 + 11 * i) for i in range(5)], 10, together=True)
    for r in requests:
        assert r.output_ids == alone(r.prompt_ids, 10)


@pytest.mark.slow
def test_an_attention_that_reads_past_the_length_is_caught(model, alone, monkeypatch):
    """The check above can fail: attention to one more position than the sequence holds reads
    whatever its page held before (the large values), and the tokens change."""
    import gptoss_jax.kernels.attention.paged as paged

    config, params = model
    prefix = paged.prefix
    monkeypatch.setattr(paged, "prefix", lambda q, k, v, table, n, **kw: prefix(q, k, v, table, n + 1, **kw))
    jax.clear_caches()  # the steps trace again, with the broken read
    try:
        engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
        _poison(engine)
        prompts = [_tokens(config, 330 + i, 20 + 5 * i) for i in range(3)]
        requests = _run(engine, prompts, 6, together=True)
        assert any(r.output_ids != alone(r.prompt_ids, 6) for r in requests)
    finally:
        jax.clear_caches()


@pytest.mark.slow
def test_a_page_half_prefilled_is_not_found_by_a_request_that_arrives_meanwhile(model, alone):
    """Pages of 32 positions, prompts prefilled 24 at a time: a request sharing a prompt whose second
    page is half prefilled finds only the first page cached (a page is named once whole), and its
    tokens are its own (the free pages hold large values, so a read of the missing half would show)."""
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=24, page_size=32))
    _poison(engine)
    first = _tokens(config, 350, 100)
    a = engine.submit(first, Settings(max_new_tokens=6, sampling=GREEDY))
    engine.step()
    engine.step()  # positions 0-47: the second page half written
    b = engine.submit(first[:70] + _tokens(config, 351, 9), Settings(max_new_tokens=6, sampling=GREEDY))
    engine.run_until_idle()
    assert b.cached_tokens == 32
    assert a.output_ids == alone(a.prompt_ids, 6) and b.output_ids == alone(b.prompt_ids, 6)
    c = _run(engine, [first[:70] + _tokens(config, 352, 9)], 6)[0]  # once whole, it is found
    assert c.cached_tokens == 64 and c.output_ids == alone(c.prompt_ids, 6)


# Memory: pages as sequences grow, the window's pages only, preemption -----------------------------------

@pytest.mark.slow
def test_sliding_layers_hold_a_window_of_pages_and_full_layers_every_page(model, alone, engine):
    config, _ = model
    prompt = _tokens(config, 400, 150)
    request = engine.submit(prompt, Settings(max_new_tokens=40, sampling=GREEDY))
    most = 0
    while not request.finished:
        engine.step()
        for seq in engine.scheduler.admitted:
            assert len(seq.full) == -(-seq.length // engine.page_size)
            most = max(most, len(seq.sliding))
    # The window (16) and a chunk (16) of new positions: at most 2 + 2 + 1 pages of 8, never the 24
    # pages of the sequence.
    assert 0 < most <= window_pages(config, 8) + 16 // 8 + 1 == 6
    assert request.output_ids == alone(prompt, 40)


@pytest.mark.slow
def test_a_pool_too_small_for_everything_running_preempts_and_every_request_completes(model, alone):
    """Four requests that need 16 to 20 pages each at their longest, in a pool of 30: the latest admitted
    are preempted and come back, and every request gets its tokens alone."""
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8, pages=30))
    prompts = [_tokens(config, 500 + i, 40 + 10 * i) for i in range(4)]
    requests = _run(engine, prompts, 40, together=True)
    for r in requests:
        assert r.output_ids == alone(r.prompt_ids, 40)
        assert r.finish_reason == "length"
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "devices"])
def test_speculated_steps_take_their_pages_and_preempt_as_decode_steps_do(model, alone, where):
    """As above, with every step of up to four sequences checking 3 drafted tokens (right but for every
    third), drafted on the host or on the devices (four checked steps a call: a chunk's positions): a
    step's drafted positions take pages, preempting where the pool runs out; sliding pages leave as
    the window passes; every request still gets its tokens alone, and every page is given back."""
    config, params = model
    prompts = [_tokens(config, 500 + i, 40 + 10 * i) for i in range(4)]
    replies = {tuple(p): alone(p, 40) for p in prompts}
    known = KnownReplies(prompts, [replies[tuple(p)] for p in prompts], config.vocab_size, wrong_every=3,
                         by_position=True)
    draft = known if where == "devices" else (lambda context, k: known(context, k))  # (no `propose`: the host)
    engine = Engine(config, params,
                    EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8, pages=30, speculate_steps=4),
                    draft=draft)
    assert engine.speculation.most == (4 if where == "devices" else 1)
    requests = [engine.submit(p, Settings(max_new_tokens=40, sampling=GREEDY)) for p in prompts]
    most = 0
    while engine.step():  # the sliding pages out of the window are released after speculated steps too
        most = max([most] + [len(seq.sliding) for seq in engine.scheduler.admitted])
    assert 0 < most <= window_pages(config, 8) + 16 // 8 + 1
    assert [r.output_ids for r in requests] == [replies[tuple(p)] for p in prompts]
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("read", [0, 3])
def test_a_request_preempted_when_its_tokens_fill_whole_pages_computes_its_last_token_again(model, alone, read):
    """Pages of 8; a request preempted when its prompt and the tokens it has read fill whole pages
    exactly (read 0: right after its prompt of 40; read 3: a prompt of 37 and three tokens), all of
    them named: it comes back finding every page but the last token's in the cache (the last token is
    computed again, for the logits of the next), and its tokens are its own alone."""
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=2, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
    prompt = _tokens(config, 560 + read, 40 - read)
    request = engine.submit(prompt, Settings(max_new_tokens=12, sampling=GREEDY))
    while not engine.scheduler.admitted or engine.scheduler.admitted[0].prefilling or len(request.output_ids) < read:
        engine.step()
    seq = engine.scheduler.admitted[0]
    assert seq.length == len(seq.request.prompt_ids) + len(request.output_ids) == 40  # whole pages, all known
    engine.scheduler.preempt(seq)
    prefix, _ = engine.scheduler.cached_prefix(request)
    assert len(prefix) == 4  # of the 5 pages named, the last holds the last token
    engine.run_until_idle()
    assert request.output_ids == alone(prompt, 12)


def test_a_request_that_cannot_fit_alone_is_refused_at_once(model):
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=2, max_len=MAX_LEN, prefill_chunk=16, page_size=8, pages=12))
    # 80 positions: 10 pages of the full layers, and the sliding layers' window and chunk, 6.
    with pytest.raises(ValueError, match=r"needs 16 pages of the KV cache, more than its 12 \(96 positions\)"):
        engine.submit([1] * 60, Settings(max_new_tokens=20))
    engine.submit([1] * 20, Settings(max_new_tokens=20))  # 5 + 6 pages: fits
    with pytest.raises(ValueError, match="holds no page"):
        Engine(config, params, EngineConfig(kv_memory=page_bytes(config, 64, jnp.float32) - 1))


def test_slots_by_default_follow_the_pools_size(model):
    """Without slots given: one a 2,048 positions of the pool, the power of two at or below, from 16 to
    1,024, where the pool's size is known (given here; a GPU's memory); 16 where it is not (a CPU).
    Prompts prefilled together by default: 4, or 8 from 256 slots."""
    from gptoss_jax.serving.scheduler import prefill_rows_for, slots_for

    config, params = model
    assert [slots_for(n) for n in (None, 0, 17 * 2048, 40 * 2048, 1000 * 2048, 7_400_000)] == [16, 16, 16, 32, 512, 1024]
    assert [prefill_rows_for(n) for n in (1, 16, 255, 256, 1024)] == [4, 4, 4, 8, 8]
    pages = 40 * 2048 // 64
    engine = Engine(config, params, EngineConfig(max_len=MAX_LEN, kv_memory=pages * page_bytes(config, 64, jnp.float32)))
    assert (engine.slots, engine.slots_by_pool, engine.scheduler.pages.count) == (32, True, pages)
    assert (engine.options.prefill_rows, engine.prefill_shapes) == (4, [1, 4])
    assert Engine(config, params, EngineConfig(slots=256, max_len=MAX_LEN, pages=64)).prefill_shapes == [1, 8]
    engine = Engine(config, params, EngineConfig(max_len=MAX_LEN))
    assert (engine.slots, engine.slots_by_pool) == (16, False)


def test_without_prefix_reuse_every_prompt_is_computed_whole(model, alone):
    config, params = model
    engine = Engine(config, params,
                    EngineConfig(slots=2, max_len=MAX_LEN, prefill_chunk=16, page_size=8, prefix_reuse=False))
    system = _tokens(config, 600, 40)
    requests = _run(engine, [system + _tokens(config, 601, 5), system + _tokens(config, 602, 5)], 6)
    assert [r.cached_tokens for r in requests] == [0, 0]
    assert all(r.output_ids == alone(r.prompt_ids, 6) for r in requests)
    assert engine.stats()["pages_cached"] == 0


@pytest.mark.slow
def test_penalized_requests_keep_their_tokens_beside_others_and_across_preemption(model):
    """Presence and frequency penalties count each row's own generated tokens on the device: four
    penalized requests (and one with a grammar-free logit bias beside them) in a pool too small for
    all, preempted and resumed (their counts rebuilt from the tokens they have), give the tokens each
    gives alone; and the penalties change them (a test that could not see them would pass anyway)."""
    config, params = model
    prompts = [_tokens(config, 700 + i, 40 + 10 * i) for i in range(4)]
    kinds = [dict(frequency_penalty=2.0), dict(presence_penalty=-2.0), dict(frequency_penalty=-1.5, presence_penalty=1.0),
             dict(logit_bias=((3, 4.0),))]

    def settings(i):
        return Settings(max_new_tokens=40, sampling=GREEDY, **kinds[i])

    one = Engine(config, params, EngineConfig(slots=1, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
    alone = []
    for i, prompt in enumerate(prompts):
        alone.append(one.submit(prompt, settings(i)))
        one.run_until_idle()
    plain = [one.submit(p, Settings(max_new_tokens=40, sampling=GREEDY)) for p in prompts]
    one.run_until_idle()
    assert all(a.output_ids != p.output_ids for a, p in zip(alone, plain))
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8, pages=30))
    together = [engine.submit(p, settings(i)) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    assert engine.stats()["preemptions"] > 0
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]


@pytest.mark.slow
def test_a_request_after_another_with_its_prompt_waits_for_it_and_finds_the_prompt_cached(model, alone):
    """Choices of one API request: the second is admitted once the first has its first token, and then
    finds every whole page of the prompt in the cache (computed once); each gets its tokens alone."""
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=16, page_size=8))
    prompt = _tokens(config, 800, 45)
    first = engine.submit(prompt, Settings(max_new_tokens=5, sampling=GREEDY))
    second = engine.submit(prompt, Settings(max_new_tokens=5, sampling=GREEDY), after=first)
    other = engine.submit(_tokens(config, 801, 20), Settings(max_new_tokens=5, sampling=GREEDY))
    while not first.output_ids:
        engine.step()
        assert second.cached_tokens is None or first.output_ids  # not admitted before the first's token
    assert other.cached_tokens == 0  # the one behind it was not held up
    engine.run_until_idle()
    assert second.cached_tokens == 40  # every whole page of the 45 tokens
    assert first.output_ids == second.output_ids == alone(prompt, 5)
