"""Fine-tuning speed and memory of full-size gpt-oss-20b (synthetic bf16 weights) on one GPU: LoRA
(rank 16 on the q, k, v and output projections), batch 1, activation checkpointing, AdamW step
included, with transformers + peft (the same LoRA, gradient checkpointing, its eager attention)
measured in the same run on the same GPU, one after the other.

    python bench/finetune_20b.py [--contexts 2048,4096,8192] [--fit 16384,32768,65536]
        [--moe tokamax] [--attention-block 512] [--steps 3] [--skip-peer] [--preset tiny]

tokens/s = context / the median time of `--steps` steps after a warm-up step (compilation
excluded); peak memory is the device's peak since the process started (the contexts run in
increasing order). --fit tries longer contexts, one step each, until one runs out of memory.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

PEER = r'''
import json, sys, time, torch
from peft import LoraConfig, get_peft_model
sys.path.insert(0, "bench")
from peer import build
args = json.loads(sys.argv[1])
model, cfg, dev, sync = build(args["preset"])
model.gradient_checkpointing_enable()
model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=args["rank"], lora_alpha=2 * args["rank"], lora_dropout=0.0,
                                         target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.train()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
out = {"peer": f"transformers {__import__('transformers').__version__}, peft {__import__('peft').__version__}, "
               f"torch {torch.__version__}", "attn": model.config._attn_implementation, "contexts": {}}
def step(tokens):
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for T in args["contexts"]:
    tokens = torch.randint(0, cfg.vocab_size, (1, T), device=dev)
    try:
        step(tokens); sync()
        times = []
        for _ in range(args["steps"]):
            sync(); t = time.perf_counter(); step(tokens); sync(); times.append(time.perf_counter() - t)
        times.sort()
        peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else None
        out["contexts"][T] = {"tokens_per_s": T / times[len(times) // 2], "peak_gib": peak}
    except torch.OutOfMemoryError:
        out["contexts"][T] = "out of memory"
        break
print("RESULT " + json.dumps(out))
'''


def peak_gib():
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", 0) / 2**30 or None


def ours(args) -> dict:
    # JAX takes 75% of the GPU's memory by default; a benchmark of the longest context that fits
    # lets it take 95% (set XLA_PYTHON_CLIENT_MEM_FRACTION to change that).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gptoss_jax as gj
    from gptoss_jax.testing import random_params_on_device
    from gptoss_jax.training.lora import LoraConfig, init_adapters
    from gptoss_jax.training.step import OptimizerConfig, StepConfig, make_step, optimizer

    config = gj.ModelConfig.preset(args.preset)
    params = random_params_on_device(config, dtype=jnp.bfloat16)
    lora = LoraConfig(rank=args.rank, alpha=2.0 * args.rank, targets=("attention",))
    kernels = gj.Kernels(attention="blockwise", attention_block=args.attention_block, moe=args.moe)
    setup = StepConfig(config, lora=lora, compute_dtype="bfloat16", kernels=kernels, remat=True)
    tx = optimizer(OptimizerConfig(lr=1e-4, steps=1000))
    adapters = init_adapters(config, lora, jax.random.key(0))
    opt_state = tx.init(adapters)
    step = make_step(setup, tx)
    # What "auto" resolves to (without tokamax a GPU runs the jnp attention and experts).
    out = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "kernels": str(kernels),
           "mem_fraction": os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
           "resolved": f"attention {kernels.attention_for(4096)}, experts {kernels.moe_for(1 << 16)}", "contexts": {}}
    rng = np.random.default_rng(0)
    for T in args.contexts + args.fit:
        tokens = jnp.asarray(rng.integers(0, config.vocab_size, (1, 1, T)), jnp.int32)
        mask = jnp.ones((1, 1, T), bool)
        try:
            t0 = time.perf_counter()
            adapters, opt_state, m = step(adapters, opt_state, params, tokens, mask)
            first = float(m["loss"])
            compile_s = time.perf_counter() - t0
            # Once more untimed: the first step's outputs (the next inputs) are laid out as the
            # step's own, which may compile it once more.
            adapters, opt_state, m = step(adapters, opt_state, params, tokens, mask)
            float(m["loss"])
            times = []
            for _ in range(args.steps if T in args.contexts else 1):
                t0 = time.perf_counter()
                adapters, opt_state, m = step(adapters, opt_state, params, tokens, mask)
                float(m["loss"])
                times.append(time.perf_counter() - t0)
            times.sort()
            out["contexts"][T] = {"tokens_per_s": T / times[len(times) // 2], "peak_gib": peak_gib(),
                                  "first_step_s": compile_s, "loss": first}
        except Exception as e:  # noqa: BLE001  (out of memory, reported as such)
            if "RESOURCE_EXHAUSTED" not in str(e) and "out of memory" not in str(e).lower():
                raise
            out["contexts"][T] = "out of memory"
            break
        print(f"ours T={T}: {out['contexts'][T]}", file=sys.stderr, flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="gpt-oss-20b")
    p.add_argument("--contexts", default="2048,4096,8192")
    p.add_argument("--fit", default="", help="longer contexts to try, one step each, until out of memory")
    p.add_argument("--peer-contexts", default=None, help="default: --contexts")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--moe", default="auto", help="the expert kernel (Kernels.moe; auto: the Mosaic GPU ragged dot on Hopper)")
    p.add_argument("--attention-block", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skip-peer", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    args.contexts, args.fit = ints(args.contexts), ints(args.fit)
    if args.worker:
        print("RESULT " + json.dumps(ours(args)), flush=True)
        return
    result = {"date": time.strftime("%Y-%m-%d"), "args": vars(args).copy()}
    if not args.skip_ours:
        # Each framework in a process of its own, one after the other: JAX keeps its memory pool
        # until its process ends.
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", *sys.argv[1:]], cwd=ROOT,
                             stdout=subprocess.PIPE, text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        result["ours"] = json.loads(lines[-1][7:]) if lines else {"error": f"exit {run.returncode}"}
    if not args.skip_peer:
        peer_args = {"preset": args.preset, "rank": args.rank, "steps": args.steps,
                     "contexts": ints(args.peer_contexts) if args.peer_contexts else args.contexts}
        run = subprocess.run([sys.executable, "-c", PEER, json.dumps(peer_args)], cwd=ROOT, capture_output=True,
                             text=True)
        lines = [ln for ln in run.stdout.splitlines() if ln.startswith("RESULT ")]
        result["peer"] = json.loads(lines[-1][7:]) if lines else {"error": run.stderr[-2000:]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
