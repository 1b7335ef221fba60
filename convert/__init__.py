"""`python -m convert` from a checkout: the converter lives in `gptoss_jax.convert` (installed as
the `gptoss-convert` command); this folder only keeps the short form working at the repository root."""
