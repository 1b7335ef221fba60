"""tokamax, Google DeepMind's kernel library, found where installed: `pip install -e ".[cuda]"`
(Python >= 3.12). Nothing here is imported without a GPU. Its attention (attention/tokamax.py) and
its ragged dot (experts/ragged.py) load it through `modules`."""

from __future__ import annotations

import functools


@functools.cache
def modules():
    """(tokamax, its attention base, its Mosaic GPU flash attention, its ragged dot base); ImportError
    naming what is missing where it is not installed."""
    try:
        import tokamax
        from tokamax._src.ops.attention import base, pallas_mosaic_gpu
        from tokamax._src.ops.ragged_dot import base as ragged_base
    except ImportError as e:  # tokamax itself, or a dependency of it
        raise ImportError(f"the GPU kernels need tokamax (pip install -e \".[cuda]\", Python >= 3.12): {e}") from e
    return tokamax, base, pallas_mosaic_gpu.PallasMosaicGpuFlashAttention(), ragged_base


def available() -> bool:
    try:
        modules()
    except ImportError:
        return False
    return True
