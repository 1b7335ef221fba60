"""MXFP4 (OCP microscaling FP4) decoding of the published expert weights.

Layout: blocks uint8 [..., G, 16] and scales uint8 [..., G], one scale per 32 values along the
last (input) axis. Each byte holds two e2m1 codes: the LOW nibble is the even element, the HIGH
nibble the odd one. value = FP4_VALUES[code] * 2^(scale - 127). Every value is exact in bfloat16
and float32 (2^-128 and its multiples included); scale 255 with |code value| >= 1 overflows to inf,
as in both references.

On the host (numpy): `decode_mxfp4` (a table lookup per byte) and `unpack_experts`, for loading
decoded experts. On the device (jnp): `decode`, for experts kept packed on the device and decoded
inside the jitted step. A weight held packed is an `MXFP4` (its blocks and scales; `packed` is the
one test), chosen once where parameters are made or loaded, by the dtype "mxfp4" (`split_dtype`).
JAX is imported by the device functions only, so that the command line's checks before JAX starts
(layout.py) may read the "mxfp4" spelling.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, NamedTuple

import ml_dtypes
import numpy as np

if TYPE_CHECKING:
    import jax

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@functools.lru_cache(maxsize=None)
def _pair_table(dtype: str) -> np.ndarray:
    """[256 scales * 256 bytes] -> the byte's two decoded values, packed in one integer (low = even).

    Built with the plain formula (ldexp in float32, then a cast), so a lookup gives exactly its result.
    """
    byte = np.arange(256)
    pair = np.stack([FP4_VALUES[byte & 0x0F], FP4_VALUES[byte >> 4]], axis=-1)  # [256 bytes, 2]
    exponent = (np.arange(256) - 127).astype(np.int32)[:, None, None]  # [256 scales, 1, 1]
    with np.errstate(over="ignore"):
        values = np.ldexp(pair[None], exponent).astype(_DTYPES[dtype])  # [256, 256, 2]
    return np.ascontiguousarray(values).view(np.uint32 if dtype == "bfloat16" else np.uint64).reshape(-1)


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G * 32], vectorized.

    One table lookup per byte (scale and byte index a 64K-entry table of value pairs), which is
    several times faster than decoding nibble by nibble and needs no float32 temporaries.
    """
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
                         f"(expected [..., G, {BYTES_PER_BLOCK}] and [..., G])")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported MXFP4 decode dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    index = (scales.astype(np.uint16)[..., None] << 8) | blocks  # [..., G, 16]
    pairs = _pair_table(dtype)[index]  # [..., G, 16] of (even, odd) value pairs
    return pairs.view(_DTYPES[dtype]).reshape(*blocks.shape[:-2], -1)


def decode_mxfp4_reference(blocks: np.ndarray, scales: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """The formula as written, nibble by nibble: what the table lookup is tested against."""
    # [..., G, 16, 2]: (low nibble, high nibble) = (even, odd) element of each byte.
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], VALUES_PER_BLOCK)
    with np.errstate(over="ignore"):
        values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1).astype(_DTYPES[dtype])


