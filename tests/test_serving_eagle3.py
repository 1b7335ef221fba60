"""EAGLE-3 heads in the serving engine (drafts/eagle3.py beside serving/): the tests of prompt lookup
on the engine (tests/test_serving_speculation.py), with a head that follows every step. Greedy
requests give the tokens each gives alone whether the drafts are always right, always wrong or
partly right (`Steered`: the head runs, a known reply is proposed in its place), several requests
sharing each checked step, with prefixes found cached, preempted and taken back, and on a mesh of
8 CPU devices; nothing compiles after warm-up. The head's own drafts, each what the head gives over
the whole sequence, are tests/test_eagle3.py's (for `Generator` and the engine alike). Every engine
here has the same settings, so that the file compiles its steps once (and once on the mesh).

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
    reads_history = True  # (the known replies are found from each row's tokens so far)

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
    """6 prompts (one repeating, two sharing a beginning of 48 tokens) and the greedy tokens
    `Generator` gives each alone."""
    config, params = tiny_f32
    rng = np.random.default_rng(13)
    shared = rng.integers(0, config.vocab_size, 48).tolist()
    prompts = [rng.integers(0, config.vocab_size, n).tolist() for n in (5, 40, 90)] + [
        shared + [7, 8], shared + [9], [21, 22, 23] * 12]  # (3 and 4 share 48 tokens)
    generator = Generator(config, params, max_len=MAX_LEN)
    want = [generator.generate([p], max_new_tokens=30, sampling=GREEDY)[0].output_ids for p in prompts]
    return prompts, want


def engine_of(model, draft, **kw):
    config, params = model
    options = dict(slots=4, max_len=MAX_LEN, prefill_chunk=32, page_size=8, pages=28, decode_sizes=(2, 4),
                   draft_tokens=3, speculate_steps=4)
    return Engine(config, params, EngineConfig(**{**options, **kw}), draft=draft)


def steered(head, traffic, wrong_every: int) -> Steered:
    prompts, want = traffic
    return Steered(head.config, head.params, head.hot, KnownReplies(prompts, want, head.config.vocab_size, wrong_every))


def run(engine, prompts, batches=((3,), (4, 0, 1, 2), (5,))):
    """The prompts' requests, greedy, 30 tokens, in batches submitted at once (by index into prompts:
    the one sharing a beginning with an earlier one's first, so that it finds it cached before the
    others' pages push it out) -> their tokens, in the prompts' order."""
    requests = {}
    for batch in batches:
        requests.update({i: engine.submit(prompts[i], Settings(max_new_tokens=30, sampling=GREEDY)) for i in batch})
        engine.run_until_idle()
    assert all(r.finish_reason == "length" for r in requests.values())
    return [requests[i].output_ids for i in range(len(prompts))]


@pytest.mark.parametrize("wrong_every", [0, 1, 3], ids=["always right", "always wrong", "right but every 3rd"])
def test_greedy_tokens_are_each_requests_alone_whatever_the_head_drafts(tiny_f32, head, traffic, wrong_every):
    """A known reply proposed through the running head, always right (every draft accepted), always
    wrong (none) or wrong at every 3rd token: each request's tokens alone, four at once, then two,
    through a pool of 28 pages of 8 (the head's keys and values a page beside each), too small for
    four at once: the latest admitted are preempted and come back (their prompts and tokens computed
    again, the head following from their first chunk); a cached prefix is found for the prompt
    sharing one. (The head's own drafts: tests/test_eagle3.py, on the engine too.)"""
    prompts, want = traffic
    engine = engine_of(tiny_f32, steered(head, traffic, wrong_every))
    assert run(engine, prompts) == want
    stats = engine.stats()
    assert stats["draft_tokens"] > 0 and stats["cached_prompt_tokens"] >= 48
    assert stats["preemptions"] > 0 and stats["pages_in_use"] == 0
    if wrong_every == 0:
        assert stats["accepted_draft_tokens"] == stats["draft_tokens"]
    elif wrong_every == 1:
        assert stats["accepted_draft_tokens"] == 0
    else:
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
