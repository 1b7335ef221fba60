"""How the command lines start and end: fewer allocator arenas before JAX starts (hostmem.py),
Ctrl-C and SIGTERM taken (signals.py), and every failure one line on standard error with its exit
code. The exit codes, the same for every command (gptoss-generate, gptoss-finetune, gptoss-serve,
and gptoss-convert, which keeps its own loop, convert/cli.py):

- 0: done.
- 2, bad usage, as argparse itself answers it: the command line must change. An unknown flag, a
  flag's value out of range or of the wrong kind, a required flag missing, flags that conflict, or
  a flag at odds with what it names (an output that exists without --overwrite or --resume, or
  that lies inside its input; a --max-context beyond the model's). Raised as inputs.UsageError.
- 1, a bad file: a checkpoint, conversion source, prompt, data or tokenizer file that is missing,
  unreadable or malformed, an output that cannot be written, or a failure while running (any
  other ValueError or OSError; inputs.InputError names the prompt files).
- 130 or 143: stopped by Ctrl-C or SIGTERM. gptoss-serve is the exception: Ctrl-C and SIGTERM are
  how a server is meant to stop, so it exits 0 once its requests are ended (docs/serving.md).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from ..hostmem import limit_allocator_arenas
from .inputs import UsageError
from ..signals import Signals, say


def run_command(parse: Callable[[], object], run: Callable[[object, Signals], int], *, raising: bool,
                before_error: Callable[[], str] = lambda: "", program: bool = False) -> int:
    """run(parse(), signals) -> its exit code, or the one its failure maps to.

    raising: how signals are taken (signals.py). before_error: text printed before an interrupt's
    error line (generation ends a reply streamed to the terminal with it). program: this call is the
    whole program (the entry point, which exits next): the signals then stay taken, only recorded,
    until the process ends, since Python's own handlers, put back, would turn a Ctrl-C after the work
    was done (a fine-tuned model saved) into a traceback and exit 130. Otherwise the caller's
    handlers come back on return.
    """
    limit_allocator_arenas()  # before JAX starts its threads: loading keeps near one layer
    signals = Signals(raising=raising)
    def interrupted() -> int:
        sys.stdout.flush()
        say(f"{before_error()}error: {signals.what}")
        return signals.exit_code

    try:
        return run(parse(), signals)
    except (ValueError, OSError) as e:
        # A signal's KeyboardInterrupt raised inside code that reports it as another error (JAX
        # wraps one raised while it compares pytree metadata in a ValueError) is the interruption.
        if signals():
            return interrupted()
        say(f"error: {e}")
        return 2 if isinstance(e, UsageError) else 1
    except KeyboardInterrupt:
        return interrupted()
    finally:
        if program:
            signals.raising = False  # the exit code is decided: a signal from now on changes nothing
        else:
            signals.restore()


def leave(code: int) -> None:
    """End the program with `code`. A failed or interrupted run leaves at once, without the
    interpreter's clean-up, once its output is flushed: nothing is left to save, and the clean-up
    would run into what the failure left in flight: an interrupted step's arrays (tearing down the
    XLA runtime under them can crash it, seen with jaxlib 0.10 on CPU) or a failed checkpoint read's
    other TensorStore reads, which print tracebacks while the interpreter shuts down (seen with
    orbax on Python 3.11). The error line stays the last thing said."""
    if code == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
