"""Drafting with an EAGLE-3 head (model/eagle3.py has the head, eagle3_load.py its loading), for
the command line's `Generator` and the serving engine alike: the head keeps its own keys and
values beside the target's cache, in the same layout (a contiguous row per sequence, or one more
storage of the paged pool, reached through the full layers' page tables), one position per pair
(the target's captured states at position p, the token at p + 1).

The head follows every step of the target (`observe`: a prompt's chunks, decode steps, checked
steps): the step's kept tokens x_p .. pair with the states before them (s_(p-1) .. , the first
kept from the step before: each row's `pending` states), and go into the head's cache; the states
at the row's last kept position wait in `pending` for the token after them. A row whose part of
the cache starts at the step (`fresh`: a prompt's first chunk, after any prefix found cached)
pairs from its second token on. So before each checked step the head holds the pairs of positions
0 .. n - 2 of a row whose cache holds n positions; `propose` adds (s_(n-1), the row's latest
token) at n - 1 and drafts from the head's output there, each later draft from the head's own
output at the one before (k - 1 single-position passes, written past the committed pairs, where
the next step's writes land before anything reads them).

With a prefix found in the serving engine's cache, the pair at its last position is whatever the
page's last writer left there (the sequence that computed it pairs that position with its own next
token, and may have ended first): a draft may differ for it, never a token (every draft is
checked). A proposal writes no further than the positions a row's budget holds, which are its
own.

The head attends as the target's full layers do (the cache contract of model/cache.py): over its
cache's committed positions and the pass's own; on one device with the target's kernels, beside
a model on a mesh with the jnp path (`_attending`). Drafts are the head's greedy picks, proposed
with certainty, so greedy and sampled checks take them as they take prompt lookup's
(decoding/acceptance.py, with no draft probabilities).

Legend: B = rows, T = positions, G = the captured states' width, D = hidden, U = the head's
vocabulary, K = its KV heads, H = its head dim.
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
from ..sharding import replicated, zeros_on_devices
from .base import DeviceDraft, DraftContext, Proposal, StepResult
from .eagle3_load import load_eagle3


@dataclasses.dataclass(frozen=True, eq=False)
class Eagle3Draft(DeviceDraft):
    """A loaded head: its config, parameters {"params": ...} and hot ids [U] (the target id of each of
    its tokens), on the devices."""

    config: Eagle3Config
    params: dict
    hot: jax.Array
    reads_history = False  # it drafts from the target's captured states and its own cache

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

    @property
    def dtype(self):
        """Its weights' dtype (the norms' aside), which its cache takes."""
        return self.params["params"]["fc"].dtype

    def init_state(self, rows: int, storage: tuple[int, int], mesh=None) -> dict:
        """The head's keys and values [*storage, K, H] beside the target's cache ((rows, positions) or
        (pages, page size)) and each row's pending states [rows, G], zeros, on every device."""
        dtype = self.dtype
        shape = (*storage, self.config.num_key_value_heads, self.config.head_dim)
        G = len(self.config.aux_layers) * self.config.target_hidden_size
        shapes = {"k": jax.ShapeDtypeStruct(shape, dtype), "v": jax.ShapeDtypeStruct(shape, dtype),
                  "pending": jax.ShapeDtypeStruct((rows, G), dtype)}
        return zeros_on_devices(shapes, None if mesh is None else jax.tree.map(lambda _: replicated(mesh), shapes))

    def page_bytes(self, page_size: int) -> int:
        """Device memory its keys and values take a page of the pool (beside a paged cache)."""
        return 2 * page_size * self.config.num_key_value_heads * self.config.head_dim * jnp.dtype(self.dtype).itemsize

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """k drafts for every row (see the module): all proposed."""
        state, rows = context.state, context.rows
        # Pass j writes at n - 1 + j: a row writes no further than the positions its budget holds
        # (the paged pool's pages past them are other sequences'); padding rows write nothing.
        writes = (rows < state["pending"].shape[0])[:, None] & (jnp.arange(k)[None] <= context.budget[:, None])
        cache = _layer(state, context.table, context.lengths - 2)  # the pairs before the row's latest token
        drafts, cache = propose(self.config, k, _attending(context.kernels, context.mesh), context.arrays,
                                context.embedding, cache, (jnp.take(state["pending"], rows, axis=0, mode="clip"),
                                                           context.last, writes))
        return Proposal(drafts, jnp.full(drafts.shape[:1], k, jnp.int32), {**state, "k": cache["k"], "v": cache["v"]})

    def observe(self, context: DraftContext, step: StepResult) -> dict:
        """The state after a step of the target (see the module): its kept tokens' pairs in the head's
        cache, each row's states at its last kept position pending."""
        state, rows = context.state, context.rows
        R = state["pending"].shape[0]
        pending = jnp.take(state["pending"], rows, axis=0, mode="clip")
        states = step.states.astype(pending.dtype)  # [B, T, G]
        fresh = step.fresh[:, None]

        def later(x):  # from the second position on
            return jnp.concatenate([x[:, 1:], jnp.zeros_like(x[:, :1])], axis=1)

        tokens = jnp.where(fresh, later(step.tokens), step.tokens)  # [B, T]
        before = jnp.concatenate([pending[:, None], states[:, :-1]], axis=1)  # s_(p-1) for each x_p
        hidden = jnp.where(fresh[..., None], states, before)
        valid = jnp.where(fresh, later(step.kept), step.kept)
        head = _head(self.config, context.embedding, _attending(context.kernels, context.mesh))
        cache = _layer(state, context.table, step.start - 1 + step.fresh)
        _, _, cache = head.apply(context.arrays["head"], jnp.take(context.embedding, tokens, axis=0), hidden, cache,
                                 valid)
        n = step.kept.sum(axis=1)
        last = jnp.take_along_axis(states, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]  # [B, G]
        at = jnp.where((n > 0) & (rows < R), rows, R)  # rows that kept nothing: dropped
        return {"k": cache["k"], "v": cache["v"], "pending": state["pending"].at[at].set(last, mode="drop")}


