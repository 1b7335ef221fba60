"""What gptoss-serve says and checks of its engine at start-up: the KV cache's line, whether the
pool holds one request of the whole context."""

from __future__ import annotations


def kv_cache_line(engine) -> str:
    """The start-up's account of the KV cache: its pages, the tokens they hold, their memory, and the
    sequences it serves at once (and how they were chosen, where by the cache's size)."""
    import jax.numpy as jnp

    from .. import fp8
    from ..model.paged_cache import page_bytes

    pages, size = engine.scheduler.pages.count, engine.page_size
    memory = pages * page_bytes(engine.config, size, engine.device.kv_dtype)
    unit = next(u for u in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")) if memory >= u[0] / 10 or u[1] == "KiB")
    memory = f"{memory / unit[0]:.1f} {unit[1]}"
    reuse = "" if engine.scheduler.reuse else "; prefix cache off"
    stored = "FP8 (e4m3)" if fp8.is_fp8(engine.device.kv_dtype) else jnp.dtype(engine.device.kv_dtype).name
    how = " (by the cache's size: one per 2,048 tokens, a power of two from 16 to 1,024)" if engine.slots_by_pool else ""
    return (f"KV cache: {pages:,} pages of {size} positions ({engine.pool_tokens:,} tokens) in {stored}, "
            f"{memory}{reuse}; {engine.slots:,} sequences at once{how}; prompts prefilled "
            f"{engine.prefill_shapes[-1]} x {engine.prefill_chunk} tokens a step")


def check_pool(engine, max_len: int) -> None:
    """ValueError when the pool cannot hold one request of the whole context alone (it would be refused
    as too long for the KV cache, though within --max-context)."""
    need, pages = engine.scheduler.pages_alone(max_len), engine.scheduler.pages.count
    if need > pages:
        raise ValueError(f"the KV cache's {pages:,} pages ({engine.pool_tokens:,} positions) cannot hold one request "
                         f"of --max-context {max_len:,}, which needs {need:,} (its full and sliding layers' pages): "
                         f"give the cache more memory (--kv-memory-gb) or lower --max-context")
