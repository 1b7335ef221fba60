"""What the Pallas Triton kernels share: block sizes (powers of two), the settings of a Triton call,
masked spans, the split of a row's work over programs. JAX 0.11 deprecated Pallas's Triton
backend; while JAX ships it this folder's kernels run (triton/__init__.py says where "auto" picks
them), and once it is gone a kernel named raises an error saying so.
"""

from __future__ import annotations

import jax
from jax.experimental import pallas as pl
try:  # deprecated in JAX 0.11, to be removed: the package imports without it, and "auto" stops picking these
    from jax.experimental.pallas import triton as pltriton
except ImportError:
    pltriton = None


def block_size(n: int, preferred: int) -> int:
    """The largest power of two <= preferred dividing n (Triton blocks are powers of two)."""
    b = preferred
    while n % b:
        b //= 2
    return b


def padded_span(width: int, program_id: jax.Array) -> pl.Slice:
    """`pl.ds(0, width)` for a masked load or store that runs past the end of its axis (Triton blocks
    are powers of two; the mask covers what lies past). Its start is traced, a program id the kernel
    read at its top level times 0: JAX 0.12 refuses a constant slice past an array's end while
    tracing a kernel (seen with jax 0.12.0.1) and checks no traced one; the compiler folds it to 0."""
    return pl.ds(program_id * 0, width)


def compiler_params(interpret: bool, num_warps: int, num_stages: int) -> dict:
    """pallas_call's Triton settings (none in interpret mode). Every Triton kernel here asks for them."""
    if pltriton is None:
        raise RuntimeError(f"this JAX ({jax.__version__}) no longer has Pallas's Triton backend; the Pallas Triton "
                           "kernels ('triton', 'triton_grouped') cannot run: pick another, or 'auto'")
    if interpret:
        return {}
    return {"compiler_params": pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)}


def splits(steps: int, programs: int, splits: int | None, what: str) -> int:
    """Ranges to split a row's `steps` into (dividing them): by default the fewest giving ~1024 programs."""
    if splits is None:
        return next(s for s in range(1, steps + 1) if steps % s == 0 and (programs * s >= 1024 or s == steps))
    if steps % splits:
        raise ValueError(f"splits={splits} must divide {what}")
    return splits


def pow2_at_least(n: int, least: int = 16) -> int:
    return max(least, 1 << (n - 1).bit_length())
