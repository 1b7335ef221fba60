"""`python -m gptoss_jax.serving`: the OpenAI-compatible server, `gptoss-serve` (server/cli.py)."""

from ..server.cli import entry

if __name__ == "__main__":
    entry("python -m gptoss_jax.serving")
