"""The command lines: generation (`gptoss-generate`, i.e. run_inference.py) in generate.py, with its
input checks (inputs.py), what it shows (display.py) and the interactive chat (repl.py). The
converter's command line is gptoss_jax.convert.cli."""
