"""The mixture-of-experts block: a float32 top-k router and dropless experts with a clamped SwiGLU.

The experts compute exactly the selected (token, expert) pairs, never every expert for every token
(`jax.lax.ragged_dot` is not used: on CPU and on CUDA GPUs it lowers to a dense product over all
experts). Who computes them is the kernel layer's choice (`Kernels.experts_for`, one variant per
call from the registry in kernels/experts/__init__.py: readable jnp paths, Pallas Mosaic GPU on Hopper,
megablox on TPU); this module holds the mathematics: routing, the SwiGLU, the weighted sum, and the
experts split over a mesh. Expert matrices may be held packed in MXFP4 (`mxfp4.MXFP4`, its blocks
and scales); the variants read them packed or decode them inside the jitted step.

On a mesh (sharding.py), each device runs the variant on its own experts only
(`kernels.local_experts`): every token's pairs with other devices' experts contribute nothing there,
and one all-reduce over `expert` and `tensor` adds the devices' partial outputs. No expert weight
moves between devices (docs/architecture.md says why this rather than an all-to-all).

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

from ..config import ModelConfig
from ..kernels import Kernels, local_experts
from ..sharding import spec, weight_spec
from ..weight import Weight, adapter, declare, is_table, low_rank
from .layers import RMSNorm

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
    experts applies it in its epilogue (kernels/experts/mosaic_mxfp4.py), reading the constants from here."""

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
    def __call__(self, x: jax.Array, adapters: jax.Array | None = None) -> jax.Array:
        """x [B, T, D] -> [B, T, D]; adapters [B] int32: each row's served adapter (weight.low_rank;
        for the experts, each token's pairs read theirs: kernels/experts/xla.py)."""
        cfg = self.config
        w = {name: declare(self, name) for name in self.WEIGHTS}
        B, T, D = x.shape
        norm = RMSNorm(cfg, name="norm")
        t = norm(x).reshape(B * T, D)
        rows = None if adapters is None else jnp.repeat(adapters, T)  # [N]: each token's adapter
        expert_adapters, pick = {}, None
        for name in ("mlp1_weight", "mlp2_weight"):
            held = adapter(self, name)
            if held is not None and is_table(self.WEIGHTS[name], held):
                if rows is None:
                    continue  # a table read without rows: the base model
                pick = jax.nn.one_hot(rows, held["a"].shape[0], dtype=t.dtype)  # [N, L]: zeros for none
            if held is not None:
                expert_adapters[f"{name}_lora"] = held
        tuned = bool(expert_adapters) or adapter(self, "router_weight") is not None
        if not tuned:  # a kernel may run the whole block (norm and router included)
            out = self.kernels.fused_moe(x.reshape(B * T, D), norm.variables["params"]["scale"], w, cfg, mesh=self.mesh)
            if out is not None:
                return out.astype(x.dtype).reshape(B, T, D)
        router_delta = low_rank(self, "router_weight", t, "nd,dr->nr", "nr,re->ne", rows)
        weights, idx = route(t, w["router_weight"], w["router_bias"], cfg.experts_per_token,
                             extra=jnp.asarray(router_delta, jnp.float32))

        act = SwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
        variant = self.kernels.experts_for(idx.size, t.dtype, w["mlp1_weight"], adapters=bool(expert_adapters),
                                           mesh=self.mesh)
        run = functools.partial(local_experts, variant=variant, kernels=self.kernels)
        experts = {name: w[name] for name in EXPERT_WEIGHTS}
        experts.update(expert_adapters)
        if self.mesh is None:
            out = run(t, weights, idx, experts, act, first=0, pick=pick)
        else:
            out = _expert_parallel(t, weights, idx, experts, act, pick, mesh=self.mesh, run=run,
                                   num_local=cfg.num_experts // self.mesh.shape["expert"])
        return out.astype(x.dtype).reshape(B, T, D)


def _expert_parallel(x, weights, idx, w, act, pick, *, mesh: Mesh, run, num_local: int):
    """The MoE on a mesh: every device computes its own experts' share of every token, then one
    all-reduce (psum over expert and tensor) of the [N, D] result. No expert weight moves.

    Under `tensor`, a device holds F / tensor of each expert's intermediate units (whole gate and
    linear pairs), so its mlp2 product is a partial sum over F; the mlp2 bias is added once, by the
    devices at tensor index 0. Expert adapters (training) are split as their weights: mlp1's `b` and
    mlp2's `a` along F too, so the adapter's share of mlp2 is a partial sum over F as well; tables of
    served adapters likewise, every adapter on every device (pick [N, L]: the tokens' adapters, as x).
    """
    token_spec = spec(("batch", "act_embed"), x.shape, mesh)
    pair_spec = PartitionSpec(token_spec[0], None)  # [N, A]: tokens as x
    def layout(name):
        if name.endswith("_lora"):  # an adapter, laid out by its weight's declaration
            spec_of = MLPBlock.WEIGHTS[name[: -len("_lora")]]
            axes = spec_of.adapter_axes()
            if is_table(spec_of, w[name]):
                axes = {part: ("adapters",) + part_axes for part, part_axes in axes.items()}
            return {part: spec(axes[part], w[name][part].shape, mesh, what=f"mlp/{name}/{part}") for part in axes}
        return weight_spec(MLPBlock.WEIGHTS[name].axes, w[name], mesh, what=f"mlp/{name}")

    w_specs = {name: layout(name) for name in w}

    def per_device(x, weights, idx, w, pick):
        first = jax.lax.axis_index("expert") * num_local
        bias_once = (jax.lax.axis_index("tensor") == 0).astype(w["mlp2_bias"].dtype)
        w = dict(w, mlp2_bias=w["mlp2_bias"] * bias_once)
        out = run(x, weights, idx, w, act, first=first, pick=pick)
        return jax.lax.psum(out, ("expert", "tensor"))

    pick_spec = None if pick is None else pair_spec
    return jax.shard_map(per_device, mesh=mesh, in_specs=(token_spec, pair_spec, pair_spec, w_specs, pick_spec),
                         out_specs=token_spec, check_vma=False)(x, weights, idx, w, pick)
