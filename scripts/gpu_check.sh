#!/usr/bin/env bash
# The one device call (run with `carry: [".device-kit"]`; build the kit first here: bash scripts/device_kit.sh).
# Lays out the device kit (SGLang 0.5.23 trimmed, the wheels the image lacks) and this plugin, with its
# `sgl_kernel` stand-in, in /tmp/mfd-site next to the machine's own torch / triton / transformers, without
# building or fetching anything; then runs benchmarks/gpu_check.py. The JSON is written straight into $OUT
# when set (so a call cut short still returns what finished) and copied to benchmarks/results/.
# Exit status: gpu_check's (non-zero when any correctness item failed, errored or was skipped).
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/mfd-site
bash scripts/device_kit.sh install "$site"
export PYTHONPATH="$site:$site/mfd_sglang/cpu/sgl_kernel_standin${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
machine=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu")')
name="gpu-check-$(date +%F)-$machine.json"
out=benchmarks/results/$name
if [ -n "${OUT:-}" ]; then out=$OUT/$name; fi
mkdir -p benchmarks/results
status=0
# No section starts after 7 minutes: the call must end within 9 (a device command may run 10).
python3 benchmarks/gpu_check.py --out "$out" --time-budget 420 "$@" || status=$?
if [ "$out" != "benchmarks/results/$name" ] && [ -f "$out" ]; then cp "$out" benchmarks/results/; fi
exit $status