def _layer(state: dict, table, lengths) -> dict:
    """The head's cache as its attention reads it: its keys and values, with the rows' page table
    beside a paged cache, at these lengths [B]."""
    cache = {"k": state["k"], "v": state["v"], "lengths": jnp.maximum(lengths, 0)}
    return cache if table is None else {**cache, "table": table}


def _head(config: Eagle3Config, embedding, kernels: Kernels):
    return Eagle3Head(config, param_dtype=embedding.dtype, kernels=kernels)


def _attending(kernels: Kernels, mesh) -> Kernels:
    """The kernels the head attends with beside a model on `mesh`: the model's on one device; on a
    mesh the jnp variant, which XLA partitions (the head's arrays are whole on every device, and the
    fused variants, which see one device's part, would need them split as the model's cache is)."""
    return kernels if mesh is None else dataclasses.replace(kernels, attention="blockwise")


@functools.partial(jax.jit, static_argnames=("config", "k", "kernels"), donate_argnames=("cache",))
def propose(config, k, kernels, arrays, embedding, cache, latest):
    """k draft tokens of each row (arrays: the head's parameters and hot ids): the pair (its pending
    states, its latest token) at the cache's lengths, then k - 1 from the head's own outputs; latest
    = (pending [B, G], last [B], writes [B, k]: whether each pass writes, row by row) -> (drafts
    [B, k] target ids, the cache's keys and values, written at the lengths and after)."""
    pending, last, writes = latest
    head = _head(config, embedding, kernels)
    drafts, hidden, tokens = [], pending[:, None], last
    for j in range(k):
        logits, y, cache = head.apply(arrays["head"], jnp.take(embedding, tokens, axis=0)[:, None], hidden, cache,
                                      writes[:, j:j + 1])
        tokens = arrays["hot"][jnp.argmax(logits[:, 0], axis=-1)]
        drafts.append(tokens)
        hidden = y
    return jnp.stack(drafts, axis=1).astype(jnp.int32), cache
