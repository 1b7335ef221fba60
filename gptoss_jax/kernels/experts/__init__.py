"""The experts' variants: who computes the selected (token, expert) pairs, each registered once here.

A variant says what it takes (16-bit or MXFP4-packed experts, low-rank adapters), what it needs (a
backend), when "auto" picks it (`auto`, a test of the call and the machine), and its call:
run(x [N, D], idx [N, A], w, act, kernels=) -> the pairs' outputs [N, A, D], idx holding the pairs'
local experts (negative: held by another device); a variant marked `summed` takes the routing weights
too and returns their weighted sum [N, D] itself. "auto" takes the first variant in `EXPERTS` whose
test passes; a variant named explicitly is checked against the backend and the weights. Removing a
variant is deleting its module and its entry below. The model asks for a variant
(`Kernels.experts_for`) and runs it through `local_experts`; it names none.

A variant may also run the whole MoE block (norm, router and experts) where it `block_fits`:
`fused_block` asks the variant "auto" or the name picks for the call.

Legend: N = tokens, D = embed, A = active experts per token, P = (token, expert) pairs = N * A.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ...mxfp4 import packed
from .. import mosaic, pairs, tokamax
from .. import needs
from ..needs import GPU, HOPPER, HOPPER_NATIVE, TPU, TRITON, Needs
from ..triton import decode_moe, mxfp4 as triton_mxfp4
from . import megablox, mosaic_decode, mosaic_mxfp4, mosaic_pair, mosaic_slots, ragged, xla


@dataclasses.dataclass(frozen=True)
class Call:
    """What "auto" weighs: the call (pairs, the weights' dtype, or for packed experts the
    activations'; packed or not), the machine, and the `Kernels` asked (whose thresholds the
    variants' tests read)."""

    pairs: int
    dtype: jnp.dtype
    packed: bool
    experts: int  # the layer's experts (all devices')
    sharded: bool  # the MoE runs on a mesh (per device, in shard_map), so no variant runs the block whole
    kernels: Any
    backend: str
    hopper: bool  # an NVIDIA Hopper GPU (compute capability 9.0)
    mosaic: bool  # Hopper and a JAX whose Pallas Mosaic GPU these kernels need
    tokamax: bool
    triton: bool  # this JAX ships Pallas's (deprecated) Triton backend

    @property
    def few(self) -> bool:
        """At most one pair per expert on average (decode batches up to experts / A tokens)."""
        return self.pairs <= self.experts

    @property
    def sixteen_bit(self) -> bool:
        return jnp.dtype(self.dtype).itemsize == 2

    @property
    def bf16(self) -> bool:
        return jnp.dtype(self.dtype) == jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    run: Callable
    weights: str = "any"  # "any", or "packed": MXFP4-packed experts only
    needs: Needs | None = None
    adapters: bool = False  # adds the experts' low-rank adapters (training)
    auto: Callable[[Call], bool] = lambda call: False  # "auto" picks it (in registry order) where this holds
    summed: bool = False  # run(x, idx, weights, w, act, kernels=) -> [N, D] float32: the weighted sum itself
    block: Callable | None = None  # block(x, norm_scale, w, config, kernels) -> [N, D]: the whole MoE block
    block_fits: Callable = lambda x, w, config: False

    def check(self, interpret: bool) -> "Variant":
        """This variant named explicitly: an error where this backend cannot run it."""
        if self.needs:
            self.needs.check(self.name, interpret)
        return self


def _fused_block(x, norm_scale, w, config, kernels):
    return decode_moe.moe(x, norm_scale, w, k=config.experts_per_token, eps=config.rms_norm_eps,
                          alpha=config.swiglu_alpha, limit=config.swiglu_limit, interpret=kernels.interpret)


# In "auto"'s order of preference. The measurements behind each test are in docs/benchmarks.md, and
# `MEASURED` below holds the decode rates that tests/test_kernels.py checks "auto" against.
EXPERTS = {v.name: v for v in (
    # Decode batches of up to 16 tokens in two kernels, the weighted sum included, nothing sorted
    # (kernels/experts/mosaic_slots.py), on one Hopper GPU. bfloat16 experts up to 64 pairs: one NVIDIA
    # H200, 2026-11-30, bench/moe_block.py, gpt-oss-20b's block at 4, 8 and 16 tokens in 257, 400 and
    # 494 us (73 to 80% of the copy bandwidth) against 320, 451 and 513 for "mosaic_decode" (even at
    # one token, at 32 tokens slower: 727 against 566; that run's kernels had three warpgroups a
    # program, and the one-warpgroup form took 3% less at 8 tokens). MXFP4 experts from one to two
    # pairs per expert for up to 32 experts (`MEASURED`: batches 8 and 16 on one H100, the kernel
    # before these two; the same day on one H200 the experts alone took 0.71 and 0.79 of
    # "mosaic_decode"'s time at batches 8 and 16, against 0.85 for that kernel's blocks; at batch 8
    # 225 us against 217 for the whole Triton block of an earlier run there: not yet measured side by
    # side). Not for more experts: gpt-oss-120b's 128 at batch 32, 2,130 us against 671 for "auto"
    # (every empty slot's programs still start).
    Variant("mosaic_slots", mosaic_slots.weighted_sum, needs=HOPPER, summed=True,
            auto=lambda c: c.mosaic and not c.sharded and c.experts <= 32 and (
                (not c.packed and c.bf16 and c.pairs <= c.kernels.moe_gather_max_pairs)
                or (c.packed and c.bf16 and c.experts <= c.pairs <= 2 * c.experts))),
    # Pallas Triton (deprecated by JAX 0.11; "auto" picks it while JAX ships it): at decode on one
    # device with 16-bit activations and MXFP4 experts, the whole block as decode_moe.py's four
    # fused kernels (fewer launches and no layout kernels between them, against the Mosaic GPU
    # path's); on Hopper up to one pair per expert where "mosaic_slots" does not come first: where it
    # measured fastest (`MEASURED`).
    Variant("triton", triton_mxfp4.pairwise_experts, needs=TRITON, block=_fused_block, block_fits=decode_moe.fits,
            auto=lambda c: c.packed and c.bf16 and c.hopper and c.triton and c.few and not c.sharded),
    # One token's MXFP4 pairs a row each, on Hopper without Pallas Triton (`MEASURED`: within a few
    # percent of the fused Triton block at a batch of one, below it in most runs).
    Variant("mosaic_pair", mosaic_pair.experts, needs=HOPPER,
            auto=lambda c: c.packed and c.bf16 and c.mosaic and c.pairs <= c.kernels.moe_pair_max_pairs),
    # Decode's experts on Hopper, each selected expert read once, in place; MXFP4 experts up to
    # `moe_mosaic_min_pairs` pairs; 16-bit ones at decode, and without tokamax up to that many pairs
    # (one NVIDIA H200, gpt-oss-20b's decode step at batch 256, 1,024 pairs: 19.7 ms against 79.3 on
    # the jnp grouped path, 17.5 with tokamax's ragged dot, 2026-11-26).
    Variant("mosaic_decode", mosaic_decode.experts, needs=HOPPER,
            auto=lambda c: c.mosaic and (
                (c.packed and c.bf16 and c.pairs < c.kernels.moe_mosaic_min_pairs)
                or (not c.packed and c.sixteen_bit and c.pairs <= c.kernels.moe_gather_max_pairs)
                or (not c.packed and c.sixteen_bit and c.pairs <= c.kernels.moe_mosaic_min_pairs and not c.tokamax))),
    Variant("gather", xla.gather, adapters=True, auto=lambda c: c.pairs <= c.kernels.moe_gather_max_pairs),
    # MXFP4 prompts on Hopper: decoded into shared memory for the tensor cores, never written back.
    Variant("mosaic_grouped", mosaic_mxfp4.experts, weights="packed", needs=HOPPER,
            auto=lambda c: c.packed and c.bf16 and c.mosaic),
    Variant("megablox", megablox.experts, needs=TPU, auto=lambda c: c.backend == "tpu"),
    # The GPU ragged dots take 16-bit inputs (float32 would be TF32 there); the Mosaic GPU one hands
    # shapes off its tiles (gpt-oss's mlp2) to tokamax's, so it too needs tokamax.
    Variant("mosaic_gpu", ragged.mosaic_experts, needs=HOPPER_NATIVE,
            auto=lambda c: not c.packed and c.backend == "gpu" and c.sixteen_bit and c.tokamax and c.hopper),
    Variant("tokamax", ragged.tokamax_experts, needs=GPU,
            auto=lambda c: not c.packed and c.backend == "gpu" and c.sixteen_bit and c.tokamax and not c.hopper),
    Variant("grouped", xla.grouped, adapters=True, auto=lambda c: True),
    # Pallas Triton's grouped MXFP4 matmul: by name only.
    Variant("triton_grouped", triton_mxfp4.grouped_experts, weights="packed", needs=TRITON),
)}


# Decode tokens/s behind "auto"'s MXFP4 choices on Hopper (docs/benchmarks.md, "Decode over MXFP4
# experts"): one NVIDIA H100 80GB HBM3, 2026-11-27, jax 0.11.2, synthetic full-size weights, greedy,
# 8 decode steps per call, the median of 3 generations of 32 tokens after a 128-token prompt, each
# variant named with --kernels moe=NAME ("mosaic_pair" runs "mosaic_decode" past one token).
# (experts, batch) -> {variant: tokens/s}; tests/test_kernels.py checks that "auto" picks each row's
# fastest. A row's first two entries ran in one process (the 20b's batch 1: all three); a third
# in another process that day, except those marked "11-26": one step per call, from that day's table
# (at batches of 8 and more one step a call read about 3% above 8 a call, which runs a surplus step
# in 32 tokens: no row's fastest changes by it). Batch 1 varies between
# runs by more than its gap (20b: Triton 348.5 and 354.8, the Mosaic GPU pair kernel 341.5).
MEASURED = {
    (32, 1): {"triton": 354.8, "mosaic_pair": 341.5, "mosaic_slots": 248.7},  # gpt-oss-20b
    (32, 4): {"triton": 897.4, "mosaic_slots": 587.3, "mosaic_decode": 577.9},  # 11-26
    (32, 8): {"mosaic_slots": 1233.1, "triton": 1193.8, "mosaic_decode": 1030.3},
    (32, 16): {"mosaic_slots": 1991.6, "mosaic_decode": 1738.8, "triton": 1487.5},  # 11-26
    (32, 32): {"mosaic_decode": 3219.1, "mosaic_slots": 3079.0, "triton": 1666.7},  # 11-26
    (32, 64): {"mosaic_decode": 5903.1, "mosaic_slots": 4996.0, "triton": 1777.2},  # 11-26
    (128, 1): {"triton": 240.8, "mosaic_pair": 231.5},  # gpt-oss-120b; 11-26
    (128, 8): {"triton": 769.8, "mosaic_slots": 493.3, "mosaic_decode": 503.2},  # 11-26
    (128, 16): {"triton": 901.1, "mosaic_slots": 594.7, "mosaic_decode": 582.4},  # 11-26
}


def call_of(kernels, pairs: int, dtype, is_packed: bool, experts: int, sharded: bool = False) -> Call:
    backend = jax.default_backend()
    hopper = backend == "gpu" and needs.is_hopper()
    return Call(pairs=pairs, dtype=jnp.dtype(dtype), packed=is_packed, experts=experts, sharded=sharded,
                kernels=kernels, backend=backend, hopper=hopper, mosaic=hopper and mosaic.supported(),
                tokamax=backend == "gpu" and tokamax.available(), triton=triton_mxfp4.pltriton is not None)


def pick(kernels, pairs: int, dtype, is_packed: bool = False, *, experts: int, adapters: bool = False,
         sharded: bool = False) -> Variant:
    """The variant for a call with this many pairs over `experts` experts of this dtype (packed: MXFP4,
    dtype the activations'), on one device or `sharded` over a mesh: the one `kernels.moe` names, else
    "auto"'s; with adapters, one that adds them."""
    if kernels.moe != "auto":
        named = EXPERTS[kernels.moe].check(kernels.interpret)
        if named.adapters or not adapters:
            return named
    call = call_of(kernels, pairs, dtype, is_packed, experts, sharded)
    return next(v for v in EXPERTS.values() if v.auto(call) and (v.adapters or not adapters))


def fused_block(kernels, x, norm_scale, w, config, *, mesh) -> jax.Array | None:
    """The whole MoE block [N, D] float32 (no residual) for tokens x [N, D], where the variant picked
    for the call runs blocks whole (on one device); None otherwise."""
    if mesh is not None:
        return None
    variant = pick(kernels, x.shape[0] * config.experts_per_token, x.dtype, packed(w["mlp1_weight"]),
                   experts=pairs.num_experts(w["mlp1_weight"]))
    if variant.block is None or not variant.block_fits(x, w, config):
        return None
    return variant.block(x, norm_scale, w, config, kernels)


def local_experts(x, weights, idx, w, act, *, first: jax.Array | int, variant: Variant, kernels,
                  pick=None) -> jax.Array:
    """The weighted sum [N, D] (float32) over the pairs whose expert this device holds, by `variant`.

    w holds experts [first, first + E_local); pairs of other experts contribute nothing (their
    devices add them). With every expert local (first = 0) this is the whole MoE output. pick
    [N, L]: each token's served adapter one-hot, for tables of adapters in w (a variant that takes
    adapters).
    """
    served = {} if pick is None else {"pick": pick}
    if variant.weights == "packed" and not packed(w["mlp1_weight"]):
        raise ValueError(f"the {variant.name} expert kernel takes MXFP4-packed experts only")
    local = idx - first
    mine = (local >= 0) & (local < pairs.num_experts(w["mlp1_weight"]))
    if variant.summed:
        return variant.run(x, jnp.where(mine, local, -1), jnp.where(mine, weights, 0.0), w, act, kernels=kernels,
                           **served)
    y = variant.run(x, jnp.where(mine, local, -1), w, act, kernels=kernels, **served)
    # A weighted sum XLA fuses with the un-sorting gather of the grouped paths (an einsum would be a
    # separate batched product reading a materialized [N, A, D]).
    return jnp.sum(y.astype(jnp.float32) * jnp.where(mine, weights, 0.0)[..., None], axis=1)
