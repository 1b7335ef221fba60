"""What the generation command line shows a person: a harmony reply as it streams, and timings.

A reply streams as it reads: the reasoning (the `analysis` channel) set apart, dimmed on a
terminal and labelled, or hidden; the final answer plain; a tool call as a call. No control token
is ever printed. A reply that is not harmony at all (a model with random weights, say) is shown as
its raw text after a one-line notice.
"""

from __future__ import annotations

import sys
from typing import TextIO

from .. import tokenizer as tk

DIM, RESET = "\033[2m", "\033[0m"


class ChatPrinter:
    """Feed generated tokens one at a time; it writes the reply for a reader to `out`."""

    def __init__(self, tokenizer, vocab: str | None, *, show_reasoning: bool = True, out: TextIO | None = None,
                 color: bool | None = None):
        self.out = out or sys.stdout
        self.color = self.out.isatty() if color is None else color
        self.show_reasoning = show_reasoning
        self._reader = tk.ReplyReader(tokenizer, vocab)
        self._open: tuple[str | None, str | None] | None = None  # (channel, recipient) of the message shown
        self._wrote_any = False
        self._at_line_start = True

    def _write(self, text: str, dim: bool = False) -> None:
        if not text:
            return
        self.out.write(f"{DIM}{text}{RESET}" if dim and self.color else text)
        self.out.flush()
        self._wrote_any = True
        self._at_line_start = text.endswith("\n")

    def _newline(self) -> None:
        if not self._at_line_start:
            self._write("\n")

    def feed(self, token: int) -> None:
        kind = self._reader.feed(token)
        if kind == "raw":
            self._write(self._reader.raw_text[-1])
        elif kind == "to_raw":
            self._to_raw()
        elif kind == "content":
            message = (self._reader.channel, self._reader.recipient)
            if self._open != message:
                self._begin(*message)
            self._content(self._reader.delta)
        elif kind == "end":  # the message ended (<|end|>, <|return|>, <|call|>)
            self._end()

    def _begin(self, channel: str | None, recipient: str | None) -> None:
        self._end()
        self._open = (channel, recipient)
        if recipient:
            self._newline()
            self._write(f"[tool call] {recipient}(", dim=channel == "analysis")
        elif channel == "analysis":
            if self.show_reasoning:
                self._newline()
                self._write("[reasoning] ", dim=True)
        elif self._wrote_any:  # the answer (final, or a commentary preamble) after the reasoning
            self._newline()
            self._write("\n")

    def _content(self, text: str) -> None:
        channel, recipient = self._open or (None, None)
        if channel == "analysis" and not recipient:
            if self.show_reasoning:
                self._write(text, dim=True)
        else:
            self._write(text)

    def _end(self) -> None:
        if self._open is not None and self._open[1]:
            self._write(")")
        if self._open is not None and (self.show_reasoning or self._open[0] != "analysis"):
            self._newline()
        self._open = None

    def _to_raw(self) -> None:
        self._reader.give_up()
        self._newline()
        self._write("[the reply is not in the harmony chat format; its raw text follows]\n", dim=True)
        self._write("".join(self._reader.raw_text))

    def finish(self) -> None:
        """The reply ended (or was cut short): close what is open and end the line."""
        if self._reader.raw:
            self._write(self._reader.flush())
        elif self._reader.header_tokens and not self._wrote_any:  # cut short inside a first header: not harmony
            self._to_raw()
            self._write(self._reader.flush())
        elif self._open is not None and self._open[1]:
            self._write(" ...")  # a tool call cut short
        self._open = None
        self._newline()


def rate(count: int, seconds: float) -> str:
    """`count / seconds` with the digits that mean something (never a bare 0.0)."""
    if count == 0 or seconds <= 0:
        return "n/a"
    value = count / seconds
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def duration(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def timing_line(batch: dict, peak: str) -> str:
    """One line for a batch (`generate.batch_timings`): compilation, then prefill and decode apart."""
    compiled = f"compilation {duration(batch['compile_s'])}; " if batch["compile_s"] > 0 else "no compilation (reused); "
    prompt, decoded = batch["prompt_tokens"], batch["decode_tokens"]
    decode = (f"decode {decoded} tokens in {duration(batch['decode_s'])} ({rate(decoded, batch['decode_s'])} tokens/s)"
              if decoded else "decode: none (one new token, from prefill)")
    return (f"{compiled}prefill {prompt} tokens in {duration(batch['prefill_s'])} "
            f"({rate(prompt, batch['prefill_s'])} tokens/s); {decode}; first token after "
            f"{duration(batch['time_to_first_token_s'])}; peak device memory {peak}")
