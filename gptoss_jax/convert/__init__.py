"""Convert a published GPT-OSS checkpoint (original, Hugging Face MXFP4 or Hugging Face bf16) into a
gptoss-jax Orbax checkpoint: `gptoss-convert SOURCE_DIR OUTPUT_DIR` (or `python -m gptoss_jax.convert`).

    from gptoss_jax.convert import convert_checkpoint
    convert_checkpoint("gpt-oss-20b/original", "~/ckpt/gpt-oss-20b")
"""

from __future__ import annotations

__all__ = ["ConversionError", "Interrupted", "OptionError", "Summary", "convert_checkpoint", "plan_conversion",
           "write_checkpoint"]


def __getattr__(name: str):  # lazy, so that the command line answers --help and signals at once
    if name in __all__:
        from . import pipeline

        return getattr(pipeline, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
