"""Speculative decoding in `Generator` (gptoss_jax/decoding/): with any draft, greedy tokens are those of
decoding one token a step; a step keeps nothing of the drafts it rejects in the cache."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TWO_LAYERS
from gptoss_jax.model.cache import init_cache
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.model.transformer import extend
from gptoss_jax.sampling import Sampling
from gptoss_jax.decoding.checked import check_draft
from gptoss_jax.drafts.base import DeviceDraft, DraftContext, Proposal
from gptoss_jax.drafts.prompt_lookup import PromptLookup
from gptoss_jax.testing import random_params

GREEDY = Sampling(temperature=0)
NEW = 40


@pytest.fixture(scope="module")
def gen():
    config = TWO_LAYERS  # a sliding window of 16: replies run far past it
    return Generator(config, random_params(config, seed=5, dtype=jnp.float32), max_len=256, prefill_chunk=64)


@pytest.fixture(scope="module")
def prompts(gen):
    rng = np.random.default_rng(7)
    looped = rng.integers(0, gen.config.vocab_size, 12).tolist() * 4  # prompt lookup finds matches here
    return [rng.integers(0, gen.config.vocab_size, n).tolist() for n in (3, 40)] + [looped]


@pytest.fixture(scope="module")
def plain(gen, prompts):
    """The greedy replies decoded one token a step, with no draft."""
    return [r.output_ids for r in gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY)]


def oracle(prompts, replies, wrong_every: int = 0, vocab: int = 1024):
    """A draft proposing each sequence's own greedy reply; with `wrong_every` n, every n-th proposed
    position (counted over the reply) is replaced by another token."""
    def draft(context, k):
        for prompt, reply in zip(prompts, replies):
            full = prompt + reply
            if full[:len(context)] == list(context):
                start = len(context)
                out = full[start:start + k]
                return [(t + 1) % vocab if wrong_every and (start + i) % wrong_every == 0 else t
                        for i, t in enumerate(out)]
        raise AssertionError("the context is no prompt's greedy reply so far")
    return draft


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4, 15])
def test_a_draft_always_right_is_all_accepted_and_changes_no_token(gen, prompts, plain, k):
    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=oracle(prompts, plain), draft_tokens=k)
    assert [r.output_ids for r in results] == plain
    for r in results:
        # Each step drafts up to k and keeps them all: the reply takes ceil((NEW - 1) / (k + 1)) steps.
        assert r.timings["accepted_tokens"] == r.timings["drafted_tokens"] == NEW - 1 - -(-(NEW - 1) // (k + 1))


def test_a_draft_always_wrong_is_never_accepted_and_changes_no_token(gen, prompts, plain):
    def wrong(context, k):  # whatever the reply holds next, another token
        return [(t + 1) % gen.config.vocab_size for t in oracle(prompts, plain)(context, k)]

    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=wrong, draft_tokens=4)
    assert [r.output_ids for r in results] == plain
    assert all(r.timings["accepted_tokens"] == 0 < r.timings["drafted_tokens"] for r in results)


@pytest.mark.slow
@pytest.mark.parametrize("wrong_every", [2, 3, 5])
def test_drafts_partly_right_change_no_token(gen, prompts, plain, wrong_every):
    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY,
                           draft=oracle(prompts, plain, wrong_every), draft_tokens=6)
    assert [r.output_ids for r in results] == plain
    for r in results:
        assert 0 < r.timings["accepted_tokens"] < r.timings["drafted_tokens"]


@pytest.mark.slow
def test_prompt_lookup_changes_no_token_and_stop_tokens_still_stop(gen, prompts, plain):
    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=PromptLookup(), draft_tokens=4)
    assert [r.output_ids for r in results] == plain
    assert sum(r.timings["drafted_tokens"] for r in results) > 0
    stop = plain[2][10]
    stopped = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, stop_tokens=[stop],
                           draft=oracle(prompts, plain), draft_tokens=8)
    assert stopped[2].output_ids == plain[2][:plain[2].index(stop) + 1] and stopped[2].finish_reason == "stop"
    # Drafts accepted past the stop token are not counted: only kept tokens are.
    assert stopped[2].timings["accepted_tokens"] <= len(stopped[2].output_ids) - 1


@dataclasses.dataclass(frozen=True)
class Replies(DeviceDraft):
    """A draft proposing what follows in each sequence's `full` (its prompt and greedy reply) at the
    context's length, every `wrong_every`-th position (counted over `full`) replaced by another
    token; on the host (called) and on the devices (`propose`) alike."""

    full: tuple  # of tuples
    prompt_lengths: tuple
    wrong_every: int = 0
    vocab: int = 1024

    def __call__(self, context, k):
        b = next(b for b, (f, n) in enumerate(zip(self.full, self.prompt_lengths)) if list(f[:n]) == context[:n])
        start = len(context)
        return [(t + 1) % self.vocab if self.wrong_every and (start + i) % self.wrong_every == 0 else t
                for i, t in enumerate(self.full[b][start:start + k])]

    def propose(self, context, k):
        lengths = context.lengths
        width = max(map(len, self.full))
        full = jnp.asarray([list(f) + [0] * (width - len(f)) for f in self.full], jnp.int32)
        at = lengths[:, None] + jnp.arange(k)[None]
        drafts = jnp.take_along_axis(full, jnp.clip(at, 0, width - 1), axis=1)
        if self.wrong_every:
            drafts = jnp.where(at % self.wrong_every == 0, (drafts + 1) % self.vocab, drafts)
        return Proposal(drafts, jnp.clip(jnp.asarray([len(f) for f in self.full]) - lengths, 0, k))


@dataclasses.dataclass(frozen=True)
class Silent(DeviceDraft):
    """A draft that never proposes anything: every step on the devices is a decode step (one position)."""

    def __call__(self, context, k):
        return []

    def propose(self, context, k):
        B = context.history.shape[0]
        return Proposal(jnp.zeros((B, k), jnp.int32), jnp.zeros((B,), jnp.int32))


def replies(prompts, plain, wrong_every=0):
    return Replies(tuple(tuple(p + r) for p, r in zip(prompts, plain)), tuple(map(len, prompts)), wrong_every)


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 4])
def test_drafts_made_on_the_devices_are_all_accepted_and_stop_tokens_stop(gen, prompts, plain, k):
    draft = replies(prompts, plain)
    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=draft, draft_tokens=k)
    assert [r.output_ids for r in results] == plain
    for r in results:
        assert r.timings["accepted_tokens"] == r.timings["drafted_tokens"] == NEW - 1 - -(-(NEW - 1) // (k + 1))
    stop = plain[2][10]
    assert plain[2].index(stop) == 10  # (the step count below assumes it)
    stopped = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, stop_tokens=[stop], draft=draft,
                           draft_tokens=8)
    assert [r.output_ids for r in stopped] == [r[:r.index(stop) + 1] if stop in r else r for r in plain]
    assert stopped[2].finish_reason == "stop"
    # Steps of 9 tokens: the stop token (the 11th) ends the second step, which kept only its drafts.
    assert stopped[2].timings["accepted_tokens"] == len(stopped[2].output_ids) - 1 - 1


def test_sources_that_share_a_program_each_draft_their_own_tokens(gen, prompts, plain):
    """Two testing.KnownReplies of the same shapes are equal (one compiled program for both), and the
    command line's loop on the devices gives each source's arrays to that program: the one always
    right has every draft accepted, the one always wrong none, and both give the greedy tokens."""
    from gptoss_jax.testing import KnownReplies

    right, wrong = (KnownReplies(prompts, plain, gen.config.vocab_size, n) for n in (0, 1))
    assert right == wrong and hash(right) == hash(wrong)
    for draft, all_accepted in ((right, True), (wrong, False), (right, True)):
        results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=draft, draft_tokens=4)
        assert [r.output_ids for r in results] == plain
        for r in results:
            want = r.timings["drafted_tokens"] if all_accepted else 0
            assert r.timings["drafted_tokens"] > 0 and r.timings["accepted_tokens"] == want


class OutOfVocabulary(Replies):
    """`Replies`, with an id outside the vocabulary at every third position (-1 or the vocabulary's size)."""

    def propose(self, context, k):
        drafts, counts, _ = super().propose(context, k)
        at = context.lengths[:, None] + jnp.arange(k)[None]
        return Proposal(jnp.where(at % 3 == 0, jnp.where(at % 2 == 0, -1, self.vocab), drafts), counts)


@pytest.mark.slow
def test_drafts_made_on_the_devices_are_cut_at_an_id_outside_the_vocabulary(gen, prompts, plain):
    draft = OutOfVocabulary(replies(prompts, plain).full, tuple(map(len, prompts)))
    results = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=draft, draft_tokens=4)
    assert [r.output_ids for r in results] == plain
    for r in results:  # what came before each bad id was proposed, and right
        assert 0 < r.timings["accepted_tokens"] == r.timings["drafted_tokens"] < NEW - 1 - -(-(NEW - 1) // 5)


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0, top_k=1), Sampling(temperature=1.0)],
                         ids=["greedy", "sampled-top-k-1", "sampled"])
