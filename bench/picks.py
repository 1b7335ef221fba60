"""The serving engine's token picks for one decode step (serving/steps.py), timed on the device for each
sampling mode with and without what some requests add around the pick (adjusted logits: logit bias,
penalties, a grammar's mask; their tokens counted; log-probabilities), alone and behind a stand-in for
the decode step that the engine queues before them.

    python bench/picks.py [--sizes 1,64] [--calls 200]

Alone, the picks of a small batch take about as long as the host takes to queue their programs; behind
a model step (a stand-in of about 2 ms on one NVIDIA H200: a bfloat16 [16, 8192] x [8192, 8192] product
64 times), the host queues them while the device runs the step, as the engine does. Inputs: logits
[B, 201088] float32 from a fixed seed, every row sampled at temperature 0.8 with top-k 50 and top-p 0.9
(used by "rank" only), an all-allowed mask. Each figure is the best of three runs of `--calls` steps
queued back to back, in microseconds a step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

from gptoss_jax.decoding.steps import pick_next  # noqa: E402
from gptoss_jax.serving import steps  # noqa: E402

V = 201088
CASES = (("greedy", False, False), ("draw", False, False), ("rank", False, False), ("greedy", True, False),
         ("draw", True, True), ("rank", True, True))  # mode, log-probabilities, adjusted


def stand_in():
    """A jitted step of about 2 ms on one NVIDIA H200, and its input."""
    w = jnp.asarray(np.random.default_rng(1).normal(size=(8192, 8192)).astype(np.float32) / 90, jnp.bfloat16)

    @jax.jit
    def model(x):
        return jax.lax.fori_loop(0, 64, lambda i, x: jnp.tanh(x @ w), x)
    return model, jnp.ones((16, 8192), jnp.bfloat16)


def timed(step, calls: int) -> float:
    """Best of three: microseconds a call of `step` (state -> state), `calls` calls queued back to back."""
    state = step(step(None))  # compiled, then once more
    jax.block_until_ready(state)
    best = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            state = step(state)
        jax.block_until_ready(state)
        best.append((time.perf_counter() - start) / calls * 1e6)
    return min(best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,64", help="rows decoded together, comma-separated (default: 1,64)")
    parser.add_argument("--calls", type=int, default=200, help="steps queued back to back per run (default: 200)")
    args = parser.parse_args()
    model, hidden = stand_in()
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}; the stand-in step alone: "
          f"{timed(lambda h: model(hidden if h is None else h), args.calls):.1f} us")
    table = []
    for B in map(int, args.sizes.split(",")):
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(B, V)).astype(np.float32) * 3)
        plan = jnp.asarray(np.stack([np.arange(B), np.full(B, 100), np.arange(B), np.ones(B)]).astype(np.int32))
        host = steps.sampling_arrays(B)
        host[1][:], host[2][:], host[3][:] = 0.8, 50, 0.9  # temperature, top-k, top-p
        settings = tuple(jnp.asarray(x) for x in host)
        mask = jnp.full((B, steps.mask_words(V)), -1, jnp.int32)
        for mode, logprobs, adjusted in CASES:
            def picks(state, behind: bool):
                last, counts, hidden_in = (state or (jnp.zeros(B, jnp.int32), jnp.zeros((B, V), jnp.int16), hidden))[:3]
                hidden_out = model(hidden_in) if behind else hidden_in
                x = steps.adjust_rows(logits, plan, settings, counts, mask) if adjusted else logits
                (last,) = pick_next(None, mode, x, last, plan, settings)
                if adjusted:
                    counts = steps.count_next(None, counts, plan, last, counted=V)
                out = steps.logprobs_next(None, x, plan, settings, last) if logprobs else ()
                return last, counts, hidden_out, out
            table.append((B, mode, logprobs, adjusted, timed(lambda s: picks(s, False), args.calls),
                          timed(lambda s: picks(s, True), args.calls)))
            print(*table[-1], flush=True)
    print("\n| B | mode | log-probabilities | adjusted | alone (us) | behind the stand-in step (us) |")
    print("|---|---|---|---|---|---|")
    for B, mode, logprobs, adjusted, alone, behind in table:
        print(f"| {B} | {mode} | {'yes' if logprobs else 'no'} | {'yes' if adjusted else 'no'} | {alone:.1f} | "
              f"{behind:.1f} |")


if __name__ == "__main__":
    main()
