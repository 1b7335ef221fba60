"""The serving engine's state on the devices and the calls that run over it: the pool of KV pages
(paged_cache.py), the page tables [2, R, W], each row's latest token [R], the picks' settings,
counts and masks (picks.py), and a draft head's state (its keys and values a page beside the pool's). The engine (engine.py) decides what runs; this holds what it runs on,
and every step goes through here, speculation's checked steps included (`run_checked`).

Legend: R = rows, W = table width, P = prompts prefilled together, C = prefill chunk, B = rows
decoded together, V = vocab.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ..decoding.steps import Decode, Model, decode, follow, prefill
from ..model.paged_cache import PoolSize, init_pool
from ..sharding import on_every_device
from ..training.lora import check_fits, served_count, table_entry, tables_of, with_tables
from ..weight import Params
from . import steps
from .picks import Picks

TABLE_WRITES = 256  # table entries set by one call (a long cached prefix takes several)


class Device:
    """One engine's arrays on the devices (see the module) for `model` (decoding.steps.Model): `slots`
    rows, tables `width` wide, a pool of `pool.pages` pages of `pool.page_size` positions in `pool.dtype`."""

    def __init__(self, model: Model, params: Params, *, slots: int, width: int, pool: PoolSize, grammars=None,
                 tokenizer=None):
        self.model, self.config, self.params, self.mesh = model, model.config, params, model.mesh
        self.served = served_count(params)  # adapters in the parameters' tables (Settings.adapter's range)
        self._decode = Decode(self.model)  # one step's model pass, picked apart
        self.slots, self.width = slots, width
        self.pages, self.page_size, self.kv_dtype = pool.pages, pool.page_size, pool.dtype
        self.picks = Picks(slots, self.config.vocab_size, self.mesh, self.put, grammars, tokenizer)
        self.head = None  # (a draft source with a state that follows every step, its arrays here)
        self._fresh()

    def draft_with(self, draft) -> None:
        """Have a draft source with a state (an EAGLE-3 head: drafts/base.py) follow every step from
        now on, its state beside the pool (the steps capture the layers it reads)."""
        self.model = dataclasses.replace(self.model, capture=draft.capture)
        self._decode = Decode(self.model)
        self.head = (draft, jax.tree.map(self.put, draft.arrays()))
        self.state = draft.init_state(self.slots, (self.pages, self.page_size), self.mesh)

    def put(self, x):
        """A host array onto the engine's devices (on its mesh: a copy on each)."""
        return on_every_device(x, self.mesh)

    def reset(self) -> None:
        """A fresh pool, tables and latest tokens, and no row's picks (a failed step may have consumed
        the donated ones): nothing is held or cached any more."""
        self._fresh()
        self.picks.reset()

    def _fresh(self) -> None:
        self.pool = init_pool(self.config, self.pages, self.page_size, self.kv_dtype, mesh=self.mesh)
        self.tables = self.put(np.zeros((2, self.slots, self.width), np.int32))
        self.last = self.put(np.zeros(self.slots, np.int32))  # each row's latest token
        self.adapters = self.put(np.full(self.slots, -1, np.int32))  # each row's served adapter (-1: none)
        self.state = None if self.head is None else self.head[0].init_state(self.slots, (self.pages, self.page_size),
                                                                           self.mesh)

    def release(self) -> None:
        """Give the pool's memory back (the engine runs no step after)."""
        self.pool = self.state = None

    def write_tables(self, writes: list[tuple[int, int, int, int]]) -> None:
        """Set table entries (group, row, column, page)."""
        for part in steps.in_parts(writes, TABLE_WRITES, self.slots):
            self.tables = steps.write_tables(self.tables, self.put(part))

    def prefill(self, plan: np.ndarray, tokens: np.ndarray):
        """A prompt chunk's model pass (decoding/steps.py's prefill): plan [6, P] (rows, counts, starts,
        finishing, sampling steps, fresh: the rows whose part of the cache starts at this chunk), tokens
        [P, C] -> (logits [P, V] at each row's last real token, the plan), on the devices."""
        plan = self.put(plan)
        logits, cache, step = prefill(self.model, self.params, self._cache(), self.put(tokens), plan)
        self._keep(cache)
        self._follow(step, plan[0])
        return logits, plan

    def pick_first(self, prefilled, settings, mode: str, wants: tuple[bool, bool], ending: list):
        """The first tokens of the rows whose prompt a prefill ended (prefilled: `prefill`'s; settings:
        every row's, on the devices; ending: the request of each row whose prompt ends, else None) ->
        (first tokens [P], with logprobs their log-probabilities (sampling.token_logprobs), else None),
        on the devices."""
        logits, plan = prefilled
        first, self.last, logprobs = self.picks.first(logits, self.last, plan, settings, mode, wants, ending)
        return first, logprobs

    def decode(self, plan: np.ndarray):
        """One step's model pass (decoding/steps.py's decode, no sampling mode): plan [4, B] (rows,
        lengths, sampling steps: -1 padding, budgets) -> (logits [B, V], the plan), on the devices."""
        plan = self.put(plan)
        logits, cache, step = decode(self._decode, self.params, self._cache(), self.last, plan)
        self._keep(cache)
        self._follow(step, plan[0])
        return logits, plan

    def _follow(self, step, rows) -> None:
        """The draft with a state after a step (its StepResult) of these rows."""
        if self.head is not None:
            self.state = follow(self.model, self.head[0], self.params, self.head[1], self.state, step, rows,
                                self.tables)

    def pick(self, decoded, settings, requests: list):
        """The picks of a decode step (decoded: `decode`'s; settings: the rows', their mode and wants;
        requests: each row's, None for padding) -> (the latest tokens [R], log-probabilities by row or
        None), on the devices."""
        (logits, plan), (arrays, mode, wants) = decoded, settings
        self.last, logprobs = self.picks.next(logits, self.last, plan, arrays, mode, wants, requests)
        return self.last, logprobs

    def run_checked(self, call):
        """call(cache, last, state) -> (outcome, cache, history, last, state): checked steps
        (decoding/checked.py) over the pool, the latest tokens and the draft's state, which this keeps
        -> (outcome, history)."""
        outcome, cache, history, self.last, self.state = call(self._cache(), self.last, self.state)
        self._keep(cache)
        return outcome, history

    def put_adapter(self, index: int, weights: Params | None) -> None:
        """Entry `index` of the parameters' table of served adapters set to `weights` (scales folded in;
        None: zeros), the parameters replaced whole (a step already queued keeps the ones it was given)."""
        if not 0 <= index < self.served:
            raise ValueError(f"adapter {index}: the engine serves {self.served} adapters")
        check_fits(self.params, weights or {}, what=f"adapter {index}")
        entry = table_entry(self.params, weights or {}, 1.0)  # the same shapes whatever the adapter: no compile
        tables = steps.set_entry(tables_of(self.params), self.put(np.int32(index)), entry)  # (the tables alone)
        self.params = with_tables(self.params, tables)

    def take_adapter(self, row: int, adapter: int | None) -> None:
        """A row's served adapter from its next step on (None: the base model); nothing without a table."""
        if self.served:
            self.adapters = steps.set_adapter(self.adapters, self.put(np.int32(row)),
                                              self.put(np.int32(-1 if adapter is None else adapter)))

    def _cache(self) -> dict:
        """The pool with its tables and the rows' adapters: what the decoding steps take (and donate)
        as a paged cache."""
        return {"pages": self.pool["pages"], "tables": self.tables, "adapters": self.adapters}

    def _keep(self, cache: dict) -> None:
        self.pool, self.tables, self.adapters = {"pages": cache["pages"]}, cache["tables"], cache["adapters"]

    def ready(self, outputs) -> None:
        """Wait for these outputs (a warm-up's)."""
        for x in jax.tree.leaves(outputs):
            np.asarray(x)
