import sys

from .cli import main

sys.exit(main(prog="python -m gptoss_jax.convert"))
