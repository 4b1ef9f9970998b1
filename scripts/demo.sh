#!/usr/bin/env bash
# Set up .venv (idempotent), build the tiny target + MFD drafter pair (cached), and generate with
# the reference engine: prints the text, tau and the per-stage times.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1  # nothing is ever fetched from a model hub
CACHE=${MFD_SGLANG_CACHE:-$HOME/.cache/mfd-sglang}
PAIR="$CACHE/tiny-seed0"
if [ ! -f "$PAIR/drafter/model.safetensors" ]; then
  .venv/bin/python -m mfd_sglang make-tiny "$PAIR" --seed 0
fi
.venv/bin/python -m mfd_sglang generate --target "$PAIR/target" --drafter "$PAIR/drafter" \
  --prompt "${1:-january february march}" --max-new-tokens "${2:-64}" --budget 16
