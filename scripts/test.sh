#!/usr/bin/env bash
# Set up .venv (idempotent) and run the CPU test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1  # nothing is ever fetched from a model hub
exec .venv/bin/python -m pytest tests -q --durations=20 "$@"
