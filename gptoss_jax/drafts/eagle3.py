"""Drafting with an EAGLE-3 head beside `Generator` (model/eagle3.py has the head, eagle3_load.py
its loading): the head's own KV cache follows the target's, a pair (the target's captured states at
position p, the token at p + 1) per position, and each step drafts k tokens on the devices.

For a sequence whose committed tokens are x_0 .. x_n (x_n not yet in the target's cache):

- prefill: the prompt's pairs p = 0 .. n - 2 go into the head's cache chunk by chunk
  (`head_prefill`); the states at the last prompt position wait (`pending`) for the first token;
- each checked step (`propose`): the pairs not yet in the head's cache (after the prefill, the last
  prompt position's with the first token; after a checked step, its positions 0 .. a: the
  target's states there with the accepted drafts and the target's next token, `next_pairs`) go
  in, the last of them gives the first draft token, and each later one comes from the head's own
  output at the one before (k - 1 single-position passes). The head's cache counts the committed
  pairs only: what the drafting passes wrote past them is written over before it is read.

The head attends as the target's full layers do (eagle3.py): over its cache's committed positions
and the pass's own; on one device with the target's kernels (Hopper's decode kernel reads the
positions a sequence has, not the whole cache), beside a model on a mesh with the jnp path
(`_attending`).

Drafts are the head's greedy picks, proposed with certainty, so greedy and sampled checks take
them as they take prompt lookup's (decoding/acceptance.py, with no draft probabilities).

Legend: B = batch, T = positions, G = the captured states' width, D = hidden, U = the head's vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..eagle3_config import Eagle3Config
from ..kernels import Kernels
from ..model.eagle3 import Eagle3Head
from ..sharding import everywhere
from .base import DeviceDraft, DraftContext, Proposal, StepResult
from .eagle3_load import load_eagle3


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Draft(DeviceDraft):
    """A loaded head: its config, parameters {"params": ...} and hot ids [U] (the target id of each of
    its tokens), on the devices."""

    config: Eagle3Config
    params: dict
    hot: jax.Array

    # A static argument of the steps that draft with it, its arrays their arguments: heads alike in
    # kind, shape and dtypes share compiled steps (and a head in another dtype gets its own).
    def __post_init__(self):
        dtypes = tuple(str(x.dtype) for x in jax.tree.leaves((self.params, self.hot)))
        object.__setattr__(self, "_key", (type(self), self.config, dtypes))

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, Eagle3Draft) and self._key == other._key

    @classmethod
    def load(cls, folder: str, target: ModelConfig, dtype=jnp.bfloat16) -> "Eagle3Draft":
        config, params, hot = load_eagle3(folder, target, dtype)
        return cls(config, params, jnp.asarray(hot))

    # Drafting inside the checked steps (decoding/checked.py): the head is a static argument, its arrays
    # and its state are arguments (never constants of the compiled steps).
    @property
    def capture(self) -> tuple[int, ...]:
        """The target layers whose outputs each checked step keeps for the head."""
        return self.config.aux_layers

    def arrays(self) -> dict:
        return {"head": self.params, "hot": self.hot}

    def start(self, cache: dict, pending: jax.Array, last: jax.Array, active: jax.Array, k: int) -> dict:
        """The state after the prefill (`head_prefill`'s cache and each prompt's last states, pending
        [B, G]; last [B] the first new token): the pairs not yet in the head's cache, padded to k + 1."""
        pad = ((0, 0), (0, k))
        return {"cache": cache, "tokens": jnp.pad(last[:, None], pad),
                "states": jnp.pad(pending[:, None], pad + ((0, 0),)), "valid": jnp.pad(active[:, None], pad)}

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """k drafts for every row from the state (attending with the target's kernels' variants; beside
        a model on a mesh, the jnp one): all proposed."""
        state = context.state
        drafts, cache = propose(self.config, k, _attending(context.kernels, context.mesh), context.arrays,
                                context.embedding, state["cache"], (state["tokens"], state["states"], state["valid"]))
        return Proposal(drafts, jnp.full(drafts.shape[:1], k, jnp.int32), {**state, "cache": cache})

    def observe(self, state: dict, step: StepResult) -> dict:
        """The state after a checked step (`next_pairs`): the pairs it commits, waiting."""
        tokens, states, valid = next_pairs(step.tokens, step.valid, step.accepted, step.next_tokens, step.states)
        return {**state, "tokens": tokens, "states": states.astype(state["states"].dtype), "valid": valid}


