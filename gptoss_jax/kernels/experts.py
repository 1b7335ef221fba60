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
from . import decode_moe, gpu, jnp_experts, mosaic, mosaic_decode, mosaic_mxfp4, mosaic_pair, pairs, tpu, triton_mxfp4
from .needs import GPU, HOPPER, HOPPER_NATIVE, TPU, TRITON, Needs


@dataclasses.dataclass(frozen=True)
class Call:
    """What "auto" weighs: the call (pairs, the weights' dtype, or for packed experts the
    activations'; packed or not) and the machine."""

    pairs: int
    dtype: jnp.dtype
    packed: bool
    decode: bool  # pairs <= Kernels.moe_gather_max_pairs
    small: bool  # pairs < Kernels.moe_mosaic_min_pairs
    at_most_min: bool  # pairs <= Kernels.moe_mosaic_min_pairs
    backend: str
    hopper: bool  # an NVIDIA Hopper GPU (compute capability 9.0)
    mosaic: bool  # Hopper and a JAX whose Pallas Mosaic GPU these kernels need
    tokamax: bool

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


# In "auto"'s order of preference. The measurements behind each test are in docs/benchmarks.md.
EXPERTS = {v.name: v for v in (
    # One token's MXFP4 pairs a row each, on Hopper: one H100 80GB (gpt-oss-20b, batch 1), 326.1
    # tokens/s against 325.2 for the fused Pallas Triton decode MoE, in one run.
    Variant("mosaic_pair", mosaic_pair.experts, needs=HOPPER,
            auto=lambda c: c.packed and c.bf16 and c.mosaic and c.decode and c.small),
    # Decode's experts on Hopper, each selected expert read once, in place; MXFP4 experts up to
    # `moe_mosaic_min_pairs` pairs; 16-bit ones at decode, and without tokamax up to that many pairs
    # (one NVIDIA H200, gpt-oss-20b's decode step at batch 256, 1,024 pairs: 19.7 ms against 79.3 on
    # the jnp grouped path, 17.5 with tokamax's ragged dot, 2026-11-26).
    Variant("mosaic_decode", mosaic_decode.experts, needs=HOPPER,
            auto=lambda c: c.mosaic and ((c.packed and c.bf16 and c.small)
                                         or (not c.packed and c.sixteen_bit and c.decode)
                                         or (not c.packed and c.sixteen_bit and c.at_most_min and not c.tokamax))),
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
    # Pallas Triton (deprecated by JAX 0.11): by name only. At decode on one device with 16-bit
    # activations and MXFP4 experts, the whole block as decode_moe.py's four fused kernels.
    Variant("triton", triton_mxfp4.pairwise_experts, needs=TRITON, block=_fused_block, block_fits=decode_moe.fits),
    Variant("triton_grouped", triton_mxfp4.grouped_experts, weights="packed", needs=TRITON),
)}


def call_of(kernels, pairs: int, dtype, is_packed: bool) -> Call:
    backend = jax.default_backend()
    hopper = backend == "gpu" and gpu.is_hopper()
    return Call(pairs=pairs, dtype=jnp.dtype(dtype), packed=is_packed, decode=pairs <= kernels.moe_gather_max_pairs,
                small=pairs < kernels.moe_mosaic_min_pairs, at_most_min=pairs <= kernels.moe_mosaic_min_pairs,
                backend=backend, hopper=hopper, mosaic=hopper and mosaic.supported(),
                tokamax=backend == "gpu" and gpu.available())


def pick(kernels, pairs: int, dtype, is_packed: bool = False, *, adapters: bool = False) -> Variant:
    """The variant for a call with this many pairs over experts of this dtype (packed: MXFP4, dtype the
    activations'): the one `kernels.moe` names, else "auto"'s; with adapters, one that adds them."""
    if kernels.moe != "auto":
        named = EXPERTS[kernels.moe].check(kernels.interpret)
        if named.adapters or not adapters:
            return named
    call = call_of(kernels, pairs, dtype, is_packed)
    return next(v for v in EXPERTS.values() if v.auto(call) and (v.adapters or not adapters))


def fused_block(kernels, x, norm_scale, w, config, *, mesh) -> jax.Array | None:
    """The whole MoE block [N, D] float32 (no residual) for tokens x [N, D], where the variant picked
    for the call runs blocks whole (on one device); None otherwise."""
    if mesh is not None:
        return None
    variant = pick(kernels, x.shape[0] * config.experts_per_token, x.dtype, packed(w["mlp1_weight"]))
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
