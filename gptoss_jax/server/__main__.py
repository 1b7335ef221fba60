"""`python -m gptoss_jax.server`: the OpenAI-compatible server, `gptoss-serve` (cli.py)."""

from .cli import entry

if __name__ == "__main__":
    entry("python -m gptoss_jax.server")
