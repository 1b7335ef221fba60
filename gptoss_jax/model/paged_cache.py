"""The paged KV cache: keys and values in a pool of pages of P positions, found through page tables.

    pool   {"pages": [{"k": [N, P, K, H], "v": [N, P, K, H]}, ...]}   one storage per layer pair
    tables int32 [2, R, W]    tables[g, r, i]: the page holding positions [i P, (i + 1) P) of the
                              sequence in row r, for the layers of group g (0: full, 1: sliding)
    a step's view of it, for B sequences (rows gathered from the tables):
    cache  {"lengths": [B], "tables": [2, B, W], "pages": [...]}  (and "adapters" [B] where the rows
                              run served adapters: decoding/steps.py passes them to the model)

The layers of one kind form a group: full-attention layers (group 0) keep every position of a
sequence; sliding-window layers (group 1) need only the last `window` positions, so the host frees
their older pages (serving/pages.py) and a step reads `window_pages` of them at most. A page id
belongs to one group at a time and holds that group's keys and values for all of the group's layers:
the n-th layer of each group keeps them in storage n, so a full layer and a sliding layer share a
storage array (gpt-oss alternates the two kinds, 12 of each in the 20b), and one pool of page ids
serves both groups with no memory set aside for either.

A table entry past a sequence's length (or a sliding page out of its window) may name a page that
another sequence owns now: the attention never reads positions at or past a sequence's length, or
out of a sliding layer's window, and a step writes only at the positions of its new tokens.

Legend: N = pages in the pool, P = positions a page, K = KV heads, H = head dim, R = rows (running
sequences), W = table width (pages of the longest context), B = sequences of one step.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import fp8
from ..config import ModelConfig
from ..kernels import write_pages
from ..sharding import constrain, sharding, zeros_on_devices

FULL, SLIDING = 0, 1
POOL_SHARE = 0.85  # of the device memory free after the weights, for the pool when no size is given
POOL_AXES = ("kv_pages", "page_slots", "kv_heads", "head_dim")


@dataclasses.dataclass(frozen=True)
class PoolSize:
    """A pool's pages: `pages` of `page_size` positions, keys and values stored in `dtype`
    (float8_e4m3fn: FP8 storage, fp8.py)."""

    pages: int
    page_size: int
    dtype: Any = jnp.bfloat16


def group_of(config: ModelConfig, layer: int) -> int:
    return SLIDING if config.is_sliding(layer) else FULL


def storage_of(config: ModelConfig, layer: int) -> int:
    """The storage a layer keeps its pages in: its rank among the layers of its group."""
    return sum(group_of(config, n) == group_of(config, layer) for n in range(layer))


def storages(config: ModelConfig) -> int:
    kinds = [group_of(config, n) for n in range(config.num_hidden_layers)]
    return max(kinds.count(FULL), kinds.count(SLIDING))


def table_width(max_len: int, page_size: int) -> int:
    """Pages of the longest context (a table row's width)."""
    return -(-max_len // page_size)


def window_pages(config: ModelConfig, page_size: int) -> int:
    """Pages a sliding layer reads for the positions before a step's first new token: those of the
    last window - 1 positions, wherever a page boundary falls."""
    return pages_for_window(config.sliding_window, page_size)


def pages_for_window(window: int, page_size: int) -> int:
    return -(-(window - 1) // page_size) + 1


def page_bytes(config: ModelConfig, page_size: int, dtype=jnp.bfloat16) -> int:
    """Device memory of one page id (keys and values of one group's layers, P positions)."""
    per_position = 2 * config.num_key_value_heads * fp8.vector_bytes(config.head_dim, dtype)
    return storages(config) * page_size * per_position


def pool_pages(config: ModelConfig, page_size: int, dtype, kv_memory: int | None, *, extra: int = 0) -> int | None:
    """Pages in `kv_memory` bytes, each taking `extra` bytes beside its own (a draft head's cache); by
    default in `POOL_SHARE` of the memory the first device has free (after the weights), or None where
    JAX does not say (a CPU)."""
    per_page = page_bytes(config, page_size, dtype) + extra
    if kv_memory is None:
        stats = jax.local_devices()[0].memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        kv_memory = int(POOL_SHARE * (stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    if kv_memory < per_page:
        raise ValueError(f"{kv_memory / 2**20:.1f} MiB of KV memory holds no page of {per_page / 2**20:.2f} MiB")
    pages = kv_memory // per_page
    if jax.process_count() > 1:  # every process runs the same steps, so they hold the same pool: the smallest
        from jax.experimental import multihost_utils  # (here: only with several processes)

        pages = int(np.min(multihost_utils.process_allgather(np.array([pages], np.int64), tiled=True)))
    return pages


def pool_shapes(config: ModelConfig, pages: int, page_size: int, dtype=jnp.bfloat16) -> dict:
    """The pool's `jax.ShapeDtypeStruct`s; float8_e4m3fn: FP8 storage (fp8.py)."""
    shape = (pages, page_size, config.num_key_value_heads, config.head_dim)
    return {"pages": [{x: fp8.storage_shapes(shape, dtype) for x in ("k", "v")} for _ in range(storages(config))]}


def init_pool(config: ModelConfig, pages: int, page_size: int, dtype=jnp.bfloat16, *, mesh=None) -> dict:
    """A pool of `pages` pages of `page_size` positions, zeros, made on the devices (on a mesh: KV
    heads on `tensor` where they divide, the pages on every device)."""
    return zeros_on_devices(*_layout(config, pages, page_size, jnp.dtype(dtype), mesh))


@functools.lru_cache(maxsize=8)
def _layout(config, pages, page_size, dtype, mesh):
    shapes = pool_shapes(config, pages, page_size, dtype)
    if mesh is None:
        return shapes, None
    return shapes, jax.tree.map(lambda s: sharding(POOL_AXES[:len(s.shape)], s.shape, mesh, what="KV pages"), shapes)


def layer_view(config: ModelConfig, cache: dict, layer: int) -> dict:
    """What a layer's attention reads and writes: {"k", "v": its storage, "table": [B, W] of its group}."""
    storage = cache["pages"][storage_of(config, layer)]
    return {"k": storage["k"], "v": storage["v"], "table": cache["tables"][group_of(config, layer)]}


class Paged:
    """The paged layout's side of the cache contract (cache.Contiguous is the other): a layer's
    view is its storage {"k", "v": [N, P, K, H]} and its group's table [B, W]."""

    @staticmethod
    def attend(ops, q, k, v, layer_cache: dict, positions, lengths, valid, window: int | None, mesh=None):
        """As cache.Contiguous.attend, through the rows' page table: the new keys and values are
        written at their positions after the read."""
        pool_k, pool_v, table = layer_cache["k"], layer_cache["v"], layer_cache["table"]
        if window is None:
            before = ops.paged_full(q, pool_k, pool_v, table, lengths)
        else:
            before = ops.paged_window(q, pool_k, pool_v, table, lengths, positions, window,
                                      pages_for_window(window, pool_k.shape[1]))
        # The write must follow the read: nothing else orders the kernel that reads the storage before
        # the scatter that updates it, and inside a loop's branch (several checked steps a call,
        # decoding/checked.py) XLA then copied every storage before writing it, a copy of the whole
        # pool each step. The barrier makes the write depend on the read, so it updates in place.
        before, pool_k, pool_v = jax.lax.optimization_barrier((before, pool_k, pool_v))
        written = {"k": write_pages(pool_k, table, positions, valid, k), "v": write_pages(pool_v, table, positions, valid, v)}
        return before, {name: constrain(a, POOL_AXES, mesh) for name, a in written.items()}

    @staticmethod
    def keep(config: ModelConfig, cache: dict, before: dict, written: dict, valid: jax.Array,
             kept: jax.Array) -> dict:
        """Nothing of a rejected draft needs taking back: attention never reads a position at or past a
        sequence's length, and the next step writes over what the rejected drafts left."""
        return {"pages": written["pages"], "tables": cache["tables"],
                **({"adapters": cache["adapters"]} if "adapters" in cache else {})}
