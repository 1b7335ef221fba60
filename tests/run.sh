#!/usr/bin/env bash
# Install what the tests need, then run them: the README's test command (.ci/run calls it as is).
#
#   bash tests/run.sh              the whole suite (what CI runs)
#   bash tests/run.sh --fast       the fast tier: pytest -m "not slow" (docs/testing.md says what it leaves out)
#   bash tests/run.sh ARGS...      pytest with ARGS (a file, -k EXPR, ...); --fast may come first
#
# It installs only what is missing (tests/missing.py checks; a second call goes straight to pytest),
# saying what it installs and what it found already there, in order:
#   1. torch 2.13.0, the CPU build where one can be had: with TORCH_INDEX_URL set, from that wheel
#      index (e.g. PyTorch's CPU index); else what pip finds (a local CPU wheel if pip is configured
#      with one). When that would be the CUDA build (PyPI's Linux default: several GB of nvidia-*
#      packages) it says so first.
#   2. this package with its `test` extra (pytest, pytest-xdist, transformers, peft, the clients, ...),
#      editable;
#   3. OpenAI's reference, gpt-oss 0.0.9, without its serving dependencies (--no-deps; it declares
#      Python >= 3.12 but its torch model runs on 3.11, hence --ignore-requires-python).
# Then, unless pytest arguments other than --fast are given: the Pallas Mosaic GPU kernels' tests in
# Mosaic GPU's interpret mode (tests/test_mosaic_*.py), which need JAX >= 0.11 and so Python >= 3.12.
# Where this Python's JAX is older (Python 3.11 gets 0.10), they run in a virtual environment of their
# own (.venv-mosaic, JAX 0.11.2 as on the GPU machines, this package, pytest; no torch) under a Python
# >= 3.12 found on PATH or in pyenv; with none, it says so, and the main run skips them with that reason.
# Last, pytest over the machine's cores (pytest-xdist, one worker a core: PYTEST_WORKERS overrides),
# with any arguments given to this script. Every pip call passes --no-compile: Python compiles a module
# to bytecode when it is first imported, so the tests pay only for what they import (it saves about 10 s
# of .venv-mosaic's install on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TORCH_SPEC="torch==2.13.0"
say() { echo "tests/run.sh: $*" >&2; }
fast=()
if [[ "${1:-}" == "--fast" ]]; then
  fast=(-m "not slow")
  shift
fi
missing() { "$PY" tests/missing.py "$1" | awk 'NR > 1 { printf "; " } { printf "%s", $0 }'; }  # PY=... missing WHAT: another Python

lacking=$(missing torch)
if [[ -z "$lacking" ]]; then
  say "torch $("$PY" -c 'from importlib.metadata import version; print(version("torch"))') is installed: not installing it"
elif [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  say "installing $TORCH_SPEC (CPU build) from TORCH_INDEX_URL=$TORCH_INDEX_URL"
  "$PY" -m pip install -q --no-compile "$TORCH_SPEC" --index-url "$TORCH_INDEX_URL"
else
  plan=$("$PY" -m pip install -q --dry-run --report - "$TORCH_SPEC" 2>/dev/null \
         | "$PY" -c 'import json, sys; print(" ".join(i["metadata"]["name"] for i in json.load(sys.stdin)["install"]))' \
         || true)
  if [[ " $plan " == *" nvidia-"* ]]; then
    say "no CPU build of $TORCH_SPEC is available to pip for $("$PY" -V); installing the default build," \
        "which is the CUDA one with nvidia-* packages (several GB). To get the CPU build, set" \
        "TORCH_INDEX_URL to a CPU wheel index (docs/install.md, 'Running the tests', says how)."
  else
    say "installing $TORCH_SPEC (CPU build)"
  fi
  "$PY" -m pip install -q --no-compile "$TORCH_SPEC"
fi
lacking=$(missing package)
if [[ -z "$lacking" ]]; then
  say "gptoss-jax (editable) and every requirement of its test extra are installed: not running pip"
elif [[ "$lacking" == "gptoss-jax (editable, from "*")" && "$lacking" != *"; "* ]]; then  # the checkout alone
  say "installing gptoss-jax (editable) alone: every requirement of its test extra is installed"
  "$PY" -m pip install -q --no-compile --no-deps -e .
else
  say "installing gptoss-jax (editable) with its test extra; missing: $lacking"
  "$PY" -m pip install -q --no-compile -e ".[test]"
fi
lacking=$(missing reference)
if [[ -z "$lacking" ]]; then
  say "OpenAI's reference gpt-oss 0.0.9 is installed: not installing it"
else
  say "installing OpenAI's reference gpt-oss==0.0.9 (--no-deps --ignore-requires-python)"
  "$PY" -m pip install -q --no-compile --no-deps --ignore-requires-python "gpt-oss==0.0.9"
fi
mosaic_python() {  # an interpreter for JAX >= 0.11: Python >= 3.12 on PATH or in pyenv, if any
  local cand
  for cand in python3.13 python3.12 $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.1[2-9]*/bin/python3 2>/dev/null); do
    if "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then echo "$cand"; return; fi
  done
}
workers=${PYTEST_WORKERS:-$(nproc 2>/dev/null || echo 2)}
jax_below_0_11='import sys; from importlib.metadata import version; sys.exit(tuple(int(p) for p in version("jax").split(".")[:2]) < (0, 11))'
if [[ $# -eq 0 ]] && ! "$PY" -c "$jax_below_0_11" 2>/dev/null; then  # (without importing JAX: 2 s)
  newer=$(mosaic_python)
  if [[ -z "$newer" ]]; then
    say "no Python >= 3.12 here: the Mosaic GPU interpret-mode tests need JAX >= 0.11 and will be skipped"
  else
    say "the Mosaic GPU kernels in interpret mode need JAX >= 0.11: running them under $("$newer" -V) in .venv-mosaic"
    [[ -x .venv-mosaic/bin/python ]] || "$newer" -m venv .venv-mosaic
    lacking=$(PY=.venv-mosaic/bin/python missing mosaic)
    if [[ -z "$lacking" ]]; then
      say ".venv-mosaic has JAX 0.11.2, pytest and this package: not running pip"
    else
      say "installing in .venv-mosaic: $lacking"
      .venv-mosaic/bin/python -m pip install -q --no-compile "jax==0.11.2" "jaxlib==0.11.2" pytest pytest-xdist -e .
    fi
    # --dist load: these tests are spread one by one (three files of about the same length would leave
    # one worker two of them); their fixtures are cheap, and what they compile is in the shared cache.
    .venv-mosaic/bin/python -m pytest -q -n "$workers" --dist load ${fast[@]+"${fast[@]}"} tests/test_mosaic_*.py
  fi
fi
say "running pytest -n $workers ${fast[*]+${fast[*]}} $*"
"$PY" -m pytest -q -n "$workers" ${fast[@]+"${fast[@]}"} "$@"