def test_the_loop_on_the_devices_gives_what_the_host_loop_gives(gen, prompts, plain, sampling):
    """Drafts made on the devices (several checked steps a call) against the same drafts made on the
    host (a step a call): the same tokens, drafts and acceptances, with a stop token, and a budget
    that ends inside a step; with no draft at all (a step with none is a one-position decode step on
    the devices, k + 1 positions with nothing valid on the host), the same too. Sampled, the same draws (each step's key); with top-k 1 the greedy
    reply's drafts are accepted by the sampling rule (sampled at 1.0 a reply leaves the greedy one
    at once, and the drafts with it)."""
    for draft in (replies(prompts, plain, wrong_every=3), PromptLookup(), Silent()):
        on_host = lambda context, k, draft=draft: draft(context, k)  # noqa: E731  (no `propose`)
        runs = [gen.generate(prompts, max_new_tokens=NEW - 3, sampling=sampling, seed=3, draft=d, draft_tokens=4,
                             stop_tokens=[plain[1][20]]) for d in (draft, on_host)]
        got = [[(r.output_ids, r.finish_reason, r.timings["drafted_tokens"], r.timings["accepted_tokens"])
                for r in run] for run in runs]
        assert got[0] == got[1]
        assert (sum(r.timings["drafted_tokens"] for r in runs[0]) > 0) == (not isinstance(draft, Silent))
        if sampling == GREEDY:
            assert [r.output_ids for r in runs[0]] == [p[:len(r.output_ids)] for p, r in zip(plain, runs[0])]
        if isinstance(draft, Replies) and (sampling.temperature == 0 or sampling.top_k == 1):
            assert sum(r.timings["accepted_tokens"] for r in runs[0]) > 0


