#!/usr/bin/env bash
# The device kit: what a borrowed GPU machine lacks to run a real SGLang 0.5.23 server with this plugin next
# to its own torch 2.11 / triton 3.6 / transformers 5.17 (shared/notes/device-image.md). It is carried with
# the repository in one device call (`carry: [".device-kit"]`); nothing can be fetched there.
#
#   bash scripts/device_kit.sh [build]   build .device-kit/ here from pinned versions (idempotent), print its size
#   bash scripts/device_kit.sh install SITE [--compiled-wheels DIR]
#                                        lay the kit and this plugin out in SITE (a folder for PYTHONPATH); the
#                                        Python that runs it ($PYTHON, default python3) must match the wheels
#   bash scripts/device_kit.sh rehearsal-env
#                                        build (once, cached) the CPU rehearsal: a venv with the device image's
#                                        versions and the cp311 builds of the kit's compiled wheels; prints its folder
#
# .device-kit/ (git-ignored, at most 38 MiB):
#   sglang-0.5.23-trimmed.tar.gz   the sglang wheel (cp312) less scripts/device_kit_prune.txt; pure Python after
#                                  the prune, so the same archive serves cp312 (device) and cp311 (rehearsal)
#   wheels/*.whl                   what SGLang imports that the image lacks: py3-none-any wheels and cp312
#                                  manylinux builds of the compiled ones (KIT_COMPILED below)
#   kit.json                       pins, sha256 and size of every file, the prune list's sha256
# The `sgl_kernel` stand-in is not copied: it ships inside the plugin (mfd_sglang/cpu/sgl_kernel_standin) and
# `install` lays it out with the plugin. FlashInfer is not in the kit: flashinfer-python compiles its kernels
# with nvcc at first use (minutes per kernel, more than one device call) and its prebuilt cubins are hundreds
# of MB; the GPU servers use --attention-backend triton.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
KIT=${MFD_DEVICE_KIT:-$REPO/.device-kit}
PRUNE=$REPO/scripts/device_kit_prune.txt
LIMIT_MIB=38
SGLANG=sglang==0.5.23
# Pure-Python wheels SGLang's server imports that the device image lacks (found by tracing the modules real
# plain / MFD / MFD_D servers import; the CPU rehearsal proves the list complete).
KIT_PURE=(annotated-types==0.8.0 compressed-tensors==0.18.0 dill==0.4.1 distro==1.9.0 fastapi==0.165.0
  gguf==0.19.0 ipython==9.18.1 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3
  openai==2.8.0 opentelemetry-api==1.45.2 partial-json-parser==0.2.1.1.post7 pydantic==2.14.4
  python-multipart==0.0.34 referencing==0.37.0 sniffio==1.3.1 soundfile==0.13.1 starlette==1.10.0
  traitlets==5.16.1 typing-inspection==0.4.5 uvicorn==0.54.0)
# Compiled ones: cp312 manylinux builds in the kit; the rehearsal installs the cp311 builds of the same versions.
KIT_COMPILED=(apache-tvm-ffi==0.1.11 cffi==2.1.1 msgspec==0.23.0 orjson==3.13.0 pybase64==1.5.1
  pydantic-core==2.50.5 pyzmq==27.3.0 rpds-py==2026.9.1 setproctitle==1.3.8 xgrammar==0.2.7)
# The device image's versions (shared/notes/device-image.md) of what SGLang imports, for the rehearsal only.
# numpy: the image has 2.5.2, which needs Python >= 3.12; this machine's Python is 3.11, so 2.3.5 stands in (not
# 2.4: numpy >= 2.4 refuses int() of a 1-element array, which Triton 3.6's interpreter does for a loop bound read
# from memory, so the rehearsal could not run this project's Triton kernels on the image's Triton).
IMAGE_TORCH=(torch==2.11.0 triton==3.6.0 torchvision==0.26.0)
IMAGE_REST=(transformers==5.17.0 tokenizers==0.23.2 safetensors==0.8.0 huggingface-hub==1.33.0
  accelerate==1.15.0 numpy==2.3.5 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7
  anyio==4.16.0 attrs==26.1.0 certifi==2026.10.19.post1 charset-normalizer==3.5.3 click==8.5.1 einops==0.8.2
  filelock==4.3.1 frozenlist==1.8.0 fsspec==2026.9.0 h11==0.16.0 httpcore==1.0.9 httpx==0.28.1 idna==3.20
  jinja2==3.1.6 markupsafe==3.0.4 mpmath==1.3.0 multidict==7.2.1 networkx==3.6.1 packaging==26.4 pillow==13.0.0
  propcache==0.5.4 psutil==7.2.2 pygments==2.21.0 pyyaml==6.0.4 regex==2026.11.19 requests==2.34.2 rich==15.0.0
  sentencepiece==0.2.1 sympy==1.14.0 tqdm==4.70.1 typing-extensions==4.16.0 urllib3==2.8.0 uvloop==0.23.0
  yarl==1.25.1)
