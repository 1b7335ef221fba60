"""Prompt lookup (n-gram) drafting: no weights, the tokens that followed the context's last few
tokens where they occurred before. On the host (a `HostDraft`) and on the devices alike.

Legend: B = rows, L = the history's positions, k = drafted tokens a step.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from .base import DeviceDraft, DraftContext, Proposal


@dataclasses.dataclass(frozen=True)
class PromptLookup(DeviceDraft):
    """Drafts by prompt lookup: the tokens that followed the latest earlier occurrence of the
    context's last n tokens, for n from `max_n` down to `min_n` (the longest match that has one).
    Pays off where a reply quotes its context: edits, code, retrieved text; proposes nothing where
    the last tokens are new."""

    max_n: int = 3
    min_n: int = 1

    def __post_init__(self):
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt lookup takes 1 <= min_n <= max_n, got min_n={self.min_n}, max_n={self.max_n}")

    def __call__(self, context: Sequence[int], k: int) -> list[int]:
        h = np.asarray(context, dtype=np.int64)
        L = len(h)
        if L < 2:
            return []
        # Where a match of the last n tokens can end: an earlier occurrence of the last token, with one
        # token after it (the suffix itself is not a match). One pass over the context, for every n.
        ends = np.flatnonzero(h[:-1] == h[-1])
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            match = ends[ends >= n - 1]
            for t in range(1, n):
                match = match[h[match - t] == h[L - 1 - t]]
            if match.size:
                follow = match[-1] + 1
                return h[follow:follow + k].tolist()
        return []

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """The same on the devices, for every row at once: from each row's context (the first
        context.lengths [B] tokens of context.history [B, L])."""
        history, lengths = context.history, context.lengths
        B, L = history.shape
        j = jnp.arange(L)[None]  # [1, L] where an n-gram starts
        follow = jnp.full((B,), -1, jnp.int32)  # where the draft starts: after the longest n's latest match
        for n in range(self.max_n, self.min_n - 1, -1):
            match = (j + n < lengths[:, None])  # a token follows the n-gram (so it is not the suffix itself)
            for t in range(n):
                suffix = jnp.take_along_axis(history, jnp.maximum(lengths - n + t, 0)[:, None], axis=1)  # [B, 1]
                match &= history[:, jnp.minimum(jnp.arange(L) + t, L - 1)] == suffix
            latest = jnp.max(jnp.where(match, j, -1), axis=1)  # [B]
            follow = jnp.where((follow < 0) & (latest >= 0), latest + n, follow)
        count = jnp.where(follow >= 0, jnp.minimum(k, lengths - follow), 0)
        drafts = jnp.take_along_axis(history, jnp.clip(follow[:, None] + jnp.arange(k)[None], 0, L - 1), axis=1)
        return Proposal(drafts, count.astype(jnp.int32))
