"""Speculative decoding in the serving engine (gptoss_jax/serving/speculation.py): greedy requests
give the tokens each gives alone whether the drafts are right, partly right or always wrong, several
sharing each checked step and more than the slots waiting; prompt lookup drafts from a repetitive
prompt; sampled rows draw from the distribution `sample_rows` draws from; nothing compiles after
warm-up with speculation on.

The model is the tiny config with two layers (conftest.TWO_LAYERS: a 16-token window, then full
attention) in float32; replies run past the window.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import compile_events
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.sampling import Sampling, filtered, probabilities as row_probabilities, rows_mode
from gptoss_jax.serving import Engine, EngineConfig, Settings
from gptoss_jax.serving.request import Request
from gptoss_jax.serving.scheduler import Seq
from gptoss_jax.decoding.acceptance import MOST_WAIT, accept_rows, backoff
from gptoss_jax.drafts.base import DeviceDraft, Proposal
from gptoss_jax.serving.speculation import Speculation
from gptoss_jax.drafts.prompt_lookup import PromptLookup
from gptoss_jax.testing import KnownReplies

MAX_LEN = 512  # the engine and Generator as tests/test_serving.py has them: their steps compile once
GREEDY = Sampling(temperature=0.0)


@pytest.fixture(scope="module")
def traffic_prompts(two_layers_f32):
    """7 prompts, one repeating four tokens."""
    rng = np.random.default_rng(3)
    return [rng.integers(0, two_layers_f32[0].vocab_size, n).tolist() for n in (5, 40, 17, 90, 3, 60)] + [[11, 12, 13, 14] * 10]


@pytest.fixture(scope="module")
def traffic(two_layers_f32, traffic_prompts):
    """`traffic_prompts` and the greedy tokens `Generator` gives each alone, 20 to 40 of them (the
    fixture takes about half a minute of a 2-core machine: the fast tier's tests do without it)."""
    config, params = two_layers_f32
    prompts = traffic_prompts
    budgets = [30, 25, 40, 20, 35, 30, 30]
    generator = Generator(config, params, max_len=MAX_LEN)
    want = [generator.generate([p], max_new_tokens=m, sampling=GREEDY)[0].output_ids for p, m in zip(prompts, budgets)]
    return prompts, budgets, want


def Oracle(prompts, want, vocab: int, wrong_every: int = 0, where: str = "host"):
    """Drafts the reply each prompt gives alone (testing.KnownReplies); with `wrong_every` n, every n-th
    drafted token (by its position in the reply) is off by one. where: "host" (drafts read from the
    host each step, speculation.py) or "devices" (several checked steps a call, decoding/checked.py)."""
    known = KnownReplies(prompts, want, vocab, wrong_every)
    return on_host(known) if where == "host" else known


def on_host(draft):
    """The draft source without its `propose`: the engine drafts with it on the host."""
    return lambda context, k: draft(context, k)


def engine_with(model, draft, **kw):
    """The tests' engine; a draft source with `propose` drafts on the devices (speculate_steps 4), one
    without on the host."""
    config, params = model
    kw.setdefault("speculate_steps", 4)
    return Engine(config, params, EngineConfig(slots=8, max_len=MAX_LEN, prefill_chunk=64, page_size=16,
                                               decode_sizes=(2, 8), **kw), draft=draft)


def speculation_of(draft, k: int, rows: int, sizes: list[int], steps: int = 0) -> Speculation:
    """An engine's Speculation alone: k drafted tokens, at most `rows` rows, these decode sizes."""
    return Speculation(draft, EngineConfig(draft_tokens=k, speculate_rows=rows, prefill_chunk=64,
                                           speculate_steps=steps), sizes)


def run(engine, prompts, settings):
    requests = [engine.submit(p, s) for p, s in zip(prompts, settings)]
    engine.run_until_idle()
    assert all(r.finish_reason == "length" for r in requests), [r.finish_reason for r in requests]
    return [r.output_ids for r in requests]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["devices", "host"])