def unpack_experts(blocks: np.ndarray, scales: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """Packed experts [E, out, in/32, 16] + [E, out, in/32] -> decoded [E, out, in] (our layout).

    Decoded one expert at a time into the output, so temporaries stay at one expert's size.
    """
    E, out, groups = scales.shape
    result = np.empty((E, out, groups * VALUES_PER_BLOCK), _DTYPES[dtype])
    for e in range(E):
        result[e] = decode_mxfp4(blocks[e], scales[e], dtype)
    return result


def packed_shape(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A weight [..., in] kept packed along `in` -> (blocks [..., in/32, 16], scales [..., in/32])."""
    *lead, inp = shape
    if inp % VALUES_PER_BLOCK:
        raise ValueError(f"MXFP4 packs blocks of {VALUES_PER_BLOCK} along the last axis; {inp} is not a multiple")
    return (*lead, inp // VALUES_PER_BLOCK, BYTES_PER_BLOCK), (*lead, inp // VALUES_PER_BLOCK)


class MXFP4(NamedTuple):
    """A weight [..., in] held MXFP4-packed along its last (input) axis: blocks uint8 [..., in/32, 16]
    (two e2m1 codes a byte, the low nibble the even element) and scales uint8 [..., in/32] (one
    exponent, biased by 127, per 32 values). A pytree of its two arrays, so that jax.tree.map, jit
    and shardings see two uint8 arrays (their layouts an MXFP4 of the two, likewise); checkpoints
    store it as a {"blocks", "scales"} group (checkpoint.py converts at that boundary)."""

    blocks: Any
    scales: Any


def packed(x) -> bool:
    """Whether a parameter is an MXFP4-packed weight rather than an array: the one test."""
    return isinstance(x, MXFP4)


DTYPE = "mxfp4"  # the parameters' dtype: bfloat16, with the packable (expert) matrices as MXFP4


def split_dtype(dtype) -> tuple[Any, bool]:
    """A parameters' dtype (a name or a dtype object) -> (the dtype of the weights held as arrays,
    whether the packable weights are held packed): "mxfp4" is bfloat16 with MXFP4-packed experts,
    anything else itself with nothing packed. The one reading of the "mxfp4" spelling."""
    if isinstance(dtype, str) and dtype == DTYPE:
        return "bfloat16", True
    return dtype, False


# |e2m1 code| (code & 7) as (1 + half / 2) * 2^exponent (code 0 is zero).
_EXPONENT = np.array([0, -1, 0, 0, 1, 1, 2, 2], np.int32)
_HALF = np.array([0, 0, 0, 1, 0, 1, 0, 1], np.int32)
_FORMATS = {np.dtype(np.float32): (23, np.uint32), np.dtype(ml_dtypes.bfloat16): (7, np.uint16)}


def decode(blocks: jax.Array, scales: jax.Array, dtype="bfloat16") -> jax.Array:
    """jnp: blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G * 32] (bfloat16 or
    float32), bit for bit as `decode_mxfp4`.

    The values' bits are assembled with integer operations (sign, exponent = the code's exponent +
    scale, one mantissa bit; subnormals and inf where the exponent leaves the normal range), so no
    float arithmetic can flush the tiny values of scales near 0 (XLA on CPU flushes subnormals).
    """
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(dtype)
    if dtype not in _FORMATS:
        raise ValueError(f"MXFP4 decodes to bfloat16 or float32, not {dtype}")
    mantissa, uint = _FORMATS[dtype]
    codes = jnp.stack([blocks & 0x0F, blocks >> 4], axis=-1).astype(jnp.int32)  # [..., G, 16, 2]
    codes = codes.reshape(*blocks.shape[:-1], VALUES_PER_BLOCK)  # [..., G, 32]: (even, odd) pairs
    magnitude, sign = codes & 7, codes >> 3
    half = jnp.asarray(_HALF)[magnitude]
    exponent = jnp.asarray(_EXPONENT)[magnitude] + scales.astype(jnp.int32)[..., None]  # biased
    normal = (exponent << mantissa) | (half << (mantissa - 1))
    subnormal = (2 + half) << jnp.maximum(exponent + mantissa - 2, 0)  # exponent 0 or -1 here
    bits = jnp.where(exponent >= 255, 255 << mantissa, jnp.where(exponent >= 1, normal, subnormal))
    bits = jnp.where(magnitude == 0, 0, bits) | (sign << (8 * np.dtype(uint).itemsize - 1))
    values = jax.lax.bitcast_convert_type(bits.astype(uint), dtype)
    return values.reshape(*blocks.shape[:-2], -1)


def decode_params(params, dtype="bfloat16"):
    """Parameters with every packed weight decoded to dtype (on the device it is on)."""
    import jax

    return jax.tree.map(lambda x: decode(x.blocks, x.scales, dtype) if packed(x) else x, params, is_leaf=packed)
