"""Synthetic weights and checkpoints for tests, demos and benchmarks (no real checkpoint is needed).

Unlike `init_params` (a training-style init whose tiny activations never reach the SwiGLU clamp or
make the router's choice matter), the weights here have the magnitudes a trained model shows:
unit-scale residual stream, expert pre-activations that often pass the clamp at +-7, sinks of
order 1, non-trivial norm scales and biases.

`write_synthetic_checkpoint` writes the same kind of weights in any of the three published layouts
(see formats.py), streaming one tensor at a time so a full-size 20b checkpoint needs little memory.
"""

from __future__ import annotations

import functools
import json
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from . import formats
from .config import ModelConfig
from .drafts.base import DeviceDraft, DraftContext, Proposal
from .mxfp4 import MXFP4, packed_shape, split_dtype
from .params import abstract_params, logical_axes, packable_names, param_shardings
from .stored import fuse_attention, split_attention
from .weight import Params, at_path

# Matrices get gain / sqrt(fan_in), fan_in the product of their input axes ("embed" unless listed).
_GAINS = {"mlp1_weight": 4.0, "router_weight": 2.0}
_INPUT_AXES = {"mlp2_weight": {"mlp"}, "out_weight": {"q_heads", "head_dim"}}
_FP4_RMS = math.sqrt(np.mean(np.array([0, .5, 1, 1.5, 2, 3, 4, 6]) ** 2))  # of a uniformly random code


def _matrix_std(name: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> float:
    inputs = _INPUT_AXES.get(name, {"embed"})
    fan_in = int(np.prod([n for a, n in zip(axes, shape, strict=True) if a in inputs])) or 1
    return _GAINS.get(name, 1.0) / math.sqrt(fan_in)


def draw_weight(rng: np.random.Generator, name: str, axes: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
    """One float32 weight, by its parameter name, with realistic magnitude."""
    z = rng.standard_normal(shape, dtype=np.float32)
    if name == "scale":  # RMSNorm
        return 1.0 + 0.2 * z
    if name.endswith("_bias"):
        return 0.1 * z
    if name in ("sinks", "embedding"):
        return z
    return z * np.float32(_matrix_std(name, axes, shape))


def random_params(config: ModelConfig, seed: int = 0, dtype=jnp.float32) -> Params:
    """Random parameters with realistic activation magnitudes, drawn on the host with numpy.
    dtype "mxfp4": bfloat16, with the expert matrices as random MXFP4 blocks and scales (mxfp4.MXFP4)."""
    rng = np.random.default_rng(seed)
    dtype, packs = split_dtype(dtype)
    dtype = jnp.dtype(dtype)
    names = packable_names() if packs else frozenset()

    def draw(path, leaf, spec):
        name = str(path[-1].key)
        if name in names:
            blocks, scales = packed_shape(leaf.shape)
            b, sc = draw_packed(rng, blocks, scales, _matrix_std(name, tuple(spec), leaf.shape))
            return MXFP4(jnp.asarray(b), jnp.asarray(sc))
        value = draw_weight(rng, name, tuple(spec), leaf.shape)
        return jnp.asarray(value, jnp.float32 if name == "scale" else dtype)

    # Drawn as checkpoints store them (q, k and v apart, in the order of their names), then fused:
    # the same values as before the model fused q, k and v, so the demo model did not change.
    drawn = jax.tree_util.tree_map_with_path(draw, split_attention(abstract_params(config, jnp.float32)),
                                             split_attention(logical_axes(config)),
                                             is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))
    return fuse_attention(drawn)


def _path_specs(config: ModelConfig) -> dict[str, tuple[tuple[str, ...], tuple[int, ...]]]:
    """"/"-joined parameter path -> (logical axes, shape)."""
    shapes = abstract_params(config, jnp.float32)
    axes = logical_axes(config)
    out = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_leaves_with_path(shapes),
                                  jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)), strict=True):
        out["/".join(str(p.key) for p in path)] = (tuple(spec), leaf.shape)
    return out


def draw_packed(rng, blocks_shape, scales_shape, std: float) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks, with scales putting the decoded weights' RMS near `std`."""
    blocks = rng.integers(0, 256, size=blocks_shape, dtype=np.uint8)
    exponent = _packed_exponent(std)
    scales = (exponent + rng.integers(-1, 2, size=scales_shape)).astype(np.uint8)
    return blocks, scales


def _packed_exponent(std: float) -> int:
    return 127 + round(math.log2(std / _FP4_RMS))


def _rule_tensors(rng, rule: formats.Rule, specs) -> list[np.ndarray]:
    if rule.packed:
        target = rule.targets[0]
        axes, shape = specs[target]
        blocks, scales = (src.shape for src in rule.sources)
        return list(draw_packed(rng, blocks, scales, _matrix_std(target.split("/")[-1], axes, shape)))
    ours = [draw_weight(rng, t.split("/")[-1], *specs[t]) for t in rule.targets]
    return [x.astype(ml_dtypes.bfloat16) for x in rule.from_ours(*ours)]


