#!/usr/bin/env bash
# Set up .venv (idempotent) and run the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q "$@"
