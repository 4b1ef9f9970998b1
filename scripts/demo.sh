#!/usr/bin/env bash
# The main job: set up .venv (idempotent), then run MFD in a real SGLang server on SmolLM2-135M-Instruct
# with the shipped MFD drafter, against the same server without speculation (chat requests through the
# OpenAI client; GPU if there is one, else CPU). Extra arguments go to `python -m mfd_sglang demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1  # nothing is ever fetched from a model hub
.venv/bin/python -m mfd_sglang demo "$@"
