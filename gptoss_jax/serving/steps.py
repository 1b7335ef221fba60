"""The serving engine's jitted steps over one static KV cache of S slots [S, max_len], and the latest
token of every slot [S], which stays on the devices (a decode step's input is the step before's
output, so the host queues steps without reading their tokens first; it is never donated, since the
host may still be reading it).

- `prefill_slots`: a chunk of each of P requests' prompts into their slots (tokens [P, C], row p's
  first `counts[p]` real). The slots' caches are gathered, extended, and scattered back in place
  (the cache is donated); `resets` starts a slot over at position 0, which hides whatever an
  earlier request left there (a slot's positions past its length are never read). -> the logits
  at each row's last real token.
- `pick_first`: the first tokens of the rows whose chunk ended their prompt (`finishing`), each by
  its own settings, written into those slots' latest tokens.
- `decode_slots`: the logits of one step of every slot at once, from the slots' latest tokens;
  a slot whose `steps` entry is -1 does not decode this step (computed, but its cache neither
  grows nor changes).
- `pick_next`: each active slot's next token by its own settings (`steps`: each slot's sampling
  step); an idle slot keeps its latest token.

The picks are apart from the model steps so that the sampling's `mode` (`sampling.rows_mode`: the
argmax alone, a draw, or a draw after a sort of the vocabulary) is chosen on the host for the rows
at hand, without compiling the model step three times or branching on the device.

Shapes depend only on (S, max_len, P, C), so the engine compiles each step once per P it uses and
each pick once per mode.

Legend: S = slots, P = prompts prefilled together, C = prefill chunk, V = vocab.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..model import Transformer
from ..sampling import sample_rows
from ..sharding import everywhere


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("cache",))
def prefill_slots(config, kernels, mesh, params, cache, slots, tokens, counts, resets):
    """A chunk of P requests' prompts at once: slots, counts [P] int32 and resets [P] bool, tokens
    [P, C] int32 (row p's first counts[p] real); a row whose slot is S (past the last) is padding,
    computed and dropped. -> (logits [P, V] float32 at each row's last real token, cache)."""
    part = jax.tree.map(lambda x: jnp.take(x, slots, axis=0, mode="clip"), cache)
    part["lengths"] = jnp.where(resets, 0, part["lengths"])
    valid = jnp.arange(tokens.shape[1])[None] < counts[:, None]  # [P, C]
    logits, part = Transformer(config, kernels=kernels, mesh=mesh).apply(
        {"params": params}, tokens, part, valid, logits_at=jnp.maximum(counts - 1, 0))
    cache = jax.tree.map(lambda full, new: full.at[slots].set(new, mode="drop"), cache, part)
    return everywhere(logits, mesh), cache


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_first(mesh, mode, logits, last, slots, finishing, seeds, temperature, top_k, top_p, min_p):
    """logits [P, V], slots and the settings [P] -> (first tokens [P] int32 (their sampling step 0;
    meaningful where finishing), last [S] with the finishing rows' slots set to them)."""
    first = sample_rows(logits, seeds, jnp.zeros_like(seeds), temperature, top_k, top_p, min_p, mode)
    last = last.at[jnp.where(finishing, slots, last.shape[0])].set(first, mode="drop")
    return everywhere(first, mesh), everywhere(last, mesh)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("cache",))
def decode_slots(config, kernels, mesh, params, cache, last, steps):
    """last (each slot's latest token) and steps (each slot's sampling step, -1: idle) [S] int32
    -> (logits [S, V], cache)."""
    active = steps >= 0
    logits, cache = Transformer(config, kernels=kernels, mesh=mesh).apply({"params": params}, last[:, None], cache,
                                                                         active[:, None])
    return logits[:, 0], cache


@functools.partial(jax.jit, static_argnames=("mesh", "mode"))
def pick_next(mesh, mode, logits, last, steps, seeds, temperature, top_k, top_p, min_p):
    """logits [S, V], steps (-1: idle) and the settings [S] -> the next tokens [S] int32 (an idle
    slot's stays its latest)."""
    next_tokens = sample_rows(logits, seeds, jnp.maximum(steps, 0), temperature, top_k, top_p, min_p, mode)
    return everywhere(jnp.where(steps >= 0, next_tokens, last), mesh)