def test_prompt_lookup_on_the_devices_proposes_as_on_the_host():
    rng = np.random.default_rng(0)
    for look in (PromptLookup(), PromptLookup(max_n=2, min_n=2), PromptLookup(max_n=4, min_n=1)):
        for k in (1, 3, 6):
            contexts = [rng.integers(0, 4, n).tolist() for n in (1, 2, 3, 5, 9, 17, 30)]
            history = np.zeros((len(contexts), 32), np.int32)
            for b, c in enumerate(contexts):
                history[b, :len(c)] = c
                drafts, counts, _ = look.propose(DraftContext(jnp.asarray(history),
                                                              jnp.asarray([len(c) for c in contexts])), k)
            got = [d[:n].tolist() for d, n in zip(np.asarray(drafts), np.asarray(counts))]
            assert got == [look(c, k) for c in contexts], (look, k)


def test_prompt_lookup_matches_a_plain_search():
    """The host's lookup (one pass for the last token's recurrences, then narrowed n by n) against the
    plain search: each n from the longest, each earlier start from the latest."""
    def plain(look, context, k):
        for n in range(min(look.max_n, len(context) - 1), look.min_n - 1, -1):
            for j in range(len(context) - 1 - n, -1, -1):
                if context[j:j + n] == context[-n:]:
                    return context[j + n:j + n + k]
        return []

    rng = np.random.default_rng(1)
    for look in (PromptLookup(), PromptLookup(max_n=2, min_n=2), PromptLookup(max_n=5, min_n=1)):
        for _ in range(500):
            context = rng.integers(0, rng.integers(1, 6), rng.integers(1, 40)).tolist()
            k = int(rng.integers(1, 6))
            assert look(context, k) == plain(look, context, k), (look, context, k)


def test_prompt_lookup_proposes_what_followed_the_longest_match():
    look = PromptLookup(max_n=3)
    assert look([1, 2, 3, 4, 5, 9, 2, 3], 2) == [4, 5]  # "2 3" matched; "9 2 3" did not occur before
    assert look([7, 2, 3, 8, 1, 2, 3, 4, 9, 2, 3], 3) == [4, 9, 2]  # the latest of two matches
    assert look([5, 6, 7, 5, 6], 4) == [7, 5, 6]  # up to what the context holds
    assert look([1, 2, 3], 4) == [] and look([4], 4) == [] and look([], 4) == []
    with pytest.raises(ValueError, match="min_n"):
        PromptLookup(max_n=1, min_n=2)


