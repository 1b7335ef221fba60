"""Stopping a conversion at any moment: Ctrl-C and SIGTERM end it with one line, exit 130 or 143,
and no output or partial folder; so does a worker killed from outside (as the kernel's
out-of-memory killer would), with exit 1. A signal once the output is renamed into place, the point
of no return, ends it with exit 0 and the output kept, never with a failure and the output left.

The source is large enough (8 layers, 32 experts of 512 x 512) that converting it takes seconds,
and the signals land throughout: while reading, decoding and during Orbax's saves.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import until, wait_for_signal_handlers
from gptoss_jax import ModelConfig
from gptoss_jax.testing import write_synthetic_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# When the signal lands, after the command's handlers are in: as fractions of an uninterrupted run's
# time on this machine (4.5 to 10 s seen), so that every one lands before the run would have ended.
FRACTIONS = (0.0, 0.03, 0.1, 0.18, 0.25, 0.32, 0.4, 0.5, 0.6)
# Also, whatever the machine's speed: once the first item, and once four items, have been saved.
AFTER_ITEMS = (1, 4)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    config = ModelConfig.tiny().replace(num_hidden_layers=8, hidden_size=512, intermediate_size=512,
                                        num_experts=32, vocab_size=32768, head_dim=64)
    path = tmp_path_factory.mktemp("medium") / "original"
    write_synthetic_checkpoint(config, path, "original", seed=1)
    return path


@pytest.fixture(scope="module")
def run_seconds(source, tmp_path_factory):
    """How long an uninterrupted conversion takes here, from its handlers being in to its end."""
    process = _start(source, tmp_path_factory.mktemp("whole") / "out", "--quiet")
    wait_for_signal_handlers(process)
    start = time.monotonic()
    _, err = process.communicate(timeout=300)
    assert process.returncode == 0, err
    return time.monotonic() - start


def _start(source, out, *extra):
    return subprocess.Popen([sys.executable, "-m", "convert", str(source), str(out), "--dtype", "bfloat16", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _saved_items(folder) -> int:
    """How many items the hidden partial folder holds so far (0 if there is none yet)."""
    partials = [p for p in folder.iterdir() if p.name.startswith(".out.partial-")]
    return sum(len(os.listdir(p / "params")) for p in partials if (p / "params").is_dir())


def _wait_for_items(process, folder, n: int, timeout: float = 60) -> None:
    """Until the conversion has saved n items; fails if it ends (or stalls) first."""
    def saved() -> bool:
        assert process.poll() is None, f"the conversion ended before saving {n} items"
        return _saved_items(folder) >= n

    until(saved, f"the conversion saved {n} items", timeout)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_at_any_moment_leaves_nothing(source, run_seconds, tmp_path, signum):
    midway = 0
    moments = [("seconds", f * run_seconds) for f in (FRACTIONS if signum == signal.SIGINT else FRACTIONS[::2])]
    for i, (kind, when) in enumerate(moments + [("items", n) for n in AFTER_ITEMS]):
        folder = tmp_path / f"run{i}"
        folder.mkdir()
        process = _start(source, folder / "out", "--quiet")
        wait_for_signal_handlers(process)
        if kind == "seconds":
            time.sleep(when)  # not a wait: the signal lands at this moment, whatever the state
        else:
            _wait_for_items(process, folder, when)
        midway += _saved_items(folder) > 0
        process.send_signal(signum)
        out, err = process.communicate(timeout=60)
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        assert process.returncode == 128 + signum, (kind, when, err)
        assert err.strip().splitlines()[-1] == f"error: {what}; nothing was written", (kind, when, err)
        assert "Traceback" not in err and "Exception ignored" not in err, (kind, when, err)
        assert len([line for line in err.splitlines() if not line.startswith("source: ")]) == 1, (kind, when, err)
        assert list(folder.iterdir()) == [], (kind, when, err)  # no output, no partial folder
    assert midway >= 2  # several signals landed after items had been written, amid Orbax saves


def test_interrupted_progress_bar_is_replaced_by_the_error_line(source, tmp_path):
    process = _start(source, tmp_path / "out")
    _wait_for_items(process, tmp_path, 1)  # the bar is drawn
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130 and err.rstrip().endswith("error: interrupted; nothing was written")
    assert list(tmp_path.iterdir()) == []


def _worker_pid(parent: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        if ppid == parent and b"gptoss_jax.convert.worker" in cmdline:
            return int(pid)
    return None


def test_a_killed_worker_is_an_error_and_leaves_nothing(source, tmp_path):
    process = _start(source, tmp_path / "out", "--quiet")
    def working() -> int | None:
        assert process.poll() is None, "the conversion ended first"
        pid = _worker_pid(process.pid)
        return pid if pid is not None and _saved_items(tmp_path) else None

    os.kill(until(working, "the worker has saved an item", 30), signal.SIGKILL)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 1
    assert err.strip().splitlines()[-1] == ("error: the conversion worker was killed by SIGKILL (out of memory?); "
                                            "nothing was written")
    assert list(tmp_path.iterdir()) == []


def test_an_uncreatable_output_folder_is_one_line(source, tmp_path):
    (tmp_path / "file").write_text("not a folder")
    process = subprocess.run([sys.executable, "-m", "convert", str(source), str(tmp_path / "file" / "out")],
                             cwd=ROOT, capture_output=True, text=True)
    assert process.returncode == 1 and process.stderr.count("\n") == 1, process.stderr
    assert process.stderr == f"error: cannot create {tmp_path / 'file' / 'out'}: {tmp_path / 'file'} is not a folder\n"


@pytest.fixture(scope="module")
def small_source(tmp_path_factory):
    """The tiny model: converted in about a second, for the moments at the very end of a run."""
    path = tmp_path_factory.mktemp("small") / "original"
    write_synthetic_checkpoint(ModelConfig.tiny(), path, "original", seed=2)
    return path


def _complete(output) -> bool:
    return (output / "gptoss_checkpoint.json").is_file() and not [
        p for p in output.parent.iterdir() if p.name.startswith(".")]  # no partial or old folder left


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_just_after_the_output_is_in_place_keeps_it_and_exits_0(small_source, tmp_path, monkeypatch,
                                                                          capsys, signum):
    """The signal lands right after the rename (the point of no return), from inside the process: the
    run ends with exit 0, the output complete, and one line saying so."""
    from gptoss_jax.convert import pipeline
    from gptoss_jax.convert.cli import main

    finish = pipeline._finish

    def finish_then_signal(partial, output):
        finish(partial, output)
        os.kill(os.getpid(), signum)  # the command's handler takes it: this process carries on

    monkeypatch.setattr(pipeline, "_finish", finish_then_signal)
    assert main([str(small_source), str(tmp_path / "out"), "--quiet"]) == 0
    what = "interrupted" if signum == signal.SIGINT else "terminated"
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2].startswith(f"wrote {tmp_path / 'out'}: ")
    assert err[-1] == f"{what} after the conversion had finished: {tmp_path / 'out'} is complete and kept"
    assert _complete(tmp_path / "out")


# The installed command is `sys.exit(main())`: here a signal lands between the two, once the exit code
# is decided, as a Ctrl-C in the run's last instant would.
_SIGNAL_AS_IT_ENDS = """
import os, sys
from gptoss_jax.convert.cli import main
code = main()
os.kill(os.getpid(), {signum})
sys.exit(code)
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_the_command_ends_changes_nothing(small_source, tmp_path, signum):
    script = _SIGNAL_AS_IT_ENDS.format(signum=int(signum))
    run = subprocess.run([sys.executable, "-c", script, str(small_source), str(tmp_path / "out"), "--quiet"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1].startswith(f"wrote {tmp_path / 'out'}: "), run.stderr
    assert _complete(tmp_path / "out")
