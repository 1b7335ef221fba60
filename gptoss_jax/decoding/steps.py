"""The jitted steps decoding runs on, for `Generator` and the serving engine alike, over either KV
cache: the contiguous one (cache.py: row b of the cache is row b of the batch) or the paged pool
(paged_cache.py: {"pages", "tables"}, rows reached through their page tables).

- `prefill`: a chunk of each of P prompts (tokens [P, C], row p's first `counts[p]` real) continuing
  their caches at `starts` -> the logits at each row's last real token (and, for a draft head, the
  captured layers' outputs).
- `pick_first`: the first tokens of the rows whose chunk ended their prompt (`finishing`), each by
  its row's settings at its own sampling step, written into those rows' latest tokens.
- `decode`: n steps of B rows from the rows' latest tokens, each row's token picked by its own
  settings (`sample_rows`: row b draws with fold_in(key(seed_b), its sampling step), so its tokens
  do not depend on n or on the other rows), stopping rows at stop tokens and budgets on the
  devices; with no sampling mode, one step's model pass alone, its logits (the engine picks apart,
  after the host has made the grammars' masks).
- `pick_next`: each active row's next token by its settings, from a model pass's logits.
- The checked steps (checked.py) are the family's third member.

What changes from call to call comes as int32 plans: a prefill's [5, P] (rows, counts, starts,
finishing, sampling steps), a decode's [4, B] (rows, lengths, sampling steps: -1 a row not running,
budgets: the tokens each may still add). The sampling settings are arrays of every row [R]
(seeds, temperature, top_k, top_p, min_p, more ignored), gathered by the rows.

Legend: R = rows of the caller, P = prompts prefilled together, C = prefill chunk, B = rows decoded
together, V = vocab, G = the captured layers' outputs side by side.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..config import ModelConfig
from ..drafts.base import DeviceDraft, DraftContext, StepResult
from ..kernels import Kernels
from ..model.eagle3 import captured
from ..model.paged_cache import FULL
from ..model.transformer import Transformer
from ..sampling import sample_rows
from ..sharding import everywhere

# XLA's rematerialization pass never runs on the model steps. It counts a donated pool twice (the
# parameter and the updated pool it writes in place), so once the pool passes about half of the
# memory free after the weights it decides the step cannot fit and recomputes parts of it, Pallas
# kernels included: on one NVIDIA H200, gpt-oss-20b's decode step of 256 sequences over a pool of
# 78.6 GiB ran 11 of its kernels twice and took 21.00 ms against 18.38 over a pool of 12 GiB; from
# 45.4 GiB on it recomputed some (2026-11-26, docs/benchmarks.md). The steps need no recomputation:
# their temporaries are under 1.1 GiB beside the pool, which the allocator updates in place.
STEP_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


@dataclasses.dataclass(frozen=True)
class Model:
    """The target as the steps run it (a static argument): its config, kernels, mesh (None: one
    device) and the layers whose outputs a draft head reads (`capture`)."""

    config: ModelConfig
    kernels: Kernels = Kernels()
    mesh: Any = None
    capture: tuple[int, ...] = ()

    def apply(self, params, tokens, cache: dict, valid, logits_at=None):
        """The model over tokens [B, T] continuing `cache` -> (logits, the cache written, the captured
        layers' outputs [B, T, G] or None). A paged cache's "adapters" [B], where it has them: each
        row's served adapter (Transformer's `adapters`)."""
        module = Transformer(self.config, kernels=self.kernels, mesh=self.mesh, capture=self.capture)
        cache = dict(cache)
        adapters = cache.pop("adapters", None)
        if not self.capture:
            logits, written = module.apply({"params": params}, tokens, cache, valid, logits_at=logits_at,
                                           adapters=adapters)
            state = None
        else:
            (logits, written), state = module.apply({"params": params}, tokens, cache, valid, logits_at=logits_at,
                                                    adapters=adapters, mutable=["intermediates"])
            state = captured(state, self.capture)
        return logits, written, state


def view(cache: dict, rows, lengths) -> dict:
    """What the model reads and writes for these rows [B] at these lengths [B]: a paged pool through
    the rows' page tables; a contiguous cache (its rows are the call's) with those lengths."""
    if "tables" in cache:
        out = {"lengths": lengths, "tables": jnp.take(cache["tables"], rows, axis=1, mode="clip"), "pages": cache["pages"]}
        if "adapters" in cache:  # each row's served adapter
            out["adapters"] = jnp.take(cache["adapters"], rows, mode="clip")
        return out
    return {**cache, "lengths": lengths}


def stored(cache: dict, written: dict) -> dict:
    """The caller's cache after the model wrote `written` (its `view`'s result)."""
    if "tables" in cache:
        return {"pages": written["pages"], "tables": cache["tables"],
                **({"adapters": cache["adapters"]} if "adapters" in cache else {})}
    return written


@functools.partial(jax.jit, static_argnames=("model",), donate_argnames=("cache",), compiler_options=STEP_OPTIONS)
def prefill(model: Model, params, cache: dict, tokens, plan):
    """tokens [P, C] int32, plan [5, P] (rows, counts, starts, ...; a sixth row: the rows whose part of
    the cache starts at this chunk, else those starting at 0) -> (logits [P, V] float32 at each row's
    last real token, cache, the chunk as a draft head follows it (a StepResult) or None). A row of
    no tokens (counts 0) writes nothing."""
    rows, counts, starts = plan[0], plan[1], plan[2]
    valid = jnp.arange(tokens.shape[1])[None] < counts[:, None]  # [P, C]
    logits, written, states = model.apply(params, tokens, view(cache, rows, starts), valid,
                                          logits_at=jnp.maximum(counts - 1, 0))
    put = functools.partial(everywhere, mesh=model.mesh)
    step = None if states is None else StepResult(tokens, valid, put(states), starts,
                                                  plan[5] > 0 if plan.shape[0] > 5 else starts == 0)
    return put(logits), stored(cache, written), step


def pick_rows(logits, settings, rows, sample_steps, mode: str):
    """Each row's token [B] from its logits [B, V], by its row's settings at its sampling step."""
    picks = [jnp.take(x, rows, mode="clip") for x in settings[:5]]
    return sample_rows(logits, picks[0], jnp.maximum(sample_steps, 0), *picks[1:], mode=mode)


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_first(mesh, mode, logits, last, plan, settings):
    """logits [P, V], plan [5, P] (rows, -, -, finishing, sampling steps), the settings of every row
    -> (first tokens [P] int32, meaningful where finishing; last [R] with the finishing rows set to
    them)."""
    rows, finishing = plan[0], plan[3] > 0
    first = pick_rows(logits, settings, rows, plan[4], mode)
    at = jnp.where(finishing, rows, last.shape[0])  # rows not finishing: dropped
    return everywhere(first, mesh), everywhere(last.at[at].set(first, mode="drop"), mesh)


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_next(mesh, mode, logits, last, plan, settings):
    """logits [B, V], plan [4, B] (rows, -, sampling steps: -1 not running, -), the settings of every
    row -> (last [R],): the running rows' set to their next tokens."""
    rows, steps = plan[0], plan[2]
    at = jnp.where(steps >= 0, rows, last.shape[0])  # rows not running: dropped
    return (everywhere(last.at[at].set(pick_rows(logits, settings, rows, steps, mode), mode="drop"), mesh),)


