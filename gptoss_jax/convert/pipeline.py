"""Plan (check every tensor against the config from headers alone), then stream item by item.

Nothing is written before the whole plan checks out; the output is assembled in a hidden sibling
folder and renamed into place only when complete, so a failed or interrupted run leaves no
checkpoint behind (nor the parent folders it created).
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from typing import Callable

import ml_dtypes
import numpy as np

from .. import formats
from ..config import ModelConfig
from ..metadata import expand, item_names, write_metadata
from ..mxfp4 import MXFP4, packed, unpack_experts
from ..version import __version__
from ..sources import SourceError, TensorInfo, read_config_json, read_tensor, scan

_FLOAT_DTYPES = {"BF16", "F32"}
_STORE_DTYPE = {"mxfp4": np.dtype(ml_dtypes.bfloat16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
                "float32": np.dtype(np.float32)}


class ConversionError(ValueError):
    """Conversion refused or failed; the message is one line naming the file and tensor."""


class OptionError(ConversionError):
    """Refused for what was asked rather than for the files: an output that exists (without
    overwrite), or that holds or lies inside the source; expert storage the source cannot give.
    The command line reports these as usage errors (exit code 2)."""


@dataclasses.dataclass
class Plan:
    source: str
    config: ModelConfig
    layout: str
    storage: str  # expert storage: mxfp4 (packed), bfloat16 or float32
    rules: list[formats.Rule]
    tensors: dict[str, TensorInfo]

    @property
    def total_bytes(self) -> int:
        return sum(info.nbytes for info in self.tensors.values())


@dataclasses.dataclass
class Summary:
    layout: str
    storage: str
    tensors: int
    bytes_read: int
    bytes_written: int
    seconds: float


def _check_sources(plan_rules, tensors, config_path: str) -> None:
    missing, consumed = [], set()
    for rule in plan_rules:
        for src in rule.sources:
            info = tensors.get(src.name)
            if info is None:
                missing.append(src.name)
                continue
            consumed.add(src.name)
            if info.shape != src.shape:
                raise ConversionError(f"{info.file}: tensor {src.name} has shape {list(info.shape)}, but "
                                      f"{config_path} implies {list(src.shape)}")
            ok = info.dtype == "U8" if src.kind == formats.UINT8 else info.dtype in _FLOAT_DTYPES
            if not ok:
                want = "U8" if src.kind == formats.UINT8 else " or ".join(sorted(_FLOAT_DTYPES))
                raise ConversionError(f"{info.file}: tensor {src.name} has dtype {info.dtype}, expected {want}")
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ConversionError(f"checkpoint lacks tensor(s) {', '.join(missing[:3])}{more}, "
                              f"required by {config_path}")
    unknown = sorted(set(tensors) - consumed)
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise ConversionError(f"{tensors[unknown[0]].file}: unknown tensor(s) {', '.join(unknown[:3])}{more}")


def plan_conversion(source: str, dtype: str | None = None) -> Plan:
    """Read config.json and every header; check every tensor; decide the expert storage."""
    source = os.path.abspath(expand(source))
    if not os.path.isdir(source):
        raise ConversionError(f"{source}: source directory not found")
    try:
        raw = read_config_json(source)
        config = ModelConfig.from_json(os.path.join(source, "config.json"))
        tensors = scan(source)
    except (SourceError, ValueError) as e:
        raise ConversionError(str(e)) from None
    layout = formats.detect_layout(raw, tensors)
    packed = layout != formats.HF_BF16
    if dtype is None:
        dtype = "mxfp4" if packed else "bfloat16"
    if dtype not in _STORE_DTYPE:
        raise OptionError(f"--dtype must be one of mxfp4, bfloat16, float32; got {dtype!r}")
    if dtype == "mxfp4" and not packed:
        raise OptionError(f"{source}: the {layout} layout holds decoded experts; --dtype mxfp4 would "
                          f"need quantization, which this converter does not do (use bfloat16 or float32)")
    plan_rules = formats.rules(config, layout)
    _check_sources(plan_rules, tensors, os.path.join(source, "config.json"))
    return Plan(source, config, layout, dtype, plan_rules, tensors)


def _convert_rule(rule: formats.Rule, arrays: list[np.ndarray], storage: str) -> list[tuple[str, object]]:
    if rule.packed:
        blocks, scales = arrays
        value = (MXFP4(blocks, scales) if storage == "mxfp4"
                 else unpack_experts(blocks, scales, "float32" if storage == "float32" else "bfloat16"))
        return [(rule.targets[0], value)]
    outputs = rule.to_ours(*arrays)
    converted = []
    for target, out in zip(rule.targets, outputs, strict=True):
        dtype = np.float32 if target.endswith("/scale") else _STORE_DTYPE[storage]  # norm scales: float32
        converted.append((target, np.ascontiguousarray(out.astype(dtype, copy=False))))
    return converted


def _insert(tree: dict, path: str, value) -> None:
    *parents, leaf = path.split("/")
    for key in parents:
        tree = tree.setdefault(key, {})
    if leaf in tree:
        raise ConversionError(f"parameter {path} produced twice")
    tree[leaf] = value


def _shapes(tree):
    if isinstance(tree, dict):
        return {k: _shapes(v) for k, v in tree.items()}
    if packed(tree):
        return MXFP4(*map(_shapes, tree))
    return (tuple(tree.shape), np.dtype(tree.dtype))


def write_all(plan: Plan, directory: str, progress: Callable[[int], None]) -> Summary:
    """Convert every item into `directory`, in this process (the worker's job; see write_checkpoint)."""
    from ..checkpoint import item_spec, save_item  # JAX and Orbax: only the worker needs them

    start = time.perf_counter()
    by_item = defaultdict(list)
    for rule in plan.rules:
        by_item[rule.item].append(rule)
    bytes_read = bytes_written = 0
    for name in item_names(plan.config):
        tree: dict = {}
        for rule in by_item[name]:
            arrays = []
            for src in rule.sources:
                info = plan.tensors[src.name]
                try:
                    arrays.append(read_tensor(info, src.name))
                except SourceError as e:
                    raise ConversionError(str(e)) from None
                bytes_read += info.nbytes
                progress(info.nbytes)
            for target, value in _convert_rule(rule, arrays, plan.storage):
                _insert(tree, target, value)
            del arrays  # the sources are no longer needed: free them before the item is saved
        expected = _shapes(item_spec(plan.config, plan.storage, name))
        if _shapes(tree) != expected:
            raise ConversionError(f"item {name}: converted tensors {_shapes(tree)} do not match {expected}")
        bytes_written += sum(x.nbytes for x in _leaves(tree))
        save_item(directory, name, tree)
    write_metadata(directory, plan.config, converter_version=f"gptoss-convert {__version__}", source_layout=plan.layout,
                   expert_storage=plan.storage, source=plan.source)
    return Summary(plan.layout, plan.storage, len(plan.tensors), bytes_read, bytes_written,
                   time.perf_counter() - start)


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif packed(tree):
        yield from tree
    else:
        yield tree


class Interrupted(Exception):
    """The conversion was cancelled (Ctrl-C or SIGTERM); nothing was written."""


def check_output(output: str, overwrite: bool, source: str | None = None) -> str:
    output = os.path.abspath(expand(output))
    if source is not None:
        source = os.path.abspath(expand(source))
        if os.path.commonpath([output, source]) == source:
            raise OptionError(f"{output}: the output must not be inside the source folder")
        if os.path.commonpath([output, source]) == output:  # --overwrite would delete the source with it
            raise OptionError(f"{output}: holds the source folder {source}; choose another output")
    if os.path.exists(output) and not overwrite:
        raise OptionError(f"{output}: already exists; pass --overwrite to replace it")
    if os.path.exists(output) and not os.path.isdir(output):
        raise OptionError(f"{output}: exists and is not a directory")
    ancestor = os.path.dirname(output)
    while not os.path.exists(ancestor):
        ancestor = os.path.dirname(ancestor)
    if not os.path.isdir(ancestor):
        raise ConversionError(f"cannot create {output}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ConversionError(f"cannot create {output}: no permission to write in {ancestor}")
    return output


def missing_folder(output: str) -> str | None:
    """The output's parent folder when it does not exist yet (write_checkpoint creates it), else None."""
    parent = os.path.dirname(os.path.abspath(expand(output)))
    return None if os.path.isdir(parent) else parent


def _make_partial(output: str) -> tuple[str, list[str]]:
    """The hidden sibling folder the output is assembled in, with the usual permissions (umask), and
    the missing parent folders created for it, deepest first (removed again should the run fail)."""
    parent = os.path.dirname(output)
    created = []
    folder = parent
    while not os.path.exists(folder):
        created.append(folder)
        folder = os.path.dirname(folder)
    try:
        os.makedirs(parent, exist_ok=True)
        partial = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.partial-", dir=parent)
    except OSError as e:
        _remove_empty(created)
        raise ConversionError(f"{parent}: cannot create the output folder there ({e.strerror})") from None
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(partial, 0o777 & ~umask)  # mkdtemp makes it 0700
    return partial, created


def _remove_empty(folders: list[str]) -> None:
    """The folders a failed run created, deepest first, as long as nothing else was put in them."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def _finish(partial: str, output: str) -> None:
    """Move the complete checkpoint into place (swapping out an old one for --overwrite)."""
    if os.path.exists(output):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.old-", dir=os.path.dirname(output))
        os.rename(output, os.path.join(old, "checkpoint"))
        os.rename(partial, output)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(partial, output)


def write_checkpoint(plan: Plan, output: str, *, overwrite: bool = False,
                     progress: Callable[[int], None] = lambda n: None,
                     cancelled: Callable[[], bool] = lambda: False) -> Summary:
    """Stream the plan into `output`, which appears only once complete (its parent folders are
    created if missing: see missing_folder).

    The writing runs in a worker process (gptoss_jax.convert.worker) in its own session, so that
    however the conversion ends (an error, Ctrl-C, SIGTERM, the worker killed for memory) this
    process can stop it outright, with none of Orbax's writer threads left running, and remove the
    partial folder (and the parent folders it created). `cancelled` is polled about ten times a
    second, and once more just before the output is renamed into place, the point of no return: when
    it returns True the worker is killed and `Interrupted` raised. A KeyboardInterrupt cleans up the
    same way. A cancellation after that point changes nothing: the output is complete.
    """
    output = check_output(output, overwrite, plan.source)
    partial, created = _make_partial(output)
    worker = None
    try:
        worker = _Worker(plan, partial)
        summary = worker.run(progress, cancelled)
        if cancelled():  # the last moment to stop: once renamed, the output is complete and stays
            raise Interrupted
        _finish(partial, output)
        partial = None
        return summary
    finally:
        if worker is not None:
            worker.kill()
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
            _remove_empty(created)


class _Worker:
    """The worker process and the JSON lines it reports on its stdout."""

    def __init__(self, plan: Plan, partial: str):
        cmd = [sys.executable, "-m", "gptoss_jax.convert.worker", plan.source, partial, plan.storage]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_package_root(),
                                                                        os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                        start_new_session=True, env=env)
        self.messages: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.messages.put(json.loads(line))
            except json.JSONDecodeError:
                continue
        self.messages.put(None)  # end of output

    def run(self, progress, cancelled) -> Summary:
        while True:
            if cancelled():
                raise Interrupted
            try:
                message = self.messages.get(timeout=0.1)
            except queue.Empty:
                continue
            if message is None:
                break
            if "progress" in message:
                progress(message["progress"])
            elif "error" in message:
                raise ConversionError(message["error"])
            elif "done" in message:
                code = self.process.wait()
                if code == 0:
                    return Summary(**message["done"])
        code = self.process.wait()
        if code < 0:
            name = signal.Signals(-code).name
            hint = " (out of memory?)" if -code == signal.SIGKILL else ""
            raise ConversionError(f"the conversion worker was killed by {name}{hint}; nothing was written")
        raise ConversionError(f"the conversion worker failed (exit code {code}); nothing was written")

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        self.process.stdout.close()


def _package_root() -> str:
    """The folder holding the gptoss_jax package, so the worker imports this very copy of it."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def convert_checkpoint(source: str, output: str, *, dtype: str | None = None, overwrite: bool = False,
                       progress: Callable[[int], None] = lambda n: None) -> Summary:
    """Plan and write in one call (the CLI does the same with a progress bar)."""
    check_output(output, overwrite, source)
    return write_checkpoint(plan_conversion(source, dtype), output, overwrite=overwrite, progress=progress)