def _head(config: Eagle3Config, embedding, kernels: Kernels):
    return Eagle3Head(config, param_dtype=embedding.dtype, kernels=kernels)


def _attending(kernels: Kernels, mesh) -> Kernels:
    """The kernels the head attends with beside a model on `mesh`: the model's on one device; on a
    mesh the jnp variant, which XLA partitions (the head's arrays are whole on every device, and the
    fused variants, which see one device's part, would need them split as the model's cache is)."""
    return kernels if mesh is None else dataclasses.replace(kernels, attention="blockwise")


@functools.partial(jax.jit, static_argnames=("draft", "model"), donate_argnames=("cache",))
def head_prefill(draft, model, arrays, embedding, chunk, cache, pending, where):
    """A prompt chunk's pairs into the head's cache: chunk = (next_tokens [B, T] the tokens after the
    positions start .. start + T - 1, the target's states there [B, T, G], valid [B, T]: positions
    before each prompt's last); pending [B, G]: the states at each prompt's last position once this
    chunk holds it; where = (each prompt's last position [B], start) -> (cache, pending), on every
    device of the target's mesh (model: decoding.steps.Model)."""
    next_tokens, states, valid = chunk
    last_index, start = where
    head = _head(draft.config, embedding, _attending(model.kernels, model.mesh))
    _, _, cache = head.apply(arrays["head"], jnp.take(embedding, next_tokens, axis=0), states, cache, valid)
    T = states.shape[1]
    here = (last_index >= start) & (last_index < start + T)
    at = jnp.clip(last_index - start, 0, T - 1)
    picked = jnp.take_along_axis(states, at[:, None, None], axis=1)[:, 0]
    out = cache, jnp.where(here[:, None], picked.astype(pending.dtype), pending)
    return jax.tree.map(lambda x: everywhere(x, model.mesh), out)  # one layout, call after call


@functools.partial(jax.jit, static_argnames=("config", "k", "kernels"), donate_argnames=("cache",))
def propose(config, k, kernels, arrays, embedding, cache, pairs):
    """The pairs not yet in the head's cache (pairs: tokens [B, T], states [B, T, G], valid [B, T], a
    prefix) into it, then k draft tokens from the last of them on (arrays: the head's parameters and
    hot ids) -> (drafts [B, k] target ids, the cache holding the committed pairs only)."""
    pair_tokens, pair_states, pair_valid = pairs
    head_params, hot = arrays["head"], arrays["hot"]
    head = _head(config, embedding, kernels)
    logits, y, cache = head.apply(head_params, jnp.take(embedding, pair_tokens, axis=0), pair_states, cache,
                                  pair_valid)
    last = jnp.maximum(pair_valid.sum(axis=1) - 1, 0)[:, None, None]
    logits, y = jnp.take_along_axis(logits, last, axis=1)[:, 0], jnp.take_along_axis(y, last, axis=1)[:, 0]
    drafts = [hot[jnp.argmax(logits, axis=-1)]]
    ahead = cache
    B = pair_tokens.shape[0]
    for _ in range(k - 1):
        logits, y, ahead = head.apply(head_params, jnp.take(embedding, drafts[-1], axis=0)[:, None], y[:, None],
                                      ahead, jnp.ones((B, 1), bool))
        y = y[:, 0]
        drafts.append(hot[jnp.argmax(logits[:, 0], axis=-1)])
    return jnp.stack(drafts, axis=1).astype(jnp.int32), {**ahead, "lengths": cache["lengths"]}


@jax.jit
def next_pairs(tokens, valid, accepted, nxt, states):
    """After a checked step (tokens [B, T]: each sequence's last token then its draft; accepted [B], nxt
    [B]; states [B, T, G] the target's there) -> the pairs it commits: (tokens [B, T]: the accepted
    drafts then the next token, states, valid [B, T]: positions 0 .. accepted of the checked rows)."""
    j = jnp.arange(tokens.shape[1])[None]
    after = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    pair_tokens = jnp.where(j < accepted[:, None], after, nxt[:, None])
    return pair_tokens, states, (j <= accepted[:, None]) & valid[:, :1]