_ST_DTYPES = {formats.FLOAT: ("BF16", 2), formats.UINT8: ("U8", 1)}


def _write_safetensors(path: str, rules: list[formats.Rule], produce) -> None:
    """Write a safetensors file whose header is known up front, producing one rule's tensors at a time."""
    header, offset = {}, 0
    for rule in rules:
        for src in rule.sources:
            dtype, size = _ST_DTYPES[src.kind]
            nbytes = int(np.prod(src.shape, dtype=np.int64)) * size
            header[src.name] = {"dtype": dtype, "shape": list(src.shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for rule in rules:
            for src, array in zip(rule.sources, produce(rule), strict=True):
                assert array.shape == src.shape, (src.name, array.shape, src.shape)
                f.write(np.ascontiguousarray(array).tobytes())


def write_synthetic_checkpoint(config: ModelConfig, directory: str | os.PathLike, layout: str, *,
                               seed: int = 0) -> None:
    """A checkpoint folder in `layout` ("original", "hf-mxfp4" or "hf-bf16") with random weights.

    Float tensors are bfloat16, as published. "original" is one model.safetensors; the Hugging Face
    layouts are sharded (one file per layer, plus one for the rest) with an index.
    """
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    specs = _path_specs(config)
    rules = formats.rules(config, layout)

    def produce(rule):
        return _rule_tensors(rng, rule, specs)

    if layout == formats.ORIGINAL:
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config.to_original_json(), f, indent=2)
        _write_safetensors(os.path.join(directory, "model.safetensors"), rules, produce)
        return
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_hf_json(mxfp4=layout == formats.HF_MXFP4), f, indent=2)
    items = list(dict.fromkeys(rule.item for rule in rules))
    weight_map = {}
    for i, item in enumerate(items):
        name = f"model-{i + 1:05d}-of-{len(items):05d}.safetensors"
        item_rules = [r for r in rules if r.item == item]
        _write_safetensors(os.path.join(directory, name), item_rules, produce)
        weight_map.update({src.name: name for r in item_rules for src in r.sources})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)


def random_params_on_device(config: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, *, mesh=None) -> Params:
    """Like `random_params`, drawn on the devices (for full-size benchmarks). dtype "mxfp4": bfloat16,
    with the expert matrices as random MXFP4 blocks and scales, never decoded (gpt-oss-120b then fits
    one 80 GB GPU, with no checkpoint on disk).

    Each weight is drawn by its own jitted call straight into its layout: on the default device, or
    sharded on `mesh` by the rules in sharding.py, so that no device ever holds a weight the rules
    split (threefry keys are partitionable: each device draws only its own slice).
    """
    shardings = None if mesh is None else param_shardings(config, mesh, dtype=dtype)
    dtype, packs = split_dtype(dtype)
    names = packable_names() if packs else frozenset()
    shapes = abstract_params(config, jnp.float32)
    specs = jax.tree.leaves(logical_axes(config), is_leaf=lambda x: isinstance(x, tuple))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    key = jax.random.key(seed)
    out = []
    for i, ((path, leaf), spec) in enumerate(zip(leaves, specs, strict=True)):
        name = str(path[-1].key)
        sharding = None if shardings is None else at_path(shardings, path)
        if name in names:  # blocks and scales of the weight's shape, scaled to its fan-in
            exponent = _packed_exponent(_matrix_std(name, tuple(spec), leaf.shape))
            out.append(MXFP4(*(_draw_packed_part(jax.random.fold_in(jax.random.fold_in(key, i), k), shape=shape,
                                                 blocks=k == 0, exponent=exponent,
                                                 sharding=None if sharding is None else sharding[k])
                               for k, shape in enumerate(packed_shape(leaf.shape)))))
            continue
        if name == "scale":  # RMSNorm: 1 + 0.2 z, float32 always
            offset, scale, want = 1.0, 0.2, jnp.float32
        else:
            offset, want = 0.0, jnp.dtype(dtype)
            scale = (0.1 if name.endswith("_bias") else 1.0 if name in ("sinks", "embedding")
                     else _matrix_std(name, tuple(spec), leaf.shape))
        out.append(_draw(jax.random.fold_in(key, i), shape=leaf.shape, offset=offset, scale=scale, dtype=want,
                         sharding=sharding))
    return jax.tree_util.tree_unflatten(tree, out)


@functools.partial(jax.jit, static_argnames=("shape", "blocks", "exponent", "sharding"))
def _draw_packed_part(key, *, shape, blocks, exponent, sharding):
    """Uniformly random MXFP4 block bytes, or scales of exponent - 1 .. exponent + 1, in `sharding`."""
    if blocks:
        x = jax.random.randint(key, shape, 0, 256, jnp.int32).astype(jnp.uint8)
    else:
        x = (exponent + jax.random.randint(key, shape, -1, 2, jnp.int32)).astype(jnp.uint8)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


