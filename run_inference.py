#!/usr/bin/env python
"""Generate text with gpt-oss in JAX, from a raw prompt or a harmony chat, for one prompt or a batch.

With no --checkpoint, a built-in tiny demo model with RANDOM weights runs instead (its output is
meaningless), so the whole pipeline can be seen working in seconds on a CPU.

    python run_inference.py                                   # the demo model
    python run_inference.py --checkpoint CKPT --chat --prompt "What is JAX?" --reasoning-effort low
    python run_inference.py --checkpoint CKPT --batch-file prompts.txt --json
    python run_inference.py --checkpoint CKPT --prompt-ids 1,2,3 --temperature 0 --dtype float32 --json

Convert a published checkpoint first: python -m convert SOURCE_DIR CKPT. The tokenizer vocabulary
(o200k_base.tiktoken) is read offline: --tokenizer PATH, or $TIKTOKEN_ENCODINGS_BASE, or tiktoken's cache.
"""

from __future__ import annotations

import argparse
import json
import sys

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", help="a converted gptoss-jax checkpoint (default: the demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the prompt text")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file")
    src.add_argument("--prompt-ids", metavar="IDS", type=parse_ids, help="the prompt as comma-separated token ids")
    src.add_argument("--batch-file", metavar="PATH", help="one prompt per line; generated as one batch")
    p.add_argument("--chat", action="store_true", help="render the prompt(s) as a harmony chat user turn")
    p.add_argument("--reasoning-effort", choices=["low", "medium", "high"], default="medium",
                   help="with --chat: the system message's reasoning effort (default: medium)")
    p.add_argument("--system", metavar="TEXT", help="with --chat: instructions (the harmony developer message)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="at most this many new tokens (default: 128)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default: 1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: 0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--stop-ids", type=parse_ids, default=[], metavar="IDS",
                   help="extra stop token ids (<|return|>, <|call|> and <|endoftext|> always stop)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="parameter and activation dtype (default: bfloat16; float32 for the demo model)")
    p.add_argument("--max-context", type=int, default=4096,
                   help="KV cache length: prompt plus new tokens must fit (default: 4096)")
    p.add_argument("--tokenizer", metavar="PATH", help="o200k_base.tiktoken (or its folder), hash-checked")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of streaming text")
    return p


def _load_model(args):
    import jax.numpy as jnp

    import gptoss_jax as gj
    from gptoss_jax.testing import random_params

    if args.checkpoint:
        config, params = gj.load_checkpoint(args.checkpoint, dtype=args.dtype or "bfloat16")
        return config, params, f"checkpoint {args.checkpoint}"
    config = gj.ModelConfig.demo()
    params = random_params(config, seed=0, dtype=jnp.dtype(args.dtype or "float32"))
    return config, params, "built-in tiny demo model with RANDOM weights (its output is meaningless)"


def _prompts(args, tokenizer) -> list[list[int]]:
    from gptoss_jax import tokenizer as tk

    if args.prompt_ids is not None:
        if args.chat:
            raise ValueError("--chat needs text: use --prompt, --prompt-file or --batch-file, not --prompt-ids")
        return [args.prompt_ids]
    if args.batch_file:
        with open(args.batch_file) as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
        if not texts:
            raise ValueError(f"{args.batch_file}: no prompts")
    elif args.prompt_file:
        with open(args.prompt_file) as f:
            texts = [f.read()]
    elif args.prompt is not None:
        texts = [args.prompt]
    elif tokenizer is None:
        return [DEFAULT_IDS]
    else:
        texts = [DEFAULT_PROMPT]
    if tokenizer is None:
        raise ValueError("text prompts need the tokenizer: pass --tokenizer PATH to o200k_base.tiktoken "
                         "(or set TIKTOKEN_ENCODINGS_BASE), or give --prompt-ids")
    if args.chat:
        return [tk.render_chat([("user", t)], reasoning_effort=args.reasoning_effort, instructions=args.system,
                               vocab=args.tokenizer) for t in texts]
    return [tokenizer.encode(t, disallowed_special=()) for t in texts]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def _run(args) -> int:
    from gptoss_jax import tokenizer as tk
    from gptoss_jax.sampling import Sampling

    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.checkpoint:
        from gptoss_jax.checkpoint import read_metadata

        read_metadata(args.checkpoint)  # a missing or wrong checkpoint fails before anything is loaded
    tokenizer = None
    needs_text = not (args.prompt_ids is not None and args.json)
    if args.tokenizer or needs_text:
        try:
            tokenizer = tk.load_tokenizer(args.tokenizer)
        except tk.TokenizerError:
            if args.tokenizer or args.prompt or args.prompt_file or args.batch_file or args.chat:
                raise

    import jax

    from gptoss_jax.generate import Generator

    config, params, what = _load_model(args)
    prompts = _prompts(args, tokenizer)
    if tokenizer is None and not args.json:
        print("no tokenizer vocabulary found: prompt and output are token ids (pass --tokenizer PATH)",
              file=sys.stderr)
    if tokenizer is not None and config.vocab_size != tk.VOCAB_SIZE:
        tokenizer = None  # a test model with its own small vocabulary: report ids only
    print(f"model: {what}; jax {jax.__version__} on {jax.devices()[0].platform}", file=sys.stderr)
    stops = list(args.stop_ids) + (list(tk.STOP_TOKENS) if config.vocab_size == tk.VOCAB_SIZE else [])
    generator = Generator(config, params, max_len=args.max_context)

    stream = None
    if not args.json and len(prompts) == 1:
        decoder = tk.StreamDecoder(tokenizer) if tokenizer else None

        def stream(b, token):
            sys.stdout.write(decoder.add(token) if decoder else f"{token} ")
            sys.stdout.flush()

    results = generator.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                                 stop_tokens=stops, on_token=stream)
    for r in results:
        text = tokenizer.decode(r.output_ids) if tokenizer else None
        record = {"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "text": text,
                  "finish_reason": r.finish_reason, "timings": r.timings}
        if args.chat and tokenizer:
            reply = tk.parse_reply(r.output_ids, vocab=args.tokenizer)
            record.update(analysis=reply.analysis, final=reply.final)
        if args.json:
            print(json.dumps(record))
        elif stream is None:
            print(text if text is not None else " ".join(map(str, r.output_ids)))
            print("---")
        else:
            print()
    t = results[0].timings
    stats = jax.devices()[0].memory_stats() or {}
    peak = f"{stats['peak_bytes_in_use'] / 2**30:.2f} GiB" if "peak_bytes_in_use" in stats else "n/a on this device"
    decode = f"{t['decode_tokens_per_s']:.1f}" if t["decode_tokens_per_s"] else "n/a"
    print(f"time to first token {t['time_to_first_token_s']:.2f} s (includes compilation on the first run); "
          f"prefill {t['prefill_tokens_per_s']:.1f} tokens/s; decode {decode} tokens/s; "
          f"peak device memory {peak}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
