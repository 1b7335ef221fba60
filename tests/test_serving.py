"""The continuous-batching engine (gptoss_jax/serving): requests arriving at random moments into a
few slots give exactly what each gives alone; cancelling frees slots without touching the others;
a full queue refuses at once; nothing compiles after warm-up.

The model is the tiny config with two layers (conftest.TWO_LAYERS: a 16-token window, shorter than
most prompts here, then full attention) in float32, so every request's cache holds a wrapped ring and
slots are reused many times over; tests/test_paged.py runs the engine with all four layers.
"""

from __future__ import annotations

import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj

from gptoss_jax.decoding.generator import Generator
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, QueueFull, Settings
from conftest import VOCAB, compile_events, needs_vocab

MAX_LEN = 512
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def model(two_layers_f32):
    return two_layers_f32


@pytest.fixture(scope="module")
def engine(model):
    """8 slots (decode steps of 2 or 8 rows), prompts prefilled 64 tokens a step, pages of 16 positions;
    warmed up once for the module."""
    config, params = model
    engine = Engine(config, params,
                    EngineConfig(slots=8, max_len=MAX_LEN, prefill_chunk=64, page_size=16, decode_sizes=(2, 8)))
    engine.warm_up()
    return engine


@pytest.fixture(scope="module")
def traffic(model):
    """24 requests of 1 to 300 prompt tokens and 1 to 12 new tokens, a few ending on a stop id, with
    the greedy tokens `Generator` gives each alone."""
    config, params = model
    rng = np.random.default_rng(11)
    lengths = [1, 300, 17, 150] + list(rng.integers(1, 301, 20))
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in lengths]
    budgets = rng.integers(1, 13, len(prompts)).tolist()
    generator = Generator(config, params, max_len=MAX_LEN)
    alone = [generator.generate([p], max_new_tokens=m, sampling=GREEDY)[0].output_ids for p, m in zip(prompts, budgets)]
    stops = [(out[len(out) // 2],) if i % 5 == 0 and len(out) > 2 else () for i, out in enumerate(alone)]
    # Greedy: with a stop id, the same tokens up to its first one, which ends the reply.
    want = [out[:out.index(s[0]) + 1] if s else out for out, s in zip(alone, stops)]
    return [Settings(max_new_tokens=m, sampling=GREEDY, stop_ids=s) for m, s in zip(budgets, stops)], prompts, want


def _arrive_at_random(engine, prompts, settings, seed):
    """Submit each request at a random engine step (about one every two steps), running steps until
    all have finished; -> the requests."""
    rng = np.random.default_rng(seed)
    pending = list(zip(prompts, settings))
    requests = []
    while pending or not all(r.finished for r in requests):
        for _ in range(rng.poisson(0.5) if pending else 0):
            if pending:
                prompt, s = pending.pop(0)
                requests.append(engine.submit(prompt, s))
        engine.step()
    return requests


@pytest.mark.slow
def test_random_arrivals_give_each_request_its_tokens_alone(engine, traffic):
    """Greedy tokens equal `Generator`'s for the request alone, whatever shared its steps; slots are
    reused (24 requests, 8 slots), so a slot whose reset failed would feed the next request the
    previous one's cache (checked: with the reset removed, this fails)."""
    settings, prompts, want = traffic
    requests = _arrive_at_random(engine, prompts, settings, seed=0)
    for i, (r, w) in enumerate(zip(requests, want)):
        assert r.output_ids == w, f"request {i} ({len(r.prompt_ids)} prompt tokens)"
        assert r.finish_reason == ("stop" if settings[i].stop_ids and w[-1] in settings[i].stop_ids else "length")
    stats = engine.stats()
    assert stats["slots_in_use"] == 0 and stats["waiting"] == 0


@pytest.mark.slow
def test_a_seeded_request_samples_the_same_tokens_whatever_shares_its_batch(engine, traffic):
    settings, prompts, _ = traffic
    seeded = Settings(max_new_tokens=10, sampling=Sampling(temperature=0.8, top_p=0.95, top_k=50), seed=1234)
    alone = engine.submit(prompts[3], seeded)
    engine.run_until_idle()
    crowd = [engine.submit(p, s) for p, s in zip(prompts[:7], settings[:7])]
    shared = engine.submit(prompts[3], seeded)
    crowd += [engine.submit(p, s) for p, s in zip(prompts[7:12], settings[7:12])]
    engine.run_until_idle()
    assert shared.output_ids == alone.output_ids
    # A request that only draws (no top-k or top-p) gives the same tokens alone, where its step
    # skips the sort, as next to one that needs the sort.
    plain = Settings(max_new_tokens=10, sampling=Sampling(temperature=0.9, min_p=0.05), seed=7)
    drawn_alone = engine.submit(prompts[5], plain)
    engine.run_until_idle()
    beside = [engine.submit(prompts[5], plain), engine.submit(prompts[3], seeded)]
    engine.run_until_idle()
    assert beside[0].output_ids == drawn_alone.output_ids and beside[1].output_ids == alone.output_ids
    other_seed = engine.submit(prompts[3], Settings(max_new_tokens=10, sampling=seeded.sampling, seed=99))
    engine.run_until_idle()
    assert other_seed.output_ids != alone.output_ids  # the seed matters: the check can fail


@pytest.mark.slow
def test_cancelling_half_frees_their_slots_and_leaves_the_others_unchanged(engine, traffic):
    settings, prompts, want = traffic
    longer = [Settings(max_new_tokens=s.max_new_tokens, sampling=GREEDY, stop_ids=s.stop_ids) for s in settings]
    requests = [engine.submit(p, s) for p, s in zip(prompts[:16], longer[:16])]
    for _ in range(6):
        engine.step()
    cancelled = requests[::2]
    for r in cancelled:
        r.cancel()
    engine.step()
    assert all(r.finished and r.finish_reason in ("cancelled", "stop", "length") for r in cancelled)
    assert not any(s is not None and s.request in cancelled for s in engine.scheduler.rows)  # freed within one step
    engine.run_until_idle()
    for i, r in enumerate(requests):
        if r not in cancelled:
            assert r.output_ids == want[i], f"request {i}"
    assert any(r.finish_reason == "cancelled" for r in cancelled)
    assert engine.stats()["slots_in_use"] == 0


def test_a_full_queue_refuses_at_once(model):
    config, params = model
    engine = Engine(config, params, EngineConfig(slots=1, max_len=64, max_waiting=2))
    engine.submit([1, 2], Settings(max_new_tokens=1))  # takes the free slot at the next step
    engine.submit([3], Settings(max_new_tokens=1))
    engine.submit([5], Settings(max_new_tokens=1))
    with pytest.raises(QueueFull, match=r"3 requests are waiting, the most this engine queues \(2 beyond the 1 slots"):
        engine.submit([4], Settings(max_new_tokens=1))
    assert engine.stats()["rejected"] == 1
    with pytest.raises(ValueError, match="exceeds the max context of 64"):
        engine.submit([1] * 60, Settings(max_new_tokens=8))
    with pytest.raises(ValueError, match=r"prompt token ids must lie in \[0, "):
        engine.submit([config.vocab_size], Settings(max_new_tokens=1))


@pytest.mark.slow
def test_logprobs_are_the_models_log_softmax_for_the_tokens_drawn(engine, model):
    """Settings(logprobs=5): each token's log-probability and its 5 most likely alternatives', for a
    greedy request and a sampled one (temperature 0.7, top-k 20: the distribution after temperature,
    before top-k), against transformers' float64 log-softmax of the whole sequence's logits, within
    NOISE_FACTOR x its float32 run's own error; the same tokens as without log-probabilities, also
    when a request without them shares the steps."""
    from noise import Exact
    from refs import hf_logits, log_softmax

    config, params = model
    prompt = np.random.default_rng(21).integers(0, config.vocab_size, 40).tolist()  # past the 16-token window
    for sampling, seed in ((GREEDY, 0), (Sampling(temperature=0.7, top_k=20), 3)):
        plain = Settings(max_new_tokens=6, sampling=sampling, seed=seed)
        asked = Settings(max_new_tokens=6, sampling=sampling, seed=seed, logprobs=5)
        alone = engine.submit(prompt, asked)
        engine.run_until_idle()
        beside, other = engine.submit(prompt, asked), engine.submit(prompt[::-1], plain)  # in the same steps
        engine.run_until_idle()
        reference = engine.submit(prompt[::-1], plain)
        engine.run_until_idle()
        assert other.logprobs is None and other.output_ids == reference.output_ids
        out = alone.output_ids
        assert beside.output_ids == out and len(out) == 6 and len(alone.logprobs) == 6
        T = sampling.temperature or 1.0
        seq = [prompt + out[:-1]]
        rows = slice(len(prompt) - 1, None)  # the logits each new token was drawn from
        exact = Exact.measure(log_softmax(hf_logits(config, params, seq, "float32")[0, rows] / T),
                              log_softmax(hf_logits(config, params, seq, "float64")[0, rows] / T))
        steps = np.arange(len(out))
        for request in (alone, beside):
            exact[steps, out].check([lp.logprob for lp in request.logprobs], f"chosen, T={T}")
            ids = np.array([[i for i, _ in lp.top] for lp in request.logprobs])
            exact[steps[:, None], ids].check([[v for _, v in lp.top] for lp in request.logprobs], f"top 5, T={T}")
            assert (ids == np.argsort(-exact.value, axis=-1)[:, :5]).all()  # the 5 most likely, in order
        if sampling.temperature == 0:
            assert (ids[:, 0] == out).all()


@pytest.mark.slow
def test_logit_bias_forces_or_forbids_tokens_and_leaves_the_others(engine, model):
    """Settings(logit_bias): +100 on a token makes it every token, greedy or sampled (its log-probability
    then about 0); -100 on the token greedy decoding picks first makes it never appear; a request
    without a bias sharing the steps gets its tokens alone."""
    config, _ = model
    prompt = np.random.default_rng(8).integers(0, config.vocab_size, 30).tolist()
    other = prompt[::-1]
    alone = engine.submit(prompt, Settings(max_new_tokens=5, sampling=GREEDY))
    beside_alone = engine.submit(other, Settings(max_new_tokens=5, sampling=GREEDY))
    engine.run_until_idle()
    forced = 7 if alone.output_ids[0] != 7 else 8
    for sampling in (GREEDY, Sampling(temperature=1.0)):
        r = engine.submit(prompt, Settings(max_new_tokens=5, sampling=sampling, seed=1, logit_bias=((forced, 100.0),),
                                           logprobs=0))
        beside = engine.submit(other, Settings(max_new_tokens=5, sampling=GREEDY))
        engine.run_until_idle()
        assert r.output_ids == [forced] * 5 and all(lp.logprob > -1e-3 for lp in r.logprobs)
        assert beside.output_ids == beside_alone.output_ids
    first = alone.output_ids[0]
    banned = engine.submit(prompt, Settings(max_new_tokens=5, sampling=GREEDY, logit_bias=((first, -100.0),)))
    engine.run_until_idle()
    assert first not in banned.output_ids
    with pytest.raises(ValueError, match="logit_bias"):
        engine.submit(prompt, Settings(logit_bias=((config.vocab_size, 1.0),)))
    with pytest.raises(ValueError, match="-100, 100"):
        Settings(logit_bias=((1, 101.0),))


@pytest.mark.slow
def test_nothing_compiles_after_warm_up(engine, model):
    """200 requests of random lengths and sampling settings, a third with log-probabilities, some with a
    logit bias or penalties, half of them starting with one of three shared prefixes (found in the cache, or not yet), counted by JAX's own
    compile events."""
    config, _ = model
    rng = np.random.default_rng(5)
    shared = [rng.integers(0, config.vocab_size, 100).tolist() for _ in range(3)]
    before = engine.stats()["cached_prompt_tokens"]
    with compile_events() as compiles:
        for _ in range(200):
            sampling = Sampling(temperature=float(rng.choice([0.0, 0.7, 1.0])), top_k=int(rng.choice([0, 20])),
                                top_p=float(rng.choice([1.0, 0.9])), min_p=float(rng.choice([0.0, 0.05])))
            prompt = rng.integers(0, config.vocab_size, int(rng.integers(1, 201))).tolist()
            if rng.random() < 0.5:
                prompt = shared[int(rng.integers(0, 3))] + prompt
            engine.submit(prompt, Settings(max_new_tokens=int(rng.integers(1, 4)), sampling=sampling,
                                           seed=int(rng.integers(0, 2**31)), logprobs=[None, 0, 3][_ % 3],
                                           logit_bias=((int(rng.integers(0, config.vocab_size)), 5.0),) * (_ % 2),
                                           presence_penalty=0.5 * (_ % 5 == 0), frequency_penalty=-0.5 * (_ % 7 == 0)))
        engine.run_until_idle()
    assert compiles == []
    assert engine.stats()["finished"]["length"] >= 200
    assert engine.stats()["cached_prompt_tokens"] > before  # prefixes were found


@pytest.mark.slow
def test_requests_stream_from_other_threads_and_stop_cancels(model, traffic):
    """The engine on its own thread: each client thread reads its tokens as they come."""
    config, params = model
    settings, prompts, want = traffic
    engine = Engine(config, params, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=64))
    engine.start()
    got = {}

    def client(i):
        request = engine.submit(prompts[i], settings[i])
        got[i] = list(request.tokens(timeout=120))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(got[i] == want[i] for i in range(6))
    hanging = engine.submit(prompts[1], Settings(max_new_tokens=400 - len(prompts[1]) + 100))
    engine.stop()
    assert hanging.finished and hanging.finish_reason in ("cancelled", "length")


@pytest.mark.slow
def test_on_a_mesh_the_engine_gives_one_device_tokens(model, traffic):
    """Sequences split over `data`, experts over `expert`, heads over `tensor` (8 CPU devices): the greedy
    tokens equal one device's, with requests arriving at random (float32: no reduction-order
    differences large enough to flip a greedy choice at this size, checked by the exact equality)."""
    from gptoss_jax.params import param_shardings

    config, params = model
    settings, prompts, want = traffic
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    sharded = jax.device_put(params, param_shardings(config, mesh))
    engine = Engine(config, sharded, EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=64))
    assert engine.mesh is mesh
    requests = _arrive_at_random(engine, prompts[:10], settings[:10], seed=1)
    for i, r in enumerate(requests):
        assert r.output_ids == want[i], f"request {i}"
    pool = engine.device.pool["pages"][0]["k"]  # [pages, page positions, KV heads, head dim]
    assert pool.sharding.spec[:3] == (None, None, "tensor")


@pytest.mark.slow
@needs_vocab
def test_stop_strings_end_a_request_where_its_text_first_holds_one(model):
    """Stop strings across token boundaries: the request ends at the first token whose text completes
    one (the reply's text after each token, decoded from the start)."""
    from gptoss_jax.tokenizer import StreamDecoder, load_tokenizer

    config, params = model
    tokenizer = load_tokenizer(VOCAB)
    engine = Engine(config, params, EngineConfig(slots=2, max_len=MAX_LEN, prefill_chunk=64), tokenizer=tokenizer)
    prompt = np.random.default_rng(5).integers(0, config.vocab_size, 20).tolist()
    full = engine.submit(prompt, Settings(max_new_tokens=60, sampling=GREEDY))
    engine.run_until_idle()
    decoder, texts = StreamDecoder(tokenizer), [""]
    for token in full.output_ids:
        texts.append(texts[-1] + decoder.add(token))
    # A stop string of printable ASCII that spans the end of some token's text past the 20th.
    n0 = next(n for n in range(20, 58) if len(texts[n]) >= 3 and len(texts[n + 2]) >= len(texts[n]) + 2 and
              texts[n + 2][len(texts[n]) - 3:len(texts[n]) + 2].isascii() and
              texts[n + 2][len(texts[n]) - 3:len(texts[n]) + 2].isprintable())
    stop = texts[n0 + 2][len(texts[n0]) - 3:len(texts[n0]) + 2]
    want = next(n for n in range(1, 61) if stop in texts[n])
    assert want > n0 >= 20  # it spans tokens, so a per-token check alone would miss it
    request = engine.submit(prompt, Settings(max_new_tokens=60, sampling=GREEDY, stop_strings=("never here", stop)))
    engine.run_until_idle()
    assert request.finish_reason == "stop" and request.output_ids == full.output_ids[:want]


def test_a_lockstep_message_carries_admissions_exactly():
    """What process 0 sends the others each step: the admitted prompts and settings (every field set:
    floats, stop strings with any characters, log-probabilities, a logit bias), the cancelled slots,
    the stop flag, back as they were."""
    from gptoss_jax.serving.lockstep import Message, decode, encode
    from gptoss_jax.serving.request import Request

    settings = Settings(max_new_tokens=7, sampling=Sampling(temperature=0.7, top_k=3, top_p=0.9, min_p=0.05), seed=-5,
                        stop_ids=(1, 2), stop_strings=("\n\n", "é\"}"), logprobs=3, logit_bias=((7, -100.0), (9, 2.5)),
                        presence_penalty=0.5, frequency_penalty=-1.25, grammar='start: "a" | "b"', adapter=1)
    assert all(getattr(settings, f.name) != f.default for f in dataclasses.fields(Settings))  # a field left out fails
    sent = Message(cancel=[3, 0], admit=[(1, Request(10, [5, 200_000, 0], settings)), (2, Request(11, [9], Settings()))])
    got = decode(encode(sent))
    assert got.cancel == [3, 0] and not got.stop
    assert [(s, r.id, r.prompt_ids, r.settings) for s, r in got.admit] == [
        (1, 10, [5, 200_000, 0], settings), (2, 11, [9], Settings())]
    assert decode(encode(Message(stop=True))).stop


def test_the_picks_adjust_logits_by_bias_penalties_and_grammar_mask_as_float64_does():
    """steps.adjust against numpy in float64: each row's logit bias added, frequency penalty times the
    count and presence penalty once for every token generated subtracted, and the tokens its mask
    leaves out at -inf (bit t % 32 of word t // 32, the tail past the vocabulary ignored); rows are
    gathered by `rows`. The float32 result is within a few roundings of the values it adds."""
    from gptoss_jax.serving import steps

    rng = np.random.default_rng(0)
    R, B, V, K = 5, 3, 70, 4
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    rows = np.array([4, 0, 2], np.int32)
    bias_ids = rng.integers(0, V, (R, K)).astype(np.int32)
    bias_ids[:, -1] = np.iinfo(np.int32).max  # an unused entry: names no token
    bias = rng.uniform(-100, 100, (R, K)).astype(np.float32)
    presence, frequency = rng.uniform(-2, 2, R).astype(np.float32), rng.uniform(-2, 2, R).astype(np.float32)
    counts = rng.integers(0, 3, (R, V)).astype(np.int16)
    allowed = rng.random((B, V)) < 0.7
    words = np.zeros((B, steps.mask_words(V) * 32), bool)
    words[:, :V] = allowed
    words[:, V:] = True  # the tail past the vocabulary: whatever it holds, no token
    mask = np.packbits(words.reshape(B, -1, 32), axis=-1, bitorder="little").view(np.int32)[..., 0]
    got = np.asarray(jax.jit(steps.adjust)(logits, rows, bias_ids, bias, presence, frequency, counts, mask))

    want = logits.astype(np.float64)
    for b, r in enumerate(rows):
        for j in range(K):
            if bias_ids[r, j] < V:
                want[b, bias_ids[r, j]] += bias[r, j]
        want[b] -= frequency[r] * counts[r] + presence[r] * (counts[r] > 0)
    want[~allowed] = -np.inf
    assert np.array_equal(np.isinf(got), ~allowed)
    scale = np.abs(logits).max() + 2 * np.abs(bias).max() + 2 * 3 + 2  # the largest value a sum holds
    np.testing.assert_allclose(got[allowed], want[allowed], rtol=0, atol=8 * np.finfo(np.float32).eps * scale)


def test_a_tokens_count_stops_at_32767_and_special_tokens_are_not_counted():
    """steps._count: one more of each drawn token in its row, never past int16's largest (a count that
    wrapped would turn a penalty's sign), tokens from `counted` on (harmony's special tokens) and the
    padding row R left alone."""
    from gptoss_jax.serving import steps

    counts = jnp.zeros((2, 10), jnp.int16).at[0, 3].set(32766)
    count = jax.jit(steps._count, static_argnums=3)
    for _ in range(3):
        counts = count(counts, jnp.array([0, 1, 2], jnp.int32), jnp.array([3, 9, 4], jnp.int32), 8)
    want = np.zeros((2, 10), np.int16)
    want[0, 3] = 32767
    np.testing.assert_array_equal(np.asarray(counts), want)
    counts = count(counts, jnp.array([1], jnp.int32), jnp.array([7], jnp.int32), 8)
    assert int(counts[1, 7]) == 1


@pytest.mark.slow
def test_a_row_whose_settings_raise_in_the_step_fails_alone(engine, traffic, caplog):
    """A request whose settings cannot become its row's (a top-k past int32, set after the checks at
    submit, as a bug would) ends with an error at admission; the requests beside it, admitted in the
    same step, get their exact greedy tokens and the engine goes on. With the failure not kept to its
    row (the step's exception reaching `_fail_running`), every request here would end with the error."""
    settings, prompts, want = traffic
    bad = Settings(max_new_tokens=8, sampling=Sampling(temperature=0.5, top_k=5), seed=1)
    object.__setattr__(bad.sampling, "top_k", 2**31)  # frozen: what no check at submit would let through
    requests = [engine.submit(p, s) for p, s in zip(prompts[:3], settings[:3])]
    failing = engine.submit(prompts[3], bad)
    requests += [engine.submit(p, s) for p, s in zip(prompts[4:7], settings[4:7])]
    with caplog.at_level("ERROR", "gptoss_jax.serving"):
        engine.run_until_idle()
    assert failing.finish_reason == "error" and "OverflowError" in failing.error and not failing.invalid
    assert failing.output_ids == []
    for i, r in zip([0, 1, 2, 4, 5, 6], requests):
        assert r.output_ids == want[i] and r.finish_reason in ("stop", "length"), i
    assert f"request {failing.id} failed alone" in caplog.text
    assert engine.stats()["slots_in_use"] == 0


@pytest.mark.slow
@needs_vocab
def test_a_grammar_that_fails_as_it_goes_ends_its_request_alone_as_its_own_error(model, traffic):
    """llguidance finds a `$ref` loop only when it first computes what may follow: that request ends
    as the client's error (`invalid`), the greedy requests beside it get their exact tokens."""
    from gptoss_jax import tokenizer as tk
    from gptoss_jax.server.structured import _json

    config, params = model
    settings, prompts, want = traffic
    engine = Engine(config, params,
                    EngineConfig(slots=4, max_len=MAX_LEN, prefill_chunk=64, page_size=16, decode_sizes=(4,)),
                    tokenizer=tk.load_tokenizer(VOCAB))
    loop = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    grammar = "start: " + _json(loop)
    engine.grammars.check(grammar)  # it compiles: the fault shows only later
    failing = engine.submit(prompts[1], Settings(max_new_tokens=6, sampling=GREEDY, grammar=grammar))
    others = [engine.submit(p, s) for p, s in zip(prompts[4:7], settings[4:7])]
    engine.run_until_idle()
    assert failing.finish_reason == "error" and failing.invalid and "NoExtensionBias" in failing.error
    for i, r in zip([4, 5, 6], others):
        assert r.output_ids == want[i], i
