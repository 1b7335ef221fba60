"""The serving engine's jitted steps over the paged KV cache (paged_cache.py): the pool of pages, the
page tables [2, R, W] and the latest token of every row [R] stay on the devices; the host sends each
step the rows it runs and where their sequences stand. The latest tokens are never donated (the host
may still be reading them): a decode step's input is the step before's output, so the host queues
steps without reading their tokens first.

- `write_tables`: set table entries (group, row, column) -> page, U at a time (padding: row R, dropped).
- `prefill_rows`: a chunk of each of P sequences' prompts (tokens [P, C], row p's first `counts[p]`
  real) continuing their caches at `starts` (positions already cached, reused or prefilled) -> the
  logits at each row's last real token; the pool is donated and written in place.
- `pick_first`: the first tokens of the rows whose chunk ended their prompt (`finishing`), each by its
  own settings at its own sampling step, written into those rows' latest tokens.
- `decode_rows`: one step of B rows (a bucket of the running ones; `active` false: padding, whose
  cache is neither read for a result nor written) from the rows' latest tokens -> logits [B, V].
- `pick_next`: each active row's next token by its settings (held per row [R], gathered) -> the
  latest tokens [R], those rows' replaced.

The picks are apart from the model steps so that the sampling's `mode` (`sampling.rows_mode`) is
chosen on the host for the rows at hand, without compiling the model step three times or branching
on the device. Shapes depend only on (R, W, pool, P, C, B), so nothing compiles with the traffic.

Legend: R = rows, W = table width, P = prompts prefilled together, C = prefill chunk, B = rows
decoded together, V = vocab, U = table entries set together.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model import Transformer
from ..sampling import sample_rows
from ..sharding import everywhere


@functools.partial(jax.jit, donate_argnames=("tables",))
def write_tables(tables, groups, rows, cols, pages):
    """tables [2, R, W]; groups, rows, cols, pages [U] int32 (row R: padding) -> tables."""
    return tables.at[groups, rows, cols].set(pages, mode="drop")


def _view(pool, tables, rows, lengths) -> dict:
    return {"lengths": lengths, "tables": jnp.take(tables, rows, axis=1, mode="clip"), "pages": pool["pages"]}


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("pool",))
def prefill_rows(config, kernels, mesh, params, pool, tables, rows, tokens, counts, starts):
    """rows, counts and starts [P] int32, tokens [P, C] int32 -> (logits [P, V] float32 at each row's
    last real token, pool). A padding row (counts 0) writes nothing."""
    valid = jnp.arange(tokens.shape[1])[None] < counts[:, None]  # [P, C]
    logits, view = Transformer(config, kernels=kernels, mesh=mesh).apply(
        {"params": params}, tokens, _view(pool, tables, rows, starts), valid, logits_at=jnp.maximum(counts - 1, 0))
    return everywhere(logits, mesh), {"pages": view["pages"]}


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_first(mesh, mode, logits, last, rows, finishing, steps, seeds, temperature, top_k, top_p, min_p):
    """logits [P, V]; rows, finishing, each row's sampling step and its settings [P] -> (first tokens
    [P] int32, meaningful where finishing; last [R] with the finishing rows set to them)."""
    first = sample_rows(logits, seeds, steps, temperature, top_k, top_p, min_p, mode)
    last = last.at[jnp.where(finishing, rows, last.shape[0])].set(first, mode="drop")
    return everywhere(first, mesh), everywhere(last, mesh)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("pool",))
def decode_rows(config, kernels, mesh, params, pool, tables, last, rows, lengths, active):
    """rows, lengths (each row's cached positions) and active [B] -> (logits [B, V], pool)."""
    tokens = jnp.take(last, rows, mode="clip")[:, None]  # [B, 1]
    logits, view = Transformer(config, kernels=kernels, mesh=mesh).apply(
        {"params": params}, tokens, _view(pool, tables, rows, lengths), active[:, None])
    return logits[:, 0], {"pages": view["pages"]}


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_next(mesh, mode, logits, last, rows, steps, seeds, temperature, top_k, top_p, min_p):
    """logits [B, V], rows and steps [B] (-1: padding), the settings of every row [R] -> last [R]."""
    settings = [jnp.take(x, rows, mode="clip") for x in (seeds, temperature, top_k, top_p, min_p)]
    next_tokens = sample_rows(logits, settings[0], jnp.maximum(steps, 0), *settings[1:], mode=mode)
    return everywhere(last.at[jnp.where(steps >= 0, rows, last.shape[0])].set(next_tokens, mode="drop"), mesh)
