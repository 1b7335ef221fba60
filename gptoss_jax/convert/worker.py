"""The conversion's worker process: `python -m gptoss_jax.convert.worker SOURCE PARTIAL_DIR STORAGE`.

Started by `write_checkpoint`, in a session of its own (a Ctrl-C at the terminal reaches only the
parent, which kills this process outright and removes PARTIAL_DIR). It plans again from the
headers, writes every item into PARTIAL_DIR and reports on stdout, one JSON object a line:
{"progress": bytes}, then {"done": summary} or {"error": "one-line message"}. Should the parent
vanish, it removes PARTIAL_DIR itself and exits.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys


def main(argv: list[str]) -> int:
    source, partial, storage = argv
    parent = os.getppid()
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # nothing else may write into the report channel

    def send(message: dict) -> None:
        try:
            channel.write(json.dumps(message) + "\n")
        except BrokenPipeError:
            _orphaned(partial)
        if os.getppid() != parent:
            _orphaned(partial)

    # Imported once stdout points at stderr: nothing a library prints on import reaches the report channel.
    from .pipeline import ConversionError, plan_conversion, write_all

    try:
        summary = write_all(plan_conversion(source, storage), partial, lambda n: send({"progress": n}))
    except ConversionError as e:
        send({"error": str(e)})
        return 1
    except OSError as e:
        send({"error": f"{e.filename or partial}: {e.strerror or e}"})
        return 1
    send({"done": dataclasses.asdict(summary)})
    return 0


def _orphaned(partial: str) -> None:
    shutil.rmtree(partial, ignore_errors=True)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
