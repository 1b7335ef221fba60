"""One batch of prompts through a loaded `Generator`, printed as the command line prints it: the
reply streamed as it is generated (one prompt), or each reply (text or JSON) at the end, then the
timing line. The generation command and the interactive chat both run their batches here.
"""

from __future__ import annotations

import json
import sys

import jax

from .. import tokenizer as tk
from ..decoding.generator import batch_timings
from ..drafts.eagle3 import Eagle3Draft
from ..drafts.prompt_lookup import PromptLookup
from .display import ChatPrinter, timing_line
from .inputs import head_folder
from ..signals import say


def peak_memory() -> str:
    local = jax.local_devices()
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in local]
    if None in peaks:
        return f"n/a on {local[0].platform}"
    return f"{max(peaks) / 2**30:.2f} GiB" + (f" (the most on one of {len(local)} devices)" if len(local) > 1 else "")


def run_batch(args, generator, tokenizer, prompts, sampling, stops, signals, printer=None):
    """Generate for the prompts; stream one prompt's reply, or print each (text or JSON) at the end."""
    stream = not args.json and len(prompts) == 1
    if stream and printer is None:
        if args.chat and tokenizer is not None:
            printer = ChatPrinter(tokenizer, args.tokenizer, show_reasoning=not args.hide_reasoning)
        else:
            printer = _PlainPrinter(tokenizer)

    def on_token(b, token):
        signals.check()
        if stream:
            printer.feed(token)

    draft = PromptLookup() if args.draft == "prompt-lookup" else None
    if head_folder(args) is not None:
        draft = Eagle3Draft.load(head_folder(args), generator.config, generator.dtype)
    results = generator.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                                 stop_tokens=stops, on_token=on_token, draft=draft, draft_tokens=args.draft_tokens)
    if stream:
        printer.finish()
    for r in results:
        text = tokenizer.decode(r.output_ids) if tokenizer else None
        record = {"prompt_ids": r.prompt_ids, "output_ids": r.output_ids, "text": text,
                  "finish_reason": r.finish_reason, "timings": r.timings}
        if args.chat and tokenizer:
            reply = tk.parse_reply(r.output_ids, vocab=args.tokenizer)
            record.update(analysis=reply.analysis, final=reply.final)
        if args.json:
            print(json.dumps(record))
        elif not stream:
            print(text if text is not None else " ".join(map(str, r.output_ids)))
            print("---")
    sys.stdout.flush()
    if jax.process_index() == 0:
        say(timing_line(batch_timings(results), peak_memory()))
    return results


class _PlainPrinter:
    """Raw text (or token ids, without a tokenizer) as it is generated."""

    def __init__(self, tokenizer):
        self._decoder = tk.StreamDecoder(tokenizer) if tokenizer else None

    def feed(self, token: int) -> None:
        sys.stdout.write(self._decoder.add(token) if self._decoder else f"{token} ")
        sys.stdout.flush()

    def finish(self) -> None:
        sys.stdout.write((self._decoder.flush() if self._decoder else "") + "\n")
        sys.stdout.flush()