def test_nothing_compiles_after_warm_up(two_layers_f32, where):
    """Greedy and sampled requests, some with log-probabilities or a logit bias (not speculated), one to
    eight decoding at once, drafts found and not, drafted on the devices and on the host: no compile
    event after warm_up. (First: the steps it compiles serve the tests below.) Every other prompt
    holds 480 distinct tokens, nearly half the vocabulary: whatever token the model picks, prompt
    lookup finds it there about half the time, so drafts are found whatever the model."""
    config, _ = two_layers_f32
    engine = engine_with(two_layers_f32, PromptLookup() if where == "devices" else on_host(PromptLookup()))
    engine.warm_up()
    rng = np.random.default_rng(1)
    with compile_events() as compiles:
        for i in range(24):
            sampling = [GREEDY, Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=20, top_p=0.9)][i % 3]
            prompt = rng.permutation(config.vocab_size)[:480].tolist() if i % 2 else rng.integers(
                0, config.vocab_size, int(rng.integers(1, 60))).tolist()
            engine.submit(prompt, Settings(max_new_tokens=int(rng.integers(1, 25)), sampling=sampling, seed=i,
                                           logprobs=0 if i % 5 == 0 else None,
                                           logit_bias=((3, 1.0),) if i % 7 == 0 else ()))
            if i % 4 == 3:
                engine.run_until_idle()
        engine.run_until_idle()
    assert compiles == []
    assert engine.stats()["speculative_steps"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "devices"])
@pytest.mark.parametrize("wrong_every, k", [(0, 3), (0, 1), (2, 3), (3, 3), (1, 3)])
def test_greedy_tokens_are_each_requests_alone_whatever_the_drafts(two_layers_f32, traffic, wrong_every, k, where):
    """Drafts always right (every draft accepted), partly right, always wrong (none accepted), drafted on
    the host or on the devices: the tokens are those of each request alone, 7 requests at once, then 2
    (decode sizes 8 and 2)."""
    prompts, budgets, want = traffic
    engine = engine_with(two_layers_f32, Oracle(prompts, want, two_layers_f32[0].vocab_size, wrong_every, where), draft_tokens=k)
    got = run(engine, prompts, [Settings(max_new_tokens=m, sampling=GREEDY) for m in budgets])
    assert got == want
    stats = engine.stats()
    assert stats["speculative_steps"] > 0 and stats["draft_tokens"] > 0
    if wrong_every == 0:
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]
        assert stats["speculative_steps"] < sum(budgets) / 2  # several tokens a step
    elif wrong_every == 1:
        assert stats["accepted_draft_tokens"] == 0
    else:
        assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "devices"])