IMAGE_TEST_TOOLS=(pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1)
PLATFORM_FLAGS=(--python-version 3.12 --implementation cp --only-binary=:all: --platform manylinux2014_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64
  --platform manylinux_2_34_x86_64)
PIP=(-m pip --disable-pip-version-check -q)

say() { echo "[device_kit] $*"; }
die() { echo "[device_kit] ERROR: $*" >&2; exit 1; }

# What the kit is built from: a kit.json with another key is rebuilt.
kit_key() { { cat "$PRUNE"; printf '%s\n' "$SGLANG" "${KIT_PURE[@]}" "${KIT_COMPILED[@]}" "${PLATFORM_FLAGS[@]}"; } | sha256sum | cut -c1-16; }

kit_size() { du -sb "$KIT" | cut -f1; }

print_size() {
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"[device_kit] {sys.argv[1].rsplit('/',2)[-2]}: {m['total_bytes']/2**20:.1f} MiB in {len(m['files'])} files (limit {m['limit_mib']} MiB; sglang {m['sglang_files_kept']} files kept, {m['sglang_files_pruned']} pruned)\")" "$KIT/kit.json"
}

# Every SGLang internal a hook in patches/ wraps must be in the trimmed sglang ($1, its archive): on the device
# SGLang would only log a hook it cannot apply (and the plugin refuse to start).
check_hook_targets() {
  local missing
  missing=$(python3 "$REPO/scripts/hook_targets.py" "$1" 2>&1) \
    || die "hook targets missing from the trimmed sglang (pruned by $(basename "$PRUNE")?): $missing"
}

build() {
  local key; key=$(kit_key)
  if [ -f "$KIT/kit.json" ] && python3 - "$KIT" "$key" <<'PY'
import hashlib, json, pathlib, sys
kit, key = pathlib.Path(sys.argv[1]), sys.argv[2]
m = json.loads((kit / "kit.json").read_text())
ok = m.get("key") == key and all(
    (kit / f["path"]).is_file() and hashlib.sha256((kit / f["path"]).read_bytes()).hexdigest() == f["sha256"]
    for f in m["files"])
sys.exit(0 if ok else 1)
PY
  then
    check_hook_targets "$KIT"/sglang-*-trimmed.tar.gz
    say "$KIT is up to date (key $key)"; print_size; return
  fi
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/kit/wheels" "$tmp/sglang"
  say "downloading $SGLANG (cp312) and ${#KIT_PURE[@]} + ${#KIT_COMPILED[@]} wheels (cp312 manylinux / py3-none-any)"
  python3 "${PIP[@]}" download --no-deps "${PLATFORM_FLAGS[@]}" -d "$tmp/sglang" "$SGLANG"
  python3 "${PIP[@]}" download --no-deps "${PLATFORM_FLAGS[@]}" -d "$tmp/kit/wheels" "${KIT_PURE[@]}" "${KIT_COMPILED[@]}"
  say "trimming sglang with $(basename "$PRUNE")"
  python3 - "$tmp" "$PRUNE" "$key" "$LIMIT_MIB" "$SGLANG" "${KIT_PURE[*]}" "${KIT_COMPILED[*]}" <<'PY'
import fnmatch, glob, gzip, hashlib, io, json, pathlib, sys, tarfile, zipfile

tmp, prune_path, key, limit_mib, sglang_pin, pure, compiled = sys.argv[1:8]
tmp = pathlib.Path(tmp)
wheel = pathlib.Path(glob.glob(str(tmp / "sglang" / "sglang-*.whl"))[0])
rules = []  # (keep?, pattern)
for line in pathlib.Path(prune_path).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        rules.append((line.startswith("!"), line.lstrip("!")))


def matches(pattern: str, path: str) -> bool:
    if pattern.endswith("/"):
        return path.startswith(pattern)
    return fnmatch.fnmatchcase(path, pattern)


used = {p: 0 for keep, p in rules if not keep}
kept, pruned = [], 0
with zipfile.ZipFile(wheel) as zf:
    for info in sorted(zf.infolist(), key=lambda i: i.filename):
        name = info.filename
        if name.endswith("/"):
            continue
        removals = [p for keep, p in rules if not keep and matches(p, name)]
        for p in removals:
            used[p] += 1
        if removals and not any(keep and matches(p, name) for keep, p in rules):
            pruned += 1
            continue
        kept.append((name, zf.read(name), info.external_attr >> 16))
unused = [p for p, n in used.items() if n == 0]
if unused:
    sys.exit(f"[device_kit] ERROR: prune patterns that match nothing in {wheel.name}: {unused}")
if any(name.endswith(".so") for name, _, _ in kept):
    sys.exit("[device_kit] ERROR: compiled files left in the trimmed sglang (it must stay pure Python): "
             + ", ".join(n for n, _, _ in kept if n.endswith(".so")))
# A reproducible archive: sorted entries, fixed times, owners and modes, gzip without a timestamp.
out = tmp / "kit" / f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}-trimmed.tar.gz"
raw = io.BytesIO()
with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
    for name, data, _mode in kept:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = len(data), 0, 0o644, 0, 0, "", ""
        tar.addfile(ti, io.BytesIO(data))
