"""The contract between a draft source and the checked steps that check its drafts
(decoding/checked.py), for the command line's `Generator` and the serving engine alike.

Two kinds of source:

- `HostDraft`: any callable `draft(context, k) -> up to k token ids`, given a sequence's tokens so
  far (prompt and reply). It runs on the host between steps, so each step waits for the tokens of
  the one before; its drafts reach the devices as a `Given` draft.
- `DeviceDraft`: proposes inside the checked steps on the devices, several steps a call with no
  host round trip between them. A subclass is a static argument of those steps, so it must be
  hashable, and equal sources share their compiled steps; everything that tells two equal sources
  apart belongs in `arrays()`, which the steps take as arguments, never as constants. A source
  with a state (an EAGLE-3 head: its own KV cache beside the target's, and each row's last
  captured states) names target layers in `capture` and follows every step of the target with
  their outputs (`observe`), whoever runs it: the command line's `Generator` or the serving engine.

Legend: B = rows checked together, L = the history's positions, k = drafted tokens a step,
T = k + 1 positions checked, G = the captured layers' outputs side by side.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax

HostDraft = Callable[[Sequence[int], int], Sequence[int]]


class DraftContext(NamedTuple):
    """What a device draft proposes from, or follows a step with."""

    history: jax.Array | None  # [B, L] each row's tokens so far, prompt and reply (None: not kept)
    lengths: jax.Array  # [B] how many of each row's are its context (the last not in the cache yet)
    arrays: Any = None  # the source's `arrays()`, placed on the devices (None where it has none)
    state: Any = None  # the source's state, its per-row parts of the caller's R rows (None where it has none)
    embedding: jax.Array | None = None  # the target's token embedding [V, D]
    kernels: Any = None  # the target's `Kernels`
    mesh: Any = None  # the target's mesh (None: one device)
    rows: jax.Array | None = None  # [B] the caller's row of each (R: padding)
    last: jax.Array | None = None  # [B] each row's latest token, not in the cache yet
    table: jax.Array | None = None  # [B, W] the rows' page table of the full layers (a paged cache), else None
    budget: jax.Array | None = None  # [B] the tokens each row may still add (a proposal writes no further)


class Proposal(NamedTuple):
    drafts: jax.Array  # [B, k] token ids, of which the first `counts` are proposed
    counts: jax.Array  # [B] int32
    state: Any = None  # the source's state after proposing


class StepResult(NamedTuple):
    """A step of the target (a prompt chunk, a decode step, a checked step), as a source with a state
    sees it afterwards."""

    tokens: jax.Array  # [B, T] the tokens it ran on (a checked step's: each row's last token, then its draft)
    kept: jax.Array  # [B, T] those now in the cache (a prefix of each row; none: a row not running)
    states: jax.Array  # [B, T, G] the target's outputs of the layers in `capture` there
    start: jax.Array  # [B] the position of each row's first token
    fresh: jax.Array  # [B] bool: rows whose part of the cache starts here (a prompt's first chunk, after
    #                   any prefix found cached), so no state before their first token is known


class DeviceDraft:
    """A draft source that proposes on the devices (see the module)."""

    capture: tuple[int, ...] = ()  # the target layers whose outputs it follows (a source with a state)
    reads_history: bool = True  # it proposes from context.history (False: the callers keep none)

    def arrays(self) -> Any:
        """The source's arrays, arguments of the steps that draft with it (None: it has none)."""
        return None

    def init_state(self, rows: int, storage: tuple[int, int], mesh=None) -> Any:
        """A fresh state for `rows` rows beside a cache of `storage`: (rows, positions) for a
        contiguous cache, (pages, page size) for a paged pool (None: a source without one)."""
        return None

    def page_bytes(self, page_size: int) -> int:
        """Device memory its state takes a page of the pool, beside a paged cache."""
        return 0

    def propose(self, context: DraftContext, k: int) -> Proposal:
        raise NotImplementedError(f"{type(self).__name__} must define propose(context, k)")

    def observe(self, context: DraftContext, step: StepResult) -> Any:
        """The state after a step of the target (`capture` non-empty: after every step, the prompt's
        chunks and the steps that decode without drafting included; a source without one keeps None)."""
        return context.state


class Given(DeviceDraft):
    """Drafts made on the host (a `HostDraft`'s), handed to a checked step as its arrays: drafts [B, k]
    and how many of each row's are proposed [B]."""

    reads_history = False

    def __hash__(self):
        return hash(Given)

    def __eq__(self, other):
        return isinstance(other, Given)

    def propose(self, context: DraftContext, k: int) -> Proposal:
        return Proposal(context.arrays["drafts"], context.arrays["counts"])


GIVEN = Given()

Draft = Union[HostDraft, DeviceDraft]


def on_devices(draft) -> bool:
    """Whether a draft source proposes on the devices."""
    return isinstance(draft, DeviceDraft)