def test_on_a_mesh_speculation_gives_one_device_tokens(two_layers_f32, traffic, where):
    """Sequences over `data`, experts over `expert`, heads over `tensor` (8 CPU devices), drafts right
    but for every 3rd token, on the host or the devices: each request's tokens alone, drafts accepted
    and rejected."""
    import gptoss_jax as gj
    from gptoss_jax.params import param_shardings

    prompts, budgets, want = traffic
    config, params = two_layers_f32
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    engine = engine_with((config, jax.device_put(params, param_shardings(config, mesh))),
                         Oracle(prompts, want, config.vocab_size, 3, where))
    assert engine.mesh is mesh
    engine.warm_up()
    with compile_events() as compiles:
        assert run(engine, prompts, [Settings(max_new_tokens=m, sampling=GREEDY) for m in budgets]) == want
    assert compiles == []  # the steps keep their layouts on the mesh, call after call
    assert 0 < engine.stats()["accepted_draft_tokens"] < engine.stats()["draft_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "devices"])
def test_prompt_lookup_and_stops(two_layers_f32, traffic, where):
    """Prompt lookup drafts from the repetitive prompt; a stop token ends a reply at it even where it
    was accepted inside a draft (the tokens after it are dropped), or, drafted on the devices, where
    the call ran on past it."""
    prompts, budgets, want = traffic
    config, params = two_layers_f32
    engine = engine_with(two_layers_f32, PromptLookup() if where == "devices" else on_host(PromptLookup()))
    assert run(engine, prompts, [Settings(max_new_tokens=m, sampling=GREEDY) for m in budgets]) == want
    assert engine.stats()["draft_tokens"] > 0
    oracle = engine_with(two_layers_f32, Oracle(prompts, want, config.vocab_size, where=where), draft_tokens=5)
    stop = want[0][12]
    request = oracle.submit(prompts[0], Settings(max_new_tokens=budgets[0], sampling=GREEDY, stop_ids=(stop,)))
    oracle.run_until_idle()
    assert request.finish_reason == "stop" and request.output_ids == want[0][:want[0].index(stop) + 1]
    assert oracle.stats()["pages_in_use"] == 0


@pytest.mark.slow
def test_rows_past_the_bound_decode_one_token_a_step(two_layers_f32, traffic):
    """With more decoding sequences than speculate_rows, or one asking for log-probabilities, the
    steps do not speculate; the tokens are the same."""
    prompts, budgets, want = traffic
    engine = engine_with(two_layers_f32, Oracle(prompts, want, two_layers_f32[0].vocab_size), speculate_rows=1)
    assert run(engine, prompts[:4], [Settings(max_new_tokens=60, sampling=GREEDY)] * 4)[0][:budgets[0]] == want[0]
    assert engine.stats()["speculative_steps"] < 60 * 4 / 2
    engine = engine_with(two_layers_f32, Oracle(prompts, want, two_layers_f32[0].vocab_size))
    settings = [Settings(max_new_tokens=m, sampling=GREEDY, logprobs=0 if i == 0 else None) for i, m in
                enumerate(budgets[:2])]
    assert run(engine, prompts[:2], settings) == want[:2]
    assert engine.stats()["speculative_steps"] <= budgets[0] - budgets[1] + 1  # once the first has ended


def _filtered_by_hand(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The probabilities one row draws from, written out in numpy from the filters' definitions
    (sampling.py): temperature, then top-k, min-p, top-p, each over the tokens the one before kept."""
    x = logits.astype(np.float64) / s.temperature
    keep = np.ones(x.shape, bool)
    if s.top_k:
        keep &= x >= np.sort(x)[::-1][s.top_k - 1]
    p = np.where(keep, np.exp(x - x.max()), 0)
    p /= p.sum()
    if s.min_p:
        keep &= p >= s.min_p * p.max()
    p = np.where(keep, p, 0)
    p /= p.sum()
    if s.top_p < 1:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # the mass of the more likely tokens
        keep[order[before >= s.top_p]] = False
    p = np.where(keep, p, 0)
    return p / p.sum()


@pytest.mark.slow
def test_sampled_rows_draw_from_sample_rows_distribution():
    """row_probabilities, by row, equal the filters written out by hand for each row's own settings
    (what `sample` and `sample_rows` draw from), and a greedy row's are 1 at its argmax."""
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)) * 3, jnp.float32)
    rows = [Sampling(temperature=0.7), Sampling(temperature=1.0, top_k=5), Sampling(temperature=1.3, top_p=0.8),
            Sampling(temperature=0.9, min_p=0.1), Sampling(temperature=1.0, top_k=7, top_p=0.9, min_p=0.05), GREEDY]
    arrays = [jnp.asarray([getattr(s, f) for s in rows], dtype) for f, dtype in
              (("temperature", jnp.float32), ("top_k", jnp.int32), ("top_p", jnp.float32), ("min_p", jnp.float32))]
    got = row_probabilities(logits, *arrays, mode=rows_mode(rows))
    for i, s in enumerate(rows[:-1]):
        np.testing.assert_allclose(got[i], _filtered_by_hand(np.asarray(logits[i]), s), rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got[i], jax.nn.softmax(filtered(logits[i:i + 1], s))[0], rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[-1], jax.nn.one_hot(jnp.argmax(logits[-1]), 50))


