#!/usr/bin/env bash
# The two kits a borrowed GPU machine gets with the repository in its one call (`carry`; nothing can be fetched
# there), built here from pins: idempotent (a kit whose kit.json has the same key and file hashes is kept),
# packed reproducibly, each file's sha256 and size in its kit.json, within a size limit (scripts/kit_pack.py).
#
#   bash scripts/kit.sh device [build]     build .device-kit/ here from pinned versions, print its size
#   bash scripts/kit.sh device install SITE [--compiled-wheels DIR]
#                                          lay the kit and this plugin out in SITE (a folder for PYTHONPATH); the
#                                          Python that runs it ($PYTHON, default python3) must match the wheels
#   bash scripts/kit.sh device rehearsal-env
#                                          build (once, cached) the CPU rehearsal: a venv with the device image's
#                                          versions and the cp311 builds of the kit's compiled wheels; prints its folder
#   bash scripts/kit.sh flashinfer [build] build .flashinfer-kit/ here from the pin, print its size
#   bash scripts/kit.sh flashinfer install SITE [--tvm-ffi WHEEL]
#                                          lay the kit out in SITE (a folder for PYTHONPATH, next to the device
#                                          kit's site); --tvm-ffi also installs that apache-tvm-ffi wheel there
#                                          (the device kit carries it; $PYTHON, default python3, must match it)
#   bash scripts/kit.sh flashinfer rehearsal-extras
#                                          build (once, cached) a folder with the device image's packages that
#                                          `import flashinfer` needs and the device kit's rehearsal venv lacks
#                                          (pynvml, tabulate); prints its folder
#
# The device kit: what the machine lacks to run a real SGLang 0.5.23 server with this plugin next to its own
# torch 2.11 / triton 3.6 / transformers 5.17 (shared/notes/device-image.md); `carry: [".device-kit"]`.
# .device-kit/ (git-ignored, at most 38 MiB):
#   sglang-0.5.23-trimmed.tar.gz   the sglang wheel (cp312) less scripts/device_kit_prune.txt; pure Python after
#                                  the prune, so the same archive serves cp312 (device) and cp311 (rehearsal)
#   wheels/*.whl                   what SGLang imports that the image lacks: py3-none-any wheels and cp312
#                                  manylinux builds of the compiled ones (KIT_COMPILED below)
#   kit.json                       pins, sha256 and size of every file, the prune list's sha256
# The `sgl_kernel` stand-in is not copied: it ships inside the plugin (mfd_sglang/cpu/sgl_kernel_standin) and
# `install` lays it out with the plugin. FlashInfer is not in this kit: flashinfer-python compiles its kernels
# with nvcc at first use (minutes per kernel, more than one device call) and its prebuilt cubins are hundreds
# of MB; the GPU check's servers use --attention-backend triton.
#
# The FlashInfer kit: flashinfer-python 0.7.2 (what SGLang 0.5.23 pins) pruned to what a dense bf16 target served
# with --attention-backend flashinfer needs, for the FlashInfer visit (scripts/gpu_visit_flashinfer.sh). The wheel
# is 62 MB (458 MB unpacked: kernel sources for every model family); the kit keeps the Python modules a server
# reaches and the JIT sources and header trees of the modules scripts/flashinfer_modules.py compiles
# (scripts/flashinfer_kit_keep.txt says what and why).
# .flashinfer-kit/ (git-ignored, at most 14 MiB):
#   flashinfer_python-0.7.2-pruned.tar.gz   the pruned package and its dist-info (SGLang checks the version)
#   kit.json                                 pins, the wheel's sha256 and size, the keep list's sha256, what was kept
#                                            and dropped, and the sha256 and size of every file
# Needed beside it: apache-tvm-ffi (in the device kit) and, from the device image, torch, pynvml (nvidia-ml-py),
# tabulate, jinja2, filelock, packaging, requests, numpy, einops, click, tqdm, cuda-bindings, ninja and nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
KIND=${1:-}
PIP=(-m pip --disable-pip-version-check -q)

