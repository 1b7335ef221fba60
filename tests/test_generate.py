"""Generation (prefill + decode loop) and sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gptoss_jax as gj
from gptoss_jax.decoding.generator import Generator, batch_timings
from gptoss_jax.sampling import Sampling, sample
from gptoss_jax.testing import random_params

GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def gen():
    config = gj.ModelConfig.tiny().replace(sliding_window=128)
    return Generator(config, random_params(config, seed=5), max_len=400, prefill_chunk=64)


@pytest.fixture(scope="module")
def prompts(gen):
    rng = np.random.default_rng(5)
    return [rng.integers(0, gen.config.vocab_size, n).tolist() for n in (3, 130, 250)]


@pytest.mark.slow
def test_greedy_equals_uncached_argmax_and_batch_equals_single(gen, prompts):
    batch = gen.generate(prompts, max_new_tokens=12, sampling=GREEDY)
    for prompt, result in zip(prompts, batch, strict=True):
        seq = prompt + result.output_ids
        logits = gj.forward(gen.config, gen.params, np.array([seq[:-1]]))
        np.testing.assert_array_equal(np.asarray(logits[0, len(prompt) - 1:]).argmax(-1), result.output_ids)
        alone = gen.generate([prompt], max_new_tokens=12, sampling=GREEDY)[0]
        assert alone.output_ids == result.output_ids and result.finish_reason == "length"


def test_stop_tokens_end_one_sequence_and_the_others_go_on(gen, prompts):
    free = gen.generate(prompts, max_new_tokens=10, sampling=GREEDY)
    stop = free[1].output_ids[3]
    assert stop not in free[1].output_ids[:3]
    stopped = gen.generate(prompts, max_new_tokens=10, sampling=GREEDY, stop_tokens=[stop])
    assert stopped[1].output_ids == free[1].output_ids[:4] and stopped[1].finish_reason == "stop"
    for b in (0, 2):  # unaffected unless they produce the same token
        expected = free[b].output_ids
        if stop in expected:
            expected = expected[: expected.index(stop) + 1]
        assert stopped[b].output_ids == expected


@pytest.mark.slow
def test_sampling_is_seeded(gen, prompts):
    warm = Sampling(temperature=1.0)
    a = gen.generate(prompts[:2], max_new_tokens=8, sampling=warm, seed=1)
    b = gen.generate(prompts[:2], max_new_tokens=8, sampling=warm, seed=1)
    c = gen.generate(prompts[:2], max_new_tokens=8, sampling=warm, seed=2)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert [r.output_ids for r in a] != [r.output_ids for r in c]


def test_streaming_callback_sees_every_token(gen, prompts):
    seen = []
    results = gen.generate(prompts[:2], max_new_tokens=5, sampling=GREEDY, on_token=lambda b, t: seen.append((b, t)))
    for b, r in enumerate(results):
        assert [t for s, t in seen if s == b] == r.output_ids


@pytest.mark.slow
def test_decode_steps_per_call_change_no_token(gen, prompts):
    """Decoding 8 steps a call (the fixture's default), 3 or 1 gives the same tokens: greedy, sampled
    (each step keeps its own key), with a stop token, and with the cache filled to its last position
    (the last call's surplus steps run past it; they must not disturb what came before)."""
    assert gen.decode_steps == 8
    others = {n: Generator(gen.config, gen.params, max_len=400, prefill_chunk=64, decode_steps=n) for n in (1, 3)}
    warm = Sampling(temperature=1.0)
    for sampling, kwargs in ((GREEDY, {}), (warm, {"seed": 4})):
        want = [r.output_ids for r in gen.generate(prompts, max_new_tokens=11, sampling=sampling, **kwargs)]
        for other in others.values():
            assert [r.output_ids for r in other.generate(prompts, max_new_tokens=11, sampling=sampling,
                                                         **kwargs)] == want
    stop = want[1][5]
    assert stop not in want[1][:5]
    stopped = [(r.output_ids, r.finish_reason) for r in gen.generate(prompts, max_new_tokens=11, sampling=warm,
                                                                     seed=4, stop_tokens=[stop])]
    assert stopped[1] == (want[1][:6], "stop")
    assert stopped == [(r.output_ids, r.finish_reason) for r in others[1].generate(
        prompts, max_new_tokens=11, sampling=warm, seed=4, stop_tokens=[stop])]
    # Every sequence stopped within the first call (the next one queued already), then the same
    # generation again; stop ids no token has change nothing.
    early = gen.generate(prompts, max_new_tokens=11, sampling=warm, seed=4, stop_tokens=[w[2] for w in want])
    assert all(r.finish_reason == "stop" and len(r.output_ids) <= 3 for r in early)
    assert [r.output_ids for r in gen.generate(prompts, max_new_tokens=11, sampling=warm, seed=4,
                                               stop_tokens=[-1, gen.config.vocab_size])] == want
    full = 400 - len(prompts[2])  # 149 decode steps: 19 calls of 8, the last 3 surplus (2 past the cache's end)
    assert ([r.output_ids for r in gen.generate(prompts[1:], max_new_tokens=full, sampling=GREEDY)]
            == [r.output_ids for r in others[1].generate(prompts[1:], max_new_tokens=full, sampling=GREEDY)])
    with pytest.raises(ValueError, match="decode steps per call must be >= 1, got 0"):
        Generator(gen.config, gen.params, max_len=400, decode_steps=0)


@pytest.mark.slow
def test_a_calls_steps_past_the_limit_leave_the_cache_alone(gen):
    """Steps counted at or past the limit (a call's surplus beyond max_new_tokens) run with every
    sequence inactive: the cache does not grow (so no kernel sees a length past the cache's end)."""
    from gptoss_jax.decoding.checked import row_settings
    from gptoss_jax.decoding.steps import Decode, Model, decode

    config = gen.config
    _, cache = gj.extend(config, gen.params, np.ones((2, 395), np.int32), gj.init_cache(config, 2, 400, gen.dtype))
    plan = jnp.array([[0, 1], [395, 395], [1, 1], [3, 3]], jnp.int32)  # rows, lengths, sampling steps, budgets
    new, last, plan, cache = decode(Decode(Model(config, gen.kernels), 8, "greedy"), gen.params, cache,
                                    jnp.array([1, 2]), plan, row_settings(GREEDY, 0, 2))
    assert cache["lengths"].tolist() == [398, 398]  # steps 1, 2 and 3 of 1 to 8 ran
    assert new.shape == (8, 2) and (last == new[2]).all() and plan[3].tolist() == [0, 0]
    assert plan[1].tolist() == [398, 398] and plan[2].tolist() == [4, 4]


def test_generator_rejects_bad_requests(gen, prompts):
    with pytest.raises(ValueError, match="exceeds the max context of 400"):
        gen.generate([list(range(390))], max_new_tokens=20)
    with pytest.raises(ValueError, match="at least one token"):
        gen.generate([[]], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        gen.generate([[5000]], max_new_tokens=2)
    with pytest.raises(ValueError, match="32-bit signed integer, got 1099511627776"):
        gen.generate([[5]], max_new_tokens=2, seed=2**40)


@pytest.mark.slow
def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 2000)

    def draws(params):
        return np.asarray(jax.vmap(lambda k: sample(logits, k, params))(keys))[:, 0]

    assert set(draws(Sampling(top_k=1))) == {0}
    assert set(draws(Sampling(top_k=2))) == {0, 1}
    assert set(draws(Sampling(top_p=0.5))) == {0}  # 0.5 alone reaches p
    assert set(draws(Sampling(top_p=0.85))) == {0, 1, 2}
    assert set(draws(Sampling(min_p=0.5))) == {0, 1}  # 0.15 < 0.5 * 0.5
    # Plain sampling draws each token at its probability: each count within 5 binomial standard
    # deviations of n p (a correct sampler strays that far with probability below 1e-6 per token;
    # at n = 20,000 that is under 0.018 in frequency, while sampling at temperature 0.9 instead of 1
    # moves the first token's frequency by 0.024).
    many = jax.random.split(jax.random.key(1), 20_000)
    counts = np.bincount(np.asarray(jax.vmap(lambda k: sample(logits, k, Sampling()))(many))[:, 0], minlength=4)
    p, n = np.array([0.5, 0.3, 0.15, 0.05]), len(many)
    assert np.all(np.abs(counts - n * p) <= 5 * np.sqrt(n * p * (1 - p))), counts / n
    assert int(sample(logits, keys[0], GREEDY)[0]) == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top-p"), ({"top_p": 1.5}, "top-p"),
    ({"top_k": -1}, "top-k"), ({"min_p": 1.0}, "min-p"),
])
def test_sampling_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


