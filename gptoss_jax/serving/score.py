"""A prompt's own log-probabilities: for each token after the first, log p(token | the tokens before
it) under the model, and the k most likely tokens at that position (what a completions request with
`echo` and `logprobs` returns for its prompt, and what evaluation harnesses score choices by).

    chosen, ids, top = prompt_logprobs(config, params, prompt, k=5)
    # chosen [T-1] float32: token t's log-probability given tokens < t, for t = 1 .. T-1
    # ids [T-1, k] int32, top [T-1, k] float32: the k most likely tokens there, most likely first

The distribution is the model's own: log_softmax of its logits (temperature 1, no bias, penalty or
grammar). One forward pass over the whole prompt, without a cache, outside the engine's steps (it
runs beside them on the same devices); the logits are made a chunk of positions at a time, so that
a long prompt never holds [T, V] of them. Prompts are padded to a power of two (at least 64) so that
each length class compiles once, whatever k; padding after the prompt cannot reach it (attention is
causal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..kernels import Kernels
from ..model.transformer import Transformer
from ..sampling import TOP_LOGPROBS
from ..sharding import mesh_of, on_every_device

CHUNK = 256  # positions whose logits [CHUNK, V] float32 are held at once (201 MB for gpt-oss)
SHORTEST = 64  # the smallest padded length


def padded_length(n: int) -> int:
    """The compiled length a prompt of n tokens runs at: the next power of two, at least SHORTEST."""
    return max(SHORTEST, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("config", "kernels", "mesh"))
def _score(config: ModelConfig, params, tokens: jax.Array, kernels: Kernels, mesh):
    # tokens [1, L] (L a multiple of CHUNK or shorter than it) -> chosen [L], ids [L, k], top [L, k]
    # (k = TOP_LOGPROBS: the most any request asks for, one compiled pass per length class):
    # position t scores tokens[t + 1] (the last position scores a padding token, dropped by the caller)
    hidden = Transformer(config, kernels=kernels, mesh=mesh).apply({"params": params}, tokens, hidden=True)[0]
    L, D = hidden.shape
    C = min(CHUNK, L)
    targets = jnp.roll(tokens[0], -1).reshape(L // C, C)
    unembedding = params["unembedding"]

    def chunk(xs):
        x, t = xs  # [C, D], [C]
        logits = jnp.einsum("cd,dv->cv", x, unembedding, preferred_element_type=jnp.float32)
        logprobs = jax.nn.log_softmax(logits, axis=-1)
        chosen = jnp.take_along_axis(logprobs, t[:, None], axis=-1)[:, 0]
        top, ids = jax.lax.top_k(logprobs, TOP_LOGPROBS)
        return chosen, ids.astype(jnp.int32), top

    chosen, ids, top = jax.lax.map(chunk, (hidden.reshape(L // C, C, D), targets))
    return chosen.reshape(L), ids.reshape(L, TOP_LOGPROBS), top.reshape(L, TOP_LOGPROBS)


def prompt_logprobs(config: ModelConfig, params, prompt: list[int], *, k: int = 0,
                    kernels: Kernels = Kernels()) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(chosen [T-1], ids [T-1, k], top [T-1, k]) of a prompt of T >= 1 token ids (see the module).
    ValueError for ids outside the vocabulary, k outside [0, TOP_LOGPROBS], or several processes (a
    pass of one process's own would leave the others' devices out of the program)."""
    if not 0 <= k <= TOP_LOGPROBS:
        raise ValueError(f"k must lie in [0, {TOP_LOGPROBS}], got {k}")
    if not prompt or min(prompt) < 0 or max(prompt) >= config.vocab_size:
        raise ValueError(f"a prompt of token ids in [0, {config.vocab_size}) is needed")
    if jax.process_count() > 1:
        raise ValueError("a prompt's log-probabilities are computed on one process only")
    T = len(prompt)
    L = padded_length(T)
    tokens = np.zeros((1, L), np.int32)
    tokens[0, :T] = prompt
    mesh = mesh_of(params)
    # The top TOP_LOGPROBS always, cut to k here: one compiled pass per length class, whatever k.
    chosen, ids, top = _score(config, params, on_every_device(jnp.asarray(tokens), mesh), kernels, mesh)
    chosen, ids, top = jax.device_get((chosen, ids, top))
    return chosen[:T - 1], ids[:T - 1, :k], top[:T - 1, :k]
