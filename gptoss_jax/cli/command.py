"""How the generation and fine-tuning command lines start and end: fewer allocator arenas before JAX
starts (hostmem.py), Ctrl-C and SIGTERM taken (signals.py), and every failure one line on standard
error with its exit code: 2 for bad usage, 1 for bad input files or folders, 130 or 143 for a
signal."""

from __future__ import annotations

import os
import sys
from typing import Callable

from ..hostmem import limit_allocator_arenas
from .inputs import UsageError
from .signals import Signals


def run_command(parse: Callable[[], object], run: Callable[[object, Signals], int], *, raising: bool,
                before_error: Callable[[], str] = lambda: "") -> int:
    """run(parse(), signals) -> its exit code, or the one its failure maps to.

    raising: how signals are taken (signals.py). before_error: text printed before an interrupt's
    error line (generation ends a reply streamed to the terminal with it).
    """
    limit_allocator_arenas()  # before JAX starts its threads: loading keeps near one layer
    signals = Signals(raising=raising)
    try:
        return run(parse(), signals)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{before_error()}error: {signals.what}", file=sys.stderr)
        return signals.exit_code
    finally:
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