with open(out, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0, compresslevel=9) as gz:
    gz.write(raw.getvalue())

kit = tmp / "kit"
files = []
for p in sorted(x for x in kit.rglob("*") if x.is_file()):
    files.append({"path": str(p.relative_to(kit)), "bytes": p.stat().st_size,
                  "sha256": hashlib.sha256(p.read_bytes()).hexdigest()})
total = sum(f["bytes"] for f in files)
manifest = {
    "key": key, "limit_mib": int(limit_mib), "total_bytes": total, "sglang": sglang_pin,
    "sglang_wheel": wheel.name, "sglang_wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
    "sglang_files_kept": len(kept), "sglang_files_pruned": pruned,
    "prune_list_sha256": hashlib.sha256(pathlib.Path(prune_path).read_bytes()).hexdigest(),
    "pure_wheels": pure.split(), "compiled_wheels_cp312": compiled.split(), "files": files,
}
(kit / "kit.json").write_text(json.dumps(manifest, indent=1) + "\n")
if total > int(limit_mib) * 2**20:
    sys.exit(f"[device_kit] ERROR: the kit is {total / 2**20:.1f} MiB, over its {limit_mib} MiB")
PY
  check_hook_targets "$tmp"/kit/sglang-*-trimmed.tar.gz
  rm -rf "$KIT.old"
  if [ -e "$KIT" ]; then mv "$KIT" "$KIT.old"; fi
  mv "$tmp/kit" "$KIT" && rm -rf "$KIT.old"
  say "built $KIT (key $key)"; print_size
}

