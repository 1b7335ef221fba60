"""The experts' variants: who computes the selected (token, expert) pairs, each registered once here.

A variant says what it takes (16-bit or MXFP4-packed experts, low-rank adapters), what it needs (a
backend), when "auto" picks it (`auto`, a test of the call and the machine), and its call:
run(x [N, D], idx [N, A], w, act, kernels=) -> the pairs' outputs [N, A, D], idx holding the pairs'
local experts (negative: held by another device). "auto" takes the first variant in `EXPERTS` whose
test passes; a variant named explicitly is checked against the backend and the weights. Removing a
variant is deleting its module and its entry below. The model asks for a variant
(`Kernels.experts_for`) and runs it through `local_experts`; it names none.

A variant may also run the whole MoE block (norm, router and experts) where it `block_fits`:
`fused_block` asks the variant "auto" or the name picks for the call.

Legend: N = tokens, D = embed, A = active experts per token, P = (token, expert) pairs = N * A.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from ..mxfp4 import packed
from . import (decode_moe, gpu, jnp_experts, mosaic, mosaic_decode, mosaic_mxfp4, mosaic_pair, mosaic_slots, pairs, tpu,
               triton_mxfp4)
from .needs import GPU, HOPPER, HOPPER_NATIVE, TPU, TRITON, Needs


@dataclasses.dataclass(frozen=True)
class Call:
    """What "auto" weighs: the call (pairs, the weights' dtype, or for packed experts the
    activations'; packed or not) and the machine."""

    pairs: int
    dtype: jnp.dtype
    packed: bool
    decode: bool  # pairs <= Kernels.moe_gather_max_pairs
    pair: bool  # pairs <= Kernels.moe_pair_max_pairs
    experts: int  # the layer's experts (all devices')
    sharded: bool  # the MoE runs on a mesh (per device, in shard_map), so no variant runs the block whole
    small: bool  # pairs < Kernels.moe_mosaic_min_pairs
    at_most_min: bool  # pairs <= Kernels.moe_mosaic_min_pairs
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
    # Pallas Triton (deprecated by JAX 0.11; "auto" picks it while JAX ships it): at decode on one
    # device with 16-bit activations and MXFP4 experts, the whole block as decode_moe.py's four
    # fused kernels (fewer launches and no layout kernels between them, against the Mosaic GPU
    # path's); on Hopper up to one pair per expert, where it measured fastest (`MEASURED`).
    Variant("triton", triton_mxfp4.pairwise_experts, needs=TRITON, block=_fused_block, block_fits=decode_moe.fits,
            auto=lambda c: c.packed and c.bf16 and c.hopper and c.triton and c.few and not c.sharded),
    # One token's MXFP4 pairs a row each, on Hopper without Pallas Triton (`MEASURED`: within a few
    # percent of the fused Triton block at a batch of one, below it in most runs).
    Variant("mosaic_pair", mosaic_pair.experts, needs=HOPPER,
            auto=lambda c: c.packed and c.bf16 and c.mosaic and c.pair),
    # Decode's experts on Hopper, each selected expert read once, in place; MXFP4 experts up to
    # `moe_mosaic_min_pairs` pairs; 16-bit ones at decode, and without tokamax up to that many pairs
    # (one NVIDIA H200, gpt-oss-20b's decode step at batch 256, 1,024 pairs: 19.7 ms against 79.3 on
    # the jnp grouped path, 17.5 with tokamax's ragged dot, 2026-11-26).
    Variant("mosaic_decode", mosaic_decode.experts, needs=HOPPER,
            auto=lambda c: c.mosaic and ((c.packed and c.bf16 and c.small)
                                         or (not c.packed and c.sixteen_bit and c.decode)
                                         or (not c.packed and c.sixteen_bit and c.at_most_min and not c.tokamax))),
    # Small decode batches without sorting the pairs (kernels/mosaic_slots.py): by name only until
    # measured against the two above.
    Variant("mosaic_slots", mosaic_slots.experts, needs=HOPPER),
    Variant("gather", jnp_experts.gather, adapters=True, auto=lambda c: c.decode),
    # MXFP4 prompts on Hopper: decoded into shared memory for the tensor cores, never written back.
    Variant("mosaic_grouped", mosaic_mxfp4.experts, weights="packed", needs=HOPPER,
            auto=lambda c: c.packed and c.bf16 and c.mosaic),
    Variant("megablox", tpu.experts, needs=TPU, auto=lambda c: c.backend == "tpu"),
    # The GPU ragged dots take 16-bit inputs (float32 would be TF32 there); the Mosaic GPU one hands
    # shapes off its tiles (gpt-oss's mlp2) to tokamax's, so it too needs tokamax.
    Variant("mosaic_gpu", gpu.mosaic_experts, needs=HOPPER_NATIVE,
            auto=lambda c: not c.packed and c.backend == "gpu" and c.sixteen_bit and c.tokamax and c.hopper),
    Variant("tokamax", gpu.tokamax_experts, needs=GPU,
            auto=lambda c: not c.packed and c.backend == "gpu" and c.sixteen_bit and c.tokamax and not c.hopper),
    Variant("grouped", jnp_experts.grouped, adapters=True, auto=lambda c: True),
    # Pallas Triton's grouped MXFP4 matmul: by name only.
    Variant("triton_grouped", triton_mxfp4.grouped_experts, weights="packed", needs=TRITON),
)}


