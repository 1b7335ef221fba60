import sys

from gptoss_jax.convert.cli import main

sys.exit(main(prog="python -m convert"))
