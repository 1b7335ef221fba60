"""Attention's variants: who computes sink-free attention over a set of keys, each registered once here.

The model asks for the operations of one call (`Kernels.attention_ops`: its queries per sequence,
dtype and mesh) and calls them; it names no kernel. Each returns (o, lse) over one set of keys
(the model folds the sinks in, kernels/combine.py):
- `causal(q, k, v, window)`: among the same positions (a prompt, a chunk, a decode step's tokens);
- `prefix(q, cache_k, cache_v, lengths)`: to each sequence's cached positions [0, lengths);
- `paged_full(q, pool_k, pool_v, table, lengths)`: the same through a paged cache's page table;
- `paged_window(q, pool_k, pool_v, table, lengths, positions, window, pages)`: a sliding layer's
  window of pages;
and `whole(q, k, v, sinks, positions, window)`: the output with the sinks, without a cache, where a
variant computes it whole (the reference; the blockwise path's own backward pass), else None.

A variant fills in the operations it has: each may return None where it does not take the call
(shapes, a mesh), and the operation falls back to the jnp variant, "blockwise", which has them all.
A variant's `auto` test says when "auto" picks it (the first in `ATTENTION`'s order); one named
explicitly is checked against the backend. Removing a variant is deleting its module and its entry.

Legend: B = batch, T = query positions, S = key positions, K = KV heads, G = query heads per KV
head, H = head dim, N = pages in the pool, P = positions per page, W = a table's pages.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from ... import fp8
from ...sharding import CACHE_AXES, spec
from .. import mosaic, tokamax
from .. import needs
from ..needs import GPU, HOPPER, TPU, TRITON, Needs
from ..triton import attention as triton
from . import flash, mosaic_cache, paged, splash, xla


@dataclasses.dataclass(frozen=True)
class Call:
    """What "auto" weighs: the call's queries per sequence and dtype, and the machine."""

    queries: int
    dtype: jnp.dtype
    backend: str
    mosaic: bool  # an NVIDIA Hopper GPU and a JAX whose Pallas Mosaic GPU the kernels need
    tokamax: bool

    @property
    def sixteen_bit(self) -> bool:  # the GPU kernels take 16-bit inputs (float32 would be TF32 there)
        return jnp.dtype(self.dtype).itemsize == 2


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    needs: Needs | None = None
    auto: Callable[[Call], bool] = lambda call: False
    jnp: bool = False  # runs on global shapes on a mesh (XLA partitions it); else per device (shard_map)
    prompt_chunk: int = 512  # prompt positions a step suits: flash kernels hold no [chunk, keys] scores
    fp8: bool = False  # reads a cache in FP8 storage (fp8.py); where not, such a cache gets the jnp variant
    causal: Callable | None = None
    prefix: Callable | None = None
    paged_full: Callable | None = None
    paged_window: Callable | None = None
    whole: Callable | None = None


ATTENTION = {v.name: v for v in (
    Variant("tokamax", GPU, prompt_chunk=4096,
            auto=lambda c: c.queries > 16 and c.backend == "gpu" and c.sixteen_bit and c.tokamax,
            fp8=True, causal=flash.tokamax_causal, prefix=flash.tokamax_prefix, paged_full=flash.tokamax_paged_full),
    Variant("splash", TPU, prompt_chunk=4096, auto=lambda c: c.queries > 16 and c.backend == "tpu",
            causal=splash.splash_causal),
    # Decode over the filled cache only (full and sliding layers, contiguous or paged).
    Variant("mosaic", HOPPER, auto=lambda c: c.queries <= 16 and c.backend == "gpu" and c.sixteen_bit and c.mosaic,
            fp8=True, prefix=mosaic_cache.mosaic_prefix, paged_full=mosaic_cache.mosaic_paged_full,
            paged_window=mosaic_cache.mosaic_paged_window),
    Variant("blockwise", auto=lambda c: True, jnp=True, fp8=True, causal=xla.blockwise_causal, prefix=xla.blockwise_prefix,
            paged_full=paged.blockwise_paged_full, paged_window=paged.blockwise_paged_window,
            whole=xla.blockwise_whole),
    Variant("reference", jnp=True, fp8=True, causal=xla.reference_causal, prefix=xla.reference_prefix,
            paged_full=paged.reference_paged_full, whole=xla.reference_whole),
    # Pallas Triton (deprecated by JAX 0.11): by name only.
    Variant("triton", TRITON, prefix=triton.triton_prefix),
)}
JNP = ATTENTION["blockwise"]


