"""The generation command line: `gptoss-generate` (and `python run_inference.py` in a checkout).

The library is imported inside the functions that use it, so that `--help` and a bad flag answer at
once: tiktoken, JAX and the model load only once every flag has been checked.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..metadata import expand
from ..signals import Signals, say
from ..version import __version__
from . import devices, loading
from .command import leave, run_command
from .inputs import (DRAFT_CHOICES, UsageError, check_draft, check_fits, check_flags, draft_flag, max_context,
                     model_config, prompt_texts)

DESCRIPTION = """\
Generate text with gpt-oss in JAX, from a raw prompt or a harmony chat, for one prompt or a batch.

With no --checkpoint, a built-in tiny demo model with RANDOM weights runs instead (its output is
meaningless), so the whole pipeline can be seen working in seconds on a CPU.

examples:
  %(prog)s                                                  # the demo model
  %(prog)s --checkpoint CKPT --chat                         # talk with it (on a terminal)
  %(prog)s --checkpoint CKPT --chat --prompt "What is JAX?" --reasoning-effort low
  echo "What is JAX?" | %(prog)s --checkpoint CKPT --chat   # the prompt piped in
  %(prog)s --checkpoint CKPT --batch-file prompts.txt --json
  %(prog)s --checkpoint CKPT --prompt-ids 1,2,3 --temperature 0 --dtype float32 --json

Convert a published checkpoint first: gptoss-convert SOURCE_DIR CKPT. The tokenizer vocabulary
(o200k_base.tiktoken, hash-checked) is found as tiktoken finds it: --tokenizer PATH,
$TIKTOKEN_ENCODINGS_BASE, tiktoken's cache, else downloaded once into that cache. Ctrl-C stops at once (exit 130); in the interactive chat it stops the reply being written.
Bad usage exits with code 2, a missing or unusable file (checkpoint, prompt, tokenizer) with 1.
"""

DEFAULT_PROMPT = "The capital of France is"
DEFAULT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("no token ids given")
    return ids


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    loading.add_flags(p)
    loading.add_kv_flag(p)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a UTF-8 file (- for standard input)")
    src.add_argument("--prompt-ids", metavar="IDS", type=parse_ids, help="the prompt as comma-separated token ids")
    src.add_argument("--batch-file", metavar="PATH", help="one prompt per line (- for standard input); one batch")
    p.add_argument("--chat", action="store_true",
                   help="harmony chat: the prompt(s) become a user turn and the reply streams as a person reads "
                        "it; with no prompt, an interactive conversation on a terminal, else the prompt is read "
                        "from standard input")
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default=None,
                   help="with --chat: the system message's reasoning effort (default: medium)")
    p.add_argument("--system", metavar="TEXT", help="with --chat: instructions (the harmony developer message)")
    p.add_argument("--hide-reasoning", action="store_true", help="with --chat: show only the answer, not the reasoning")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default: 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--stop-ids", type=parse_ids, default=[], metavar="IDS",
                   help="extra stop token ids (<|return|>, <|call|> and <|endoftext|> always stop)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed; prompt b of a batch file samples with seed + b (default: 0)")
    p.add_argument("--decode-steps", type=int, default=8, metavar="N",
                   help="decode steps per call to the device (default: 8): the host dispatches once and reads "
                        "the tokens once per N tokens, which keeps a batch of one from waiting on the host; "
                        "text streams N tokens at a time; the device may run up to N - 1 steps past the last token "
                        "(2N - 1 when stop tokens end every sequence: the call after is already queued)")
    p.add_argument("--draft", type=draft_flag, default="none", metavar="DRAFT",
                   help=f"speculative decoding, {DRAFT_CHOICES}: each step checks up to --draft-tokens proposed "
                        "tokens at once and keeps those the model accepts (greedy: the same tokens as without it, up "
                        "to the rounding of a pass over several positions; sampled: drawn from the same "
                        "distributions); prompt-lookup proposes what followed the last 1-3 tokens where they "
                        "occurred earlier in the prompt or reply (pays off where replies quote their context); "
                        "eagle3:DIR drafts with a published EAGLE-3 head (config.json and safetensors, as SpecForge "
                        "and SGLang publish them for gpt-oss) from the model's own hidden states (default: none)")
    p.add_argument("--draft-tokens", type=int, default=4, metavar="K",
                   help="with --draft: tokens proposed and checked per step (default: 4; less than the sliding "
                        "window, 128 for gpt-oss, and than --max-context)")
    p.add_argument("--lora", metavar="PATH", type=expand, default=None,
                   help="a LoRA adapter applied to every prompt, unmerged (its low-rank products beside the weights "
                        "at each step): a peft adapter folder for transformers' GptOssForCausalLM, or "
                        "gptoss-finetune's --out")
    p.add_argument("--merge-lora", action="store_true",
                   help="with --lora: fold the adapter into the weights once instead (decodes as fast as the base)")
    p.add_argument("--max-context", type=int, default=None,
                   help="KV cache length: prompt plus new tokens must fit (default: 4096, or the model's "
                        "context if shorter)")
    p.add_argument("--tokenizer", metavar="PATH", type=expand, help="o200k_base.tiktoken (or its folder), hash-checked")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    p.add_argument("--quiet", action="store_true", help="no loading progress bar")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    devices.add_flags(p)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    return run_command(lambda: build_parser(prog).parse_args(argv), _run, raising=True, program=argv is None,
                       before_error=lambda: "\n" if sys.stdout.isatty() else "")  # end a reply streamed to a terminal


def entry(prog: str | None = None) -> None:
    """The program's entry point (`gptoss-generate`, run_inference.py): main(), then exit (command.leave)."""
    leave(main(prog=prog or os.path.basename(sys.argv[0])))


