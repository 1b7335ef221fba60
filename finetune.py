#!/usr/bin/env python
"""Fine-tune gpt-oss in JAX: the checkout's entry point, the same command line as the installed
`gptoss-finetune` (gptoss_jax/cli/finetune.py). `python finetune.py --help` lists every flag; with
no --checkpoint it trains the built-in tiny demo model with random weights."""

from gptoss_jax.cli.finetune import entry, main  # noqa: F401  (main: for callers and tests)

if __name__ == "__main__":
    entry(prog="finetune.py")