say() { echo "[${KIND}_kit] $*"; }
die() { echo "[${KIND}_kit] ERROR: $*" >&2; exit 1; }

# Whether $KIT holds the kit of key $1, every file as its kit.json lists it.
up_to_date() { python3 "$REPO/scripts/kit_pack.py" up-to-date "$KIT" "$1"; }

# $1 (a freshly built kit folder) takes $KIT's place; the old kit goes only once the new one is in.
replace_kit() {
  rm -rf "$KIT.old"
  if [ -e "$KIT" ]; then mv "$KIT" "$KIT.old"; fi
  mv "$1" "$KIT" && rm -rf "$KIT.old"
}

# Runs "$@" holding lock file $1: one build of a kit or a rehearsal folder at a time (the test workers share them).
with_lock() {
  local lock=$1; shift
  mkdir -p "$(dirname "$lock")"
  exec 9>"$lock"
  flock 9
  "$@"
}

# Unpack archive $1 into folder $2 with the Python that runs the install ($py).
extract() { "$py" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="data")' "$1" "$2"; }

# --- the device kit ---------------------------------------------------------------------------------------------

device_settings() {
  INSTALL_OPTION=--compiled-wheels
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
}

# What the kit is built from: a kit.json with another key is rebuilt.
device_kit_key() { { cat "$PRUNE"; printf '%s\n' "$SGLANG" "${KIT_PURE[@]}" "${KIT_COMPILED[@]}" "${PLATFORM_FLAGS[@]}"; } | sha256sum | cut -c1-16; }

device_print_size() {
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"[device_kit] {sys.argv[1].rsplit('/',2)[-2]}: {m['total_bytes']/2**20:.1f} MiB in {len(m['files'])} files (limit {m['limit_mib']} MiB; sglang {m['sglang_files_kept']} files kept, {m['sglang_files_pruned']} pruned)\")" "$KIT/kit.json"
}

# Every SGLang internal a hook in patches/ wraps must be in the trimmed sglang ($1, its archive): on the device
# SGLang would only log a hook it cannot apply (and the plugin refuse to start).
check_hook_targets() {
  local missing
  missing=$(python3 "$REPO/scripts/hook_targets.py" "$1" 2>&1) \
    || die "hook targets missing from the trimmed sglang (pruned by $(basename "$PRUNE")?): $missing"
}

device_build() {
  local key; key=$(device_kit_key)
  if up_to_date "$key"; then
    check_hook_targets "$KIT"/sglang-*-trimmed.tar.gz
    say "$KIT is up to date (key $key)"; device_print_size; return
  fi
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/kit/wheels" "$tmp/sglang"
  say "downloading $SGLANG (cp312) and ${#KIT_PURE[@]} + ${#KIT_COMPILED[@]} wheels (cp312 manylinux / py3-none-any)"
  python3 "${PIP[@]}" download --no-deps "${PLATFORM_FLAGS[@]}" -d "$tmp/sglang" "$SGLANG"
  python3 "${PIP[@]}" download --no-deps "${PLATFORM_FLAGS[@]}" -d "$tmp/kit/wheels" "${KIT_PURE[@]}" "${KIT_COMPILED[@]}"
  say "trimming sglang with $(basename "$PRUNE")"
  python3 - "$REPO/scripts" "$tmp" "$PRUNE" "$key" "$LIMIT_MIB" "$SGLANG" "${KIT_PURE[*]}" "${KIT_COMPILED[*]}" <<'PY'
import fnmatch, glob, hashlib, pathlib, sys, zipfile

sys.path.insert(0, sys.argv.pop(1))
from kit_pack import write_archive, write_manifest  # noqa: E402

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
        kept.append((name, zf.read(name)))
unused = [p for p, n in used.items() if n == 0]
if unused:
    sys.exit(f"[device_kit] ERROR: prune patterns that match nothing in {wheel.name}: {unused}")
if any(name.endswith(".so") for name, _ in kept):
    sys.exit("[device_kit] ERROR: compiled files left in the trimmed sglang (it must stay pure Python): "
             + ", ".join(n for n, _ in kept if n.endswith(".so")))
out = tmp / "kit" / f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}-trimmed.tar.gz"
write_archive(out, kept)
write_manifest(tmp / "kit", key, limit_mib, {
    "sglang": sglang_pin, "sglang_wheel": wheel.name,
    "sglang_wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
    "sglang_files_kept": len(kept), "sglang_files_pruned": pruned,
    "prune_list_sha256": hashlib.sha256(pathlib.Path(prune_path).read_bytes()).hexdigest(),
    "pure_wheels": pure.split(), "compiled_wheels_cp312": compiled.split(),
}, "device_kit")
PY
  check_hook_targets "$tmp"/kit/sglang-*-trimmed.tar.gz
  replace_kit "$tmp/kit"
  say "built $KIT (key $key)"; device_print_size
}