@pytest.mark.slow
def test_each_rows_key_draws_the_targets_distribution():
    """accept_rows over 100,000 rows of distinct seeds, one target and certain drafts of two tokens on a
    vocabulary of 6: the first token and the second (where the first draft was accepted) follow the
    target at their positions (chi-square p-values above 1e-4, fixed seeds), and a row's seed and
    step give it the same tokens again. (Rows drawing with one key would give every row one token.)"""
    from scipy.stats import chisquare

    N, V, k = 100_000, 6, 2
    rng = np.random.default_rng(1)
    target = rng.dirichlet(np.ones(V), size=k + 1)
    drafted = jnp.asarray(np.broadcast_to(rng.choice(V, k), (N, k)))
    seeds, steps = jnp.arange(N, dtype=jnp.int32), jnp.full(N, 5, jnp.int32)
    probs = jnp.broadcast_to(jnp.asarray(target, jnp.float32), (N, k + 1, V))
    accepted, nxt = (np.asarray(x) for x in accept_rows(seeds, steps, probs, drafted, jnp.ones((N, k), bool)))
    first = np.where(accepted >= 1, np.asarray(drafted)[:, 0], nxt)
    second = np.where(accepted >= 2, np.asarray(drafted)[:, 1], nxt)[accepted >= 1]
    for tokens, p in ((first, target[0]), (second, target[1])):
        assert chisquare(np.bincount(tokens, minlength=V), len(tokens) * p).pvalue > 1e-4
    again = accept_rows(seeds[:50], steps[:50], probs[:50], drafted[:50], jnp.ones((50, k), bool))
    np.testing.assert_array_equal(np.asarray(again[1]), nxt[:50])


@pytest.mark.parametrize("drafts", ["none", "always wrong", "always right", "wrong, then right"])
def test_steps_wait_for_tokens_only_where_drafts_pay(two_layers_f32, traffic_prompts, drafts):
    """A step that drafts reads the step before's tokens first (its pipelining given up): with drafts
    never found or never accepted, three sequences draft at most once in MOST_WAIT steps once backed
    off, together; with drafts always right, every step drafts; drafts that turn right after 20
    tokens make the sequence draft every step again. The tokens stay each request's alone."""
    prompts = traffic_prompts
    config, params = two_layers_f32
    new, chosen = 80, [prompts[i] for i in ((1, 3, 5) if drafts == "none" else (1,))]
    generator = Generator(config, params, max_len=MAX_LEN)
    want = [generator.generate([p], max_new_tokens=new, sampling=GREEDY)[0].output_ids for p in chosen]
    wrong, right = (Oracle(chosen, want, config.vocab_size, n) for n in (1, 0))
    source = {"none": lambda context, k: [], "always wrong": wrong, "always right": right,
              "wrong, then right": lambda c, k: (wrong if len(c) - len(chosen[0]) < 20 else right)(c, k)}[drafts]
    engine = engine_with(two_layers_f32, source)
    assert run(engine, chosen, [Settings(max_new_tokens=new, sampling=GREEDY)] * len(chosen)) == want
    stats = engine.stats()
    if drafts == "always right":  # (a last step may leave no room for a draft: not checked)
        assert stats["speculative_steps"] <= stats["drafting_steps"] <= stats["speculative_steps"] + 1
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"] >= new / 2
    elif drafts == "wrong, then right":  # back to every step within MOST_WAIT steps of the turn
        assert stats["accepted_draft_tokens"] >= (new - 20 - MOST_WAIT) * 3 / 4
    else:  # drafting after at most 1, 2, 4, 8 steps, then every 16 (MOST_WAIT), the sequences together
        assert stats["accepted_draft_tokens"] == 0
        assert 0 < stats["drafting_steps"] <= 5 + new // MOST_WAIT


class Steered(DeviceDraft):
    """Drafts on the devices from `wrong` until a row's context reaches `turn` tokens, then from `right`
    (two testing.KnownReplies); `cut`: the second drafted token of each draft replaced by an id outside
    the vocabulary. Its turn and cut are arrays (`arrays()`), as the two sources': every Steered of the
    same shapes shares its compiled steps."""

    def __init__(self, wrong, right, turn: int, cut: bool = False):
        self.wrong, self.right, self.vocab = wrong, right, right.vocab
        self._arrays = {"wrong": wrong.arrays(), "right": right.arrays(), "turn": np.int32(turn), "cut": np.bool_(cut)}

    def __hash__(self):
        return hash((Steered, self.wrong, self.right))

    def __eq__(self, other):
        return isinstance(other, Steered) and (self.wrong, self.right) == (other.wrong, other.right)

    def arrays(self):
        return self._arrays

    def propose(self, context, k):
        arrays, lengths = context.arrays, context.lengths
        w, nw, _ = self.wrong.propose(context._replace(arrays=arrays["wrong"]), k)
        r, nr, _ = self.right.propose(context._replace(arrays=arrays["right"]), k)
        late = lengths >= arrays["turn"]
        drafts, n = jnp.where(late[:, None], r, w), jnp.where(late, nr, nw)
        return Proposal(drafts.at[:, 1].set(jnp.where(arrays["cut"], self.vocab, drafts[:, 1])), n)


