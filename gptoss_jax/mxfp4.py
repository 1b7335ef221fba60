"""MXFP4 (OCP microscaling FP4) decoding of the published expert weights.

Layout: blocks uint8 [..., G, 16] and scales uint8 [..., G], one scale per 32 values along the
last (input) axis. Each byte holds two e2m1 codes: the LOW nibble is the even element, the HIGH
nibble the odd one. value = FP4_VALUES[code] * 2^(scale - 127). Every value is exact in bfloat16
and float32 (2^-128 and its multiples included); scale 255 with |code value| >= 1 overflows to inf,
as in both references.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = 16
_DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


def decode_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> dtype [..., G * 32], vectorized."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[-1] != BYTES_PER_BLOCK or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape} do not match "
                         f"(expected [..., G, {BYTES_PER_BLOCK}] and [..., G])")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported MXFP4 decode dtype {dtype!r}; expected one of {', '.join(_DTYPES)}")
    # [..., G, 16, 2]: (low nibble, high nibble) = (even, odd) element of each byte.
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], VALUES_PER_BLOCK)
    with np.errstate(over="ignore"):
        values = np.ldexp(FP4_VALUES[codes], scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1).astype(_DTYPES[dtype])


def unpack_experts(blocks: np.ndarray, scales: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """Packed expert weights [E, out, in/32, 16] + [E, out, in/32] -> decoded [E, in, out] (our layout)."""
    return np.ascontiguousarray(np.swapaxes(decode_mxfp4(blocks, scales, dtype), -1, -2))
