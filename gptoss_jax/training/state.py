"""Train-state checkpoints (Orbax): what is trained, the optimizer state, and where the run stands.

    OUT/checkpoints/<step>/state/   the trainable pytree (adapters or master weights) and the
                                    optimizer state (Orbax's standard pytree format)
    OUT/checkpoints/<step>/meta/    JSON: step, data position, seed, the model config and the
                                    training settings that must match on resume

Orbax writes each step into a temporary folder and renames it when complete, so a checkpoint is
either whole or absent; an interrupted save leaves the earlier ones intact. The newest `keep` are
kept.
"""

from __future__ import annotations

import os
from typing import Any

import jax

# Settings a resumed run must share with the run that wrote the checkpoint (others, such as
# --steps, may change between runs).
MUST_MATCH = ("config", "lora", "compute_dtype", "batch_size", "accumulation", "max_length", "seed", "data")


class ResumeError(ValueError):
    """A checkpoint that cannot continue this run; the message says why, naming the folder."""


class TrainCheckpoints:
    def __init__(self, directory: str, *, keep: int = 2):
        import orbax.checkpoint as ocp

        self.directory = os.path.abspath(os.path.expanduser(directory))
        self._manager = ocp.CheckpointManager(
            self.directory, item_names=("state", "meta"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False))

    def latest(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, trainable, opt_state, meta: dict[str, Any]) -> None:
        import orbax.checkpoint as ocp

        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave({"trainable": trainable, "opt_state": opt_state}),
            meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)
        self._manager.wait_until_finished()

    def meta(self, step: int) -> dict[str, Any]:
        import orbax.checkpoint as ocp

        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def restore(self, step: int, trainable, opt_state):
        """(trainable, opt_state) of `step`, laid out as the given (abstract or concrete) trees."""
        import orbax.checkpoint as ocp

        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None)),
                              {"trainable": trainable, "opt_state": opt_state})
        state = self._manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))["state"]
        return state["trainable"], state["opt_state"]

    def close(self) -> None:
        self._manager.close()


def check_resumable(directory: str, saved: dict[str, Any], wanted: dict[str, Any]) -> None:
    """One-line error if the checkpoint's settings differ from this run's in what must match."""
    for key in MUST_MATCH:
        if saved.get(key) != wanted.get(key):
            if key == "config":
                diff = sorted(k for k in set(saved.get(key) or {}) | set(wanted.get(key) or {})
                              if (saved.get(key) or {}).get(k) != (wanted.get(key) or {}).get(k))
                raise ResumeError(f"{directory}: its checkpoint is of another model config (differs in "
                                  f"{', '.join(diff)}); resume with the checkpoint it was trained from")
            raise ResumeError(f"{directory}: its checkpoint was written with {key} = {saved.get(key)!r}, this run has "
                              f"{wanted.get(key)!r}; resume with the same setting or start a new --out")
