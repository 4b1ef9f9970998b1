"""The FlashInfer 0.7.2 JIT modules a dense bf16 SGLang 0.5.23 server needs with --attention-backend flashinfer on
Hopper, their build on the GPU machine, and their sources on a CPU.

Which modules (sglang/srt/layers/attention/flashinfer_backend.py and flashinfer's wrappers; the arguments are the
ones the wrappers pass: q / kv / o bf16, int32 indptr, no RoPE in the kernel, no sliding window, no logits cap, no
fp16 QK reduction), per shape in SHAPES:

  prefill       BatchPrefillWithPagedKVCacheWrapper(backend="fa2"): EXTEND over a cached prefix, TARGET_VERIFY
                (MFD's tree, a custom mask) and decode with tensor cores (GQA group >= 4); the "equal K / V
                strides" module, as SGLang's MHA pool has
  ragged        BatchPrefillWithRaggedKVCacheWrapper(backend="auto"): EXTEND; flashinfer picks fa3 (sm90) on
                Hopper for head_dim 64 / 128 / 256, else it is the prefill module above
  decode        BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=False): decode with a GQA group < 4
  quantization  segment_packbits, which plan() runs on every custom mask (each TARGET_VERIFY plan)
  cascade       merge_state: EXTEND with a cached prefix (ragged new tokens + paged prefix)
  sampling      SGLang's default sampling backend when FlashInfer is importable; non-greedy requests only, last

    python scripts/flashinfer_modules.py build --out-dir DIR --deadline EPOCH   (GPU machine)
        compiles the modules (each its own ninja; started in the order above on the machine's cores, a module
        taking as many cores as it has CUDA sources), writes a row per module to DIR/flashinfer-compile.jsonl as
        it finishes (and DIR/flashinfer-compile.json after each), installs each built module into the installed
        package's flashinfer/data/aot/, where flashinfer loads it without ninja (a later process needs neither
        this JIT cache nor the same include paths), then plans and runs SGLang's four wrapper kinds at both
        shapes with FLASHINFER_DISABLE_JIT=1 against a float32 torch reference: a module missing from this list
        fails there by name. A rerun continues: ninja keeps the objects it finished.
    python scripts/flashinfer_modules.py sources --out FILE [--scan]                (CPU, as on an H200)
        generates every module's sources and build.ninja, lists their inputs; --scan runs nvcc's dependency
        scan (-M, the build's own flags) on one translation unit per template and module: every #include must
        resolve (tests/test_flashinfer_kit.py)

Environment: FLASHINFER_WORKSPACE_BASE (the JIT cache: BASE/.cache/flashinfer/0.7.2/<arch>/), FLASHINFER_CUDA_ARCH_LIST
(set from the GPU as SGLang's set_cuda_arch does, or 9.0a on a CPU), CUDA_HOME (else nvcc's own folder).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int


# The two targets of the FlashInfer visit: the make-tiny pair (mfd_sglang/lab/tiny.py) and a Qwen3-4B-shaped one.
SHAPES = (Shape("tiny", 4, 2, 16), Shape("qwen3-4b", 32, 8, 128))


def decode_uses_tensor_cores(shape: Shape) -> bool:
    """SGLang's should_use_tensor_core for a bf16 KV cache: a GQA group of at least 4."""
    return shape.heads // shape.kv_heads >= 4


@dataclass
class Module:
    roles: list[str]  # "prefill tiny", ...
    spec: object  # flashinfer.jit.core.JitSpecNvcc

    @property
    def name(self) -> str:
        return self.spec.name


