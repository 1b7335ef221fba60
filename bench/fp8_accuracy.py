"""How far an FP8 KV cache moves gpt-oss-20b's logits (synthetic full-size weights, one GPU), beside
the noise floor: two attention kernels over the same bf16 cache.

    python bench/fp8_accuracy.py [--experts mxfp4] [--prompt 2048] [--steps 16] [--batch 4]

Each run prefills `--batch` random prompts of `--prompt` tokens, then feeds `--steps` more random
tokens one step at a time (the same tokens for every run, so no run follows its own picks), and
keeps every step's logits. Printed per pair of runs, over all steps: the largest |difference|,
the relative norm ||a - b|| / ||b||, and the share of steps whose top token agrees. Runs: the cache
in bf16 and in FP8 (fp8.py), each with the kernels "auto" picks (Mosaic GPU decode attention, tokamax
for prompts) and with the jnp attention ("blockwise").
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout, not installed

import gptoss_jax as gj  # noqa: E402
from gptoss_jax import fp8  # noqa: E402
from gptoss_jax.testing import random_params_on_device  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="gpt-oss-20b")
    parser.add_argument("--experts", default="mxfp4", choices=("bf16", "mxfp4"))
    parser.add_argument("--prompt", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    config = gj.ModelConfig.preset(args.preset)
    params = jax.block_until_ready(random_params_on_device(config, seed=0, dtype="mxfp4" if args.experts == "mxfp4"
                                                           else "bfloat16"))
    tokens = np.random.default_rng(3).integers(0, config.vocab_size, (args.batch, args.prompt + args.steps))
    runs = {}
    for cache in ("bf16", "fp8"):
        for attention in ("auto", "blockwise"):
            kernels = gj.Kernels(attention=attention)
            state = gj.init_cache(config, args.batch, args.prompt + args.steps, fp8.KV_DTYPES[cache])
            _, state = gj.extend(config, params, tokens[:, :args.prompt], state, kernels=kernels)
            logits = []
            for i in range(args.prompt, args.prompt + args.steps):
                out, state = gj.extend(config, params, tokens[:, i:i + 1], state, kernels=kernels)
                logits.append(np.asarray(out[:, 0], np.float32))
            runs[f"{cache} cache, {attention}"] = np.stack(logits, 1)  # [B, steps, V]
            print(f"{cache} cache, {attention} attention: done", flush=True)
    print(f"\n{jax.devices()[0].device_kind}, jax {jax.__version__}, {args.experts} experts, {args.batch} prompts of "
          f"{args.prompt} tokens then {args.steps} steps\n")
    print("| a | b | max abs diff | rel norm | top-1 agree |\n|---|---|---:|---:|---:|")
    for a, b in (("bf16 cache, blockwise", "bf16 cache, auto"), ("fp8 cache, blockwise", "fp8 cache, auto"),
                 ("fp8 cache, auto", "bf16 cache, auto"), ("fp8 cache, blockwise", "bf16 cache, blockwise")):
        x, y = runs[a], runs[b]
        rel = float(np.linalg.norm(x - y) / np.linalg.norm(y))
        agree = float(np.mean(x.argmax(-1) == y.argmax(-1)))
        print(f"| {a} | {b} | {np.abs(x - y).max():.4g} | {rel:.3g} | {agree:.1%} |")


if __name__ == "__main__":
    main()
