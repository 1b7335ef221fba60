"""The fine-tuning command line: `gptoss-finetune` (and `python finetune.py` in a checkout).

The library is imported inside the functions that use it, so that `--help` and a bad flag answer at
once: JAX, the model and the trainer load only once the flags and the data have been checked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from ..metadata import expand
from ..version import __version__
from . import devices, loading
from .command import leave, run_command
from .inputs import UsageError, model_config
from ..signals import Signals, say

DESCRIPTION = """\
Fine-tune gpt-oss in JAX on harmony conversations: LoRA adapters (the default) or every weight.

The data is JSONL, one conversation per line:
  {"messages": [{"role": "user", "content": "..."},
                {"role": "assistant", "content": "...", "thinking": "... (optional)"}]}
(roles: system or developer, user, assistant), rendered in the harmony format; the model learns the
assistant's tokens only. A line {"text": "..."} trains on plain text, every token.

--out DIR receives the train states (DIR/checkpoints/STEP, every --save-every steps, at the end and
on Ctrl-C) and, at the end, the fine-tuned model with the adapters merged, a checkpoint that
`run_inference.py --checkpoint DIR` loads; with LoRA, also the adapters alone in DIR/adapter, in
peft's format for transformers' GptOssForCausalLM (peft loads them; so does
gptoss_jax.training.adapter_files.read_adapter, to serve them unmerged). --resume continues from DIR's newest train state, with
the same data order, as if never stopped.

With no --checkpoint, the built-in tiny demo model with RANDOM weights is trained (a CPU runs it in
seconds).

On several devices (and hosts) the frozen weights are split as for generation (--mesh); the
sequences of a batch are split over `data`, and what is trained and AdamW's state are split over
`data` as well (fully sharded), so --mesh data=8 trains a batch of 8 on eight GPUs with an eighth
of the optimizer state on each.

examples:
  %(prog)s --data train.jsonl --out run1 --steps 50
  %(prog)s --checkpoint CKPT --data train.jsonl --eval-data held.jsonl --out run2 --steps 2000 \\
      --batch-size 4 --max-length 8192 --lora-rank 16 --lr 2e-4 --json > log.jsonl
  %(prog)s --checkpoint CKPT --data train.jsonl --out run2 --steps 4000 --resume
  %(prog)s --checkpoint CKPT --data train.jsonl --out run3 --batch-size 8 --mesh data=8
