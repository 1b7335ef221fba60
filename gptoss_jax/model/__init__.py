"""The model: the GPT-OSS transformer as Flax modules (transformer.py: `Transformer`, `forward`,
`extend`), its layers (layers.py, attention.py, moe.py), the KV caches they read and write
(cache.py: contiguous; paged_cache.py: a pool of pages), and EAGLE-3 draft heads (eagle3.py)."""

from .transformer import Transformer, TransformerBlock, extend, forward

__all__ = ["Transformer", "TransformerBlock", "extend", "forward"]
