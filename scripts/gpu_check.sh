#!/usr/bin/env bash
# The GPU check: what proves the GPU path, in one device call (benchmarks/gpu_check.py says what runs).
#
#   bash scripts/gpu_check.sh prepare         here, before the call: the device kit (.device-kit) and the tiny
#                                             pair (.gpu-check-pair, make-tiny seed 0, K = 4) with the ledger's
#                                             round_cost predictions in it; prints the carry size
#   bash scripts/gpu_check.sh [--part 1|2|flashinfer]
#                                             on the GPU machine, as ONE command with carry
#                                             [".device-kit", ".gpu-check-pair"] and timeout_s 560
#   bash scripts/gpu_check.sh --cpu           the rehearsal: the same call on a CPU (tests/test_device_kit.py runs it
#                                             in an environment with the device image's versions)
#
# One deadline for the whole call, set first: MFD_GPU_CHECK_SECONDS (default 530) from the start of this script;
# the kit install, every section and every server start check it. fp32 is IEEE fp32 (TRITON_F32_DEFAULT=ieee for
# every process: Triton's default on NVIDIA GPUs is TF32). Results go to $OUT (the folder the device call returns;
# else benchmarks/results/gpu-check-<date>-<machine>/) as they finish: report.json, rows.jsonl, server-logs.txt,
# console.log, kit-install.log. A kit install that fails is recorded, and the sections that need no SGLang still run.
# Exit status: 0 when every section of the part ran and every row passed or was skipped for a structural reason
# (needs CUDA on a CPU run; FlashInfer where it is not installed).
set -uo pipefail
start=$(date +%s)
cd "$(dirname "$0")/.."
export MFD_GPU_CHECK_DEADLINE=$((start + ${MFD_GPU_CHECK_SECONDS:-530}))
export TRITON_F32_DEFAULT=ieee PYTHONUNBUFFERED=1
PAIR=.gpu-check-pair

if [ "${1:-}" = prepare ]; then
  set -e
  bash scripts/kit.sh device build
  py=.venv/bin/python; [ -x "$py" ] || py=python3
  # rebuilt when make-tiny changes (its bytes are fixed per seed and source)
  made_by="$(sha256sum mfd_sglang/lab/tiny.py | cut -c1-16) seed 0 K 4"
  # (MFD_SGLANG_TINY_PAIR: one already built with these settings, copied instead, as the tests' tiny_pair)
  if [ "$(cat "$PAIR/made-by" 2>/dev/null)" != "$made_by" ]; then
    rm -rf "$PAIR"
    if [ -n "${MFD_SGLANG_TINY_PAIR:-}" ]; then cp -r "$MFD_SGLANG_TINY_PAIR" "$PAIR"
    else "$py" -m mfd_sglang make-tiny "$PAIR" --seed 0 --num-modes 4; fi
    echo "$made_by" >"$PAIR/made-by"
  fi
  # what part 1's round_cost rows are set beside: the GPU cost ledger's prediction of this checkout's round
  "$py" -m mfd_sglang gpu-ledger --round-cost-predictions "$PAIR/round-cost-predictions.json" --batch-sizes 1 32 \
    --shapes qwen3-4b
  "$py" benchmarks/gpu_check.py --carry-size .device-kit "$PAIR"
  exit 0
fi

args=() cpu=0
for a in "$@"; do
  args+=("$a")
  if [ "$a" = --cpu ]; then cpu=1; fi
done
machine=cpu
if [ $cpu = 0 ]; then
  machine=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr ' ' '_')
  machine=${machine:-unknown-gpu}
else
  export TRITON_INTERPRET=1  # Triton kernels run under the interpreter on a CPU
fi
out=${OUT:-benchmarks/results/gpu-check-$(date +%F)-$machine}
mkdir -p "$out"

# The kit and this plugin laid out as installed (no editable install exists there), next to the machine's own
# torch / triton / transformers. MFD_DEVICE_KIT_COMPILED_WHEELS: the rehearsal's cp311 builds of the kit's
# compiled wheels.
site=${MFD_GPU_CHECK_SITE:-/tmp/mfd-site}
compiled=()
if [ -n "${MFD_DEVICE_KIT_COMPILED_WHEELS:-}" ]; then compiled=(--compiled-wheels "$MFD_DEVICE_KIT_COMPILED_WHEELS"); fi
kit_status=0
timeout $((MFD_GPU_CHECK_DEADLINE - $(date +%s))) bash scripts/kit.sh device install "$site" "${compiled[@]}" \
  >"$out/kit-install.log" 2>&1 || kit_status=$?
export MFD_GPU_CHECK_KIT_STATUS=$kit_status
export PYTHONPATH="$site:$site/mfd_sglang/cpu/sgl_kernel_standin${MFD_FLASHINFER_SITE:+:$MFD_FLASHINFER_SITE}"
# Nothing below imports from the repository's source folder: scripts run from benchmarks/ (their own folder
# comes first on sys.path), `python -m` does not put the working directory on sys.path, and servers start in a
# folder of their own.
export PYTHONSAFEPATH=1
python3 benchmarks/gpu_check.py --out-dir "$out" --pair "$PAIR" "${args[@]}" 2>&1 | tee "$out/console.log"
exit "${PIPESTATUS[0]}"