def modules() -> list[Module]:
    """The modules, deduplicated, in build order (the tiny pair's first, sampling last)."""
    from flashinfer.jit.attention.modules import (_gen_batch_prefill_primary_module, gen_batch_decode_module,
                                                  gen_batch_prefill_module)
    from flashinfer.jit.cascade import gen_cascade_module
    from flashinfer.jit.quantization import gen_quantization_module
    from flashinfer.jit.sampling import gen_sampling_module
    from flashinfer.utils import determine_attention_backend

    bf16, i32 = torch.bfloat16, torch.int32
    found: dict[str, Module] = {}

    def add(role: str, spec) -> None:
        found.setdefault(spec.name, Module([], spec)).roles.append(role)

    for i, shape in enumerate(SHAPES):
        d = shape.head_dim
        args = (bf16, bf16, bf16, i32, d, d, 0, False, False, False)
        add(f"prefill {shape.name}", _gen_batch_prefill_primary_module("fa2", *args))
        ragged = determine_attention_backend(torch.device("cuda", 0), 0, False, False, bf16, bf16,
                                             head_dim_qk=d, head_dim_vo=d)
        add(f"ragged {shape.name}", (gen_batch_prefill_module("fa3", *args) if ragged == "fa3"
                                     else _gen_batch_prefill_primary_module("fa2", *args)))
        if not decode_uses_tensor_cores(shape):
            add(f"decode {shape.name}", gen_batch_decode_module(bf16, bf16, bf16, i32, d, d, 0, False, False))
        if i == 0:
            add("quantization (custom masks)", gen_quantization_module())
            add("cascade (merge_state)", gen_cascade_module())
    add("sampling (non-greedy requests)", gen_sampling_module())
    return list(found.values())


# --- environment ------------------------------------------------------------------------------------------------

def prepare_environment() -> dict:
    """CUDA_HOME, FLASHINFER_CUDA_ARCH_LIST and, when the CUDA toolkit has no cuRAND headers (a toolkit assembled
    from pip wheels; CUTLASS's tensor_fill.h and sampling.cuh include them), FLASHINFER_EXTRA_CUDAFLAGS with the
    nvidia-curand wheel's include folder, searched after the toolkit's. Set before flashinfer is imported."""
    if not os.environ.get("CUDA_HOME"):
        nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
        dry = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True).stderr
        here = re.search(r"_HERE_=(\S+)", dry)
        if here is None:
            raise RuntimeError(f"cannot locate the CUDA toolkit from `nvcc --dryrun`:\n{dry[-2000:]}")
        os.environ["CUDA_HOME"] = str(Path(here.group(1)).resolve().parent)
    if not os.environ.get("FLASHINFER_CUDA_ARCH_LIST"):
        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            os.environ["FLASHINFER_CUDA_ARCH_LIST"] = f"{major}.{minor}{'a' if major >= 9 else ''}"
        else:
            os.environ["FLASHINFER_CUDA_ARCH_LIST"] = "9.0a"  # the H200
    curand = None
    if not (Path(os.environ["CUDA_HOME"]) / "include" / "curand_kernel.h").exists():
        candidates = [Path(p) / "nvidia" / sub / "include" for p in sys.path if p
                      for sub in ("cu13", "curand", "cu12")]
        curand = next((c for c in candidates if (c / "curand_kernel.h").exists()), None)
        if curand is not None:
            flags = os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "")
            os.environ["FLASHINFER_EXTRA_CUDAFLAGS"] = f"{flags} -isystem {curand}".strip()
    shims = link_shims(Path(os.environ["CUDA_HOME"]))
    if shims and shims.get("dir"):
        flags = os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
        os.environ["FLASHINFER_EXTRA_LDFLAGS"] = f"{flags} -L{shims['dir']}".strip()
    if not torch.cuda.is_available():
        # Sources only: flashinfer's backend choice asks the device; answer as an H200 would.
        import flashinfer.utils

        flashinfer.utils.get_compute_capability = lambda device: (9, 0)
    return {"CUDA_HOME": os.environ["CUDA_HOME"], "FLASHINFER_CUDA_ARCH_LIST": os.environ["FLASHINFER_CUDA_ARCH_LIST"],
            "curand_include": str(curand) if curand else None, "link_shims": shims,
            "FLASHINFER_WORKSPACE_BASE": os.environ.get("FLASHINFER_WORKSPACE_BASE")}


