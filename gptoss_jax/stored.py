"""Parameters as checkpoints store them, and back: attention's fused q, k, v weight and bias as
the three parts the published checkpoints name (`q_weight` [D, N, H], `k_weight` and `v_weight`
[D, K, H], and their biases; model/attention.py holds them as one), and each `mxfp4.MXFP4` as its
{"blocks", "scales"} group. checkpoint.py converts at this boundary, both ways.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from .formats import fuse_qkv, qkv_part
from .mxfp4 import MXFP4, packed


def _part(x, name: str):
    """The q, k or v part of a fused attention weight or bias: an array's (numpy: contiguous, as
    stored), a `jax.ShapeDtypeStruct`'s (its sharding's spec without the fused axis), or its logical
    axes' (q's on query heads)."""
    if isinstance(x, (tuple, PartitionSpec)):  # logical axes
        *lead, kv, _, last = x
        return PartitionSpec(*lead, "q_heads" if name[0] == "q" else kv, last)
    if not isinstance(x, jax.ShapeDtypeStruct):
        part = qkv_part(x, name)
        return np.ascontiguousarray(part) if isinstance(part, np.ndarray) else part
    shape = jax.eval_shape(lambda t: qkv_part(t, name), x).shape
    sharding = x.sharding
    if sharding is not None:  # [..., K, G + 2, H] split as [..., K, H] or [..., N, H]: the K split, N's too
        spec = tuple(sharding.spec) + (None,) * (len(x.shape) - len(sharding.spec))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1]))
    return jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding)


def split_attention(tree):
    """The tree with attention's fused q, k, v weight and bias as the three parts the published
    checkpoints name (`q_weight`, `k_weight`, `v_weight` and their biases; model/attention.py fuses
    them): how checkpoints store them."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: split_attention(v) for k, v in tree.items()}
    if "qkv_weight" in tree:
        w, b = tree.pop("qkv_weight"), tree.pop("qkv_bias")
        tree.update({f"{x}_{kind}": _part(a, x) for x in "qkv" for kind, a in (("weight", w), ("bias", b))})
    return tree


def fuse_attention(tree, shardings=None):
    """Back from `split_attention`: each attention's parts fused (into `shardings`' layout, a tree
    like the fused one, where given)."""
    if not isinstance(tree, dict):
        return tree
    tree = {k: fuse_attention(v, shardings.get(k) if isinstance(shardings, dict) else None)
            for k, v in tree.items()}
    if "q_weight" in tree:
        for kind in ("weight", "bias"):
            parts = [tree.pop(f"{x}_{kind}") for x in "qkv"]
            out = shardings[f"qkv_{kind}"] if isinstance(shardings, dict) else None
            tree[f"qkv_{kind}"] = (fuse_qkv(*parts) if isinstance(parts[0], np.ndarray)
                                   else jax.jit(fuse_qkv, out_shardings=out)(*parts))
    return tree


def stored_form(tree):
    """The on-disk form: attention's q, k, v apart (`split_attention`), every MXFP4 as its
    {"blocks", "scales"} group."""
    return jax.tree.map(lambda x: {"blocks": x.blocks, "scales": x.scales} if packed(x) else x,
                        split_attention(tree), is_leaf=packed)


def from_groups(like, tree):
    """Back from the on-disk groups: an MXFP4 where `like` (the item's spec) holds one. The attention
    parts stay apart (`fuse_attention` joins them once read)."""
    return jax.tree.map(lambda s, x: MXFP4(x["blocks"], x["scales"]) if packed(s) else x,
                        split_attention(like), tree, is_leaf=packed)