@pytest.mark.slow
def test_a_checked_step_keeps_nothing_of_the_rejected_drafts(gen):
    """The cache after a step that accepts 2 of 5 drafted tokens is, bit for bit, the cache of
    writing the last token and those 2 alone in a step of the same shape: the full layers' rejected
    positions zero, the ring slots they overwrote (the prompt is longer than the window) restored."""
    config, params = gen.config, gen.params
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 40).tolist()

    def prefilled():
        logits, cache = extend(config, params, np.array([prompt]), init_cache(config, 1, 64, jnp.float32))
        return int(np.asarray(logits)[0, -1].argmax()), cache

    last, cache = prefilled()
    reply = gen.generate([prompt], max_new_tokens=4, sampling=GREEDY)[0].output_ids
    assert reply[0] == last
    proposed = [reply[1], reply[2], (reply[3] + 1) % config.vocab_size, 5, 6]
    accepted, nxt, checked = check_draft(config, cache, np.array([[last] + proposed]), np.ones((1, 6), bool),
                                         params, kernels=gen.kernels)
    assert int(accepted[0]) == 2 and int(nxt[0]) == reply[3]
    _, cache = prefilled()
    _, expected = extend(config, params, np.array([[last, reply[1], reply[2], 0, 0, 0]]), cache,
                         np.array([[True] * 3 + [False] * 3]))
    assert int(checked["lengths"][0]) == int(expected["lengths"][0]) == len(prompt) + 3
    for name in expected:
        if name != "lengths":
            for x in ("k", "v"):
                np.testing.assert_array_equal(np.asarray(checked[name][x]), np.asarray(expected[name][x]),
                                              err_msg=f"{name}.{x}")


@pytest.mark.slow
def test_sampled_speculation_is_seeded_and_with_top_k_1_is_greedy(gen, prompts, plain):
    """Sampling through the speculative rule: with top-k 1 the target is the argmax, so the tokens are
    the greedy ones whatever the draft; otherwise a seed gives the same tokens again, another seed others."""
    one = Sampling(temperature=0.7, top_k=1)
    for draft in (oracle(prompts, plain, wrong_every=3), PromptLookup()):
        results = gen.generate(prompts, max_new_tokens=NEW, sampling=one, draft=draft, draft_tokens=4)
        greedy = gen.generate(prompts, max_new_tokens=NEW, sampling=GREEDY, draft=draft, draft_tokens=4)
        assert [r.output_ids for r in results] == plain
        # and the same drafts accepted as greedily
        assert [r.timings["accepted_tokens"] for r in results] == [r.timings["accepted_tokens"] for r in greedy]
    warm = Sampling(temperature=1.0)
    runs = [[r.output_ids for r in gen.generate(prompts, max_new_tokens=16, sampling=warm, seed=seed,
                                                draft=PromptLookup(), draft_tokens=4)] for seed in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]


def test_bad_speculation_settings_are_refused(gen, prompts):
    with pytest.raises(ValueError, match=r"\[1, 15\]"):
        gen.generate(prompts, max_new_tokens=4, sampling=GREEDY, draft=PromptLookup(), draft_tokens=16)
    with pytest.raises(ValueError, match="outside"):
        gen.generate(prompts, max_new_tokens=4, sampling=GREEDY, draft=lambda context, k: [10**6])


@pytest.mark.parametrize("drawn", [True, False], ids=["drafts-drawn-from-q", "drafts-certain"])
def test_speculative_sampling_draws_the_targets_distribution(drawn):
    """Over 300,000 steps of up to two drafted tokens on a vocabulary of 6 (a third of the steps with
    one draft only), each token a step gives is distributed as the target's at its position: the
    first; the second, where the first draft was accepted (the second draft's fate, or the token
    after a lone accepted draft); the third, after two accepted drafts. Chi-square p-values above
    1e-4 (fixed seeds). Drafts are drawn from a distribution q unlike the target's, or (prompt
    lookup's case) proposed with certainty."""
    from scipy.stats import chisquare

    from gptoss_jax.decoding.acceptance import accept_sampled

    N, V, k = 300_000, 6, 2
    rng = np.random.default_rng(0)
    target = rng.dirichlet(np.ones(V), size=k + 1)  # [T, V]
    q = rng.dirichlet(np.ones(V), size=k)  # [k, V]
    drafted = np.stack([rng.choice(V, N, p=q[i]) for i in range(k)], axis=1)  # [N, k]
    valid = np.ones((N, k), bool)
    valid[: N // 3, 1] = False  # one draft only (its second column is padding)
    accepted, nxt = accept_sampled(jax.random.key(1), jnp.broadcast_to(jnp.asarray(target, jnp.float32), (N, k + 1, V)),
                                   jnp.asarray(drafted), jnp.asarray(valid),
                                   jnp.broadcast_to(jnp.asarray(q, jnp.float32), (N, k, V)) if drawn else None)
    accepted, nxt = np.asarray(accepted), np.asarray(nxt)
    assert accepted.max() == 2 and accepted[: N // 3].max() == 1
    given = np.concatenate([drafted, nxt[:, None]], axis=1)  # the step's tokens: accepted drafts, then nxt
    tokens = np.where(np.arange(k + 1)[None] < accepted[:, None], given[:, :k + 1], nxt[:, None])
    for position, rows in ((0, np.ones(N, bool)), (1, accepted >= 1), (2, accepted >= 2)):
        counts = np.bincount(tokens[rows, position], minlength=V)
        assert chisquare(counts, rows.sum() * target[position]).pvalue > 1e-4, (position, counts / rows.sum())
