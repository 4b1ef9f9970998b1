#!/usr/bin/env bash
# Stronger SmolLM2-135M-Instruct drafters (issue: method), resumable: run it again after any
# interruption and every stage continues where it stopped (the data file skips done prompts, each
# train stage resumes from OUT/train_state/; a finished stage returns at once). The regenerated data is
# committed (data/, ~1.5 MB of token ids) because it takes hours of CPU and a new machine starts
# without runs/: commit it again after a session that added to it.
#
#   RUN_DIR=runs/smollm2-v2 bash scripts/train_smollm2_drafters.sh
#
# Data: the target's greedy answers (up to 256 tokens, chat template) to EVERY training prompt of the
# three sets (1005). A 2-layer single-mode base, then the same extra steps for a single-mode drafter,
# an MFD drafter with K = 4 and one with K = 8, all from that base, so the comparison is fair (same
# data, same steps). Then the acceptance evaluation of each MFD drafter against the single-mode one, and
# of today's shipped pair, on ALL held-out prompts, T = 0 and T = 1, B = 8..64, 8 prompts at a time: one
# JSON per (pair, T, set) in OUT/eval/, a finished one skipped. On 2 CPU cores this takes hours; run it
# under `nice` beside other work (and run a copy: bash reads a script as it goes, so editing this file under
# a running instance makes it read the wrong lines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN=${RUN_DIR:-runs/smollm2-v2}
BASE_STEPS=${BASE_STEPS:-3000}
EXTRA_STEPS=${EXTRA_STEPS:-800}
DATA=${DATA:-data/smollm2-135m-regenerated.jsonl}
mkdir -p "$RUN"
T=$($PY -m mfd_sglang prepare-target)
COMMON=(--target "$T" --data "$DATA" --batch-size 2 --anchors 32 --save-every 100 --dtype bfloat16 --resume)
$PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/dflash0" --regenerate-sets code,chat,math \
    --max-new-tokens 256 --steps "$BASE_STEPS" --layers 2 --draft-vocab-size 4096
$PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/dflash" --init-from "$RUN/dflash0" --num-modes 1 --steps "$EXTRA_STEPS"
$PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/mfd4" --init-from "$RUN/dflash0" --num-modes 4 --steps "$EXTRA_STEPS"
$PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/mfd8" --init-from "$RUN/dflash0" --num-modes 8 --steps "$EXTRA_STEPS"
# Evaluation: each new MFD drafter against the new single-mode one, and today's shipped pair as the
# baseline to beat, on the same prompts; 64 new tokens (the target's verify forwards are 60% of the time:
# 8 chat prompts x 128 tokens took 7.7 minutes on one core, so a unit of ~80 prompts x 64 tokens is
# expected near 40 core-minutes, not measured).
mkdir -p "$RUN/eval"
SHIPPED=drafters/smollm2-135m
for TEMP in 0 1; do
    for PAIR in mfd4 mfd8 shipped; do
        if [ "$PAIR" = shipped ]; then SINGLE=$SHIPPED/dflash MFD=$SHIPPED/mfd; else SINGLE=$RUN/dflash MFD=$RUN/$PAIR; fi
        for SET in code chat math; do
            OUT="$RUN/eval/$PAIR-T$TEMP-$SET.json"
            [ -f "$OUT" ] && continue
            $PY -m mfd_sglang eval --target "$T" --single "$SINGLE" --mfd "$MFD" --sets "$SET" \
                --budgets 8 16 32 64 --max-new-tokens 64 --dtype bfloat16 --temperature "$TEMP" --seed 0 \
                --batch-size 8 --out "$OUT.tmp" && mv "$OUT.tmp" "$OUT"
        done
    done
done
echo "done: $RUN/{dflash,mfd4,mfd8} and $RUN/eval/"
