"""The installed commands (`pip install -e .`): each names itself in --help and answers --version,
and every command line exits the same way: 2 for bad usage, 1 for a missing or unusable file."""

import contextlib
import importlib
import io
import os
import shutil
import signal
import subprocess
import sys

import pytest

import gptoss_jax


@pytest.mark.parametrize("command, first_flag", [("gptoss-generate", "--checkpoint"), ("gptoss-convert", "--dtype"),
                                                 ("gptoss-finetune", "--data"), ("gptoss-serve", "--slots")])
def test_installed_command_names_itself(command, first_flag):
    path = shutil.which(command)
    assert path, f"{command} is not installed: run `pip install -e .` (tests/run.sh does)"
    help_text = subprocess.run([path, "--help"], capture_output=True, text=True, check=True).stdout
    assert help_text.startswith(f"usage: {command} ") and first_flag in help_text
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    assert version.strip() == f"{command} {gptoss_jax.__version__}"


def test_the_library_is_the_only_installed_top_level_package():
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)
    assert project["tool"]["setuptools"]["packages"]["find"]["include"] == ["gptoss_jax*"]
    assert set(project["project"]["scripts"]) == {"gptoss-generate", "gptoss-convert", "gptoss-finetune",
                                                   "gptoss-serve"}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory):
    """A dequantized (hf-bf16) source: converting it with --dtype mxfp4 is refused."""
    from gptoss_jax.testing import write_synthetic_checkpoint

    path = tmp_path_factory.mktemp("source") / "hf"
    write_synthetic_checkpoint(gptoss_jax.ModelConfig.tiny(), path, "hf-bf16", seed=4)
    return path


def _usage_cases(tmp, source):
    """(command, arguments, exit code) for every command line: 2 for bad usage (argparse's own code),
    1 for a file or folder that is missing or unusable (gptoss_jax/cli/command.py)."""
    (tmp / "exists").mkdir()
    (tmp / "data.jsonl").write_text('{"text": "hello"}\n')
    data, out = str(tmp / "data.jsonl"), str(tmp / "run")
    cases = [
        ("gptoss-convert", [str(source)], 2),  # OUTPUT_DIR missing
        ("gptoss-convert", [str(source), str(tmp / "c1"), "--dtype", "int8"], 2),
        ("gptoss-convert", [str(source), str(tmp / "exists")], 2),  # exists, no --overwrite
        ("gptoss-convert", [str(source), str(tmp / "c2"), "--dtype", "mxfp4"], 2),  # decoded experts: cannot repack
        ("gptoss-convert", [str(source), str(source / "inside")], 2),
        ("gptoss-convert", [str(tmp / "nowhere"), str(tmp / "c3")], 1),
    ]
    for generate in ("gptoss-generate", "run_inference.py"):
        cases += [
            (generate, ["--temperature", "-1"], 2),
            (generate, ["--top-p", "1.5"], 2),
            (generate, ["--max-new-tokens", "x"], 2),
            (generate, ["--prompt", "a", "--prompt-ids", "1"], 2),
            (generate, ["--chat", "--prompt-ids", "1"], 2),
            (generate, ["--coordinator", "h:1"], 2),  # needs --num-processes and --process-id
            (generate, ["--checkpoint", str(tmp / "nowhere"), "--prompt-ids", "1"], 1),
            (generate, ["--prompt-file", str(tmp / "missing.txt")], 1),
        ]
    for finetune in ("gptoss-finetune", "finetune.py"):
        cases += [
            (finetune, ["--out", out], 2),  # --data missing
            (finetune, ["--data", data, "--out", out, "--steps", "0"], 2),
            (finetune, ["--data", data, "--out", out, "--lora-targets", "mlp"], 2),
            (finetune, ["--data", data, "--out", out, "--resume"], 2),  # nothing to resume
            (finetune, ["--checkpoint", str(tmp / "nowhere"), "--data", data, "--out", out], 1),
        ]
    cases += [
        ("gptoss-serve", ["--slots", "0"], 2),
        ("gptoss-serve", ["--port", "99999"], 2),
        ("gptoss-serve", ["--bogus"], 2),
        ("gptoss-serve", ["--checkpoint", str(tmp / "nowhere")], 1),
    ]
    return cases


# The function each program's entry point calls with its command line (pyproject.toml's scripts,
# run_inference.py and finetune.py).
_MAINS = {"gptoss-convert": "gptoss_jax.convert.cli", "gptoss-generate": "gptoss_jax.cli.generate",
          "run_inference.py": "gptoss_jax.cli.generate", "gptoss-finetune": "gptoss_jax.cli.finetune",
          "finetune.py": "gptoss_jax.cli.finetune", "gptoss-serve": "gptoss_jax.server.cli"}


def _in_this_process(command: str, args: list[str]) -> tuple[int, str]:
    """(exit code, standard error) of `command args` run by its main function in this process."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = importlib.import_module(_MAINS[command]).main(args, prog=command)
        except SystemExit as e:  # argparse's own refusals
            code = e.code
    return code, err.getvalue()


def test_bad_usage_exits_2_and_a_missing_folder_1(tmp_path, bf16_source):
    """Every case through the main function its program's entry point calls, in this process (a
    Python start for each of 37 command lines was most of this test's 40 s); the test below runs
    each program's first case as the process a user starts."""
    for command, args, code in _usage_cases(tmp_path, bf16_source):
        got, stderr = _in_this_process(command, args)
        assert got == code, (command, args, stderr)
        assert "Traceback" not in stderr and "error: " in stderr.splitlines()[-1], (command, args, stderr)
        assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.slow
def test_each_program_exits_as_a_process_as_its_main_function_says(tmp_path, bf16_source):
    """Each program's first bad command line, run as the process a user starts (its console script
    or .py file): the exit code and the one error line of its main function, no traceback."""
    firsts = {}
    for command, args, code in _usage_cases(tmp_path, bf16_source):
        firsts.setdefault(command, (args, code))
    assert set(firsts) == set(_MAINS)
    for command, (args, code) in firsts.items():
        program = [sys.executable, os.path.join(ROOT, command)] if command.endswith(".py") else [shutil.which(command)]
        run = subprocess.run(program + args, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
        assert run.returncode == code, (command, args, run.stderr)
        assert "Traceback" not in run.stderr and "error: " in run.stderr.splitlines()[-1], (command, args, run.stderr)
        assert run.stderr.splitlines()[-1] == _in_this_process(command, args)[1].splitlines()[-1], command
        assert not (tmp_path / "run").exists()


# Each command's entry point, with a signal landing just after its exit code was decided (as a Ctrl-C in
# a run's last instant would): that code stands, with no traceback.
_SIGNAL_AS_IT_ENDS = """
import os
from gptoss_jax.cli import {module} as command
leave = command.leave
command.leave = lambda code: (os.kill(os.getpid(), {signum}), leave(code))
command.entry()
"""


@pytest.mark.parametrize("module, signum, args", [
    ("generate", signal.SIGINT, ["--max-new-tokens", "0"]),
    ("finetune", signal.SIGTERM, ["--data", "x", "--out", "y", "--steps", "0"])])
def test_a_signal_once_the_outcome_is_decided_changes_nothing(module, signum, args):
    script = _SIGNAL_AS_IT_ENDS.format(module=module, signum=int(signum))
    run = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("error: ") and "must be at least 1" in run.stderr, run.stderr
