"""The serving engine's two jitted steps over one static KV cache of S slots [S, max_len].

- `prefill_slots`: a chunk of each of P requests' prompts into their slots (tokens [P, C], row p's
  first `counts[p]` real). The slots' caches are gathered, extended, and scattered back in place
  (the cache is donated); `resets` starts a slot over at position 0, which hides whatever an
  earlier request left there (a slot's positions past its length are never read). Returns the
  logits at each row's last real token [P, V].
- `decode_slots`: one token for every slot at once (tokens [S], active [S]: inactive slots are
  computed but neither grow nor change their cache), each row sampled by its own settings
  (`sampling.sample_rows`).

Shapes depend only on (S, max_len, P, C), so the engine compiles each step once per P it uses.

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


@functools.partial(jax.jit, static_argnames=("mesh",))
def sample_first(mesh, logits, seed, step, temperature, top_k, top_p, min_p):
    """Requests' first tokens, from their prompts' last logits [P, V] (their sampling step 0) -> [P]."""
    return everywhere(sample_rows(logits, seed, step, temperature, top_k, top_p, min_p), mesh)


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"), donate_argnames=("cache",))
def decode_slots(config, kernels, mesh, params, cache, tokens, active, seeds, steps, temperature, top_k, top_p,
                 min_p):
    """tokens, active and the sampling arrays [S] -> (next tokens [S] int32, cache)."""
    logits, cache = Transformer(config, kernels=kernels, mesh=mesh).apply({"params": params}, tokens[:, None], cache,
                                                                         active[:, None])
    next_tokens = sample_rows(logits[:, 0], seeds, steps, temperature, top_k, top_p, min_p)
    return everywhere(next_tokens, mesh), cache
