"""`late_map`: `jax.lax.map` whose output buffers XLA cannot allocate ahead of time.

`lax.map` (a scan) starts from output buffers filled with zeros: broadcasts of a constant, which
depend on nothing. XLA is free to compute them whenever it likes, and it does so early: on a GPU it
merges such broadcasts, from every layer of a model and from the forward and backward passes
alike, into a few fusions at the start of the program. Training the 20b at 16K positions, that
kept each layer's attention output and query-gradient buffers (float32, 256 MiB each) alive for the
whole step: 13.3 of the step's 26.6 GiB of temporaries.

Here the zeros hang on `anchor`, an array the loop's own inputs come from, through an optimization
barrier: XLA cannot see that they are zeros or create them before `anchor` exists, so each buffer
lives from its own layer's loop to its consumer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def zeros_after(shape, dtype, anchor) -> jax.Array:
    """Zeros [shape] that XLA cannot create before `anchor` (any array) is computed."""
    zero, _ = jax.lax.optimization_barrier((jnp.zeros((), dtype), jax.lax.stop_gradient(anchor)))
    return jnp.broadcast_to(zero, shape)


def late_map(f, xs, *, anchor):
    """`jax.lax.map(f, xs)`, each output [n, ...] written into a buffer created after `anchor`."""
    n = jax.tree.leaves(xs)[0].shape[0]
    outs = jax.eval_shape(f, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs))
    init = jax.tree.map(lambda o: zeros_after((n,) + o.shape, o.dtype, anchor), outs)

    def body(i, buffers):
        ys = f(jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), xs))
        return jax.tree.map(lambda b, y: jax.lax.dynamic_update_index_in_dim(b, y, i, 0), buffers, ys)

    return jax.lax.fori_loop(0, n, body, init)
