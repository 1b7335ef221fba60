"""What the Pallas Mosaic GPU kernels (attention/mosaic_cache.py, experts/mosaic_*.py) share: the JAX they are
written for, their interpret mode, the swizzled shared-memory tiles wgmma reads, and loads from shared
memory into registers (in a given layout, and a strided column of bytes, which Pallas does not offer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.lib.mlir import ir  # Mosaic GPU's MLIR, for loads Pallas does not offer
from jax._src.lib.mlir.dialects import arith, memref, vector
from jax.experimental.mosaic import gpu as mgpu
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


def load(ref, idx, layout, interpret: bool):
    """ref[idx] (shared memory) into registers in `layout`, bank conflicts allowed (interpret mode:
    a plain read)."""
    return ref[idx] if interpret else plgpu.load(ref.at[idx], layout=layout, optimized=False)


def load_rows_strided(ref, rows: int, stride: int):
    """ref[0], ref[stride], ..., ref[(rows - 1) * stride] (a contiguous 1-D uint8 ref in shared
    memory: one column of a row-major [rows, stride] table) -> [rows] uint8 in the wgmma layout's
    rows (`Layout.WGMMA.reduce(1)`), a byte load each (a GPU only: Pallas's own loads take
    contiguous rows only)."""
    out = plgpu.ShapeDtypeStruct((rows,), jnp.uint8, layout=plgpu.Layout.WGMMA.reduce(1))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out)
    def column(_, table):
        layout = mgpu.fragmented_array.WGMMA_ROW_LAYOUT
        index = ir.IndexType.get()
        byte = ir.VectorType.get((1,), ir.IntegerType.get_signless(8))
        regs = np.empty(layout.registers_shape((rows,)), dtype=object)
        for reg, (row,) in zip(np.ndindex(regs.shape), layout.thread_idxs((rows,))):
            at = arith.muli(row, arith.constant(index, stride))
            regs[reg] = vector.broadcast(byte, memref.load(table, [at]))
        return mgpu.FragmentedArray(_registers=regs, _layout=layout, _is_signed=False)

    return column(ref)
