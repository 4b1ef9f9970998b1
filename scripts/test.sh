#!/usr/bin/env bash
# Set up .venv (idempotent) and run the CPU test suite on MFD_TEST_WORKERS pytest-xdist workers (default 2, one a
# core here; each module stays on one worker, so its servers are started once). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1  # nothing is ever fetched from a model hub
exec .venv/bin/python -m pytest tests -q --durations=20 -n "${MFD_TEST_WORKERS:-2}" --dist loadfile "$@"
