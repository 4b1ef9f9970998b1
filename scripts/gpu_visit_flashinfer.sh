#!/usr/bin/env bash
# The FlashInfer visit to the GPU machine: SGLang on Hopper with --attention-backend flashinfer, the backend MFD
# switches to from fa3 (mfd_sglang/serving/launch/algorithms.py), with its JIT kernels compiled there first. Two device
# calls back to back on the same machine: it stays warm only 30 s after a call, and keeps the git-ignored outputs in
# the repository's copy there that a call does not carry, so call 1's work lives in .flashinfer-site/:
#
#   call 1, compile: install the pruned FlashInfer (scripts/kit.sh flashinfer) in .flashinfer-site/, compile the
#           JIT modules the servers need (scripts/flashinfer_modules.py: both pairs' shapes, sm_90a, on all cores,
#           in priority order, under one deadline), install each into the package as an AOT module, and check
#           SGLang's wrapper kinds against a torch reference with JIT disabled. Rows: $OUT/flashinfer-compile.json
#           (per module: seconds, seconds per object, .so size) and $OUT/flashinfer-wrappers.json.
#   call 2, servers: reuse .flashinfer-site/ and run `bash scripts/gpu_check.sh --part flashinfer` (plain / MFD /
#           MFD_D on FlashInfer with CUDA graphs, bf16: the make-tiny pair, then a Qwen3-4B-width random pair),
#           with FLASHINFER_DISABLE_JIT=1: a module call 1 did not build fails at once, naming itself, instead of
#           compiling for minutes inside a server start (MFD_FLASHINFER_ALLOW_JIT=1 lets it compile).
#
# Here, before the visit (needs the package registry):
#   bash scripts/gpu_check.sh prepare            # .device-kit and .gpu-check-pair
#   bash scripts/kit.sh flashinfer build         # .flashinfer-kit
#   bash scripts/gpu_visit_flashinfer.sh sizes   # what each call carries, against the device call's 64 MiB
#
# The device-tool calls, the second issued as soon as the first returns (a machine found cold again has lost
# call 1's work: `servers` says so and stops; the session's 15 device minutes hold a start, both calls and slack):
#   run(command="bash scripts/gpu_visit_flashinfer.sh compile", timeout_s=330,
#       carry=[".flashinfer-kit", ".device-kit/wheels/apache_tvm_ffi-0.1.11-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl"])
#   run(command="bash scripts/gpu_visit_flashinfer.sh servers", timeout_s=360,
#       carry=[".device-kit", ".gpu-check-pair"])
# Deadlines: compile MFD_FLASHINFER_COMPILE_SECONDS (default 300: compiles stop 20 s before it, then the wrapper
# checks); servers MFD_GPU_CHECK_SECONDS (default here 330). A compile cut by its deadline can be rerun: ninja keeps
# the objects it finished.
#
# What call 2 needs from gpu_check.sh: the `flashinfer` part, and MFD_FLASHINFER_SITE appended to the PYTHONPATH
# it exports (its servers inherit the environment, FLASHINFER_* included).
set -euo pipefail
cd "$(dirname "$0")/.."
# Absolute: the servers start in folders of their own.
SITE=$(pwd)/.flashinfer-site/site
JIT=$(pwd)/.flashinfer-site/jit  # FLASHINFER_WORKSPACE_BASE: generated sources and objects of call 1
TVM_FFI_WHEEL=.device-kit/wheels/apache_tvm_ffi-0.1.11-cp312-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl
CALL1_CARRY=(.flashinfer-kit "$TVM_FFI_WHEEL")
CALL2_CARRY=(.device-kit .gpu-check-pair)

say() { echo "[gpu_visit_flashinfer] $*"; }