@pytest.mark.slow
def test_no_recompilation_for_a_new_prompt_length_inside_a_bucket():
    config = gj.ModelConfig.tiny().replace(sliding_window=128)
    gen = Generator(config, random_params(config, seed=5), max_len=400, prefill_chunk=64)
    first = gen.generate([list(range(1, 21))], max_new_tokens=3, sampling=GREEDY)[0]  # 20 tokens: the 32 bucket
    compiled = set(gen.executables)
    again = gen.generate([list(range(1, 27))], max_new_tokens=5, sampling=GREEDY)[0]  # 26 tokens: same bucket
    assert set(gen.executables) == compiled and again.timings["compile_s"] == 0.0
    gen.generate([list(range(1, 40))], max_new_tokens=3, sampling=GREEDY)  # 39 tokens: the 64 bucket
    assert len(gen.executables) == len(compiled) + 1  # one new prefill chunk shape, nothing else
    assert first.timings["prompt_tokens"] == 20 and first.timings["new_tokens"] == 3


@pytest.mark.slow
def test_timings_are_per_sequence_and_keep_compilation_apart(prompts):
    config = gj.ModelConfig.tiny().replace(sliding_window=128)
    fresh = Generator(config, random_params(config, seed=5), max_len=400, prefill_chunk=64)
    free = fresh.generate(prompts, max_new_tokens=8, sampling=GREEDY)
    stop = free[0].output_ids[1]  # the first sequence stops after 2 tokens, the others run on
    results = fresh.generate(prompts, max_new_tokens=8, sampling=GREEDY, stop_tokens=[stop])
    t = [r.timings for r in results]
    assert free[0].timings["compile_s"] > 0 and t[0]["compile_s"] == 0.0  # the first call compiled, not this one
    assert [x["prompt_tokens"] for x in t] == [3, 130, 250]
    assert [x["new_tokens"] for x in t] == [len(r.output_ids) for r in results]
    assert t[0]["new_tokens"] == 2 and t[0]["decode_s"] < max(x["decode_s"] for x in t[1:])
    for x in t:
        assert x["prefill_tokens_per_s"] == pytest.approx(x["prompt_tokens"] / x["prefill_s"])
        assert x["decode_tokens_per_s"] == pytest.approx((x["new_tokens"] - 1) / x["decode_s"])
        assert x["time_to_first_token_s"] >= x["prefill_s"] > 0
    batch = batch_timings(results)  # the whole batch: every decoded token over the longest decode
    assert batch["prompt_tokens"] == 383 and batch["decode_tokens"] == sum(x["new_tokens"] - 1 for x in t)
    assert batch["decode_s"] == max(x["decode_s"] for x in t)
    assert batch["decode_tokens_per_s"] == pytest.approx(batch["decode_tokens"] / batch["decode_s"])
    longest = max(t, key=lambda x: x["decode_s"])  # the batch's decode time: more tokens in it than its own
    assert batch["decode_tokens_per_s"] > longest["decode_tokens_per_s"]
