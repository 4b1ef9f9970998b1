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
# three sets (1005). A 2-layer single-mode base, then the same extra steps for a single-mode drafter, an
# MFD drafter with K = 4 and one with K = 8, all from that base, so the comparison is fair (same data,
# same steps). Then the acceptance evaluation of each MFD drafter against the single-mode one, and of
# the shipped pair (drafters/smollm2-135m), on ALL held-out prompts (239: 32 code, 14 chat, 193 math),
# T = 0 and T = 1, B = 8..64: one JSON per (pair, T, set) in OUT/eval/, a finished one skipped. The
# evaluation replays every method against the target's own continuation (`mfd_sglang eval`), 5-10
# core-seconds per prompt and pair; run it under `nice` beside other work (and run a copy: bash reads a
# script as it goes, so editing this file under a running instance makes it read the wrong lines). JOBS
# (default 2) stages or units run at once.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RUN=${RUN_DIR:-runs/smollm2-v2}
BASE_STEPS=${BASE_STEPS:-3000}
EXTRA_STEPS=${EXTRA_STEPS:-800}
JOBS=${JOBS:-2}
DATA=${DATA:-data/smollm2-135m-regenerated.jsonl}
mkdir -p "$RUN"
T=$($PY -m mfd_sglang prepare-target)
COMMON=(--target "$T" --data "$DATA" --batch-size 2 --anchors 32 --save-every 100 --dtype bfloat16 --resume)
$PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/dflash0" --regenerate-sets code,chat,math \
    --max-new-tokens 256 --steps "$BASE_STEPS" --layers 2 --draft-vocab-size 4096
# The extra-step stages and the evaluation units run JOBS at a time, one thread each (two single-thread
# processes use 2 cores better than one process with two threads).
pids=()
launch() {
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do sleep 5; done
    OMP_NUM_THREADS=1 "$@" &
    pids+=($!)
}
finish() {  # wait for every launched job; a failed one stops the script (set -e)
    for pid in "${pids[@]}"; do wait "$pid"; done
    pids=()
}
for STAGE in dflash:1 mfd4:4 mfd8:8; do
    launch $PY -m mfd_sglang train "${COMMON[@]}" --out "$RUN/${STAGE%:*}" --init-from "$RUN/dflash0" \
        --num-modes "${STAGE#*:}" --steps "$EXTRA_STEPS"
done
finish
# Evaluation: each new MFD drafter against the new single-mode one, and the shipped pair as the
# baseline to beat, on the same prompts, T = 1 first; 64 new tokens. EVAL_LIMIT=N evaluates the first N
# held-out prompts of each set (into eval-lN/).
EVAL_DIR=$RUN/eval${EVAL_LIMIT:+-l$EVAL_LIMIT}
mkdir -p "$EVAL_DIR"
SHIPPED=drafters/smollm2-135m
for TEMP in 1 0; do
    for PAIR in mfd4 mfd8 shipped; do
        if [ "$PAIR" = shipped ]; then SINGLE=$SHIPPED/dflash MFD=$SHIPPED/mfd; else SINGLE=$RUN/dflash MFD=$RUN/$PAIR; fi
        for SET in code chat math; do
            OUT="$EVAL_DIR/$PAIR-T$TEMP-$SET.json"
            [ -f "$OUT" ] && continue
            launch bash -c 'out=$1; shift; "$@" && mv "$out.tmp" "$out"' unit "$OUT" $PY -m mfd_sglang eval --target "$T" \
                --single "$SINGLE" --mfd "$MFD" --sets "$SET" ${EVAL_LIMIT:+--limit "$EVAL_LIMIT"} \
                --budgets 8 16 32 64 --max-new-tokens 64 --dtype bfloat16 --temperature "$TEMP" --seed 0 \
                --out "$OUT.tmp"
        done
    done
done
finish
echo "done: $RUN/{dflash,mfd4,mfd8} and $EVAL_DIR/"
