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
  with a state (an EAGLE-3 head: its own KV cache and the target's states it has not read yet)
  gets the target layers named in `capture` after each step (`observe`).

Legend: B = rows checked together, L = the history's positions, k = drafted tokens a step,
T = k + 1 positions checked, G = the captured layers' outputs side by side.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence, Union

import jax

HostDraft = Callable[[Sequence[int], int], Sequence[int]]


class DraftContext(NamedTuple):
    """What a device draft proposes from, at one checked step."""

    history: jax.Array  # [B, L] each row's tokens so far, prompt and reply
    lengths: jax.Array  # [B] how many of each row's are its context (the last not in the cache yet)
    arrays: Any = None  # the source's `arrays()`, placed on the devices (None where it has none)
    state: Any = None  # the source's state (None where it has none)
    embedding: jax.Array | None = None  # the target's token embedding [V, D]
    kernels: Any = None  # the target's `Kernels`
    mesh: Any = None  # the target's mesh (None: one device)


class Proposal(NamedTuple):
    drafts: jax.Array  # [B, k] token ids, of which the first `counts` are proposed
    counts: jax.Array  # [B] int32
    state: Any = None  # the source's state after proposing


class StepResult(NamedTuple):
    """A checked step, as a stateful source sees it afterwards."""

    tokens: jax.Array  # [B, T] each row's last token, then its draft
    valid: jax.Array  # [B, T] the positions checked (a prefix of each row; none: a row not running)
    accepted: jax.Array  # [B] the drafted tokens kept
    next_tokens: jax.Array  # [B] the target's token after them
    states: jax.Array | None  # [B, T, G] the target's outputs of the layers in `capture`


class DeviceDraft:
    """A draft source that proposes on the devices (see the module)."""

    capture: tuple[int, ...] = ()  # the target layers whose outputs the checked steps keep for it

    def arrays(self) -> Any:
        """The source's arrays, arguments of the steps that draft with it (None: it has none)."""
        return None

    def propose(self, context: DraftContext, k: int) -> Proposal:
        raise NotImplementedError(f"{type(self).__name__} must define propose(context, k)")

    def observe(self, state: Any, step: StepResult) -> Any:
        """The state after a checked step (a source without one keeps None)."""
        return state


class Given(DeviceDraft):
    """Drafts made on the host (a `HostDraft`'s), handed to a checked step as its arrays: drafts [B, k]
    and how many of each row's are proposed [B]."""

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
