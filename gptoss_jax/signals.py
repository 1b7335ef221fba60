"""Ctrl-C (SIGINT) and SIGTERM for the command lines: one line and exit code 130 or 143, and the
commands' lines on standard error written whole (`say`), so that a signal cannot split one.

Two ways to take them:
- raising=False (the converter): the handler only records the signal, and the command polls it
  where stopping is safe (it then kills its worker and cleans up);
- raising=True (generation): the handler raises KeyboardInterrupt at once. Should that land in a
  callback that swallows it (JAX's garbage-collection hook does), the recorded signal raises it
  again at the next `check()`, and the "Exception ignored" report of the swallowed one is dropped.
"""

from __future__ import annotations

import signal
import sys


class Signals:
    def __init__(self, *, raising: bool):
        self.raising = raising
        self.received: int | None = None
        self._previous = {s: signal.signal(s, self._handle) for s in (signal.SIGINT, signal.SIGTERM)}
        self._unraisable = sys.unraisablehook
        if raising:
            sys.unraisablehook = self._drop_swallowed

    def _handle(self, signum, frame):
        self.received = signum
        if self.raising:
            raise KeyboardInterrupt

    def _drop_swallowed(self, unraisable):
        if not (self.received and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            self._unraisable(unraisable)

    def __call__(self) -> bool:
        """Whether a signal has come."""
        return self.received is not None

    def check(self) -> None:
        if self.received is not None:
            raise KeyboardInterrupt

    @property
    def what(self) -> str:
        return "terminated" if self.received == signal.SIGTERM else "interrupted"

    @property
    def exit_code(self) -> int:
        return 128 + (self.received or signal.SIGINT)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = self._unraisable


def say(line: str) -> None:
    """One line on standard error, written whole: print() writes the text and its newline apart, so
    a Ctrl-C landing between the two would leave the error line glued to the end of this one."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()