"""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_flags(p, mxfp4=False, checkpoint_help="the converted gptoss-jax checkpoint to start from (default: the "
                                                      "demo model)",
                      dtype_help="the model's compute dtype (default: bfloat16; float32 for the demo model); "
                                 "optimizer state, adapters and full fine-tuning's master weights are float32")
    p.add_argument("--data", metavar="JSONL", type=expand, required=True, help="training conversations")
    p.add_argument("--eval-data", metavar="JSONL", type=expand, help="held-out conversations: loss at each --eval-every")
    p.add_argument("--out", metavar="DIR", type=expand, required=True,
                   help="where the train states and the fine-tuned model go")
    p.add_argument("--resume", action="store_true", help="continue from the newest train state in --out")
    p.add_argument("--steps", type=int, default=100, help="optimizer steps in all, a resumed run's included (default: 100)")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per micro-batch (default: 1)")
    p.add_argument("--accumulation", type=int, default=1,
                   help="micro-batches per optimizer step, gradients summed (default: 1)")
    p.add_argument("--max-length", type=int, default=2048,
                   help="tokens per sequence; longer conversations are cut to it with a warning (default: 2048)")
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank; 0 = full fine-tuning (default: 16)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default: 2 x rank)")
    p.add_argument("--lora-targets", default="attention", metavar="GROUPS",
                   help="comma-separated: attention (q, k, v, output projections), router, experts "
                        "(default: attention)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 2e-4 for LoRA, 2e-5 full)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 3%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay on matrices (default: 0)")
    p.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clipping; 0 = off (default: 1)")
    p.add_argument("--label-smoothing", type=float, default=0.0, help="in [0, 1) (default: 0)")
    p.add_argument("--seed", type=int, default=0, help="data order and adapter init (default: 0)")
    p.add_argument("--save-every", type=int, default=100, metavar="N", help="train state every N steps (default: 100)")
    p.add_argument("--eval-every", type=int, default=100, metavar="N", help="held-out loss every N steps (default: 100)")
    p.add_argument("--log-every", type=int, default=1, metavar="N", help="log every N steps (default: 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object per logged step on standard output")
    p.add_argument("--no-remat", action="store_true",
                   help="keep every block's activations instead of recomputing them (faster, more memory)")
    p.add_argument("--tokenizer", metavar="PATH", type=expand, help="o200k_base.tiktoken (or its folder), hash-checked")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    devices.add_flags(p)
    return p


def check_flags(args) -> None:
    for flag in ("steps", "batch_size", "accumulation", "save_every", "eval_every", "log_every"):
        if getattr(args, flag) < 1:
            raise UsageError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_length < 2:
        raise UsageError(f"--max-length must be at least 2, got {args.max_length}")
    if args.lora_rank < 0:
        raise UsageError(f"--lora-rank must be 0 (full fine-tuning) or more, got {args.lora_rank}")
    if args.lr is not None and not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if not 0 <= args.label_smoothing < 1:
        raise UsageError(f"--label-smoothing must lie in [0, 1), got {args.label_smoothing}")
    if args.warmup is not None and args.warmup < 0:
        raise UsageError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.clip < 0 or args.weight_decay < 0:
        raise UsageError("--clip and --weight-decay must be 0 or more")
    from ..training.lora import TARGETS  # start-up: the model's modules load after argparse

    targets = tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise UsageError(f"--lora-targets: {', '.join(bad) or 'none given'}; choose from {', '.join(TARGETS)}")
    args.lora_targets = targets
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UsageError(f"--out {args.out}: exists and is not a folder")
    train_states = os.path.join(args.out, "checkpoints")
    has_states = os.path.isdir(train_states) and any(n.isdigit() for n in os.listdir(train_states))
    if args.resume and not has_states:
        raise UsageError(f"--resume: {args.out} holds no train state to continue from")
    if not args.resume and has_states:
        raise UsageError(f"--out {args.out} already holds a training run; pass --resume to continue it, "
                         f"or choose another folder")
    if args.checkpoint and os.path.abspath(args.checkpoint) == os.path.abspath(args.out):
        raise UsageError("--out must not be the --checkpoint folder")


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    # Signals are polled between steps (raising=False): a step is never cut in half.
    return run_command(lambda: build_parser(prog).parse_args(argv), _run, raising=False, program=argv is None)


def entry(prog: str | None = None) -> None:
    """The program's entry point (`gptoss-finetune`, finetune.py): main(), then exit (command.leave)."""
    leave(main(prog=prog or os.path.basename(sys.argv[0])))


def _warn(message: str) -> None:
    say(f"warning: {message}")


def _settings(args, config, length: int) -> dict:
    """What a resumed run must share with the run it continues (training/state.py)."""
    lora = None if args.lora_rank == 0 else {"rank": args.lora_rank, "alpha": args.lora_alpha,
                                               "targets": list(args.lora_targets)}
    return {"config": config.to_json_dict(), "lora": lora, "compute_dtype": args.dtype,
            "batch_size": args.batch_size, "accumulation": args.accumulation, "max_length": length,
            "seed": args.seed, "data": os.path.abspath(args.data)}