# Decode tokens/s behind "auto"'s MXFP4 choices on Hopper (docs/benchmarks.md, "Decode over MXFP4
# experts"): one NVIDIA H100 80GB HBM3, 2026-11-26, jax 0.11.2, synthetic full-size weights, greedy,
# the median of 3 generations of 32 tokens after a 128-token prompt, each variant named with
# --kernels moe=NAME ("mosaic_pair" runs "mosaic_decode" past one token). (experts, batch) ->
# {variant: tokens/s}; tests/test_kernels.py checks that "auto" picks each row's fastest. Batch 1
# varies by more than its gap between runs (20b: Mosaic GPU 290.0, 346.6, 309.6 against Triton
# 357.6, 315.0, 333.9 in three runs); the rows are the last run's (its 20b batch 32 and 64 from a
# run an hour before on the same kind of machine, the 120b's batch 8 from the day's first run).
MEASURED = {
    (32, 1): {"triton": 333.9, "mosaic_pair": 309.6},  # gpt-oss-20b
    (32, 4): {"triton": 920.2, "mosaic_decode": 577.9},
    (32, 8): {"triton": 1233.3, "mosaic_decode": 1012.5},
    (32, 16): {"triton": 1487.5, "mosaic_decode": 1740.8},
    (32, 32): {"triton": 1666.7, "mosaic_decode": 3220.3},
    (32, 64): {"triton": 1777.2, "mosaic_decode": 5888.4},
    (128, 1): {"triton": 241.1, "mosaic_pair": 231.5},  # gpt-oss-120b
    (128, 8): {"triton": 795.1, "mosaic_decode": 503.2},
    (128, 16): {"triton": 927.3, "mosaic_decode": 582.4},
}


def call_of(kernels, pairs: int, dtype, is_packed: bool, experts: int, sharded: bool = False) -> Call:
    backend = jax.default_backend()
    hopper = backend == "gpu" and gpu.is_hopper()
    return Call(pairs=pairs, dtype=jnp.dtype(dtype), packed=is_packed, decode=pairs <= kernels.moe_gather_max_pairs,
                pair=pairs <= kernels.moe_pair_max_pairs, experts=experts, sharded=sharded,
                small=pairs < kernels.moe_mosaic_min_pairs, at_most_min=pairs <= kernels.moe_mosaic_min_pairs,
                backend=backend, hopper=hopper, mosaic=hopper and mosaic.supported(),
                tokamax=backend == "gpu" and gpu.available(), triton=triton_mxfp4.pltriton is not None)


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


def local_experts(x, weights, idx, w, act, *, first: jax.Array | int, variant: Variant, kernels) -> jax.Array:
    """The weighted sum [N, D] (float32) over the pairs whose expert this device holds, by `variant`.

    w holds experts [first, first + E_local); pairs of other experts contribute nothing (their
    devices add them). With every expert local (first = 0) this is the whole MoE output.
    """
    if variant.weights == "packed" and not packed(w["mlp1_weight"]):
        raise ValueError(f"the {variant.name} expert kernel takes MXFP4-packed experts only")
    local = idx - first
    mine = (local >= 0) & (local < pairs.num_experts(w["mlp1_weight"]))
    y = variant.run(x, jnp.where(mine, local, -1), w, act, kernels=kernels)
    # A weighted sum XLA fuses with the un-sorting gather of the grouped paths (an einsum would be a
    # separate batched product reading a materialized [N, A, D]).
    return jnp.sum(y.astype(jnp.float32) * jnp.where(mine, weights, 0.0)[..., None], axis=1)