@functools.partial(jax.jit, static_argnames=("shape", "offset", "scale", "dtype", "sharding"))
def _draw(key, *, shape, offset, scale, dtype, sharding):
    """offset + scale * N(0, 1), drawn in the layout `sharding` (None: the default device)."""
    x = (offset + scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)
    return x if sharding is None else jax.lax.with_sharding_constraint(x, sharding)


class KnownReplies(DeviceDraft):
    """A draft source for tests and benchmarks that knows each prompt's reply (computed beforehand): it
    proposes the reply's next tokens where the context is a known prompt followed by a prefix of its
    reply, and nothing elsewhere; with `wrong_every` n, every n-th token of a reply (by its position
    there) is proposed off by one; `by_position`: the reply's tokens at the context's position once
    the prompt matches, whatever the reply so far (an oracle that survives a near-tie's swap in
    bfloat16). On the host (`draft(context, k)`) and on the devices (`propose`), alike.

    On the devices everything that tells two sources apart is in their arrays (`arrays()`, an argument
    of the steps): the table of prompts and replies, padded to a few sizes (8, 16, ... sequences of a
    multiple of 128 tokens), and `wrong_every`. Two sources whose tables pad alike are equal, and so
    share their compiled steps."""

    def __init__(self, prompts, replies, vocab: int, wrong_every: int = 0, by_position: bool = False):
        self.known = [(list(p), list(r)) for p, r in zip(prompts, replies)]
        self.vocab, self.wrong_every, self.by_position = vocab, wrong_every, by_position
        N = max(8, 1 << (len(self.known) - 1).bit_length())
        W = -(-max(len(p) + len(r) for p, r in self.known) // 128) * 128
        table = np.full((N, W), -1, np.int32)  # [N, W] prompt then reply; rows past the known ones: -1
        starts, ends = np.ones(N, np.int32), np.zeros(N, np.int32)  # a padding row follows no context
        for i, (p, r) in enumerate(self.known):
            table[i, :len(p) + len(r)] = p + r
            starts[i], ends[i] = len(p), len(p) + len(r)
        self._arrays = {"table": table, "starts": starts, "ends": ends, "wrong_every": np.int32(wrong_every)}
        self._key = (type(self), table.shape, vocab, by_position)
        self._index: dict = {}  # the known sequences by prompt: on the host, a few lookups a draft, not one a prompt
        for i, (prompt, _) in enumerate(self.known):
            self._index.setdefault((len(prompt), tuple(prompt)), []).append(i)
        self._lengths = sorted({len(prompt) for prompt, _ in self.known})

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, KnownReplies) and self._key == other._key

    def arrays(self) -> dict:
        """The table of prompts and replies [N, W], where each reply starts and ends [N], wrong_every []."""
        return self._arrays

    def _wrong(self, xp, tokens, at, n):
        """Tokens at these positions of their replies, every n-th off by one (n = 0: none; xp: np or jnp)."""
        return xp.where((n > 0) & (at % xp.maximum(n, 1) == n - 1), (tokens + 1) % self.vocab, tokens)

    def __call__(self, context, k: int) -> list[int]:
        context = list(context)
        candidates = [self._index.get((n, tuple(context[:n])), []) for n in self._lengths if n <= len(context)]
        for i in sorted(i for c in candidates for i in c):
            prompt, reply = self.known[i]
            j = len(context) - len(prompt)
            compared = len(prompt) if self.by_position else len(context)
            if j >= 0 and context[:compared] == (prompt + reply)[:compared]:
                draft = np.asarray(reply[j:j + k], np.int64)
                return self._wrong(np, draft, np.arange(j, j + len(draft)), self.wrong_every).tolist()
        return []

    def propose(self, context: DraftContext, k: int) -> Proposal:
        """From each row's context (the first context.lengths [B] of context.history [B, L]), with the
        arrays on the devices (context.arrays; None: these, as constants of the program)."""
        history, lengths, arrays = context.history, context.lengths, context.arrays or self._arrays
        table, starts, ends, wrong_every = (jnp.asarray(arrays[x]) for x in ("table", "starts", "ends", "wrong_every"))
        N, W = table.shape
        P = min(W, history.shape[1])
        seen = jnp.minimum(lengths[:, None], starts[None]) if self.by_position else lengths[:, None]  # [B, N]
        before = jnp.arange(P)[None, None] < seen[..., None]  # [B, N, P]: the positions compared
        same = ((table[None, :, :P] == history[:, None, :P]) | ~before).all(axis=-1)  # [B, N]
        ok = same & (lengths[:, None] >= starts[None]) & (lengths[:, None] <= ends[None])
        n = jnp.argmax(ok, axis=1)  # the first known sequence the context follows
        at = lengths[:, None] + jnp.arange(k)[None]  # [B, k]
        drafts = self._wrong(jnp, table[n[:, None], jnp.clip(at, 0, W - 1)], at - starts[n][:, None], wrong_every)
        count = jnp.where(ok.any(axis=1), jnp.clip(ends[n] - lengths, 0, k), 0)
        return Proposal(drafts, count.astype(jnp.int32))