def _warn(message: str) -> None:
    say(f"warning: {message}")


def _prompts(args, tokenizer, texts) -> list[list[int]]:
    from .. import tokenizer as tk  # start-up: tiktoken loads after the flags are checked

    if args.prompt_ids is not None:
        return [args.prompt_ids]
    if texts is None:
        if tokenizer is None:
            return [DEFAULT_IDS]
        texts = [DEFAULT_PROMPT]
    if tokenizer is None:
        raise UsageError("text prompts need the tokenizer: pass --tokenizer PATH to o200k_base.tiktoken "
                         "(or set TIKTOKEN_ENCODINGS_BASE), or give --prompt-ids")
    if args.chat:
        return [tk.render_chat([("user", t)], reasoning_effort=args.reasoning_effort or "medium",
                               instructions=args.system, vocab=args.tokenizer) for t in texts]
    return [tokenizer.encode(t, disallowed_special=()) for t in texts]


def _run(args, signals: Signals) -> int:
    # Start-up: tiktoken and the library load here, after argparse has checked the flags.
    from .. import tokenizer as tk
    from ..sampling import Sampling

    # Everything that can be checked without the model, first: flags, files, the model's limits.
    check_flags(args, _warn)
    if args.merge_lora and args.lora is None:
        raise UsageError("--merge-lora folds an adapter into the weights: give it with --lora PATH")
    processes = devices.process_settings(args)
    mesh_sizes = devices.mesh_sizes(args)
    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    except ValueError as e:  # a bad flag value: its message names the setting as the flag does, less the dashes
        raise UsageError(f"--{e}") from None
    texts = prompt_texts(args)
    config, what = model_config(args)
    max_len = max_context(args, config)
    check_draft(args, config, max_len)
    interactive = args.chat and texts is None and sys.stdin.isatty()
    if interactive and processes is not None:
        raise UsageError("the interactive chat runs in one process; give the prompt with --prompt, --prompt-file "
                         "or --batch-file")
    tokenizer = None
    needs_text = texts is not None or args.chat or not args.json
    if args.tokenizer or needs_text:
        try:
            tokenizer = tk.load_tokenizer(args.tokenizer)
        except tk.TokenizerError:
            if args.tokenizer or texts is not None or args.chat:
                raise
    if tokenizer is not None and config.vocab_size != tk.VOCAB_SIZE:
        if args.chat or texts is not None:
            raise UsageError(f"this model's vocabulary has {config.vocab_size} tokens, not o200k_harmony's "
                             f"{tk.VOCAB_SIZE}: give --prompt-ids")
        tokenizer = None  # a test model with its own small vocabulary: report ids only
    prompts = None if interactive else _prompts(args, tokenizer, texts)
    if prompts is not None:
        check_fits(max(len(p) for p in prompts), args, max_len)

    # JAX starts here, once everything that can be checked without it has been.
    import jax

    from ..decoding.generator import Generator
    from ..sharding import describe
    from .batch import run_batch

    devices.use_compile_cache(args.compile_cache)
    devices.start_processes(processes)
    # Checked against the devices and the model: nothing read yet.
    mesh = devices.choose_mesh(mesh_sizes, config, dtype=loading.dtype_of(args))
    main_process = devices.quiet_other_processes()
    args.quiet = args.quiet or not main_process
    batch = 1 if prompts is None else len(prompts)
    unsplit = devices.unsplit_batch(batch, mesh, f"a batch of {batch}")
    if unsplit and main_process:
        _warn(unsplit)
    if main_process:
        experts = "; experts packed in MXFP4" if loading.packed_experts(args) else ""
        say(f"model: {what}{experts}; jax {jax.__version__}; max context {max_len}")
        say(f"devices: {describe(mesh, config) if mesh else '1 ' + jax.devices()[0].platform + ' device'}")
    adapter = None if args.lora is None else _adapter(args.lora, config)  # (read before the model loads)
    if adapter is not None and args.merge_lora and "experts" in adapter.targets and loading.packed_experts(args):
        raise UsageError("--merge-lora: the adapter adapts the experts, which --dtype mxfp4 keeps packed; run it "
                         "unmerged (no --merge-lora) or load the experts in bfloat16")
    params = loading.load_params(args, config, mesh)
    if adapter is not None:
        from ..training.lora import attach, merge  # (as above)

        params = merge(params, adapter.weights, 1.0) if args.merge_lora else attach(params, adapter.weights, 1.0)
        if main_process:
            say(f"LoRA adapter: {adapter.path} (rank {adapter.rank}, on {', '.join(adapter.targets)}), "
                f"{'merged' if args.merge_lora else 'unmerged'}")
    if tokenizer is None and not args.json and main_process:
        say("no tokenizer vocabulary found: prompt and output are token ids (pass --tokenizer PATH)")
    stops = list(args.stop_ids) + (list(tk.STOP_TOKENS) if config.vocab_size == tk.VOCAB_SIZE else [])
    generator = Generator(config, params, max_len=max_len, decode_steps=args.decode_steps, kv_dtype=args.kv_dtype)
    if interactive:
        from .repl import chat_loop  # the chat's modules: imported only when it runs

        return chat_loop(args, generator, tokenizer, sampling, stops, signals)
    run_batch(args, generator, tokenizer, prompts, sampling, stops, signals)
    return 0


def _adapter(path: str, config):
    """--lora's adapter (training.adapter_files.Adapter): UsageError naming the file and field."""
    from ..training.adapter_files import AdapterError, read_adapter  # (JAX's modules: after the flags' checks)

    try:
        return read_adapter(path, config)
    except AdapterError as e:
        raise UsageError(f"--lora {path}: {e}") from None


if __name__ == "__main__":
    entry()