@pytest.mark.slow
def test_on_the_devices_a_call_runs_several_steps_and_backs_off(two_layers_f32, traffic):
    """Drafted on the devices, a call runs up to speculate_steps checked steps (so the engine steps are
    fewer than the checked ones); a sequence whose drafts are all rejected drafts after 1, 2, 4, 8, then
    every MOST_WAIT steps, and every step again once they are accepted; a draft is cut at its first id
    outside the vocabulary. The tokens stay the request's alone."""
    prompts, _, _ = traffic
    config, params = two_layers_f32
    new, prompt = 80, prompts[1]
    want = Generator(config, params, max_len=MAX_LEN).generate([prompt], max_new_tokens=new,
                                                               sampling=GREEDY)[0].output_ids
    wrong, right = (KnownReplies([prompt], [want], config.vocab_size, n) for n in (1, 0))

    def serve(draft, steps):
        engine = engine_with(two_layers_f32, draft, speculate_steps=steps)
        request = engine.submit(prompt, Settings(max_new_tokens=new, sampling=GREEDY))
        calls = 0
        while engine.step():
            calls += 1
        assert request.output_ids == want
        return calls, engine.stats()

    calls, stats = serve(right, 4)
    assert stats["accepted_draft_tokens"] == stats["draft_tokens"] >= new * 3 / 4 - 3
    assert calls < stats["drafting_steps"] / 2, (calls, stats)
    calls_one, stats_one = serve(right, 1)
    assert calls_one >= stats_one["drafting_steps"] > 0  # one checked step a call
    _, stats = serve(wrong, 4)  # drafting steps about 1, 2, 4, 8, 16, 32, 48, 64, 80: 3 tokens each at most
    assert stats["accepted_draft_tokens"] == 0 and 0 < stats["draft_tokens"] <= 3 * (5 + new // MOST_WAIT)
    assert 0 < stats["speculative_steps"] <= 5 + new // MOST_WAIT
    assert stats["drafting_steps"] <= 5 + new // MOST_WAIT  # a call ends once no row is due: decoded as usual
    _, stats = serve(Steered(wrong, right, len(prompt) + 20), 4)
    assert stats["accepted_draft_tokens"] >= (new - 20 - MOST_WAIT) * 3 / 4
    _, stats = serve(Steered(right, right, 0, cut=True), 4)  # one token a draft, accepted
    assert stats["accepted_draft_tokens"] == stats["draft_tokens"] == stats["speculative_steps"] >= new / 2 - 1


def test_on_the_devices_a_call_runs_only_where_a_sequence_is_due():
    """Drafted on the devices, a step speculates where a sequence is due to draft, and its call may run
    four steps while nothing else waits, one otherwise (room for each step's draft); before the
    sequence is due it decodes as usual (pipelined)."""
    assert not speculation_of(PromptLookup(), 3, 8, [8]).on_devices  # by default drafted on the host
    speculation = speculation_of(PromptLookup(), 3, 8, [8], steps=4)
    assert speculation.on_devices and speculation.most == 4
    request = Request(0, [1], Settings(max_new_tokens=500), None)
    seq = Seq(request, 0, [1], [], {}, length=1, queued=0, draft_due=10)
    assert [speculation.wanted([seq]) for _ in range(10)] == [False] * 9 + [True]  # clocks 1 .. 10
    assert speculation.ahead(seq) == 16
    speculation.clock = 0
    assert [speculation.wanted([seq], alone=False) for _ in range(10)] == [False] * 9 + [True]
    assert speculation.ahead(seq) == 4


@pytest.mark.slow
def test_on_the_devices_a_call_is_queued_before_the_step_befores_tokens_are_read(two_layers_f32, traffic, monkeypatch):
    """Drafted on the devices, a call of checked steps is queued without waiting for the decode step
    before it (the call takes that step's token from the devices): the host reads that step's tokens
    while the call runs. A reply that stops at such a step's token ends there, the call's tokens for
    it dropped and its pages freed, whichever step that is; the tokens stay the request's alone."""
    prompts, _, _ = traffic
    config, params = two_layers_f32
    new, prompt = 40, prompts[1]
    want = Generator(config, params, max_len=MAX_LEN).generate([prompt], max_new_tokens=new,
                                                               sampling=GREEDY)[0].output_ids
    wrong = KnownReplies([prompt], [want], config.vocab_size, 1)  # backs off: decode steps between calls
    events = []
    check_steps, read, step = Speculation._check_steps, Engine._read, Engine.step
    monkeypatch.setattr(Speculation, "_check_steps", lambda self, engine, seqs, steps, given=None: (
        events.append("call") if any(seqs) else None, check_steps(self, engine, seqs, steps, given))[1])
    monkeypatch.setattr(Engine, "_read", lambda self, *a: (events.append("read"), read(self, *a))[0])
    monkeypatch.setattr(Engine, "step", lambda self: (events.append("step"), step(self))[1])
    engine = engine_with(two_layers_f32, wrong)
    assert run(engine, [prompt], [Settings(max_new_tokens=new, sampling=GREEDY)]) == [want]
    assert engine.stats()["speculative_steps"] >= 3
    in_steps = " ".join(events).split("step")
    assert sum(s.split() == ["call", "read"] for s in in_steps) >= 3, in_steps  # (a step: the call, then the read)
    assert not any(s.split() == ["read", "call"] for s in in_steps), in_steps
    firsts = [j for j, t in enumerate(want) if t not in want[:j]]
    for j in firsts[:12]:  # each early step's token as a stop: decode steps and calls alike
        engine = engine_with(two_layers_f32, wrong)
        request = engine.submit(prompt, Settings(max_new_tokens=new, sampling=GREEDY, stop_ids=(want[j],)))
        engine.run_until_idle()
        assert request.finish_reason == "stop" and request.output_ids == want[:j + 1], j
        assert engine.stats()["pages_in_use"] == 0
    # Beside other rows of the same calls, which go on to their own tokens.
    others, budgets, replies = ([x[i] for i in (0, 2)] for x in traffic)
    wrong = KnownReplies([prompt, *others], [want, *replies], config.vocab_size, 1)
    for j in firsts[:4]:
        engine = engine_with(two_layers_f32, wrong)
        stopped = engine.submit(prompt, Settings(max_new_tokens=new, sampling=GREEDY, stop_ids=(want[j],)))
        going = [engine.submit(p, Settings(max_new_tokens=m, sampling=GREEDY)) for p, m in zip(others, budgets)]
        engine.run_until_idle()
        assert stopped.output_ids == want[:j + 1] and [r.output_ids for r in going] == replies, j
        assert engine.stats()["pages_in_use"] == 0


@pytest.mark.slow
def test_a_missing_sequence_waits_2_4_8_then_most_wait_steps_aligned():
    """A sequence's drafting steps after misses: 2, 4, 8, then MOST_WAIT steps apart, each wait ending
    on a multiple of its length (sequences waiting as long come due together); an accepted token makes
    it due the next step."""
    speculation = speculation_of(on_host(PromptLookup()), 3, 8, [8])
    request = Request(0, [1], Settings(max_new_tokens=500), None)
    seq = Seq(request, 0, [1], [], {}, length=1, queued=0)

    def score(accepted):  # what a checked step does to a row that was due (acceptance.backoff, on the host)
        seq.draft_misses, seq.draft_due = (int(x) for x in backoff(np, seq.draft_misses, seq.draft_due, True,
                                                                   accepted, speculation.clock, MOST_WAIT))

    drafted = []
    for _ in range(70):
        if speculation.wanted([seq]):
            drafted.append(speculation.clock)
            score(1 if speculation.clock == 40 else 0)
    assert MOST_WAIT == 16 and drafted[:6] == [1, 2, 4, 8, 16, 32]
    assert drafted[6:] == [48, 64]  # (clock 40 was not due: nothing was scored there)
    assert speculation.ahead(seq) == 1  # not due: a step reserves no room for its draft
    score(1)
    assert seq.draft_due == speculation.clock + 1 and seq.draft_misses == 0
    speculation.wanted([seq])
    assert speculation.ahead(seq) == 4


@pytest.mark.slow
@pytest.mark.parametrize("where", ["host", "devices"])
def test_sampled_speculation(two_layers_f32, traffic, where):
    """top-k 1 sampling accepts what greedy does and gives its tokens; a seeded sampled request repeats
    its tokens."""
    prompts, budgets, want = traffic
    oracle = Oracle(prompts, want, two_layers_f32[0].vocab_size, 3, where)
    engine = engine_with(two_layers_f32, oracle)
    top1 = Sampling(temperature=0.8, top_k=1)
    assert run(engine, prompts[:3], [Settings(max_new_tokens=m, sampling=top1, seed=i) for i, m in
                                     enumerate(budgets[:3])]) == want[:3]
    assert 0 < engine.stats()["accepted_draft_tokens"] < engine.stats()["draft_tokens"]
    sampled = Settings(max_new_tokens=30, sampling=Sampling(temperature=1.0), seed=7)
    lookup = PromptLookup() if where == "devices" else on_host(PromptLookup())
    first, again = (run(engine_with(two_layers_f32, lookup), prompts[-1:], [sampled])[0] for _ in range(2))
    assert first == again


def test_by_default_the_engine_drafts_on_the_host(two_layers_f32):
    """A source that could propose on the devices (prompt lookup) drafts on the host unless
    speculate_steps asks otherwise."""
    config, params = two_layers_f32
    engine = Engine(config, params, EngineConfig(slots=2, max_len=MAX_LEN, prefill_chunk=64, page_size=16),
                    draft=PromptLookup())
    assert not engine.speculation.on_devices and engine.speculation.most == 1
    assert engine_with(two_layers_f32, PromptLookup()).speculation.on_devices  # (the tests' engine: speculate_steps 4)


def test_bad_settings(two_layers_f32):
    for kw in ({"draft_tokens": 0}, {"draft_tokens": 64}, {"speculate_rows": 0}, {"speculate_steps": -1}):
        with pytest.raises(ValueError, match=next(iter(kw))):  # the setting named
            engine_with(two_layers_f32, PromptLookup(), **kw)


def test_checked_sizes_and_drafts_cut_to_the_budget_and_vocabulary():
    """The checked steps' sizes stop at the first decode size that holds speculate_rows (bounded by the
    slots); a draft is cut to what the request's budget leaves and at its first id outside the
    vocabulary."""
    assert speculation_of(PromptLookup(), 3, 8, [2, 4]).sizes == [2, 4]  # more rows than slots
    assert speculation_of(PromptLookup(), 3, 5, [1, 4, 16, 64]).sizes == [1, 4, 16]
    request = Request(0, [1, 2], Settings(max_new_tokens=10), None)
    request.output_ids = [3] * 7
    seq = Seq(request, 0, [1, 2], [], {}, length=8, queued=7)
    speculation = speculation_of(lambda context, k: [5, 6, -1, 7, 8][:k] + [9] * 10, 4, 8, [8])
    assert speculation._draft(seq, 100) == [5, 6]  # budget: 3 tokens, the step's own and 2 drafted
    request.output_ids, seq.queued = [3] * 2, 2
    assert speculation._draft(seq, 100) == [5, 6]  # cut at -1
    assert speculation_of(lambda context, k: [5, 100, 6], 4, 8, [8])._draft(seq, 100) == [5]


@pytest.mark.slow
def test_a_draft_source_failing_on_one_sequence_leaves_it_and_the_others_their_tokens(two_layers_f32, traffic, caplog):
    """A draft source that raises for one request's context (drafted on the host): that sequence gets no
    draft that step and decodes on; every request, that one included, gets its tokens alone. Before,
    the exception ended the step, and with it every request running."""
    prompts, budgets, want = traffic
    known = KnownReplies(prompts, want, two_layers_f32[0].vocab_size)

    def draft(context, k):
        if context[:len(prompts[2])] == prompts[2]:
            raise RuntimeError("this draft source cannot draft here")
        return known(context, k)

    engine = engine_with(two_layers_f32, draft)
    with caplog.at_level("ERROR", "gptoss_jax.serving"):
        got = run(engine, prompts, [Settings(max_new_tokens=m, sampling=GREEDY) for m in budgets])
    assert got == want
    assert "the draft source failed, no draft this step" in caplog.text
    assert engine.stats()["accepted_draft_tokens"] > 0
