#!/usr/bin/env bash
# Installs the package with its test dependencies, then runs the whole suite.
# PYTHON chooses the interpreter (CI passes a virtual environment's, see .ci/run).
set -euo pipefail
cd "$(dirname "$0")"
python="${PYTHON:-python3}"
"$python" -m pip install --quiet --disable-pip-version-check -e ".[test]"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
"$python" -m pytest "$@"