# SITE gets: the kit's wheels (pip --target, no index), the trimmed sglang, and the plugin laid out as
# setup.py installs it (kernels/ and patches/ inside mfd_sglang, the sglang.srt.plugins entry point) with its
# sgl_kernel stand-in; nothing is built or fetched.
device_install() {
  local site=$1 compiled_dir=$2 py=${PYTHON:-python3}
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
    extract "$KIT"/sglang-*-trimmed.tar.gz "$site"
  else
    say "no $KIT/kit.json: laying out the plugin only (SGLang servers will not start; build the kit with: bash scripts/kit.sh device)"
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
device_rehearsal_env() {
  local key; key=$({ printf '%s\n' "${IMAGE_TORCH[@]}" "${IMAGE_REST[@]}" "${KIT_COMPILED[@]}"; python3 -V; } | sha256sum | cut -c1-16)
  local dir=$CACHE/device-rehearsal-$key
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

# --- the FlashInfer kit -----------------------------------------------------------------------------------------

flashinfer_settings() {
  INSTALL_OPTION=--tvm-ffi
  KIT=${MFD_FLASHINFER_KIT:-$REPO/.flashinfer-kit}
  KEEP=$REPO/scripts/flashinfer_kit_keep.txt
  LIMIT_MIB=14
  FLASHINFER=flashinfer-python==0.7.2
  # Image packages `import flashinfer` needs that the device kit's rehearsal venv lacks (the image has them; its
  # versions are not recorded, so these are current releases).
  REHEARSAL_EXTRAS=(nvidia-ml-py==13.615.71 tabulate==0.10.0)
}

flashinfer_kit_key() { { cat "$KEEP" "$REPO/scripts/kit.sh" "$REPO/scripts/kit_pack.py"; echo "$FLASHINFER"; } | sha256sum | cut -c1-16; }

flashinfer_print_size() {
  python3 -c "import json,sys; m=json.load(open(sys.argv[1])); print(f\"[flashinfer_kit] .flashinfer-kit: {m['total_bytes']/2**20:.1f} MiB (limit {m['limit_mib']} MiB; wheel {m['wheel_bytes']/2**20:.1f} MiB; kept {m['kept_files']} files, {m['kept_bytes']/2**20:.1f} MiB unpacked, of which {m['python_modules']} Python modules; dropped {m['dropped_files']} files, {m['dropped_bytes']/2**20:.1f} MiB)\")" "$KIT/kit.json"
}

flashinfer_build() {
  local key; key=$(flashinfer_kit_key)
  if up_to_date "$key"; then
    say "$KIT is up to date (key $key)"; flashinfer_print_size; return
  fi
  tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/kit" "$tmp/wheel"
  say "downloading $FLASHINFER"
  python3 "${PIP[@]}" download --no-deps --only-binary=:all: -d "$tmp/wheel" "$FLASHINFER"
  say "pruning with $(basename "$KEEP")"
  python3 - "$REPO/scripts" "$tmp" "$KEEP" "$key" "$LIMIT_MIB" "$FLASHINFER" <<'PY'
import ast, fnmatch, glob, hashlib, pathlib, sys, zipfile

sys.path.insert(0, sys.argv.pop(1))
from kit_pack import write_archive, write_manifest  # noqa: E402

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

out = tmp / "kit" / f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}-pruned.tar.gz"
entries = [(name, zf.read(name)) for name in sorted(keep)]
write_archive(out, entries)
kept_bytes = sum(len(data) for _, data in entries)
write_manifest(tmp / "kit", key, limit_mib, {
    "flashinfer": pin, "wheel": wheel.name,
    "wheel_bytes": wheel.stat().st_size, "wheel_sha256": hashlib.sha256(wheel.read_bytes()).hexdigest(),
    "keep_list_sha256": hashlib.sha256(pathlib.Path(keep_path).read_bytes()).hexdigest(),
    "python_modules": len(modules), "kept_files": len(keep), "kept_bytes": kept_bytes,
    "dropped_files": len(names) - len(keep),
    "dropped_bytes": sum(zf.getinfo(n).file_size for n in names) - kept_bytes,
    "needs_from_device_kit": ["apache-tvm-ffi==0.1.11"],
}, "flashinfer_kit")
PY
  replace_kit "$tmp/kit"
  say "built $KIT (key $key)"; flashinfer_print_size
}

flashinfer_install() {
  local site=$1 tvm_ffi=$2 py=${PYTHON:-python3}
  [ -f "$KIT/kit.json" ] || die "no $KIT/kit.json: build the kit first (bash scripts/kit.sh flashinfer)"
  rm -rf "$site" && mkdir -p "$site"
  extract "$KIT"/flashinfer_python-*-pruned.tar.gz "$site"
  if [ -n "$tvm_ffi" ]; then
    "$py" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile --target "$site" "$tvm_ffi"
  fi
}

flashinfer_rehearsal_extras() {
  local key; key=$(printf '%s\n' "${REHEARSAL_EXTRAS[@]}" | sha256sum | cut -c1-16)
  local dir=$CACHE/flashinfer-rehearsal-extras-$key
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir" && mkdir -p "$dir"
    python3 "${PIP[@]}" install --no-deps --no-compile --target "$dir/site" "${REHEARSAL_EXTRAS[@]}" >&2
    touch "$dir/.complete"
  fi
  echo "$dir/site"
}

case $KIND in
  device|flashinfer) shift; "${KIND}_settings" ;;
  -h|--help) sed -n '2,46p' "$REPO/scripts/kit.sh"; exit 0 ;;
  *) echo "usage: bash scripts/kit.sh {device|flashinfer} [build|install SITE ...|rehearsal-env|rehearsal-extras]" \
       "(--help says more)" >&2; exit 1 ;;
esac
CACHE=${MFD_SGLANG_CACHE:-$HOME/.cache/mfd-sglang}
case $KIND:${1:-build} in
  *:build) with_lock "$KIT.lock" "${KIND}_build" ;;
  *:install)  # SITE, then the kit's one option ($INSTALL_OPTION) with its value
    shift; [ $# -ge 1 ] || die "usage: kit.sh $KIND install SITE [$INSTALL_OPTION ...]"
    site=$1 value=""; shift
    while [ $# -gt 0 ]; do
      { [ "$1" = "$INSTALL_OPTION" ] && [ $# -ge 2 ]; } || die "install: unknown argument $1"
      value=$2; shift 2
    done
    "${KIND}_install" "$site" "$value" ;;
  device:rehearsal-env) with_lock "$CACHE/device-rehearsal.lock" device_rehearsal_env ;;
  flashinfer:rehearsal-extras) with_lock "$CACHE/flashinfer-rehearsal-extras.lock" flashinfer_rehearsal_extras ;;
  *) die "unknown command $1 for the $KIND kit (device: build, install, rehearsal-env; flashinfer: build, install," \
       "rehearsal-extras)" ;;
esac
