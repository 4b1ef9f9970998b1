#!/usr/bin/env bash
# The FlashInfer kit: flashinfer-python 0.7.2 (what SGLang 0.5.23 pins) pruned to what a dense bf16 target served
# with --attention-backend flashinfer needs, for the FlashInfer visit to the GPU machine
# (scripts/gpu_visit_flashinfer.sh). The wheel is 62 MB (458 MB unpacked: kernel sources for every model family);
# the kit keeps the Python modules a server reaches and the JIT sources and header trees of the modules
# scripts/flashinfer_modules.py compiles (scripts/flashinfer_kit_keep.txt says what and why).
#
#   bash scripts/flashinfer_kit.sh [build]      build .flashinfer-kit/ here from the pin (idempotent), print its size
#   bash scripts/flashinfer_kit.sh install SITE [--tvm-ffi WHEEL]
#                                               lay the kit out in SITE (a folder for PYTHONPATH, next to the device
#                                               kit's site); --tvm-ffi also installs that apache-tvm-ffi wheel there
#                                               (the device kit carries it; $PYTHON, default python3, must match it)
#   bash scripts/flashinfer_kit.sh rehearsal-extras
#                                               build (once, cached) a folder with the device image's packages that
#                                               `import flashinfer` needs and the device kit's rehearsal venv lacks
#                                               (pynvml, tabulate); prints its folder
#
# .flashinfer-kit/ (git-ignored, at most 14 MiB):
#   flashinfer_python-0.7.2-pruned.tar.gz   the pruned package and its dist-info (SGLang checks the version)
#   kit.json                                 pins, the wheel's sha256 and size, the keep list's sha256, what was kept
#                                            and dropped, and the sha256 and size of every file
# Needed beside it: apache-tvm-ffi (in the device kit) and, from the device image, torch, pynvml (nvidia-ml-py),
# tabulate, jinja2, filelock, packaging, requests, numpy, einops, click, tqdm, cuda-bindings, ninja and nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
KIT=${MFD_FLASHINFER_KIT:-$REPO/.flashinfer-kit}
KEEP=$REPO/scripts/flashinfer_kit_keep.txt
LIMIT_MIB=14
FLASHINFER=flashinfer-python==0.7.2
# Image packages `import flashinfer` needs that the device kit's rehearsal venv lacks (the image has them; its
# versions are not recorded, so these are current releases).
REHEARSAL_EXTRAS=(nvidia-ml-py==13.615.71 tabulate==0.10.0)
PIP=(-m pip --disable-pip-version-check -q)

say() { echo "[flashinfer_kit] $*"; }
die() { echo "[flashinfer_kit] ERROR: $*" >&2; exit 1; }

kit_key() { { cat "$KEEP" "$REPO/scripts/flashinfer_kit.sh"; echo "$FLASHINFER"; } | sha256sum | cut -c1-16; }

print_size() {
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"[flashinfer_kit] .flashinfer-kit: {m['total_bytes']/2**20:.1f} MiB (limit {m['limit_mib']} MiB; wheel {m['wheel_bytes']/2**20:.1f} MiB; kept {m['kept_files']} files, {m['kept_bytes']/2**20:.1f} MiB unpacked, of which {m['python_modules']} Python modules; dropped {m['dropped_files']} files, {m['dropped_bytes']/2**20:.1f} MiB)\")" "$KIT/kit.json"
}

