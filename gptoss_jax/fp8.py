"""FP8 (e4m3) storage for keys and values: each vector of head_dim values in e4m3 with its own
power-of-two scale.

    Fp8.values     float8_e4m3fn [..., H]   x / 2^e, rounded to nearest (|x / 2^e| <= 448, e4m3's largest)
    Fp8.exponents  uint8 [...]              e + 127, one per vector: the smallest power of two that keeps
                                            the vector's largest |x| within 448

A vector's scale depends on that vector alone, so a cache written a position at a time never
rescales what it holds, and a power of two makes x / 2^e and the value read back, v 2^e, exact: the
only error is e4m3's rounding of x / 2^e. With 2^e in [max|x| / 448, max|x| / 224), an element's
error is at most 2^-4 |x| (half a unit of 3 mantissa bits) plus 2^-10 2^e (e4m3's subnormals, below
2^-6), which is under 2^-17.8 max|x| (`error_bound`).
A vector takes H + 1 bytes against 2 H in 16 bits: 65 against 128 for gpt-oss's H = 64.

Leading axes index both fields alike (`Fp8.map`), so a cache's gathers, slices and scatters over
positions, pages or rows work on either storage through `take`-like functions given once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

DTYPE = jnp.float8_e4m3fn
LARGEST = 448.0  # e4m3fn's largest finite value
RELATIVE = 2.0**-4  # e4m3's rounding: half a unit in the last of 3 mantissa bits, relative to |x| (normals)
SUBNORMAL = 2.0**-10  # its absolute rounding below the smallest normal (2^-6), in units of the scale
BIAS = 127


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8:
    """Vectors in e4m3 with a power-of-two scale each (the module's docstring)."""

    values: jax.Array
    exponents: jax.Array

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def map(self, fn: Callable[[jax.Array], jax.Array]) -> "Fp8":
        """fn applied to both fields: an indexing of leading axes (gather, slice, scatter of whole vectors)."""
        return Fp8(fn(self.values), fn(self.exponents))


KV_DTYPES = {"bf16": jnp.bfloat16, "fp8": DTYPE}  # a KV cache's storage by the name the commands take


def cache_dtype(name: str | None, activations):
    """The KV cache's dtype for a name of KV_DTYPES, or None: the activations' own."""
    if name is None:
        return jnp.dtype(activations)
    if name not in KV_DTYPES:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(KV_DTYPES)}")
    return jnp.dtype(KV_DTYPES[name])


def is_fp8(dtype) -> bool:
    """Whether a cache dtype (a dtype or its name, as cache_dtype returns) asks for this storage."""
    return dtype is not None and jnp.dtype(dtype) == jnp.dtype(DTYPE)


def storage_shapes(shape: tuple[int, ...], dtype):
    """Vectors of `shape` [..., H] as a cache of `dtype` stores them: an array's `jax.ShapeDtypeStruct`,
    or for float8_e4m3fn an `Fp8` of two."""
    if is_fp8(dtype):
        return Fp8(jax.ShapeDtypeStruct(shape, DTYPE), jax.ShapeDtypeStruct(shape[:-1], jnp.uint8))
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))


def vector_bytes(size: int, dtype) -> int:
    """Bytes of one stored vector of `size` values: in FP8, a byte each and one for the scale."""
    return size + 1 if is_fp8(dtype) else size * jnp.dtype(dtype).itemsize


def scale(exponents: jax.Array) -> jax.Array:
    """2^(e - 127) in float32, built from its bits (exact)."""
    return jax.lax.bitcast_convert_type(exponents.astype(jnp.uint32) << 23, jnp.float32)


def quantize(x: jax.Array) -> Fp8:
    """x [..., H] -> its FP8 storage, with the smallest power of two 2^e >= max|x| / 448 (so a vector
    read back and stored again keeps its values: `rounded` is idempotent)."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    m, e = jnp.frexp(amax / LARGEST)  # amax / 448 = m 2^e, m in [0.5, 1) (0 and e = 0 for zeros)
    e = jnp.clip(jnp.where(m == 0.5, e - 1, e), 1 - BIAS, BIAS)  # m = 0.5: 2^(e - 1) is amax / 448 itself
    exponents = (e + BIAS).astype(jnp.uint8)
    values = (x.astype(jnp.float32) / scale(exponents)[..., None]).astype(DTYPE)
    return Fp8(values, exponents)


def error_bound(x: jax.Array) -> jax.Array:
    """The most an element of x [..., H] can move in its FP8 storage: 2^-4 |x| + 2^-10 2^e (above)."""
    x = jnp.abs(x.astype(jnp.float32))
    return RELATIVE * x + SUBNORMAL * jnp.max(x, axis=-1, keepdims=True) / 224.0


def dequantize(a: Fp8, dtype) -> jax.Array:
    """The stored vectors, in `dtype`."""
    return (a.values.astype(jnp.float32) * scale(a.exponents)[..., None]).astype(dtype)


def rounded(stored, x: jax.Array) -> jax.Array:
    """x as a cache in `stored`'s storage gives it back: through FP8 and back (in x's dtype), or cast
    to the array's dtype. The new tokens of a step attend to their own keys as the cache keeps them,
    so a prompt gives the same whether computed whole or in chunks."""
    return dequantize(quantize(x), x.dtype) if isinstance(stored, Fp8) else x.astype(stored.dtype)


def read(x, dtype) -> jax.Array:
    """A cache's keys or values as an array of `dtype`: FP8 dequantized, others as they are."""
    return dequantize(x, dtype) if isinstance(x, Fp8) else x


def apply(fn: Callable[[jax.Array], jax.Array], x):
    """fn (an indexing of leading axes) over an array or both fields of an `Fp8`."""
    return x.map(fn) if isinstance(x, Fp8) else fn(x)


def like(stored, new: jax.Array):
    """`new` vectors in the storage of `stored`: quantized for FP8, else cast to its dtype."""
    return quantize(new) if isinstance(stored, Fp8) else new.astype(stored.dtype)


def scatter(stored, fn: Callable[[jax.Array, jax.Array], jax.Array], new):
    """fn(stored field, new field) -> stored field (an `.at[...].set` or a `where` over leading axes),
    over an array or both fields of an `Fp8`; `new` is in `stored`'s storage (`like`)."""
    if isinstance(stored, Fp8):
        return Fp8(fn(stored.values, new.values), fn(stored.exponents, new.exponents))
    return fn(stored, new)
