#!/usr/bin/env python
"""Generate text with gpt-oss in JAX: the checkout's entry point, the same command line as the
installed `gptoss-generate` (gptoss_jax/cli/generate.py). `python run_inference.py --help` lists
every flag; with no --checkpoint it runs a built-in tiny demo model with random weights."""

import sys

from gptoss_jax.cli.generate import main

if __name__ == "__main__":
    sys.exit(main(prog="run_inference.py"))
