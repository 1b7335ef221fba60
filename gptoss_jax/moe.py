"""The mixture-of-experts block: a float32 top-k router and dropless experts with a clamped SwiGLU.

Every path computes exactly the selected (token, expert) pairs, never every expert for every token
(`jax.lax.ragged_dot` is not used: on CPU and on CUDA GPUs it lowers to a dense product over all
experts). The kernel layer (kernels/) picks one per call, by backend and number of pairs:
- "gather" (jnp): gathers each pair's expert weights and contracts them with an einsum; its
  temporary memory is one expert's matrices per pair, so it serves decode-sized inputs.
- "mosaic_decode" (GPU, Hopper, decode; 16-bit or MXFP4 experts): the Pallas Mosaic GPU kernels of
  kernels/mosaic_decode.py over expert blocks of 8 to 64 rows (`decode_block`; one token's pairs
  each a block of its own, unsorted).
- "mosaic_pair" (GPU, Hopper): as "mosaic_decode", but one token's pairs over MXFP4 experts go
  through kernels/mosaic_pair.py, a row per pair and no tensor cores ("auto" there).
- "triton" (GPU, decode, by name only: Pallas Triton is deprecated): the same per-pair products by
  a Pallas Triton kernel reading each pair's expert in place (kernels/triton.py).
- "grouped" (jnp, prompts): sorts the pairs by expert, pads each expert's group to a multiple of
  `block` rows and loops over the blocks, one [block, D] x [D, F] product with that block's expert
  each. Work is the selected pairs plus at most `block - 1` padding rows per expert.
- "mosaic_gpu" or "tokamax" (GPU) and "megablox" (TPU), prompts: the pairs sorted by expert, then one grouped
  matmul (ragged dot) per projection that skips empty experts (kernels/gpu.py, kernels/tpu.py).

Expert matrices may be held packed in MXFP4 ({"blocks", "scales"}, mxfp4.py). On a Hopper GPU,
kernels read them packed and decode on the chip, never writing decoded weights to memory:
"mosaic_pair" / "mosaic_decode" for decode and "mosaic_grouped" (the pairs in expert blocks, as
"grouped", decoded weights in shared memory for the tensor cores; biases and the SwiGLU applied in
the kernel's epilogue) for prompts. By name only, the
Pallas Triton kernels do the same on any NVIDIA GPU while JAX ships that backend: "triton" for
decode (at decode on one device with 16-bit activations the whole block, norm, router and
experts, as kernels/decode_moe.py's four fused kernels, `MLPBlock._fused_decode`) and
"triton_grouped" for prompts.
The jnp paths decode them inside the jitted step: "gather" only the selected experts'
(`expert_rows`), "grouped" one expert block at a time; the ragged paths (TPU) the layer's experts
at once (`whole_experts`).

On a mesh (sharding.py), each device runs both paths on its own experts only (`local_experts`):
every token's pairs with other devices' experts contribute nothing there, and one all-reduce over
`expert` and `tensor` adds the devices' partial outputs. No expert weight moves between devices
(docs/architecture.md says why this rather than an all-to-all).

Legend: N = tokens, D = embed, E = experts, A = active experts per token, F = intermediate,
P = (token, expert) pairs = N * A.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from .config import ModelConfig
from .kernels import (
    Kernels,
    decode_moe,
    gpu,
    mosaic_decode,
    mosaic_mxfp4,
    mosaic_pair,
    tpu,
)
from .kernels.loops import late_map
from .kernels.triton import pair_matvec
from .kernels.triton_mxfp4 import grouped_matmul_mxfp4, pair_matvec_mxfp4
from .layers import RMSNorm
from .mxfp4 import decode, packed
from .pairs import (
    decode_block,
    pair_inputs,
    pairs_as_blocks,
    sort_by_expert,
    to_blocks,
    unsort,
)
from .sharding import spec
from .weight import Weight, adapter, declare, low_rank, packed_axes

EXPERT_WEIGHTS = ("mlp1_weight", "mlp1_bias", "mlp2_weight", "mlp2_bias")


def route(x: jax.Array, weight: jax.Array, bias: jax.Array, k: int, extra=0.0) -> tuple[jax.Array, jax.Array]:
    """x [N, D] -> (weights [N, A] float32, expert indices [N, A] int32); extra: added to the logits
    (a low-rank adapter's [N, E]).

    Logits (bias included) in float32 at full precision, so that near-ties pick the same experts as a
    float32 reference; top-k of the logits, softmax over the k selected logits only. With 16-bit
    inputs and weights the product runs in that dtype with float32 sums: the product of two bf16
    numbers is exact in float32, so this is the float32 product (up to the order of the sums), at
    matrix-unit speed (on one H100, a 4096-token prompt's routers took 0.9 ms in float32).
    """
    if x.dtype == weight.dtype and jnp.dtype(x.dtype).itemsize == 2:
        logits = jnp.einsum("nd,de->ne", x, weight, preferred_element_type=jnp.float32)
    else:
        logits = jnp.einsum("nd,de->ne", x.astype(jnp.float32), weight.astype(jnp.float32),
                            precision=jax.lax.Precision.HIGHEST)
    logits = logits + bias.astype(jnp.float32) + extra
    top, idx = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), idx


@dataclasses.dataclass(frozen=True)
class SwiGLU:
    """The experts' activation with its constants (`swiglu`), hashable: the prompt kernel over MXFP4
    experts applies it in its epilogue (kernels/mosaic_mxfp4.py), reading the constants from here."""

    alpha: float
    limit: float

    def __call__(self, h: jax.Array) -> jax.Array:
        return swiglu(h, alpha=self.alpha, limit=self.limit)


def swiglu(h: jax.Array, *, alpha: float, limit: float) -> jax.Array:
    """[..., 2F] -> [..., F]. Gate and linear halves are INTERLEAVED (gate = h[..., ::2]).

    The gate is clamped from above only, the linear half on both sides, and the linear half gets +1.
    """
    h = h.reshape(h.shape[:-1] + (h.shape[-1] // 2, 2))  # [..., F, 2]: (gate, linear) pairs
    gate = jnp.minimum(h[..., 0], limit)
    linear = jnp.clip(h[..., 1], -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (linear + 1)


def expert_rows(weight, idx, dtype) -> jax.Array:
    """weight[idx] for an expert weight [E, out, in], or for its MXFP4-packed form decoded right here
    (inside the jitted step: only the experts idx selects are decoded)."""
    if packed(weight):
        return decode(weight["blocks"][idx], weight["scales"][idx], dtype)
    return weight[idx]


def whole_experts(weight, dtype) -> jax.Array:
    """An expert weight [E, out, in]; a packed one is decoded here, the layer's experts at once."""
    return decode(weight["blocks"], weight["scales"], dtype) if packed(weight) else weight


def num_experts(weight) -> int:
    return (weight["scales"] if packed(weight) else weight).shape[0]


def _pair_low_rank(x, w, name, e, pairs: str):
    """The expert adapter of weight `name` (w[name + "_lora"]: a [E, in, r], b [E, r, out]) on x
    [..., in] for experts e, `pairs` the einsum letters of x's leading axes; 0 without one."""
    held = w.get(f"{name}_lora")
    if held is None:
        return 0.0
    a, b = held["a"][e].astype(x.dtype), held["b"][e].astype(x.dtype)
    lead = pairs[: a.ndim - 2]  # the axes e indexes
    low = jnp.einsum(f"{pairs}i,{lead}ir->{pairs}r", x, a)
    return jnp.einsum(f"{pairs}r,{lead}ro->{pairs}o", low, b)


def _experts_gather(x, idx, w, act):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D]."""
    h = jnp.einsum("nd,nafd->naf", x, expert_rows(w["mlp1_weight"], idx, x.dtype)) + w["mlp1_bias"][idx]
    h = h + _pair_low_rank(jnp.broadcast_to(x[:, None], idx.shape + x.shape[-1:]), w, "mlp1_weight", idx, "na")
    a = act(h)
    y = jnp.einsum("naf,nadf->nad", a, expert_rows(w["mlp2_weight"], idx, x.dtype)) + w["mlp2_bias"][idx]
    return y + _pair_low_rank(a, w, "mlp2_weight", idx, "na")


def _experts_grouped(x, idx, w, act, *, num_experts: int, block: int):
    """x [N, D], idx [N, A] -> per-pair outputs [N, A, D] (zero for dropped pairs), one expert per `block` rows."""
    D = x.shape[-1]
    # Every block of the static bound is computed (blocks past the used ones hold zero rows): a
    # lax.cond skipping them would cost a host round trip per block on a GPU.
    rows, undo, block_expert, _ = to_blocks(x, idx, num_experts, block)
    num_blocks = block_expert.shape[0]
    rows = rows.reshape(num_blocks, block, D)

    # Recomputed in the backward pass rather than kept: the saved residuals would otherwise include
    # each block's expert matrices (a [2F, D] and a [D, F] copy per block).
    @jax.checkpoint
    def one_block(args):
        b, xb = args
        e = block_expert[b]

        h = jnp.einsum("bd,fd->bf", xb, expert_rows(w["mlp1_weight"], e, x.dtype)) + w["mlp1_bias"][e]  # [block, 2F]
        a = act(h + _pair_low_rank(xb, w, "mlp1_weight", e, "b"))
        y = jnp.einsum("bf,df->bd", a, expert_rows(w["mlp2_weight"], e, x.dtype)) + w["mlp2_bias"][e]
        return y + _pair_low_rank(a, w, "mlp2_weight", e, "b")

    return undo(late_map(one_block, (jnp.arange(num_blocks), rows), anchor=rows).reshape(num_blocks * block, D))


def _grouped_mxfp4_settings(block: int, name: str) -> dict:
    """The grouped MXFP4 kernel's settings, the best of bench/kernels.py --part grouped-mxfp4 on one
    H100 80GB: for decode batches (blocks of 16 to 32 rows), then for prompts per projection."""
    if block < 64:
        return dict(block_n=64, num_warps=4, num_stages=3)
    return dict(block_n=128, num_warps=8, num_stages=3) if name == "mlp1_weight" else \
        dict(block_n=128, num_warps=4, num_stages=2)


def _experts_blocked(x, idx, w, act, *, block: int, matmul, epilogue: bool = False):
    """The grouped path's contract by a kernel over expert blocks: the pairs in blocks of `block`
    rows of one expert each (`group_by_expert`; for one token, a block per pair), then
    matmul(rows, name, block_expert, used) -> [rows, out] for each projection ("mlp1_weight",
    "mlp2_weight"). Rows of blocks past `used` are undefined, and dropped. `epilogue`: the kernel
    adds the biases itself, and applies the activation to mlp1's outputs."""
    E = num_experts(w["mlp1_weight"])
    blocks_of = pairs_as_blocks if idx.shape[0] == 1 else to_blocks
    rows, undo, block_expert, used = blocks_of(x, idx, E, block)
    num_blocks = block_expert.shape[0]

    def project(inputs, name):
        out = matmul(inputs, name, block_expert, used)
        if epilogue:
            return out
        bias = w[name.replace("weight", "bias")][block_expert][:, None]  # [num_blocks, 1, out]
        return (out.reshape(num_blocks, block, -1) + bias).reshape(num_blocks * block, -1)

    h = project(rows, "mlp1_weight")
    return undo(project(h if epilogue else act(h), "mlp2_weight"))


def _packed_only(weight, impl: str) -> dict:
    if not packed(weight):
        raise ValueError(f"the {impl} expert kernel takes MXFP4-packed experts only")
    return weight


def _experts_grouped_mxfp4(x, idx, w, act, *, impl: str, interpret: bool):
    """MXFP4-packed experts by a grouped matmul that decodes weight tiles on the chip (`_experts_blocked`):
    "mosaic_grouped", the Pallas Mosaic GPU kernel (kernels/mosaic_mxfp4.py, Hopper) in blocks of 128
    rows, adding the biases and applying the SwiGLU in its epilogue; "triton_grouped", the Pallas
    Triton one (kernels/triton_mxfp4.py), its blocks sized to the pairs per expert (16 rows at a
    batch of 64, 128 on long prompts)."""
    E = num_experts(w["mlp1_weight"])
    block = min(128, max(16, 1 << (max(1, idx.size // E) - 1).bit_length())) if impl == "triton_grouped" else 128

    def matmul(inputs, name, block_expert, used):
        blocks, scales = _packed_only(w[name], impl)["blocks"], w[name]["scales"]
        if impl == "triton_grouped":
            return grouped_matmul_mxfp4(inputs, block_expert, used, blocks, scales, block_m=block,
                                        interpret=interpret, **_grouped_mxfp4_settings(block, name))
        return mosaic_mxfp4.grouped_matmul_mxfp4(inputs, block_expert, used, blocks, scales,
                                                 w[name.replace("weight", "bias")], block_m=block,
                                                 swiglu=act if name == "mlp1_weight" else None, interpret=interpret)

    return _experts_blocked(x, idx, w, act, block=block, matmul=matmul, epilogue=impl == "mosaic_grouped")


def _experts_mosaic_decode(x, idx, w, act, *, interpret: bool, rows_per_pair: bool = False):
    """Decode-sized calls in Pallas Mosaic GPU (Hopper) by kernels/mosaic_decode.py: products
    transposed, so that an expert's few pairs take blocks of as few as 8 rows (`decode_block`);
    MXFP4-packed experts decoded on the chip. `rows_per_pair`: one token's pairs over MXFP4
    experts as a row each, by kernels/mosaic_pair.py (no tensor cores, no padding rows)."""
    E = num_experts(w["mlp1_weight"])
    pairwise = rows_per_pair and idx.shape[0] == 1 and packed(w["mlp1_weight"]) and packed(w["mlp2_weight"])
    block = 1 if pairwise else decode_block(idx.size, E)

    def matmul(inputs, name, block_expert, used):
        weight, bound = w[name], block_expert.shape[0]
        if pairwise:
            return mosaic_pair.pair_matvec_mxfp4(inputs, block_expert, weight["blocks"], weight["scales"],
                                                 interpret=interpret,
                                                 **mosaic_pair.pair_settings(weight["blocks"].shape[2]))
        if packed(weight):
            _, F, G, _ = weight["blocks"].shape
            return mosaic_decode.grouped_matvec_mxfp4(inputs, block_expert, used, weight["blocks"], weight["scales"],
                                                      block_m=block, interpret=interpret,
                                                      **mosaic_decode.decode_settings_mxfp4(bound, F, G, block_m=block))
        _, F, D = weight.shape
        return mosaic_decode.grouped_matvec(inputs, block_expert, used, weight, block_m=block, interpret=interpret,
                                            **mosaic_decode.decode_settings(bound, F, D))

    return _experts_blocked(x, idx, w, act, block=block, matmul=matmul)


def _experts_pairwise(x, idx, w, act, *, interpret: bool):
    """The gather path's contract, by the Pallas Triton kernel: each pair's expert rows read in place
    (MXFP4-packed experts read packed and decoded in registers)."""
    def matvec(inputs, weight):
        if packed(weight):
            return pair_matvec_mxfp4(inputs, flat, weight["blocks"], weight["scales"], interpret=interpret)
        return pair_matvec(inputs, flat, weight, interpret=interpret)

    N, A = idx.shape
    flat = idx.reshape(N * A)
    h = matvec(jnp.repeat(x, A, axis=0), w["mlp1_weight"]) + w["mlp1_bias"][flat]
    y = matvec(act(h), w["mlp2_weight"]) + w["mlp2_bias"][flat]
    return y.reshape(N, A, -1)


def _experts_ragged(x, idx, w, act, *, ragged_dot):
    """x [N, D], idx [N, A] (negative or >= E: dropped) -> [N, A, D]: the pairs sorted by expert, then
    one grouped matmul per projection (ragged_dot(rows, w [E, out, in], group_sizes [E]))."""
    N, A = idx.shape
    E = num_experts(w["mlp1_weight"])
    order, expert, sizes = sort_by_expert(idx, E)
    e = jnp.minimum(expert, E - 1)
    h = ragged_dot(pair_inputs(x, order, A), whole_experts(w["mlp1_weight"], x.dtype), sizes) + w["mlp1_bias"][e]  # [P, 2F]
    y = ragged_dot(act(h), whole_experts(w["mlp2_weight"], x.dtype), sizes) + w["mlp2_bias"][e]  # [P, D]
    kept = ((idx >= 0) & (idx < E))[..., None]
    return jnp.where(kept, unsort(y, order).reshape(N, A, -1), 0)  # rows past the groups are undefined


def local_experts(x, weights, idx, w, act, *, first: jax.Array | int, impl: str, block: int,
                  interpret: bool = False):
    """The weighted sum [N, D] (float32) over the pairs whose expert this device holds.

    w holds experts [first, first + E_local); pairs of other experts contribute nothing (their
    devices add them). With every expert local (first = 0) this is the whole MoE output.
    """
    num_local = num_experts(w["mlp1_weight"])
    local = idx - first
    mine = (local >= 0) & (local < num_local)
    if impl == "gather":
        y = _experts_gather(x, jnp.where(mine, local, 0), w, act)
    elif impl == "triton":
        y = _experts_pairwise(x, jnp.where(mine, local, 0), w, act, interpret=interpret)
    elif impl in ("triton_grouped", "mosaic_grouped"):
        y = _experts_grouped_mxfp4(x, jnp.where(mine, local, -1), w, act, impl=impl, interpret=interpret)
    elif impl in ("mosaic_decode", "mosaic_pair"):
        y = _experts_mosaic_decode(x, jnp.where(mine, local, -1), w, act, interpret=interpret,
                                   rows_per_pair=impl == "mosaic_pair")
    elif impl == "grouped":
        y = _experts_grouped(x, jnp.where(mine, local, -1), w, act, num_experts=num_local, block=block)
    elif impl in ("mosaic_gpu", "tokamax"):
        y = _experts_ragged(x, jnp.where(mine, local, -1), w, act,
                            ragged_dot=gpu.mosaic_ragged_dot if impl == "mosaic_gpu" else gpu.ragged_dot)
    elif impl == "megablox":
        y = _experts_ragged(x, jnp.where(mine, local, -1), w, act,
                            ragged_dot=functools.partial(tpu.ragged_dot, interpret=interpret))
    else:
        raise ValueError(f"unknown MoE implementation {impl!r}")
    # A weighted sum XLA fuses with the un-sorting gather of the grouped paths (an einsum would be a
    # separate batched product reading a materialized [N, A, D]).
    return jnp.sum(y.astype(jnp.float32) * jnp.where(mine, weights, 0.0)[..., None], axis=1)


class MLPBlock(nn.Module):
    """norm -> router -> selected experts -> weighted sum (no residual)."""

    config: ModelConfig
    param_dtype: jnp.dtype = jnp.bfloat16
    kernels: Kernels = Kernels()
    mesh: Mesh | None = None  # None: one device
    WEIGHTS: ClassVar = {
        "router_weight": Weight(("embed", "experts"), inputs=("embed",)),
        "router_bias": Weight(("experts",)),
        # Expert matrices are [E, out, in], as published, unlike the other matrices ([in, out]):
        # MXFP4 packs along `in`, so packed experts decode in place, with no transposition.
        "mlp1_weight": Weight(("experts", "mlp_fused", "embed"), packable=True, inputs=("embed",)),
        "mlp1_bias": Weight(("experts", "mlp_fused"), init="zeros"),
        "mlp2_weight": Weight(("experts", "embed", "mlp"), packable=True, inputs=("mlp",)),
        "mlp2_bias": Weight(("experts", "embed"), init="zeros"),
    }

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """x [B, T, D] -> [B, T, D]."""
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        B, T, D = x.shape
        norm = RMSNorm(cfg, name="norm")
        t = norm(x).reshape(B * T, D)
        expert_adapters = {f"{name}_lora": adapter(self, name) for name in ("mlp1_weight", "mlp2_weight")}
        expert_adapters = {name: a for name, a in expert_adapters.items() if a is not None}
        tuned = bool(expert_adapters) or adapter(self, "router_weight") is not None
        if not tuned and self._fused_decode(x, w, B * T):
            out = decode_moe.moe(x.reshape(B * T, D), norm.variables["params"]["scale"], w,
                                 k=cfg.experts_per_token, eps=cfg.rms_norm_eps, alpha=cfg.swiglu_alpha,
                                 limit=cfg.swiglu_limit, interpret=self.kernels.interpret)
            return out.astype(x.dtype).reshape(B, T, D)
        router_delta = low_rank(self, "router_weight", t, "nd,dr->nr", "nr,re->ne")
        weights, idx = route(t, w["router_weight"], w["router_bias"], cfg.experts_per_token,
                             extra=jnp.asarray(router_delta, jnp.float32))

        act = SwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)

        is_packed = packed(w["mlp1_weight"])
        impl = self.kernels.moe_for(idx.size, t.dtype if is_packed else w["mlp1_weight"].dtype, packed=is_packed)
        if expert_adapters and impl not in ("gather", "grouped"):
            # Expert adapters (training) are added by the jnp paths only.
            impl = "gather" if idx.size <= self.kernels.moe_gather_max_pairs else "grouped"
        run = functools.partial(local_experts, impl=impl, block=self.kernels.moe_block, interpret=self.kernels.interpret)
        experts = {name: w[name] for name in EXPERT_WEIGHTS}
        experts.update(expert_adapters)
        if self.mesh is None:
            out = run(t, weights, idx, experts, act, first=0)
        else:
            out = _expert_parallel(t, weights, idx, experts, act, mesh=self.mesh, run=run)
        return out.astype(x.dtype).reshape(B, T, D)

    def _fused_decode(self, x, w, tokens: int) -> bool:
        """Whether the decode-sized MoE of MXFP4 experts runs as kernels/decode_moe.py's four fused
        kernels: on one device, with 16-bit activations, where the "triton" decode kernel is named."""
        cfg = self.config
        return (self.mesh is None and packed(w["mlp1_weight"]) and jnp.dtype(x.dtype).itemsize == 2
                and cfg.hidden_size % 64 == 0 and cfg.intermediate_size % 32 == 0
                and cfg.experts_per_token & (cfg.experts_per_token - 1) == 0  # Triton blocks: powers of two
                and 0 < cfg.swiglu_limit < float("inf")  # it bounds the SwiGLU outputs the kernels scale
                and self.kernels.moe_for(tokens * cfg.experts_per_token, x.dtype, packed=True) == "triton")


def _expert_parallel(x, weights, idx, w, act, *, mesh: Mesh, run):
    """The MoE on a mesh: every device computes its own experts' share of every token, then one
    all-reduce (psum over expert and tensor) of the [N, D] result. No expert weight moves.

    Under `tensor`, a device holds F / tensor of each expert's intermediate units (whole gate and
    linear pairs), so its mlp2 product is a partial sum over F; the mlp2 bias is added once, by the
    devices at tensor index 0. Expert adapters (training) are split as their weights: mlp1's `b` and
    mlp2's `a` along F too, so the adapter's share of mlp2 is a partial sum over F as well.
    """
    token_spec = spec(("batch", "act_embed"), x.shape, mesh)
    pair_spec = PartitionSpec(token_spec[0], None)  # [N, A]: tokens as x
    def weight_spec(name):
        if name.endswith("_lora"):  # an adapter, laid out by its weight's declaration
            axes = MLPBlock.WEIGHTS[name[: -len("_lora")]].adapter_axes()
            return {part: spec(axes[part], w[name][part].shape, mesh, what=f"mlp/{name}/{part}") for part in axes}
        axes = MLPBlock.WEIGHTS[name].axes
        if packed(w[name]):
            return {part: spec(tuple(packed_axes(axes)[part]), w[name][part].shape, mesh, what=f"mlp/{name}/{part}")
                    for part in ("blocks", "scales")}
        return spec(axes, w[name].shape, mesh, what=f"mlp/{name}")

    w_specs = {name: weight_spec(name) for name in w}

    def per_device(x, weights, idx, w):
        num_local = num_experts(w["mlp1_weight"])
        first = jax.lax.axis_index("expert") * num_local
        bias_once = (jax.lax.axis_index("tensor") == 0).astype(w["mlp2_bias"].dtype)
        w = dict(w, mlp2_bias=w["mlp2_bias"] * bias_once)
        out = run(x, weights, idx, w, act, first=first)
        return jax.lax.psum(out, ("expert", "tensor"))

    return jax.shard_map(per_device, mesh=mesh, in_specs=(token_spec, pair_spec, pair_spec, w_specs),
                         out_specs=token_spec, check_vma=False)(x, weights, idx, w)