def link_shims(cuda_home: Path) -> dict | None:
    """A folder of unversioned symlinks for what FlashInfer's link step asks for (-lcudart -lcuda) where the
    linker would not find it: a toolkit assembled from pip wheels has neither lib64/libcuda.so stubs nor, in
    some layouts, lib64/ at all; the driver ships libcuda.so.1. None when nothing is missing."""
    found, missing = {}, []
    for lib in ("cudart", "cuda"):
        dirs = [cuda_home / "lib64", cuda_home / "lib64" / "stubs"]
        default = subprocess.run(["c++", f"-print-file-name=lib{lib}.so"], capture_output=True, text=True).stdout.strip()
        if any((d / f"lib{lib}.so").exists() for d in dirs) or Path(default).is_absolute():
            continue
        ldconfig = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
        candidates = re.findall(rf"lib{lib}\.so\.\d+ \(.*?\) => (\S+)", ldconfig)
        for base in [cuda_home, *(Path(p) / "nvidia" / sub for p in sys.path if p for sub in ("cu13", "cuda_runtime"))]:
            candidates += sorted(map(str, (base / "lib").glob(f"lib{lib}.so.*"))) + sorted(
                map(str, (base / "lib64").glob(f"lib{lib}.so.*")))
        if candidates:
            found[lib] = candidates[0]
        else:
            missing.append(lib)
    if not found:
        return {"missing": missing} if missing else None
    shim_dir = Path(tempfile.gettempdir()) / "mfd-flashinfer-link-shims"
    shim_dir.mkdir(exist_ok=True)
    for lib, target in found.items():
        link = shim_dir / f"lib{lib}.so"
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    return {"dir": str(shim_dir), "libs": found, "missing": missing}


# The image's ninja is a pip package: its command, or the module when no script is on PATH.
NINJA = [shutil.which("ninja")] if shutil.which("ninja") else [sys.executable, "-m", "ninja"]


def nvcc_commands(module: Module) -> list[list[str]]:
    """The nvcc command lines of the module's build.ninja (written first)."""
    module.spec.write_ninja()
    lines = subprocess.run([*NINJA, "-f", str(module.spec.ninja_path), "-t", "commands"], capture_output=True,
                           text=True, check=True, cwd=module.spec.build_dir).stdout.splitlines()
    return [argv for argv in map(shlex.split, lines) if argv and argv[0].endswith("nvcc")]


# --- CPU: sources ---------------------------------------------------------------------------------------------------

def dependency_scan(argv: list[str]) -> dict:
    """nvcc -M with the compile's own flags: (source, the files it includes, or the error)."""
    source = argv[argv.index("-c") + 1]
    drop = {argv.index("-c"), argv.index("-c") + 1, argv.index("-o"), argv.index("-o") + 1}
    cmd = [a for i, a in enumerate(argv) if i not in drop]
    cmd[cmd.index("--generate-dependencies-with-compile")] = "-M"
    with tempfile.TemporaryDirectory() as tmp:
        cmd[cmd.index("-MF") + 1] = f"{tmp}/deps"
        proc = subprocess.run(cmd + [source], capture_output=True, text=True)
        deps = [] if proc.returncode else Path(f"{tmp}/deps").read_text().replace("\\\n", " ").split(":", 1)[1].split()
    return {"source": source, "ok": proc.returncode == 0, "error": proc.stderr[-3000:], "includes": deps}


def sources(out: Path, scan: bool) -> int:
    env = prepare_environment()
    from concurrent.futures import ThreadPoolExecutor

    result, scans = {"environment": env, "modules": []}, []
    for module in modules():
        commands = nvcc_commands(module)
        inputs = [str(p) for p in module.spec.sources]
        result["modules"].append({"name": module.name, "roles": module.roles, "ninja": str(module.spec.ninja_path),
                                  "sources": inputs, "missing": [p for p in inputs if not Path(p).exists()],
                                  "cuda_sources": len(commands)})
        # The kernel sources of one template differ only in the mask mode they instantiate: scan one of each.
        seen = set()
        for argv in commands:
            template = re.sub(r"_mask_\d", "", Path(argv[argv.index("-c") + 1]).name)
            if template not in seen:
                seen.add(template)
                scans.append((module.name, argv))
    if scan:
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            for (name, _), res in zip(scans, pool.map(dependency_scan, [argv for _, argv in scans])):
                result.setdefault("scans", []).append({"module": name, **res})
    out.write_text(json.dumps(result, indent=1))
    return 0


# --- GPU: build -------------------------------------------------------------------------------------------------

class Rows:
    """Rows appended to OUT/NAME.jsonl as they finish, and OUT/NAME.json rewritten after each."""

    def __init__(self, out_dir: Path, name: str, header: dict):
        self.jsonl, self.json, self.header, self.rows = out_dir / f"{name}.jsonl", out_dir / f"{name}.json", header, []
        self.lock = threading.Lock()
        out_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl.write_text("")
        self.flush()

    def add(self, row: dict) -> None:
        with self.lock:
            self.rows.append(row)
            with self.jsonl.open("a") as f:
                f.write(json.dumps(row) + "\n")
            self.flush()
        print(json.dumps({k: v for k, v in row.items() if k not in ("log_tail", "objects")}), flush=True)

    def flush(self) -> None:
        self.json.write_text(json.dumps({**self.header, "rows": self.rows}, indent=1))


