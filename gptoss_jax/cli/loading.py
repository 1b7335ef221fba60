"""The model-loading flags and loader that gptoss-generate, gptoss-serve and gptoss-finetune share.

`add_flags` adds --checkpoint and --dtype; `dtype_of` is the dtype the parameters load in (--dtype
mxfp4: the experts stay packed in MXFP4 on the device, the rest bfloat16; `packed_experts` says so
for messages); `load_params` loads the checkpoint (or makes the demo model's weights) onto the mesh. JAX and the
loaders are imported inside `load_params` only, so that the flags are checked before they load.
"""

from __future__ import annotations

import argparse

from ..metadata import expand

MXFP4_HELP = ("mxfp4: the experts stay packed in MXFP4 on the device as published (half the memory of bfloat16; "
              "the checkpoint must store them packed, the converter's default) and the rest is bfloat16")


def add_flags(p: argparse.ArgumentParser, *, mxfp4: bool = True, checkpoint_help: str | None = None,
              dtype_help: str | None = None) -> None:
    """--checkpoint DIR and --dtype (bfloat16, float32, and with `mxfp4` the packed experts)."""
    p.add_argument("--checkpoint", metavar="DIR", type=expand,
                   help=checkpoint_help or "a converted gptoss-jax checkpoint (default: the demo model)")
    default_help = "parameter and activation dtype (default: bfloat16; float32 for the demo model)"
    p.add_argument("--dtype", choices=["bfloat16", "float32"] + (["mxfp4"] if mxfp4 else []), default=None,
                   help=(dtype_help or default_help) + ("; " + MXFP4_HELP if mxfp4 else ""))


def add_kv_flag(p: argparse.ArgumentParser) -> None:
    """--kv-dtype, for the commands that keep a KV cache."""
    p.add_argument("--kv-dtype", choices=["bf16", "fp8"], default=None,
                   help="the KV cache's storage: bf16, or fp8 (e4m3, each vector of keys or values with its own "
                        "power-of-two scale: 1.97 times the tokens in the same memory, attention read back at "
                        "e4m3's precision, 2^-4 of each value at most; docs/serving.md) (default: the activations' "
                        "dtype, --dtype)")


def packed_experts(args) -> bool:
    """Whether the experts stay packed on the device (--dtype mxfp4), for start-up messages."""
    from ..mxfp4 import split_dtype

    return split_dtype(dtype_of(args))[1]


def dtype_of(args) -> str:
    """The dtype the model loads in: --dtype (mxfp4: the experts packed, the rest bfloat16), else
    bfloat16 for a checkpoint and float32 for the demo model."""
    if args.dtype:
        return args.dtype
    return "bfloat16" if args.checkpoint else "float32"


def load_params(args, config, mesh):
    """The parameters, on `mesh` (None: one device): the checkpoint's, else the demo model's (random)."""
    # Start-up: JAX and the loaders load once the flags and devices are checked.
    import jax

    from ..checkpoint import load_checkpoint
    from ..params import param_shardings
    from ..testing import random_params

    dtype = dtype_of(args)
    if args.checkpoint:
        return load_checkpoint(args.checkpoint, dtype=dtype, mesh=mesh, progress=not args.quiet)[1]
    params = random_params(config, seed=0, dtype=dtype)
    return params if mesh is None else jax.device_put(params, param_shardings(config, mesh, dtype=dtype))
