"""The interactive chat: `--chat` with no prompt, on a terminal.

Each turn renders the whole conversation again in the harmony format, earlier assistant turns as
their final answers only (harmony drops the reasoning of earlier turns), and generates with the
same loaded model and Generator, so the compiled steps are reused from turn to turn.
"""

from __future__ import annotations

import signal

from .. import tokenizer as tk
from .batch import run_batch
from .display import ChatPrinter
from .inputs import UsageError, check_fits
from ..signals import say

HELP = "type a message; /reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply"


def chat_loop(args, generator, tokenizer, sampling, stops, signals, read=input) -> int:
    history: list[tuple[str, str]] = []
    say(f"chat: {HELP}")
    while True:
        try:
            line = read("> ")
        except EOFError:
            say("")
            return 0
        except KeyboardInterrupt:  # Ctrl-C at the prompt: leave quietly
            say("")
            return 130
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            history.clear()
            say("(a new conversation)")
            continue
        if text.startswith("/"):
            say(f"unknown command {text.split()[0]}: {HELP}")
            continue
        turns = history + [("user", line)]
        prompt = tk.render_chat(turns, reasoning_effort=args.reasoning_effort or "medium",
                                instructions=args.system, vocab=args.tokenizer)
        try:
            check_fits(len(prompt), args, generator.max_len)
        except UsageError as e:
            say(f"{e}: /reset to start a new conversation")
            continue
        printer = ChatPrinter(tokenizer, args.tokenizer, show_reasoning=not args.hide_reasoning)
        try:
            (result,) = run_batch(args, generator, tokenizer, [prompt], sampling, stops, signals, printer=printer)
        except KeyboardInterrupt:
            if signals.received != signal.SIGINT:  # SIGTERM ends the program
                raise
            signals.received = None
            printer.finish()
            say("(reply stopped; it is not kept in the conversation)")
            continue
        history = turns + [("assistant", tk.parse_reply(result.output_ids, vocab=args.tokenizer).final)]
