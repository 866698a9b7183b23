#!/usr/bin/env bash
# Installs the package with its test dependencies, then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
python3 -m pytest "$@"
