#!/usr/bin/env python
"""Run gpt-oss in JAX.

This release runs the model without a KV cache: each new token is one full forward pass over a
fixed-size buffer (compiled once). With no checkpoint it uses the built-in tiny demo model with
RANDOM weights, so the whole pipeline can be seen working in seconds on a CPU; its output tokens
are meaningless. Checkpoint loading, the tokenizer, chat, sampling and a cached decoder come next
(see the README's roadmap).

    python run_inference.py                        # tiny demo model, a default prompt
    python run_inference.py --prompt-ids 1,2,3 --max-new-tokens 8 --dtype float32
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import gptoss_jax as gj
from gptoss_jax.testing import random_params


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-ids", type=parse_ids, default=[1, 2, 3, 4, 5, 6, 7, 8],
                        help="prompt as comma-separated token ids (default: 1,...,8)")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="tokens to generate, greedily (default: 16)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="parameter and activation dtype (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the demo model's random weights (default: 0)")
    args = parser.parse_args(argv)

    config = gj.ModelConfig.tiny()
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    bad = [i for i in args.prompt_ids if not 0 <= i < config.vocab_size]
    if bad:
        parser.error(f"--prompt-ids: ids {bad} are outside the demo model's vocabulary [0, {config.vocab_size})")

    print(f"gptoss-jax {gj.__version__}, jax {jax.__version__} on {jax.devices()[0].platform}")
    print(f"model: built-in tiny demo ({gj.param_count(gj.abstract_params(config)) / 1e6:.1f} M parameters, "
          f"RANDOM weights, seed {args.seed}): the tokens below are meaningless")
    params = random_params(config, seed=args.seed, dtype=jnp.dtype(args.dtype))

    prompt = args.prompt_ids
    total = len(prompt) + args.max_new_tokens
    buffer = np.zeros((1, total), np.int32)  # fixed shape: one compilation for every step
    buffer[0, : len(prompt)] = prompt
    step = jax.jit(lambda p, toks, pos: jnp.argmax(gj.Transformer(config).apply({"params": p}, toks)[0, pos]))

    start = time.perf_counter()
    generated = []
    for pos in range(len(prompt) - 1, total - 1):
        token = int(step(params, buffer, pos))  # causal: the zeros after `pos` do not affect it
        buffer[0, pos + 1] = token
        generated.append(token)
        if len(generated) == 1:
            first = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    print(f"prompt ids: {','.join(map(str, prompt))}")
    print(f"output ids: {','.join(map(str, generated))}")
    print(f"time to first token {first:.2f} s (includes compilation); "
          f"{len(generated) / elapsed:.1f} tokens/s overall, uncached")
    return 0


if __name__ == "__main__":
    sys.exit(main())