def pick(kernels, queries: int, dtype) -> Variant:
    """The variant `kernels.attention` names, else the first whose `auto` test takes the call."""
    if kernels.attention != "auto":
        named = ATTENTION[kernels.attention]
        if named.needs:
            named.needs.check(named.name, kernels.interpret)
        return named
    backend = jax.default_backend()
    call = Call(queries=queries, dtype=jnp.dtype(dtype), backend=backend,
                mosaic=backend == "gpu" and needs.is_hopper() and mosaic.supported(),
                tokamax=backend == "gpu" and tokamax.available())
    return next(v for v in ATTENTION.values() if v.auto(call))


@dataclasses.dataclass(frozen=True)
class Ops:
    """One call's attention operations by `variant` (see the module's docstring)."""

    variant: Variant
    kernels: object
    mesh: Mesh | None = None

    def _first(self, op: str, *args, **kwargs):
        """The variant's operation, or the jnp one where it has none or declines the call."""
        fn = getattr(self.variant, op)
        out = fn(*args, kernels=self.kernels, **kwargs) if fn is not None else None
        return out if out is not None else getattr(JNP, op)(*args, kernels=self.kernels, **kwargs)

    def _reading(self, cache) -> "Ops":
        """These operations, or the jnp ones where the cache is in FP8 storage and the variant does
        not read it."""
        return self if self.variant.fp8 or not isinstance(cache, fp8.Fp8) else dataclasses.replace(self, variant=JNP)

    def _per_device(self, fn, q, k, v, *rest):
        """fn(q, k, v, *rest) -> (o, lse), run on each device's sequences and KV heads when a fused
        kernel (which sees only local shapes) runs on a mesh; rest: per-sequence arrays [B]."""
        if self.mesh is None or self.variant.jnp:
            return fn(q, k, v, *rest)
        kv = spec(CACHE_AXES, k.shape, self.mesh)  # sequences on data, KV heads on tensor, where they divide
        q_spec, lse_spec = PartitionSpec(kv[0], None, kv[2], None, None), PartitionSpec(kv[0], None, kv[2], None)
        seqs = kv[0]
        if isinstance(k, fp8.Fp8):  # its exponents: one per vector, the spec less its last axis
            kv = fp8.Fp8(kv, PartitionSpec(*kv[:3]))
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(q_spec, kv, kv) + (PartitionSpec(seqs),) * len(rest),
                             out_specs=(q_spec, lse_spec), check_vma=False)(q, k, v, *rest)

    def causal(self, q, k, v, window):
        """q [B, T, K, G, H], k and v [B, T, K, H] of the same positions -> (o, lse)."""
        return self._per_device(lambda q, k, v: self._first("causal", q, k, v, window=window), q, k, v)

    def prefix(self, q, cache_k, cache_v, lengths):
        """Every query sees keys [0, lengths[b]) of cache_k, cache_v [B, S, K, H] -> (o, lse)."""
        ops = self._reading(cache_k)
        return ops._per_device(lambda q, k, v, n: ops._first("prefix", q, k, v, n), q, cache_k, cache_v, lengths)

    def paged_full(self, q, pool_k, pool_v, table, lengths):
        """As `prefix`, the keys in pages [N, P, K, H] of the pool through table [B, W]."""
        return self._reading(pool_k)._first("paged_full", q, pool_k, pool_v, table, lengths, mesh=self.mesh)

    def paged_window(self, q, pool_k, pool_v, table, lengths, positions, window: int, pages: int):
        """A sliding layer's earlier positions in the window of queries at `positions` [B, T], held in
        the table's `pages` columns from the one holding the window's first position."""
        return self._reading(pool_k)._first("paged_window", q, pool_k, pool_v, table, lengths, positions, window=window, pages=pages,
                           mesh=self.mesh)

    def whole(self, q, k, v, sinks, positions, window):
        """Without a cache: the output [B, T, K, G, H] with the sinks where the variant computes it
        whole; None where the sinks are folded into `causal`'s parts instead."""
        return self.variant.whole(q, k, v, sinks, positions, window=window, kernels=self.kernels) \
            if self.variant.whole else None