@dataclasses.dataclass(frozen=True)
class Decode:
    """What a decode call is compiled for: the model, the steps it runs, the sampling mode of its rows
    (sampling.rows_mode; None: one step's model pass alone, its logits returned)."""

    model: Model
    steps: int = 1
    mode: str | None = None


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("cache",), compiler_options=STEP_OPTIONS)
def decode(spec: Decode, params, cache: dict, last, plan, settings=None, is_stop=None):
    """spec.steps decode steps of the plan's rows [4, B] (see the module) from their latest tokens
    last [R]; is_stop [V]: tokens that end a row (kept; None: none).

    -> with a mode: (the new tokens [steps, B], last, the plan after them, cache): a row stops at a
    stop token or its budget, and a step past every row's end writes nothing, so the host reads tokens
    once per call. Without one: (logits [B, V], cache, the step as a draft head follows it or None)
    of one step."""
    model = spec.model
    rows, lengths, sample_steps, budget = plan
    R = last.shape[0]

    def one(carry, _):
        cache, last, lengths, sample_steps, budget = carry
        running = (sample_steps >= 0) & (budget > 0)
        tokens = jnp.take(last, rows, mode="clip")[:, None]  # [B, 1]
        logits, written, states = model.apply(params, tokens, view(cache, rows, lengths), running[:, None])
        if spec.mode is None:
            step = None if states is None else StepResult(tokens, running[:, None], states, lengths,
                                                          jnp.zeros_like(running))
            return stored(cache, written), (logits[:, 0], step)
        new = pick_rows(logits[:, 0], settings, rows, sample_steps, spec.mode)
        last = last.at[jnp.where(running, rows, R)].set(new, mode="drop")
        ended = running & (False if is_stop is None else is_stop[new])
        sample_steps = jnp.where(ended, -1, sample_steps + running)
        carry = (stored(cache, written), last, lengths + running, sample_steps, budget - running)
        return carry, new

    if spec.mode is None:
        cache, (logits, step) = one((cache, last, lengths, sample_steps, budget), None)
        return everywhere(logits, model.mesh), cache, step
    (cache, last, lengths, sample_steps, budget), new = jax.lax.scan(
        one, (cache, last, lengths, sample_steps, budget), None, length=spec.steps)
    put = functools.partial(everywhere, mesh=model.mesh)
    return put(new), put(last), put(jnp.stack([rows, lengths, sample_steps, budget])), cache


@functools.partial(jax.jit, static_argnames=("model", "draft"), donate_argnames=("state",))
def follow(model: Model, draft: DeviceDraft, params, arrays, state, step: StepResult, rows, tables=None):
    """A draft source with a state (drafts/base.py) after a prompt chunk or a decode step of `rows`
    [B] (the caller's; R: padding): its observe -> its state. tables: a paged cache's [2, R, W]
    (None: a contiguous cache)."""
    table = None if tables is None else jnp.take(tables[FULL], rows, axis=0, mode="clip")
    context = DraftContext(None, None, arrays, state, params["embedding"], model.kernels, model.mesh, rows, None, table)
    return jax.tree.map(functools.partial(everywhere, mesh=model.mesh), draft.observe(context, step))
