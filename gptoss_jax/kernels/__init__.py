"""The kernel layer: the model asks for attention and for expert matmuls; `Kernels` picks who computes them.

| op | "auto" on an NVIDIA GPU | "auto" on a TPU | "auto" elsewhere (the readable reference) |
|---|---|---|---|
| attention, prompts | tokamax flash attention ("tokamax") | splash attention ("splash") | jnp, blockwise ("blockwise") |
| attention, decode | Pallas Mosaic GPU over the filled cache ("mosaic": Hopper, 16-bit, JAX >= 0.11), else jnp ("blockwise") | jnp over the whole cache ("blockwise") | same as TPU |
| experts, prompts | Mosaic GPU ragged dot ("mosaic_gpu", Hopper; else "tokamax"; both need tokamax); MXFP4 experts: Pallas Mosaic GPU grouped matmul ("mosaic_grouped", Hopper, JAX >= 0.11, from `moe_mosaic_min_pairs` pairs), before Hopper jnp ("grouped") | megablox grouped matmul ("megablox") | jnp, per expert block ("grouped") |
| experts, decode | Pallas Mosaic GPU ("mosaic_decode", Hopper; MXFP4 experts at one token "mosaic_pair"; without tokamax also decode batches up to `moe_mosaic_min_pairs` pairs), before Hopper jnp ("gather") | jnp gather ("gather") | jnp gather ("gather") |

Experts kept packed in MXFP4 (`experts="mxfp4"`): on a Hopper GPU, Pallas Mosaic GPU kernels read
them packed and decode on the chip, no decoded weight written to memory: for prompts
"mosaic_grouped" (decoded into shared memory for the tensor cores, kernels/mosaic_mxfp4.py), for
decode "mosaic_decode" (kernels/mosaic_decode.py: decoded weights handed to the tensor cores from
registers) and, for one token's pairs, "mosaic_pair" (a row each, no tensor cores,
kernels/mosaic_pair.py); all take 16-bit activations. Elsewhere the jnp paths decode them inside
the jitted step (gather: the selected experts only; grouped: one expert block at a time; megablox
on TPU: a layer's experts).

JAX 0.11 deprecated Pallas's Triton backend, and "auto" no longer picks any of its kernels. They
remain for comparison and for GPUs before Hopper, by name only, while JAX ships the backend (JAX
warns when they compile): "triton" (decode attention to the cache; decode's experts, and for MXFP4
experts at decode on one device the whole MoE block, norm and router included, as four fused
kernels, kernels/decode_moe.py) and "triton_grouped" (MXFP4 experts, prompts, in registers,
kernels/triton_mxfp4.py). A Triton kernel named once the backend is gone raises an error saying so.

tokamax is optional (`pip install -e ".[cuda]"`, Python >= 3.12); without it a GPU runs the jnp
attention and prompts' experts. The Mosaic GPU, Triton and TPU kernels ship with JAX (Pallas). Every kernel's result is checked against the jnp
code: on CPU in Pallas interpret mode (`Kernels(interpret=True)`), on a GPU by `pytest -m gpu`.

Attention kernels compute sink-free attention over one set of keys with its softmax statistics, and
combine.py folds the sinks in exactly (see there).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import gpu, mosaic

ATTENTION = ("auto", "blockwise", "reference", "tokamax", "splash", "mosaic", "triton")
MOE = ("auto", "gather", "grouped", "mosaic_gpu", "tokamax", "mosaic_decode", "mosaic_pair", "mosaic_grouped", "triton",
       "triton_grouped", "megablox")
# Kernels tied to a backend: (backend, runs in Pallas interpret mode, what to call it in messages).
NEEDS = {
    "tokamax": ("gpu", False, "NVIDIA GPUs"),
    "mosaic_gpu": ("gpu", False, "NVIDIA Hopper GPUs"),
    "mosaic": ("gpu", True, "NVIDIA Hopper GPUs"),
    "triton": ("gpu", True, "NVIDIA GPUs"),
    "triton_grouped": ("gpu", True, "NVIDIA GPUs"),
    "mosaic_grouped": ("gpu", True, "NVIDIA Hopper GPUs"),
    "mosaic_decode": ("gpu", True, "NVIDIA Hopper GPUs"),
    "mosaic_pair": ("gpu", True, "NVIDIA Hopper GPUs"),
    "splash": ("tpu", True, "TPUs"),
    "megablox": ("tpu", True, "TPUs"),
}


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Which implementation runs where; results agree to rounding whichever is chosen."""

    attention: str = "auto"  # one of ATTENTION
    attention_block: int = 512  # query and key block size of the blockwise (jnp) attention
    moe: str = "auto"  # one of MOE; "auto" picks by backend and by the number of (token, expert) pairs
    moe_gather_max_pairs: int = 64  # auto: a decode path when tokens * experts_per_token <= this
    # auto, MXFP4 experts on Hopper: the Mosaic GPU grouped matmul from this many pairs on (one H100 80GB,
    # bench/kernels.py: as fast as the Triton kernel's best at 1,024 pairs, 1.5x faster at 4,096 and 16,384)
    moe_mosaic_min_pairs: int = 1024
    moe_block: int = 64  # rows per expert block on the grouped (jnp) path
    interpret: bool = False  # run the Pallas kernels in interpret mode (tests on CPU)

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention kernel {self.attention!r}; choose from {', '.join(ATTENTION)}")
        if self.moe not in MOE:
            raise ValueError(f"unknown MoE kernel {self.moe!r}; choose from {', '.join(MOE)}")

    def attention_for(self, queries: int, dtype=jnp.bfloat16) -> str:
        """The attention kernel for a call with this many query positions per sequence, of this dtype."""
        if self.attention != "auto":
            return self._runnable(self.attention)
        backend = jax.default_backend()
        if queries > 16:
            # tokamax's GPU attention takes 16-bit inputs (float32 would be TF32 there).
            if backend == "gpu" and jnp.dtype(dtype).itemsize == 2 and _tokamax_available():
                return "tokamax"
            if backend == "tpu":
                return "splash"
        elif (backend == "gpu" and jnp.dtype(dtype).itemsize == 2 and gpu.is_hopper()
              and mosaic.supported()):
            return "mosaic"  # reads the filled cache only
        return "blockwise"

    def moe_for(self, pairs: int, dtype=jnp.bfloat16, packed: bool = False) -> str:
        """The expert kernel for a call with this many (token, expert) pairs, weights of this dtype
        (for MXFP4-packed experts, `packed`: the activations' dtype, which they are decoded to)."""
        if self.moe != "auto":
            return self._runnable(self.moe)
        backend = jax.default_backend()
        sixteen_bit, bf16 = jnp.dtype(dtype).itemsize == 2, jnp.dtype(dtype) == jnp.bfloat16
        hopper = backend == "gpu" and gpu.is_hopper() and mosaic.supported()
        decode = pairs <= self.moe_gather_max_pairs
        # "auto" never picks a Pallas Triton kernel (a backend JAX 0.11 deprecated): before Hopper
        # the jnp paths run instead. Decode's experts on Hopper in Pallas Mosaic GPU; one token's
        # MXFP4 pairs a row each ("mosaic_pair"): on one H100 80GB (gpt-oss-20b, batch 1) 326.1
        # tokens/s against 325.2 for the fused Pallas Triton decode MoE, in one run
        # (docs/benchmarks.md).
        if packed and bf16 and hopper and pairs < self.moe_mosaic_min_pairs:
            return "mosaic_pair" if decode else "mosaic_decode"
        if not packed and decode and sixteen_bit and hopper:
            return "mosaic_decode"  # each selected expert read once, in place
        if not packed and sixteen_bit and hopper and pairs <= self.moe_mosaic_min_pairs and not _tokamax_available():
            # A large decode batch without tokamax: on one NVIDIA H200, gpt-oss-20b's decode step at
            # batch 256 (1,024 pairs) took 19.7 ms with this kernel against 79.3 ms on the jnp
            # grouped path (17.5 ms with tokamax's ragged dot), 2026-11-26.
            return "mosaic_decode"
        if decode:
            return "gather"
        if packed and bf16 and hopper:
            return "mosaic_grouped"  # decoded on the chip, never written back
        if packed:
            return "megablox" if backend == "tpu" else "grouped"  # decoded one expert block at a time
        # The GPU kernels take 16-bit inputs (float32 would be TF32 there). The Mosaic GPU ragged dot
        # hands shapes off its tiles (gpt-oss's mlp2) to tokamax's, so it too needs tokamax.
        if backend == "gpu" and sixteen_bit and _tokamax_available():
            return "mosaic_gpu" if gpu.is_hopper() else "tokamax"
        if backend == "tpu":
            return "megablox"
        return "grouped"

    def _runnable(self, name: str) -> str:
        """A kernel named explicitly, checked against the backend (Pallas kernels also run in interpret mode)."""
        needs = NEEDS.get(name)
        backend = jax.default_backend()
        if needs and backend != needs[0] and not (self.interpret and needs[1]):
            hint = "; Kernels(interpret=True) runs it on any backend, slowly (tests)" if needs[1] else ""
            raise ValueError(f"the {name!r} kernel runs on {needs[2]} only, and this JAX's backend is {backend!r}; "
                             f"'auto' picks what this backend runs{hint}")
        return name

    def describe(self, packed: bool = False) -> str:
        """For start-up messages: what "auto" means on this backend (`packed`: for MXFP4 experts)."""
        return (f"attention {self.attention_for(4096)} (prompts) / {self.attention_for(1)} (decode), "
                f"experts {self.moe_for(1 << 20, packed=packed)} (prompts) / {self.moe_for(1, packed=packed)} (decode)")


def _tokamax_available() -> bool:
    return gpu.available()
