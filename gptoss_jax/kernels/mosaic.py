"""What the Pallas Mosaic GPU kernels (attention/mosaic_cache.py, experts/mosaic_*.py) share: the JAX they are
written for, their interpret mode, and the swizzled shared-memory tiles wgmma reads."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def supported() -> bool:
    """JAX's Mosaic GPU interface these kernels are written for (0.10's differs: loads, interpret mode)."""
    return jax.__version_info__ >= (0, 11)


def interpret_params(interpret: bool):
    """Pallas Mosaic GPU's interpret mode (CPU: tests) or none."""
    return plgpu.InterpretGPUParams() if interpret else None


def tiles(dtype, row_bytes: int = 128) -> tuple:
    """Tiles of 8 rows of `row_bytes` bytes of dtype, swizzled by as many bytes: the layout wgmma
    reads its shared-memory operands in (and stores from its accumulators go out of)."""
    return plgpu.TilingTransform((8, row_bytes // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(row_bytes)


def splits_for(steps: int, programs: int) -> int:
    """Ranges to split a row's `steps` input steps into (a divisor of steps) so that programs x
    splits reaches 264, two programs per SM of a large GPU (an H100 has 132); all steps at most."""
    return next(d for d in range(1, steps + 1) if steps % d == 0 and (programs * d >= 264 or d == steps))