def _run(args, signals: Signals) -> int:
    # Start-up: tiktoken and the data reader load after argparse has checked the flags.
    from .. import tokenizer as tk
    from ..training import data as td

    # Everything that can be checked before JAX starts: flags, data, the model's config.
    check_flags(args)
    processes = devices.process_settings(args)
    mesh_sizes = devices.mesh_sizes(args)
    config, what = model_config(args)
    args.dtype = loading.dtype_of(args)
    args.lora_alpha = 2.0 * args.lora_rank if args.lora_alpha is None else args.lora_alpha
    args.lr = args.lr or (2e-4 if args.lora_rank else 2e-5)
    warmup = args.warmup if args.warmup is not None else max(args.steps * 3 // 100, 0)
    if config.vocab_size != tk.VOCAB_SIZE:
        raise UsageError(f"this model's vocabulary has {config.vocab_size} tokens, not o200k_harmony's "
                         f"{tk.VOCAB_SIZE}: conversations cannot be rendered for it")
    if args.max_length > config.max_context_length:
        raise UsageError(f"--max-length {args.max_length} exceeds the model's context of {config.max_context_length}")
    encoding = tk.harmony_encoding(args.tokenizer)
    train = td.read_jsonl(args.data, encoding, max_length=args.max_length, warn=_warn)
    held = td.read_jsonl(args.eval_data, encoding, max_length=args.max_length, warn=_warn) if args.eval_data else None
    longest = max(len(e.tokens) for e in train + (held or []))
    length = min(args.max_length, -(-longest // 64) * 64)  # static batch shape: one compilation
    settings = _settings(args, config, length)

    # JAX starts here, once the flags, the data and the model's config are checked.
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from ..checkpoint import save_checkpoint
    from ..sharding import describe
    from ..training.lora import LoraConfig, init_adapters, merge
    from ..training.placement import place, put_batch
    from ..training.state import TrainCheckpoints, check_resumable
    from ..training.step import OptimizerConfig, StepConfig, cast_for_compute, make_eval, make_step, optimizer

    devices.use_compile_cache(args.compile_cache)
    devices.start_processes(processes)
    mesh = devices.choose_mesh(mesh_sizes, config)  # checked against the devices and the model: nothing read yet
    # Orbax, which keeps the train states, starts JAX: only once the processes have joined.
    states = TrainCheckpoints(os.path.join(args.out, "checkpoints"))
    start_step, position = 0, 0
    if args.resume:
        start_step = states.latest()
        saved = states.meta(start_step)
        check_resumable(args.out, saved, settings)
        position = saved["position"]
        if start_step >= args.steps:
            raise UsageError(f"--resume: {args.out} is already at step {start_step} of --steps {args.steps}; "
                             f"raise --steps to train further")
    main_process = devices.quiet_other_processes()
    args.quiet = args.quiet or not main_process
    report = say if main_process else (lambda text: None)
    unsplit = devices.unsplit_batch(args.batch_size, mesh, f"--batch-size {args.batch_size}")
    if unsplit:
        report(f"warning: {unsplit}")
    report(f"model: {what}; jax {jax.__version__}")
    report(f"devices: {describe(mesh, config) if mesh else '1 ' + jax.devices()[0].platform + ' device'}")
    report(f"data: {len(train)} conversations" + (f", {len(held)} held out" if held else "")
        + f"; sequences of {length} tokens")
    params = loading.load_params(args, config, mesh)
    lora = LoraConfig(args.lora_rank, args.lora_alpha, args.lora_targets) if args.lora_rank else None
    setup = StepConfig(config, lora=lora, compute_dtype=args.dtype, label_smoothing=args.label_smoothing,
                       remat=not args.no_remat, mesh=mesh)
    opt = OptimizerConfig(lr=args.lr, steps=args.steps, warmup=warmup, weight_decay=args.weight_decay,
                          clip=args.clip)
    tx = optimizer(opt)
    trainable_layout, opt_layout = setup.state_shardings(tx)
    # Made in their layout (on a mesh, split as STATE_RULES says), never whole on one device.
    if lora is None:
        to_float32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
        trainable, frozen = jax.jit(to_float32, out_shardings=trainable_layout)(params), None
        del params
    else:
        trainable, frozen = place(init_adapters(config, lora, jax.random.key(args.seed)), trainable_layout), params
    opt_state = jax.jit(tx.init, out_shardings=opt_layout)(trainable)
    if args.resume:
        trainable, opt_state = states.restore(start_step, trainable, opt_state)
        report(f"resumed at step {start_step} (example {position})")
    step_fn, evaluate = make_step(setup, tx), make_eval(setup)
    schedule = opt.schedule()
    per_step = args.batch_size * args.accumulation
    stream = td.batches(train, batch_size=per_step, length=length, seed=args.seed, position=position)

    def save(step):
        states.save(step, trainable, opt_state, dict(settings, position=position))

    def held_out_loss():
        total = count = 0.0
        for i in range(0, len(held), args.batch_size):
            part = held[i:i + args.batch_size]
            part = part + [td.Example(np.zeros(2, np.int32), np.zeros(2, bool))] * (args.batch_size - len(part))
            s, n = evaluate(trainable, frozen, *(put_batch(x, mesh) for x in td.batch(part, length)))
            total, count = total + float(s), count + float(n)
        return total / max(count, 1.0)

    signals.check()  # Ctrl-C while loading or compiling: nothing trained yet, nothing to save
    step = start_step
    seen_tokens, started = 0, time.perf_counter()
    with tqdm(total=args.steps, initial=start_step, desc="training", unit="step", disable=args.quiet,
              file=sys.stderr, dynamic_ncols=True) as bar:
        while step < args.steps:
            position, tokens, mask, real = next(stream)
            shape = (args.accumulation, args.batch_size, length)
            trainable, opt_state, metrics = step_fn(trainable, opt_state, frozen, put_batch(tokens.reshape(shape), mesh),
                                                    put_batch(mask.reshape(shape), mesh))
            step += 1
            seen_tokens += real
            record = None
            if step % args.log_every == 0 or step == args.steps:
                loss = float(metrics["loss"])  # waits for the step
                elapsed = time.perf_counter() - started
                record = {"step": step, "loss": loss, "lr": float(schedule(step - 1)),
                          "grad_norm": round(float(metrics["grad_norm"]), 6),
                          "tokens": int(metrics["tokens"]), "tokens_per_s": round(seen_tokens / elapsed, 1),
                          "position": position}
                bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{seen_tokens / elapsed:,.0f}", refresh=False)
            if held is not None and (step % args.eval_every == 0 or step == args.steps):
                record = record or {"step": step}
                record["eval_loss"] = round(held_out_loss(), 6)
            if record is not None and args.json:
                print(json.dumps(record), flush=True)
            bar.update(1)
            if step % args.save_every == 0 and step < args.steps:
                save(step)
            if signals():
                save(step)
                bar.close()
                report(f"{signals.what} at step {step}: train state saved in {states.directory}; continue with --resume")
                states.close()
                return signals.exit_code
    save(step)
    states.close()
    final = merge(frozen, trainable, lora) if lora is not None else cast_for_compute(trainable, jnp.dtype(args.dtype))
    save_checkpoint(args.out, config, final, source_layout="finetune",
                    converter_version=f"gptoss-finetune {__version__}",
                    source=os.path.abspath(args.checkpoint) if args.checkpoint else "demo model")
    if lora is not None:
        from jax.experimental.multihost_utils import process_allgather

        from ..training.adapter_files import write_adapter  # (as the other imports of main: after argparse)

        whole = process_allgather(trainable, tiled=True)  # every process takes part; process 0 writes
        if jax.process_index() == 0:
            write_adapter(os.path.join(args.out, "adapter"), config, whole, lora)
        report(f"adapters alone: {os.path.join(args.out, 'adapter')} (peft's format, unmerged)")
    report(f"fine-tuned model: {args.out} (run_inference.py --checkpoint {args.out})")
    return 0

