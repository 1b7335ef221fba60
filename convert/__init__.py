"""Convert a published GPT-OSS checkpoint (original, Hugging Face MXFP4 or Hugging Face bf16) into a
gptoss-jax Orbax checkpoint: `python -m convert SOURCE_DIR OUTPUT_DIR`."""

from .pipeline import ConversionError, Summary, convert_checkpoint

__version__ = "0.1.0"
__all__ = ["ConversionError", "Summary", "convert_checkpoint", "__version__"]