build() {
  local key; key=$(kit_key)
  if [ -f "$KIT/kit.json" ] && python3 - "$KIT" "$key" <<'PY'
import hashlib, json, pathlib, sys
kit, key = pathlib.Path(sys.argv[1]), sys.argv[2]
m = json.loads((kit / "kit.json").read_text())
sys.exit(0 if m.get("key") == key and all(
    (kit / f["path"]).is_file() and hashlib.sha256((kit / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    for f in m["files"]) else 1)
PY
  then
    say "$KIT is up to date (key $key)"; print_size; return
  fi
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/kit" "$tmp/wheel"
  say "downloading $FLASHINFER"
  python3 "${PIP[@]}" download --no-deps --only-binary=:all: -d "$tmp/wheel" "$FLASHINFER"
  say "pruning with $(basename "$KEEP")"
  python3 - "$tmp" "$KEEP" "$key" "$LIMIT_MIB" "$FLASHINFER" <<'PY'
import ast, fnmatch, glob, gzip, hashlib, io, json, pathlib, sys, tarfile, zipfile

tmp, keep_path, key, limit_mib, pin = sys.argv[1:6]
tmp = pathlib.Path(tmp)
wheel = pathlib.Path(glob.glob(str(tmp / "wheel" / "flashinfer_python-*.whl"))[0])
roots, patterns = [], []
for line in pathlib.Path(keep_path).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line.startswith("module "):
        roots.append(line.split()[1])
    elif line:
        patterns.append(line)

zf = zipfile.ZipFile(wheel)
names = sorted(n for n in zf.namelist() if not n.endswith("/"))


def module_file(module: str) -> tuple[str | None, bool]:
    """(path in the wheel, is a package) of a module, or (None, False) when it is not in the wheel."""
    base = module.replace(".", "/")
    for path, is_pkg in ((f"{base}/__init__.py", True), (f"{base}.py", False)):
        if path in names_set:
            return path, is_pkg
    return None, False


def imported(module: str) -> set[str]:
    """Every flashinfer module `module` may import: top-level, in functions and in try blocks, each with its
    parent packages (a `from X import Y` counts X.Y when that is a module)."""
    path, is_pkg = module_file(module)
    found = set()
    for node in ast.walk(ast.parse(zf.read(path), filename=path)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_pkg else module.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found |= {target} | {f"{target}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    out = set()
    for name in found:
        parts = name.split(".")
        if parts[0] != "flashinfer":
            continue
        out |= {".".join(parts[:i]) for i in range(1, len(parts) + 1) if module_file(".".join(parts[:i]))[0]}
    return out


names_set = set(names)
missing_roots = [r for r in roots if module_file(r)[0] is None]
if missing_roots:
    sys.exit(f"[flashinfer_kit] ERROR: modules in the keep list that are not in {wheel.name}: {missing_roots}")
modules, todo = set(), list(roots)
while todo:
    module = todo.pop()
    if module not in modules:
        modules.add(module)
        todo.extend(imported(module) - modules)
keep = {module_file(m)[0] for m in modules}


def matches(pattern: str, path: str) -> bool:
    return path.startswith(pattern) if pattern.endswith("/") else fnmatch.fnmatchcase(path, pattern)


used = {p: 0 for p in patterns}
for name in names:
    for p in patterns:
        if matches(p, name):
            used[p] += 1
            keep.add(name)
unused = [p for p, n in used.items() if n == 0]
if unused:
    sys.exit(f"[flashinfer_kit] ERROR: keep patterns that match nothing in {wheel.name}: {unused}")

# A reproducible archive: sorted entries, fixed times, owners and modes, gzip without a timestamp.
out = tmp / "kit" / f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}-pruned.tar.gz"
raw = io.BytesIO()
kept_bytes = 0
with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name in sorted(keep):
        data = zf.read(name)
        kept_bytes += len(data)
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
        tar.addfile(ti, io.BytesIO(data))
with open(out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
    gz.write(raw.getvalue())

kit = tmp / "kit"
files = [{"path": str(p.relative_to(kit)), "bytes": p.stat().st_size,
          "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in sorted(kit.rglob("*")) if p.is_file()]
total = sum(f["bytes"] for f in files)
manifest = {
    "key": key, "limit_mib": int(limit_mib), "total_bytes": total, "flashinfer": pin, "wheel": wheel.name,
    "wheel_bytes": wheel.stat().st_size, "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
    "keep_list_sha256": hashlib.sha256(pathlib.Path(keep_path).read_bytes()).hexdigest(),
    "python_modules": len(modules), "kept_files": len(keep), "kept_bytes": kept_bytes,
    "dropped_files": len(names) - len(keep),
    "dropped_bytes": sum(zf.getinfo(n).file_size for n in names) - kept_bytes,
    "needs_from_device_kit": ["apache-tvm-ffi==0.1.11"], "files": files,
}
(kit / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
if total > int(limit_mib) * 2**20:
    sys.exit(f"[flashinfer_kit] ERROR: the kit is {total / 2**20:.1f} MiB, over its {limit_mib} MiB")
PY
  rm -rf "$KIT.old"
  if [ -e "$KIT" ]; then mv "$KIT" "$KIT.old"; fi
  mv "$tmp/kit" "$KIT" && rm -rf "$KIT.old"
  say "built $KIT (key $key)"; print_size
}

install() {
  local site=$1; shift
  local tvm_ffi=""
  while [ $# -gt 0 ]; do
    case $1 in
      --tvm-ffi) tvm_ffi=$2; shift 2 ;;
      *) die "install: unknown argument $1" ;;
    esac
  done
  [ -f "$KIT/kit.json" ] || die "no $KIT/kit.json: build the kit first (bash scripts/flashinfer_kit.sh)"
  local py=${PYTHON:-python3}
  rm -rf "$site" && mkdir -p "$site"
  "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
    "$KIT"/flashinfer_python-*-pruned.tar.gz "$site"
  if [ -n "$tvm_ffi" ]; then
    "$py" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --target "$site" "$tvm_ffi"
  fi
}

rehearsal_extras() {
  local key; key=$(printf '%s\n' "${REHEARSAL_EXTRAS[@]}" | sha256sum | cut -c1-16)
  local dir=${MFD_SGLANG_CACHE:-$HOME/.cache/mfd-sglang}/flashinfer-rehearsal-extras-$key
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    python3 "${PIP[@]}" install --no-deps --no-compile --target "$dir/site" "${REHEARSAL_EXTRAS[@]}" >&2
    touch "$dir/.complete"
  fi
  echo "$dir/site"
}

case ${1:-build} in
  build) build ;;
  install) shift; [ $# -ge 1 ] || die "usage: flashinfer_kit.sh install SITE [--tvm-ffi WHEEL]"; install "$@" ;;
  rehearsal-extras) rehearsal_extras ;;
  -h|--help) sed -n '2,26p' "$REPO/scripts/flashinfer_kit.sh" ;;
  *) die "unknown command $1 (build, install, rehearsal-extras)" ;;
esac
