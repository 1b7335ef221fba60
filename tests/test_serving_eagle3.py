"""EAGLE-3 heads in the serving engine (drafts/eagle3.py beside serving/): the tests of prompt lookup
on the engine (tests/test_serving_speculation.py), with a head that follows every step. Greedy
requests give the tokens each gives alone whether the head's drafts are its own (a random head:
never accepted), always right or partly right (`Steered`: the head runs, a known reply is proposed
in its place), several requests sharing each checked step, with prefixes found cached, preempted
and taken back, and on a mesh of 8 CPU devices; nothing compiles after warm-up. That each draft is
what the head gives over the whole sequence is tests/test_eagle3.py's (for `Generator` and the
engine alike).

The model is the tiny config in float32 (a 16-token window); replies run past the window.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from eagle3_ref import U, Reference, write_head

from conftest import compile_events
from gptoss_jax.decoding.generator import Generator
from gptoss_jax.drafts.base import Proposal
from gptoss_jax.drafts.eagle3 import Eagle3Draft
from gptoss_jax.sampling import Sampling
from gptoss_jax.serving import Engine, EngineConfig, Settings
from gptoss_jax.testing import KnownReplies

MAX_LEN = 256
GREEDY = Sampling(temperature=0.0)
pytestmark = pytest.mark.slow  # (an engine with a head compiles for about a minute)


@dataclasses.dataclass(frozen=True, eq=False)
class Steered(Eagle3Draft):
    """The head runs (its state follows as always), and the replies `known` holds are proposed in its
    drafts' place: right, or wrong at every n-th token of a reply."""

    known: Any = None

    def arrays(self) -> dict:
        return {**super().arrays(), "known": self.known.arrays()}

    def propose(self, context, k):
        own = super().propose(context, k)
        known = self.known.propose(context._replace(arrays=context.arrays["known"]), k)
        return Proposal(known.drafts, known.counts, own.state)


@pytest.fixture(scope="module")
def head(tiny_f32, tmp_path_factory):
    """A random head for the tiny model (reading its layers 1, 2 and 3), in the published layout, loaded."""
    config, _ = tiny_f32
    folder = tmp_path_factory.mktemp("head")
    torch.manual_seed(11)
    write_head(folder, Reference(False), np.sort(np.random.default_rng(11).choice(config.vocab_size, U, replace=False)),
               vocab=config.vocab_size, layer_ids=(1, 2, 3))
    return Eagle3Draft.load(str(folder), config, dtype=jnp.float32)


@pytest.fixture(scope="module")
def traffic(tiny_f32):
    """6 prompts (one repeating, two sharing a beginning of 48 tokens: the later, in `run`'s second
    batch, finds it cached) and the greedy tokens `Generator` gives each alone."""
    config, params = tiny_f32
    rng = np.random.default_rng(13)
    shared = rng.integers(0, config.vocab_size, 48).tolist()
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 40, 90)] + [
        shared + [7, 8], [21, 22, 23] * 12, shared + [9]]
    generator = Generator(config, params, max_len=MAX_LEN)
    want = [generator.generate([p], max_new_tokens=30, sampling=GREEDY)[0].output_ids for p in prompts]
    return prompts, want


def engine_of(model, draft, **kw):
    config, params = model
    options = dict(slots=4, max_len=MAX_LEN, prefill_chunk=32, page_size=16, decode_sizes=(2, 4), draft_tokens=3,
                   speculate_steps=4)
    return Engine(config, params, EngineConfig(**{**options, **kw}), draft=draft)


def steered(head, traffic, wrong_every: int) -> Steered:
    prompts, want = traffic
    return Steered(head.config, head.params, head.hot, KnownReplies(prompts, want, head.config.vocab_size, wrong_every))


