"""Everything Pallas Triton (ships with JAX; NVIDIA GPUs), one family of kernels: removing it is
removing this folder and its rows in the two registries (attention/__init__.py's "triton",
experts/__init__.py's "triton" and "triton_grouped").

JAX 0.11 deprecated this backend. While JAX ships it, "auto" picks one of its kernels where it
still measured fastest: the experts "triton" for MXFP4 experts at decode on one Hopper GPU at small
batches, as the whole MoE block (decode_moe.py's four fused kernels; experts/__init__.py has the
rules and the measurements). The others run by name only (JAX warns as each compiles): attention
"triton" (attention.py: decode attention to the cache) and experts "triton_grouped" (mxfp4.py:
prompts' MXFP4 experts). Once the backend is gone "auto" picks the Mosaic GPU kernels there, and a
Triton kernel named raises an error saying so (common.py).

- common.py: what the kernels share (block sizes, a call's settings, masked spans, splits);
- attention.py: decode attention to a full layer's cache;
- matvec.py: the experts at decode, a row of each selected expert's weights read in place (bf16);
- mxfp4.py: the same and a grouped matmul over MXFP4-packed experts;
- decode_moe.py: the decode MoE block over MXFP4 experts (norm, router, experts), fused.
"""
