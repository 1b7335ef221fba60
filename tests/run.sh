#!/usr/bin/env bash
# Install what the tests need, then run them. The README's test command; .ci/run calls it as is.
set -euo pipefail
cd "$(dirname "$0")/.."
# CPU build of torch first (a local wheel on the project's machines), so that the test extra's
# torch requirement is already met and pip does not pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps --ignore-requires-python "gpt-oss==0.0.9"
python -m pytest -q "$@"
