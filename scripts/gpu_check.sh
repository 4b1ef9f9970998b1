#!/usr/bin/env bash
# The one device call: lay this plugin out as setup.py installs it (kernels/ and patches/ inside
# mfd_sglang, the SGLang plugin entry point) without building or fetching anything, next to the
# machine's own torch / triton / transformers and any wheels carried in .whl/ (e.g. SGLang's), then
# run the GPU check. The JSON goes to benchmarks/results/ and, when $OUT is set, to $OUT as well.
set -euo pipefail
cd "$(dirname "$0")/.."
site=/tmp/mfd-site
rm -rf "$site" && mkdir -p "$site/mfd_sglang-0.1.0.dist-info"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl
fi
cp -r mfd_sglang "$site/" && cp -r kernels "$site/mfd_sglang/kernels" && cp -r patches "$site/mfd_sglang/patches"
printf 'Metadata-Version: 2.1\nName: mfd-sglang\nVersion: 0.1.0\n' >"$site/mfd_sglang-0.1.0.dist-info/METADATA"
printf '[sglang.srt.plugins]\nmfd_sglang = mfd_sglang.plugin:register\n' \
    >"$site/mfd_sglang-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
machine=$(python3 -c 'import torch; print(torch.cuda.get_device_name().replace(" ", "_"))')
out="benchmarks/results/gpu-check-$(date +%F)-$machine.json"
status=0
python3 benchmarks/gpu_check.py --out "$out" "$@" || status=$?
if [ -n "${OUT:-}" ] && [ -f "$out" ]; then cp "$out" "$OUT/"; fi
exit $status
