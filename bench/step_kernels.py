"""The kernels one decode step launches, read from its compiled program (XLA's optimized HLO).

Every top-level operation of the step's loop body that does work is a kernel launch on a GPU: a
fusion, a custom call (cuBLAS, Pallas, cuDNN), a copy, a sort. Bookkeeping operations (tuples,
bitcasts, parameters, constants) launch nothing. A cuBLAS split-K product runs two kernels for its
one call, so on a GPU this count is a lower bound of the profile's. With one step a call (no loop),
the whole program is counted.

    from step_kernels import kernels_per_step
    kernels_per_step(generator.executables)   # after a generation compiled its decode step
"""

from __future__ import annotations

import re

# Operations that launch no kernel of their own.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "opt-barrier",
        "partition-id", "replica-id", "while", "conditional", "call", "async-done", "add-dependency",
        "copy-done", "domain"}
COMPUTATION = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")  # unindented, ending in "{"
INSTRUCTION = re.compile(r"^\s+(ROOT )?%?[\w.\-]+ = .*?\s([a-z][a-z0-9\-]*)\(")  # the first "opcode(" after the shape


def _computations(hlo: str) -> tuple[dict[str, list[tuple[str, str]]], str]:
    """{computation: [(opcode, line) of each instruction]} and the entry computation's name."""
    bodies: dict[str, list[tuple[str, str]]] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        head = COMPUTATION.match(line)
        if head:
            current = head.group(2)
            bodies[current] = []
            entry = current if head.group(1) else entry
            continue
        op = INSTRUCTION.match(re.sub(r"/\*.*?\*/", "", line))
        if op and current is not None:
            bodies[current].append((op.group(2), line))
    return bodies, entry


def count(hlo: str) -> int:
    """Kernel launches of one step in this optimized HLO: its first while loop's body, else its entry."""
    bodies, entry = _computations(hlo)
    loop = next((re.search(r"body=%?([\w.\-]+)", line) for op, line in bodies[entry] if op == "while"), None)
    body = bodies[loop.group(1)] if loop else bodies[entry]
    return sum(op not in FREE for op, _ in body)


def kernels_per_step(executables: dict) -> int | None:
    """The count for a Generator's compiled decode step (its `executables`), None before one compiled."""
    decode = [exe for key, exe in executables.items() if key[0] == "decode"]
    return count(decode[-1].as_text()) if decode else None