compile() {
  local start; start=$(date +%s)
  local deadline=$((start + ${MFD_FLASHINFER_COMPILE_SECONDS:-300}))
  local out=${OUT:-benchmarks/results/flashinfer-compile-$(date +%F)}
  mkdir -p "$out"
  say "installing the FlashInfer kit in $SITE"
  if ! PYTHON=python3 bash scripts/kit.sh flashinfer install "$SITE" --tvm-ffi "$TVM_FFI_WHEEL" \
      >"$out/flashinfer-install.log" 2>&1; then
    tail -20 "$out/flashinfer-install.log"; say "ERROR: the kit install failed ($out/flashinfer-install.log)"; exit 1
  fi
  local status=0
  FLASHINFER_WORKSPACE_BASE=$JIT PYTHONPATH=$SITE PYTHONUNBUFFERED=1 \
    python3 scripts/flashinfer_modules.py build --out-dir "$out" --deadline "$deadline" 2>&1 \
    | tee "$out/flashinfer-compile.log" || status=$?
  cp "$out/flashinfer-compile.json" "$SITE/" || true  # for call 2, whose $OUT starts empty
  say "compile: exit $status after $(($(date +%s) - start)) s"
  return $status
}

servers() {
  if [ ! -f "$SITE/flashinfer-compile.json" ]; then
    say "ERROR: $SITE holds no compiled FlashInfer: this machine is not the one call 1 compiled on (it went cold"
    say "between the calls). Run call 1 (compile) again, then this call at once."
    exit 3
  fi
  if [ -n "${OUT:-}" ]; then cp "$SITE/flashinfer-compile.json" "$OUT/"; fi
  python3 - "$SITE" <<'PY'
import json, pathlib, sys
site = pathlib.Path(sys.argv[1])
rows = json.loads((site / "flashinfer-compile.json").read_text())["rows"]
for r in rows:
    print(f"[gpu_visit_flashinfer] call 1: {'ok     ' if r.get('ok') else 'MISSING'} {', '.join(r['roles'])}: {r['status']}")
PY
  if ! grep -q MFD_FLASHINFER_SITE scripts/gpu_check.sh; then
    say "ERROR: scripts/gpu_check.sh does not put MFD_FLASHINFER_SITE on its PYTHONPATH: its servers would not see"
    say "FlashInfer (and skip it as not installed)."
    exit 4
  fi
  export MFD_FLASHINFER_SITE=$SITE FLASHINFER_WORKSPACE_BASE=$JIT MFD_GPU_CHECK_SECONDS=${MFD_GPU_CHECK_SECONDS:-330}
  if [ "${MFD_FLASHINFER_ALLOW_JIT:-0}" != 1 ]; then export FLASHINFER_DISABLE_JIT=1; fi
  exec bash scripts/gpu_check.sh --part flashinfer
}

# Each call's carried bytes: the repository's working tree (tracked and untracked files that git does not
# ignore) plus its carry paths.
sizes() {
  python3 - "$1" "${#CALL1_CARRY[@]}" "${CALL1_CARRY[@]}" "${CALL2_CARRY[@]}" <<'PY'
import json, pathlib, subprocess, sys

as_json, n1, carry = sys.argv[1] == "--json", int(sys.argv[2]), sys.argv[3:]
tree = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], capture_output=True, check=True).stdout
repo = sum(p.stat().st_size for p in map(pathlib.Path, tree.decode().split("\0")) if p.name and p.is_file())


def size(path: str) -> int | None:
    p = pathlib.Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else None


calls = {}
for name, paths in (("compile", carry[:n1]), ("servers", carry[n1:])):
    sizes = {p: size(p) for p in paths}
    calls[name] = {"carry": paths, "carry_bytes": sizes, "repo_bytes": repo,
                   "missing": [p for p, s in sizes.items() if s is None],
                   "total_bytes": repo + sum(s or 0 for s in sizes.values())}
if as_json:
    print(json.dumps(calls))
else:
    for name, c in calls.items():
        parts = ", ".join(f"{p} {(s or 0) / 2**20:.1f}" for p, s in c["carry_bytes"].items())
        print(f"[gpu_visit_flashinfer] {name}: {c['total_bytes'] / 2**20:.1f} MiB of 64 (repository "
              f"{repo / 2**20:.1f}, {parts})" + (f"; MISSING {c['missing']}" if c["missing"] else ""))
PY
}

case ${1:-} in
  compile) compile ;;
  servers) servers ;;
  sizes) sizes "${2:-}" ;;
  *) echo "usage: gpu_visit_flashinfer.sh compile|servers|sizes [--json]" >&2; exit 2 ;;
esac