# SITE gets: the kit's wheels (pip --target, no index), the trimmed sglang, and the plugin laid out as
# setup.py installs it (kernels/ and patches/ inside mfd_sglang, the sglang.srt.plugins entry point) with its
# sgl_kernel stand-in; nothing is built or fetched.
install() {
  local site=$1; shift
  local compiled_dir=""
  while [ $# -gt 0 ]; do
    case $1 in
      --compiled-wheels) compiled_dir=$2; shift 2 ;;
      *) die "install: unknown argument $1" ;;
    esac
  done
  local py=${PYTHON:-python3}
  rm -rf "$site" && mkdir -p "$site/mfd_sglang-0.1.0.dist-info"
  if [ -f "$KIT/kit.json" ]; then
    local wheels=()
    mapfile -t wheels < <("$py" - "$KIT" "$compiled_dir" <<'PY'
import json, pathlib, re, sys
kit, compiled_dir = pathlib.Path(sys.argv[1]), sys.argv[2]
m = json.loads((kit / "kit.json").read_text())
norm = lambda s: re.sub(r"[-_.]+", "_", s).lower()
compiled = {norm(p.split("==")[0]): p.split("==")[1] for p in m["compiled_wheels_cp312"]}
for f in m["files"]:
    name = f["path"]
    if not name.startswith("wheels/"):
        continue
    dist, version = name.split("/")[1].split("-")[:2]
    if compiled_dir and norm(dist) in compiled:
        # the same version built for this Python (the rehearsal's cp311)
        found = sorted(pathlib.Path(compiled_dir).glob(f"{dist}-{version}-*.whl"))
        if not found:
            sys.exit(f"[device_kit] ERROR: no {dist}=={version} wheel in {compiled_dir}")
        print(found[0])
    else:
        print(kit / name)
PY
)
    "$py" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' \
      "$KIT"/sglang-*-trimmed.tar.gz "$site"
  else
    say "no $KIT/kit.json: laying out the plugin only (SGLang servers will not start; build the kit with: bash scripts/device_kit.sh)"
  fi
  cp -r "$REPO/mfd_sglang" "$site/" && cp -r "$REPO/kernels" "$site/mfd_sglang/kernels" && cp -r "$REPO/patches" "$site/mfd_sglang/patches"
  find "$site/mfd_sglang" -name __pycache__ -prune -exec rm -rf {} +
  printf 'Metadata-Version: 2.1\nName: mfd-sglang\nVersion: 0.1.0\n' >"$site/mfd_sglang-0.1.0.dist-info/METADATA"
  printf '[sglang.srt.plugins]\nmfd_sglang = mfd_sglang.plugin:register\n' >"$site/mfd_sglang-0.1.0.dist-info/entry_points.txt"
}

# The rehearsal's own environment, cached by its pins: torch 2.11.0 is PyPI's build (CUDA 13.0, as on the
# device; it runs on CPU but needs its nvidia-* libraries to load), then the image's other packages without
# their dependencies, then the cp311 builds of the kit's compiled wheels (not installed: `install` puts them
# in the site with the rest of the kit).
rehearsal_env() {
  local key; key=$({ printf '%s\n' "${IMAGE_TORCH[@]}" "${IMAGE_REST[@]}" "${KIT_COMPILED[@]}"; python3 -V; } | sha256sum | cut -c1-16)
  local dir=${MFD_SGLANG_CACHE:-$HOME/.cache/mfd-sglang}/device-rehearsal-$key
  if [ ! -f "$dir/.complete" ]; then
    say "building the rehearsal environment in $dir (torch 2.11.0 and its CUDA libraries: a few GB, once)" >&2
    rm -rf "$dir" && mkdir -p "$dir"
    python3 -m venv "$dir/venv"
    local vpy=$dir/venv/bin/python
    printf '%s\n' "${IMAGE_REST[@]}" >"$dir/constraints.txt"
    "$vpy" "${PIP[@]}" install -c "$dir/constraints.txt" "${IMAGE_TORCH[@]}" >&2
    "$vpy" "${PIP[@]}" install --no-deps "${IMAGE_REST[@]}" >&2
    "$vpy" "${PIP[@]}" download --no-deps --only-binary=:all: -d "$dir/cp311" "${KIT_COMPILED[@]}" >&2
    touch "$dir/.complete"
  fi
  # pytest, which the image has too: the GPU check runs its CUDA-graph tests with it
  if [ ! -f "$dir/.test-tools" ]; then
    "$dir/venv/bin/python" "${PIP[@]}" install --no-deps "${IMAGE_TEST_TOOLS[@]}" >&2
    touch "$dir/.test-tools"
  fi
  echo "$dir"
}

case ${1:-build} in
  build) build ;;
  install) shift; [ $# -ge 1 ] || die "usage: device_kit.sh install SITE [--compiled-wheels DIR]"; install "$@" ;;
  rehearsal-env) rehearsal_env ;;
  -h|--help) sed -n '2,25p' "$0" ;;
  *) die "unknown command $1 (build, install, rehearsal-env)" ;;
esac
