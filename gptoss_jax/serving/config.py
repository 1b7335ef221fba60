"""The serving engine's settings, in one frozen object that `Engine`, gptoss-serve's flags and the
benchmarks share, with one set of defaults (gptoss-serve's)."""

from __future__ import annotations

import dataclasses

from ..fp8 import KV_DTYPES


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: the most sequences running at once (rows of the page tables; a decode step runs the
    smallest of `decode_sizes` that holds those past their prompts); None: from the pool's size where
    the device says its memory (scheduler.slots_for: one a 2,048 positions, a power of two from 16 to
    1,024), else 16. max_len: the longest sequence,
    prompt and reply (None: the model's context). prefill_chunk, prefill_rows: prompt tokens of a
    sequence, and prompts, prefilled per step (prefill_rows None: 4, or 8 from 256 slots,
    scheduler.prefill_rows_for). max_waiting: requests queued beyond those the free
    rows take. page_size: positions of a KV cache page. pages / kv_memory: the pool's size in pages,
    or in bytes (default: paged_cache.POOL_SHARE of the device memory free after the weights; where
    JAX does not say, room for `slots` sequences of 8,192 positions and one of `max_len`). kv_dtype:
    the pool's storage, "bf16" or "fp8" (e4m3 with a power-of-two scale per vector of keys or values,
    fp8.py: 1.97 times the positions in the same memory); None: the model's activations' dtype.
    prefix_reuse False: every prompt is computed whole (for comparison). With a draft source
    (speculation.py): steps of at most `speculate_rows` decoding sequences check `draft_tokens`
    drafted tokens each, drafted on the host a step at a time (speculate_steps 0), or up to
    `speculate_steps` a call on the devices."""

    slots: int | None = None
    max_len: int | None = None
    prefill_chunk: int = 512
    prefill_rows: int | None = None
    max_waiting: int = 1024
    page_size: int = 64
    pages: int | None = None
    kv_memory: int | None = None
    kv_dtype: str | None = None
    decode_sizes: tuple[int, ...] | None = None  # None: decode_sizes_for(slots)
    prefix_reuse: bool = True
    draft_tokens: int = 3
    speculate_rows: int = 16
    speculate_steps: int = 0

    def __post_init__(self):
        if self.slots is not None and self.slots < 1:
            raise ValueError(f"slots must be at least 1, got {self.slots}")
        for name, least in (("prefill_chunk", 1), ("prefill_rows", 1), ("page_size", 1), ("max_waiting", 0),
                            ("draft_tokens", 1), ("speculate_rows", 1), ("speculate_steps", 0)):
            if getattr(self, name) is not None and getattr(self, name) < least:
                raise ValueError(f"{name} must be at least {least}, got {getattr(self, name)}")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the model's dtype), got "
                             f"{self.kv_dtype!r}")
        if self.max_len is not None and self.max_len < 1:
            raise ValueError(f"max_len must be at least 1, got {self.max_len}")
        if self.draft_tokens >= self.prefill_chunk:  # (the pool's bound on a sequence's sliding pages)
            raise ValueError(f"draft_tokens must be less than prefill_chunk ({self.prefill_chunk}), got "
                             f"{self.draft_tokens}")
        if self.decode_sizes is not None:
            if self.slots is None:
                raise ValueError("decode_sizes need slots given")
            sizes = tuple(sorted(set(self.decode_sizes)))
            if sizes[-1] != self.slots or sizes[0] < 1:
                raise ValueError(f"decode sizes {list(sizes)} must lie in [1, {self.slots}] and include {self.slots}")
            object.__setattr__(self, "decode_sizes", sizes)

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
