"""The installed commands (`pip install -e .`): each names itself in --help and answers --version."""

import os
import shutil
import subprocess

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