class Cores:
    """The machine's cores handed to modules strictly in build order: a module waits for its turn and for as
    many free cores as it has CUDA sources (capped at all of them)."""

    def __init__(self, total: int):
        self.total, self.free, self.turn, self.cond = total, total, 0, threading.Condition()

    def take(self, order: int, want: int, deadline: float) -> int | None:
        want = min(want, self.total)
        with self.cond:
            while self.turn != order or self.free < want or time.time() >= deadline:
                if time.time() >= deadline:
                    return None
                self.cond.wait(timeout=deadline - time.time())
            self.free -= want
            self.turn += 1
            self.cond.notify_all()
            return want

    def give(self, n: int) -> None:
        with self.cond:
            self.free += n
            self.cond.notify_all()


def object_seconds(build_dir: Path) -> dict[str, float]:
    """Seconds per output from ninja's log (start and end in ms)."""
    log = build_dir / ".ninja_log"
    times = {}
    if log.exists():
        for line in log.read_text().splitlines()[1:]:
            parts = line.split("\t")
            if len(parts) >= 4:
                times[Path(parts[3]).name] = round((int(parts[1]) - int(parts[0])) / 1000, 1)
    return times


def build_one(module: Module, order: int, need: int, cores: Cores, deadline: float, t0: float) -> dict:
    import tvm_ffi
    from flashinfer.jit import env as jit_env

    spec = module.spec
    row = {"module": module.name, "roles": module.roles, "order": order}
    got = cores.take(order, need, deadline)
    if got is None:
        return {**row, "ok": False, "status": "not started: deadline"}
    started = time.time()
    row.update(started_s=round(started - t0, 1), jobs=got)
    try:
        proc = subprocess.Popen([*NINJA, "-C", str(spec.build_dir), "-f", str(spec.ninja_path), "-j", str(got)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            log, _ = proc.communicate(timeout=max(1.0, deadline - time.time()))
            status = "built" if proc.returncode == 0 else f"ninja failed ({proc.returncode})"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            status = "killed: deadline"
    finally:
        cores.give(got)
    row.update(seconds=round(time.time() - started, 1), finished_s=round(time.time() - t0, 1),
               objects=object_seconds(spec.build_dir))
    so = spec.jit_library_path
    if status != "built" or not so.exists():
        return {**row, "ok": False, "status": status, "log_tail": log[-4000:]}
    try:
        tvm_ffi.load_module(str(so))
    except Exception as e:  # noqa: BLE001 - the row records why the module does not load
        return {**row, "ok": False, "status": f"built, does not load: {e}"[:2000]}
    aot = jit_env.FLASHINFER_AOT_DIR / module.name / f"{module.name}.so"
    aot.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(so, aot)
    return {**row, "ok": True, "status": "built, loads, installed as AOT", "so_bytes": so.stat().st_size,
            "aot": str(aot)}


def build_row(rows: Rows, module: Module, *args) -> None:
    try:
        row = build_one(module, *args)
    except Exception as e:  # noqa: BLE001 - a module's failure is its row, the others go on
        row = {"module": module.name, "roles": module.roles, "ok": False, "status": f"error: {e!r}"[:2000]}
    rows.add(row)


def build(out_dir: Path, deadline: float, check_deadline: float, only: str | None) -> int:
    t0 = time.time()
    env = prepare_environment()
    import flashinfer

    mods = [m for m in modules() if only is None or any(only in role for role in m.roles)]
    rows = Rows(out_dir, "flashinfer-compile", {
        "flashinfer": flashinfer.__version__, "torch": torch.__version__, "environment": env,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None, "cores": os.cpu_count(), "deadline_s": round(deadline - t0, 1),
        "modules": [{"module": m.name, "roles": m.roles} for m in mods]})
    cores = Cores(os.cpu_count() or 1)
    threads = []
    for order, module in enumerate(mods):
        try:
            need = len(nvcc_commands(module))  # writes its build.ninja
        except Exception as e:  # noqa: BLE001 - a module's failure is its row, the others go on
            rows.add({"module": module.name, "roles": module.roles, "ok": False, "status": f"error: {e!r}"[:2000]})
            cores.give(cores.take(order, 0, deadline) or 0)  # pass its turn
            continue
        threads.append(threading.Thread(target=build_row, args=(rows, module, order, need, cores, deadline, t0)))
        threads[-1].start()
    for t in threads:
        t.join()
    built = {r["module"] for r in rows.rows if r.get("ok")}
    check = Rows(out_dir, "flashinfer-wrappers", {"note": "SGLang's wrapper kinds, FLASHINFER_DISABLE_JIT=1, vs a "
                                                          "float32 torch reference"})
    for shape in SHAPES:
        if time.time() > check_deadline or not torch.cuda.is_available():
            status = "not run: deadline" if time.time() > check_deadline else "not run: needs CUDA"
            check.add({"shape": shape.name, "ok": False, "status": status})
            continue
        try:
            results = check_wrappers(shape)
        except Exception as e:  # noqa: BLE001 - recorded; the other shape still runs
            results = [{"shape": shape.name, "ok": False, "status": f"error: {e!r}"[:2000]}]
        for row in results:
            check.add(row)
    ok = all(r.get("ok") for r in rows.rows + check.rows)
    print(f"[flashinfer_modules] {len(built)}/{len(mods)} modules built and installed; wrapper checks "
          f"{sum(bool(r.get('ok')) for r in check.rows)}/{len(check.rows)} ok; {time.time() - t0:.0f} s", flush=True)
    return 0 if ok else 1


# --- GPU: SGLang's wrapper kinds against a reference -------------------------------------------------------------

def reference(q, k, v, mask) -> torch.Tensor:
    """Attention of one request in float32: q [n, H, D], k / v [m, KVH, D], mask [n, m] (True: attend)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,mhd->hnm", q.float(), k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hnm,mhd->nhd", probs, v)


def check_wrappers(shape: Shape) -> list[dict]:
    """EXTEND without and with a cached prefix (ragged, paged, merge_state), TARGET_VERIFY with a tree mask and
    decode, each built as SGLang 0.5.23 builds it, planned and run once; max |error| vs `reference`."""
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"  # a module not installed above raises, naming itself
    import flashinfer
    from flashinfer.cascade import merge_state

    dev, bf16 = torch.device("cuda"), torch.bfloat16
    h, kvh, d = shape.heads, shape.kv_heads, shape.head_dim
    g = torch.Generator(device=dev).manual_seed(0)
    workspace = torch.empty(128 * 2**20, dtype=torch.uint8, device=dev)
    slots = 1024
    k_pool = torch.randn(slots, kvh, d, generator=g, device=dev).to(bf16)
    v_pool = torch.randn(slots, kvh, d, generator=g, device=dev).to(bf16)
    i32 = dict(dtype=torch.int32, device=dev)
    plan_types = dict(q_data_type=bf16, kv_data_type=bf16)

    def indptr(lens):
        return torch.tensor([0] + list(lens), **i32).cumsum(0, dtype=torch.int32)

    def pages(lens):  # a request's KV slots, scattered over the pool (page size 1)
        return torch.randperm(slots, generator=g, device=dev)[: sum(lens)].to(torch.int32)

    def causal(n, m):
        return torch.arange(m, device=dev)[None, :] <= torch.arange(n, device=dev)[:, None] + (m - n)

    def row(kind, got, want):
        err = (got.float() - want).abs().max().item()
        return {"shape": shape.name, "check": kind, "max_abs_err": round(err, 5), "ok": err < 3e-2}

    rows = []

    def run(kind, fn):
        try:
            rows.append(fn(kind))
        except Exception as e:  # noqa: BLE001 - recorded: a missing module (MissingJITCacheError) names itself
            rows.append({"shape": shape.name, "check": kind, "ok": False, "status": f"error: {e!r}"[:2000]})

    def extend(kind, prefix_lens, new_lens):
        q = torch.randn(sum(new_lens), h, d, generator=g, device=dev).to(bf16)
        k_new = torch.randn(sum(new_lens), kvh, d, generator=g, device=dev).to(bf16)
        v_new = torch.randn(sum(new_lens), kvh, d, generator=g, device=dev).to(bf16)
        ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="auto")
        ragged.plan(indptr(new_lens), indptr(new_lens), h, kvh, d, causal=True, **plan_types)
        out, lse = ragged.run(q, k_new, v_new, return_lse=True)
        idx = pages(prefix_lens)
        if sum(prefix_lens):
            paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            paged.plan(indptr(new_lens), indptr(prefix_lens), idx, torch.ones(len(prefix_lens), **i32), h, kvh, d, 1,
                       causal=False, **plan_types)
            out_p, lse_p = paged.run(q, (k_pool, v_pool), return_lse=True)
            out, _ = merge_state(out, lse, out_p, lse_p)
        want, qo, kv = [], 0, 0
        for p, n in zip(prefix_lens, new_lens):
            ks = torch.cat([k_pool[idx[kv:kv + p].long()], k_new[qo:qo + n]])
            vs = torch.cat([v_pool[idx[kv:kv + p].long()], v_new[qo:qo + n]])
            want.append(reference(q[qo:qo + n], ks, vs, causal(n, p + n)))
            qo, kv = qo + n, kv + p
        return row(kind, out, torch.cat(want))

    def verify(kind, prefix_lens, width=9):
        kv_lens = [p + width for p in prefix_lens]
        idx = pages(kv_lens)
        q = torch.randn(width * len(kv_lens), h, d, generator=g, device=dev).to(bf16)
        masks = []
        for p in prefix_lens:  # a random tree: each node sees the prefix, itself and its ancestors
            parent = [-1] + [int(torch.randint(0, i, (1,), generator=g, device=dev)) for i in range(1, width)]
            tree = torch.zeros(width, width, dtype=torch.bool, device=dev)
            for i in range(width):
                j = i
                while j >= 0:
                    tree[i, j], j = True, parent[j]
            masks.append(torch.cat([torch.ones(width, p, dtype=torch.bool, device=dev), tree], 1))
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
        wrapper.plan(indptr([width] * len(kv_lens)), indptr(kv_lens), idx, torch.ones(len(kv_lens), **i32), h, kvh, d,
                     1, custom_mask=torch.cat([m.flatten() for m in masks]), **plan_types)
        out = wrapper.run(q, (k_pool, v_pool))
        want, kv = [], 0
        for i, (m, n) in enumerate(zip(masks, kv_lens)):
            sel = idx[kv:kv + n].long()
            want.append(reference(q[i * width:(i + 1) * width], k_pool[sel], v_pool[sel], m))
            kv += n
        return row(kind, out, torch.cat(want))

    def decode(kind, kv_lens):
        idx = pages(kv_lens)
        q = torch.randn(len(kv_lens), h, d, generator=g, device=dev).to(bf16)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2",
                                                                use_tensor_cores=decode_uses_tensor_cores(shape))
        wrapper.plan(indptr(kv_lens), idx, torch.ones(len(kv_lens), **i32), h, kvh, d, 1, **plan_types)
        out = wrapper.run(q, (k_pool, v_pool))
        want, kv = [], 0
        for i, n in enumerate(kv_lens):
            sel = idx[kv:kv + n].long()
            want.append(reference(q[i:i + 1], k_pool[sel], v_pool[sel], torch.ones(1, n, dtype=torch.bool, device=dev)))
            kv += n
        return row(kind, out, torch.cat(want))

    run("extend, no prefix (ragged)", lambda kind: extend(kind, [0, 0], [13, 70]))
    run("extend over a cached prefix (ragged + paged + merge_state)", lambda kind: extend(kind, [21, 96], [7, 30]))
    run("target verify, tree mask (paged)", lambda kind: verify(kind, [3, 131]))
    run(f"decode ({'tensor cores' if decode_uses_tensor_cores(shape) else 'decode kernel'})",
        lambda kind: decode(kind, [1, 37, 300]))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("build")
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--deadline", type=float, required=True, help="epoch seconds: no compile runs past it")
    p.add_argument("--check-seconds", type=float, default=20, help="kept after the deadline for the wrapper checks")
    p.add_argument("--only", help="build only the modules with a role containing this (e.g. tiny, cascade)")
    p = sub.add_parser("sources")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--scan", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        return build(args.out_dir, args.deadline - args.check_seconds, args.deadline, args.only)
    return sources(args.out, args.scan)


if __name__ == "__main__":
    sys.exit(main())
