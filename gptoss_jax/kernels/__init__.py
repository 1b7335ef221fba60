"""The kernel layer: the model asks for attention and for the experts' products; it picks who computes them.

The choices are written once, as two registries of variants, each variant with what it takes, what
it needs, when "auto" picks it (with the measurement behind that) and its call:
- kernels/attention/__init__.py, `ATTENTION`: attention over a prompt, a cache or a paged cache's tables
  (tokamax flash attention for prompts on NVIDIA GPUs, splash attention on TPUs, the Pallas Mosaic
  GPU cache attention for decode on Hopper, the jnp blockwise path everywhere);
- kernels/experts/__init__.py, `EXPERTS`: the selected (token, expert) pairs' products, over 16-bit or
  MXFP4-packed experts (Pallas Mosaic GPU decode, pair and grouped kernels and the Mosaic GPU ragged
  dot on Hopper, tokamax's ragged dot before Hopper, megablox on TPUs, jnp gather and grouped paths
  everywhere, and those alone with low-rank adapters).
`Kernels` is the one switch: "auto", or a variant by name (checked against the backend). The model
calls `Kernels.attention_ops` and `Kernels.experts_for` / `local_experts` and names no kernel.

JAX 0.11 deprecated Pallas's Triton backend. While JAX ships it, "auto" picks one of its kernels
where it still measured fastest: the experts "triton" for MXFP4 experts at decode on one Hopper GPU
(no mesh) at small batches (below one (token, expert) pair per expert for up to 32 experts, up to one for
more; `experts.EXPERTS` has the rules), as the whole MoE block, norm and router included (kernels/triton/decode_moe.py's
four fused kernels; `experts.MEASURED`). The
others are by name only (JAX warns when they compile): attention "triton" (decode attention to the
cache) and experts "triton_grouped" (MXFP4 experts, prompts). Once the backend is gone "auto" picks
the Mosaic GPU kernels there, and a Triton kernel named raises an error saying so.

tokamax is optional (`pip install -e ".[cuda]"`, Python >= 3.12); without it a GPU runs the jnp
attention for prompts, and the jnp grouped path for prompts' 16-bit experts. The Mosaic GPU, Triton and TPU kernels ship with JAX (Pallas). Every
variant's result is checked against the jnp code: on CPU in Pallas interpret mode
(`Kernels(interpret=True)`), on a GPU by `pytest -m gpu`.

Attention kernels compute sink-free attention over one set of keys with its softmax statistics, and
combine.py folds the sinks in exactly (see there).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from .. import mxfp4
from . import attention, experts
from .combine import combine as fold_sinks  # exported under a name of its own: `combine` is also a module
from .experts import local_experts
from .attention.paged import write as write_pages
from .attention.xla import attention_blockwise, attention_reference, ring

__all__ = ["ATTENTION", "MOE", "Kernels", "attention_blockwise", "attention_reference", "fold_sinks", "local_experts",
           "ring", "write_pages"]
ATTENTION = ("auto",) + tuple(attention.ATTENTION)
MOE = ("auto",) + tuple(experts.EXPERTS)


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
    # auto, MXFP4 experts on Hopper without Pallas Triton: the Mosaic GPU pair kernel (a row per pair) up
    # to this many pairs (one token's), the Mosaic GPU decode kernel (expert blocks) beyond
    moe_pair_max_pairs: int = 4
    moe_block: int = 64  # rows per expert block on the grouped (jnp) path
    interpret: bool = False  # run the Pallas kernels in interpret mode (tests on CPU)

    def __post_init__(self):
        if self.attention not in ATTENTION:
            raise ValueError(f"unknown attention kernel {self.attention!r}; choose from {', '.join(ATTENTION)}")
        if self.moe not in MOE:
            raise ValueError(f"unknown MoE kernel {self.moe!r}; choose from {', '.join(MOE)}")

    def attention_for(self, queries: int, dtype=jnp.bfloat16) -> str:
        """The name of the attention variant for a call with this many query positions per sequence,
        of this dtype (kernels/attention/__init__.py)."""
        return attention.pick(self, queries, dtype).name

    def attention_ops(self, queries: int, dtype, *, mesh=None) -> attention.Ops:
        """The attention operations of one call (kernels/attention/__init__.py, `Ops`)."""
        return attention.Ops(attention.pick(self, queries, dtype), self, mesh)

    def prompt_chunk(self, dtype) -> int:
        """Prompt positions a prefill step suits with the attention variant long prompts of this dtype get."""
        return attention.pick(self, 4096, dtype).prompt_chunk

    def moe_for(self, pairs: int, dtype=jnp.bfloat16, packed: bool = False, *, num_experts: int = 32) -> str:
        """The name of the expert variant for a call with this many (token, expert) pairs over
        `num_experts` experts (gpt-oss-20b's 32 unless given), weights of this dtype (for MXFP4-packed
        experts, `packed`: the activations' dtype, which they are decoded to). The variants and
        "auto"'s tests: kernels/experts/__init__.py."""
        return experts.pick(self, pairs, dtype, packed, experts=num_experts).name

    def experts_for(self, pairs: int, dtype, weight, *, adapters: bool = False, mesh=None) -> experts.Variant:
        """The expert variant for a call with this many pairs, activations of this dtype and this
        expert weight (16-bit [E, out, in] or MXFP4-packed, all devices' experts), on one device or
        over `mesh`; with adapters, one that adds them."""
        is_packed = mxfp4.packed(weight)
        return experts.pick(self, pairs, dtype if is_packed else weight.dtype, is_packed,
                            experts=experts.pairs.num_experts(weight), adapters=adapters, sharded=mesh is not None)

    def fused_moe(self, x, norm_scale, w, config, *, mesh):
        """The whole MoE block [N, D] float32 for tokens x [N, D] where a variant runs it whole, else None."""
        return experts.fused_block(self, x, norm_scale, w, config, mesh=mesh)

    def describe(self, packed: bool = False) -> str:
        """One line: what "auto" means on this backend (`packed`: for MXFP4 experts); benchmarks record it."""
        return (f"attention {self.attention_for(4096)} (prompts) / {self.attention_for(1)} (decode), "
                f"experts {self.moe_for(1 << 20, packed=packed)} (prompts) / {self.moe_for(1, packed=packed)} (decode)")
