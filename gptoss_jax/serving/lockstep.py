"""Several processes (hosts) serving as one engine: process 0 takes the requests; every process runs
the same steps.

A step's model calls are collectives over every device of every process, so each process must make
the same calls in the same order with the same inputs. Everything an engine step does follows from
its rows' state and the tokens it reads back (which every process reads alike: the pages taken,
the sequences preempted), except two things that arrive from outside: which requests are admitted
into which rows, and which are cancelled.
Process 0 decides those at the start of each step and sends them, as one message per step, through
the key-value store of `jax.distributed` (the coordination service every process already joined);
the others (followers) wait for each step's message, apply it, and run the step.

    message  = JSON header, then the admitted prompts as int32 bytes
    header   = {"cancel": [row, ...], "admit": [[row, request id, prompt length, settings], ...],
                "dropped": [id of a preempted request, ...], "stop": bool}

Sending is one call to the coordination service per step (under a millisecond on one host); the
store keeps the last `KEEP` steps' messages (a follower is never more than a step or two behind,
since every step's collectives wait for all processes).
"""

from __future__ import annotations

import dataclasses
import json
import numpy as np

from ..sampling import Sampling
from .request import Request, Settings

KEY = "gptoss-serving/step/{}"
KEEP = 64  # steps whose messages stay in the store
POLL_MS = 10_000  # a follower's wait for one message, renewed while process 0 is idle


class LockstepError(RuntimeError):
    """The processes lost each other (process 0 stopped or the coordination service failed)."""


@dataclasses.dataclass
class Message:
    """One step's decisions: slots freed by cancellation (in the order process 0 freed them), requests
    admitted (slot, request; in slot order), or the end of serving."""

    cancel: list[int] = dataclasses.field(default_factory=list)
    admit: list[tuple[int, Request]] = dataclasses.field(default_factory=list)
    stop: bool = False
    dropped: list[int] = dataclasses.field(default_factory=list)  # ids of preempted requests cancelled


def encode(message: Message) -> bytes:
    header = {"cancel": message.cancel, "stop": message.stop, "dropped": message.dropped,
              "admit": [[slot, r.id, len(r.prompt_ids), _settings_json(r.settings)] for slot, r in message.admit]}
    prompts = [np.asarray(r.prompt_ids, np.int32) for _, r in message.admit]
    body = np.concatenate(prompts).tobytes() if prompts else b""
    return json.dumps(header).encode() + b"\n" + body


def decode(data: bytes) -> Message:
    head, _, body = data.partition(b"\n")
    header = json.loads(head)
    prompts = np.frombuffer(body, np.int32)
    admit, at = [], 0
    for slot, request_id, length, settings in header["admit"]:
        admit.append((slot, Request(request_id, prompts[at:at + length].tolist(), _settings(settings))))
        at += length
    return Message(header["cancel"], admit, header["stop"], header["dropped"])


def _settings_json(s: Settings) -> dict:
    return dataclasses.asdict(s)


def _settings(d: dict) -> Settings:
    """Settings from their JSON (every field: JSON's lists back to the tuples Settings holds)."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    if set(d) != fields:
        raise LockstepError(f"process 0 sent settings with fields {sorted(d)}, this process has {sorted(fields)}")
    return Settings(**{**d, "sampling": Sampling(**d["sampling"]), "stop_ids": tuple(d["stop_ids"]),
                       "stop_strings": tuple(d["stop_strings"]),
                       "logit_bias": tuple((int(t), float(b)) for t, b in d["logit_bias"])})


class Lockstep:
    """The engine's link to the other processes: `send` on process 0, `receive` on the others, one
    message per engine step."""

    def __init__(self, process_index: int, client):
        if client is None:
            raise LockstepError("several processes, but jax.distributed is not initialized")
        self.leader = process_index == 0
        self.process_index = process_index
        self._client = client
        self._step = 0
        self._stopped = False

    @classmethod
    def of_this_process(cls) -> "Lockstep | None":
        """None with one process; otherwise the link of this process."""
        import jax
        from jax._src import distributed  # the client of the coordination service (as Orbax uses it)

        if jax.process_count() == 1:
            return None
        return cls(jax.process_index(), distributed.global_state.client)

    def send(self, message: Message) -> None:
        assert self.leader, "only process 0 sends"
        if self._stopped:
            return
        self._stopped = message.stop
        try:
            self._client.key_value_set_bytes(KEY.format(self._step), encode(message))
            if self._step >= KEEP:
                self._client.key_value_delete(KEY.format(self._step - KEEP))
        except Exception as e:  # noqa: BLE001 — the service's own error type, said with its message
            raise LockstepError(f"cannot send step {self._step} to the other processes: {e}") from None
        self._step += 1

    def receive(self) -> Message:
        assert not self.leader, "process 0 sends"
        key = KEY.format(self._step)
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, POLL_MS)
                break
            except Exception as e:  # noqa: BLE001 — a timeout (process 0 is idle) is waited out again
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise LockstepError(f"process {self.process_index} lost process 0 at step {self._step}: "
                                        f"{str(e).splitlines()[0]}") from None
        self._step += 1
        return decode(data)
