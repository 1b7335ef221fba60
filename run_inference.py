#!/usr/bin/env python
"""Generate text with gpt-oss in JAX: the checkout's entry point, the same command line as the
installed `gptoss-generate` (gptoss_jax/cli/generate.py). `python run_inference.py --help` lists
every flag; with no --checkpoint it runs a built-in tiny demo model with random weights."""

from gptoss_jax.cli.generate import entry, main  # noqa: F401  (main: for callers and tests)

if __name__ == "__main__":
    entry(prog="run_inference.py")