def run(engine, prompts, together: int = 4):
    """Each prompt's request, `together` submitted at once (the later ones of a batch find the earlier
    ones' prefixes cached), greedy, 30 tokens -> their tokens."""
    requests = []
    for i in range(0, len(prompts), together):
        requests += [engine.submit(p, Settings(max_new_tokens=30, sampling=GREEDY)) for p in prompts[i:i + together]]
        engine.run_until_idle()
    assert all(r.finish_reason == "length" for r in requests), [r.finish_reason for r in requests]
    return [r.output_ids for r in requests]


@pytest.mark.parametrize("drafts", ["its own", "always right", "right but every 3rd"])
def test_greedy_tokens_are_each_requests_alone_whatever_the_head_drafts(tiny_f32, head, traffic, drafts):
    """A random head's own drafts (never accepted), a known reply proposed through the running head
    (every draft accepted), or that reply wrong at every 3rd token: each request's tokens alone, four
    at once, then two; a cached prefix is found for the prompt sharing one."""
    prompts, want = traffic
    draft = {"its own": head, "always right": steered(head, traffic, 0),
             "right but every 3rd": steered(head, traffic, 3)}[drafts]
    engine = engine_of(tiny_f32, draft)
    assert run(engine, prompts) == want
    stats = engine.stats()
    assert stats["draft_tokens"] > 0 and stats["cached_prompt_tokens"] >= 48
    if drafts == "its own":
        assert stats["accepted_draft_tokens"] <= stats["draft_tokens"] // 10
    elif drafts == "always right":
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]
    else:
        assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


def test_a_head_beside_a_pool_too_small_preempts_and_every_request_gets_its_tokens(tiny_f32, head, traffic):
    """Four requests in a pool of 28 pages of 8 (the head's keys and values a page beside each): the
    latest admitted are preempted and come back (their prompts and tokens computed again, the head
    following from their first chunk), and every request gets its tokens alone."""
    prompts, want = traffic
    engine = engine_of(tiny_f32, steered(head, traffic, 3), page_size=8, pages=28)
    assert run(engine, prompts[1:5], together=4) == want[1:5]
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0
    assert 0 < stats["accepted_draft_tokens"] < stats["draft_tokens"]


def test_on_a_mesh_a_head_gives_one_device_tokens_and_nothing_compiles_after_warm_up(tiny_f32, head, traffic):
    """Sequences over `data`, experts over `expert`, heads over `tensor` (8 CPU devices), the head's
    arrays whole on every device: each request's tokens alone, drafts accepted and rejected; then
    sampled requests, some with log-probabilities or a logit bias (not speculated): no compile event
    after warm_up."""
    import gptoss_jax as gj
    from gptoss_jax.params import param_shardings

    prompts, want = traffic
    config, params = tiny_f32
    mesh = gj.make_mesh(data=2, expert=2, tensor=2)
    engine = engine_of((config, jax.device_put(params, param_shardings(config, mesh))), steered(head, traffic, 3))
    assert engine.mesh is mesh
    engine.warm_up()
    with compile_events() as compiles:
        assert run(engine, prompts) == want
        for i in range(8):
            sampling = [Sampling(temperature=1.0), Sampling(temperature=0.7, top_k=20, top_p=0.9)][i % 2]
            engine.submit(prompts[i % len(prompts)], Settings(max_new_tokens=12, sampling=sampling, seed=i,
                                                              logprobs=0 if i % 3 == 0 else None,
                                                              logit_bias=((3, 1.0),) if i % 4 == 1 else ()))
        engine.run_until_idle()
    assert compiles == []
    assert 0 < engine.stats()["accepted_draft_tokens"] < engine.stats()["draft_tokens"]


def test_a_head_is_given_when_the_engine_is_made(tiny_f32, head):
    """The head follows every step from the engine's first: changing to it, or from it, is refused."""
    from gptoss_jax.drafts.prompt_lookup import PromptLookup

    engine = engine_of(tiny_f32, head)
    with pytest.raises(ValueError, match="give it to Engine"):
        engine.speculation.use(PromptLookup())
    plain = engine_of(tiny_f32, PromptLookup())
    with pytest.raises(ValueError, match="give it to Engine"):
        plain.speculation.use(head)
