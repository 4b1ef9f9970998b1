"""The device kit (scripts/kit.sh device) and the CPU rehearsal of the GPU check's one device call.

The kit must let the borrowed GPU machine (torch 2.11 / triton 3.6 / transformers 5.17, no SGLang, no
registry) run a real SGLang 0.5.23 server with this plugin, in at most 38 MiB next to the repository
(64 MiB per device call). The rehearsal proves the call before any GPU minute is spent: a copy of the
repository as it travels (tracked and untracked-not-ignored files, plus the carried .device-kit and
.gpu-check-pair), an environment with the image's versions (torch 2.11.0, triton 3.6.0, transformers
5.17.0 and only those of the image's other packages that SGLang imports; see kit.sh device for the one
version that differs) and no install of the project, and in that copy's root the device's command,
`bash scripts/gpu_check.sh`, with `--cpu`: the kit is installed the way the device installs it
(`pip --target`, PYTHONPATH), every section runs through the same code (servers through the CPU
launcher, Triton under the interpreter), and a section that needs CUDA is recorded as needing it.

Building the kit downloads ~52 MB of wheels, the rehearsal environment a few GB (torch 2.11.0 is PyPI's
CUDA build, which needs its nvidia libraries to load even on a CPU); both are cached (.device-kit/ and
~/.cache/mfd-sglang/device-rehearsal-<pins>). A failed download fails these tests: nothing is skipped.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_checked

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
KIT = ["bash", str(REPO / "scripts" / "kit.sh"), "device"]
LIMIT = 38 * 2**20
MAX_NEW = 16


@pytest.fixture(scope="module")
def kit() -> Path:
    out = run_checked([*KIT, "build"])
    assert "MiB in" in out, out  # the script prints the kit's size
    return REPO / ".device-kit"


def test_kit_fits_and_holds_what_the_device_lacks(kit):
    manifest = json.loads((kit / "kit.json").read_text())
    files = {f["path"]: f for f in manifest["files"]}
    on_disk = {str(p.relative_to(kit)) for p in kit.rglob("*") if p.is_file()} - {"kit.json"}
    assert set(files) == on_disk
    for path, f in files.items():
        assert hashlib.sha256((kit / path).read_bytes()).hexdigest() == f["sha256"], path
    total = sum(p.stat().st_size for p in kit.rglob("*") if p.is_file())
    assert total <= LIMIT, f"kit is {total / 2**20:.1f} MiB"
    # Carried together: the repository's working tree (tracked + untracked, not ignored) and the kit.
    tree = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                          check=True).stdout.decode().split("\0")
    repo_bytes = sum((REPO / p).stat().st_size for p in tree if p and (REPO / p).is_file())
    assert repo_bytes + total <= 64 * 2**20, f"repo {repo_bytes / 2**20:.1f} MiB + kit {total / 2**20:.1f} MiB"
    # Wheels the device's Python 3.12 can install without a registry: pure, or cp312 manylinux x86_64.
    wheels = [Path(p).name for p in files if p.startswith("wheels/")]
    assert len(wheels) == len(manifest["pure_wheels"]) + len(manifest["compiled_wheels_cp312"])
    for name in wheels:
        python_tag, abi, platform = name[:-4].split("-")[-3:]
        assert platform == "any" or ("manylinux" in platform and platform.endswith("x86_64")), name
        assert python_tag.startswith("py") or (python_tag == "cp312" and abi in ("cp312", "abi3")), name
    assert not any(w.startswith(("torch-", "triton-", "transformers-", "flashinfer")) for w in wheels)


def test_trimmed_sglang_is_pure_python_and_keeps_what_the_checks_import(kit):
    import tarfile

    with tarfile.open(next(kit.glob("sglang-*-trimmed.tar.gz"))) as tar:
        names = set(tar.getnames())
    assert "sglang/launch_server.py" in names and "sglang-0.5.23.dist-info/METADATA" in names
    assert not [n for n in names if n.endswith(".so")]
    assert not [n for n in names if n.startswith(("sglang/multimodal_gen/", "sglang/benchmark/"))]
    # kept by `!` lines: the attention unit-test kit benchmarks/tree_mask_check.py builds on
    assert "sglang/test/kits/attention_unittest/attention_methods/dense_attention.py" in names
    assert not [n for n in names if n.startswith("sglang/test/") and "/attention_unittest/" not in n
                and n != "sglang/test/__init__.py"]


def test_kit_build_is_reproducible(kit, tmp_path):
    """The same pins and prune list give the same bytes (sorted archive, fixed times, gzip without a date)."""
    again = tmp_path / "kit"
    run_checked([*KIT, "build"], env={**os.environ, "MFD_DEVICE_KIT": str(again)})
    first = {f["path"]: f["sha256"] for f in json.loads((kit / "kit.json").read_text())["files"]}
    second = {f["path"]: f["sha256"] for f in json.loads((again / "kit.json").read_text())["files"]}
    assert first == second


# --- the CPU rehearsal --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rehearsal(kit, tmp_path_factory) -> dict:
    """(python, site): the rehearsal venv's interpreter and the site folder the kit was installed into
    exactly as on the device (scripts/kit.sh device install), with the cp311 builds of its compiled wheels."""
    env_dir = Path(run_checked([*KIT, "rehearsal-env"], timeout=3600).strip().splitlines()[-1])
    python = env_dir / "venv" / "bin" / "python"
    site = tmp_path_factory.mktemp("rehearsal") / "site"
    run_checked([*KIT, "install", str(site), "--compiled-wheels", str(env_dir / "cp311")],
        env={**os.environ, "PYTHON": str(python)})
    return {"python": python, "site": site}


def clean_env(site: Path | None) -> dict:
    """Only the rehearsal venv and the kit's site: nothing of this machine's .venv leaks in."""
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    env.update(PYTHONNOUSERSITE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    if site is not None:
        env["PYTHONPATH"] = str(site)
    return env


VERSIONS = """
import importlib, json, importlib.util
out = {}
for name in ("torch", "triton", "transformers", "sglang", "fastapi", "orjson", "sgl_kernel"):
    spec = importlib.util.find_spec(name)
    out[name] = None if spec is None else str(spec.origin)
import torch, triton, transformers
out["versions"] = [torch.__version__, triton.__version__, transformers.__version__]
print(json.dumps(out))
"""


def test_rehearsal_has_the_image_versions_and_sglang_only_from_the_kit(rehearsal):
    def probe(site):
        proc = subprocess.run([str(rehearsal["python"]), "-c", VERSIONS], capture_output=True, text=True,
                              env=clean_env(site), cwd=rehearsal["site"].parent, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout.strip().splitlines()[-1])

    alone, with_kit = probe(None), probe(rehearsal["site"])
    assert alone["versions"][0].startswith("2.11.0") and alone["versions"][1:] == ["3.6.0", "5.17.0"]
    # what the kit brings is absent without it ...
    assert alone["sglang"] is None and alone["fastapi"] is None and alone["orjson"] is None
    # ... and comes from the kit's site with it
    site = str(rehearsal["site"])
    assert all(with_kit[n].startswith(site) for n in ("sglang", "fastapi", "orjson")), with_kit
    assert with_kit["sgl_kernel"] is None  # the stand-in is put on the path by the CPU launcher only


def test_rehearsal_sglang_cuda_modules_import_against_the_standin(rehearsal):
    """What a dense server imports on CUDA (CUDA forced on this CPU) imports against the stand-in in the
    device's versions, binds the stand-in's ops, and SGLang's CUDA norm / activation paths through them
    equal its native ones."""
    from test_cpu_standins import CUDA_SERVER_MODULES, FORCED_CUDA_PROBE

    site = rehearsal["site"]
    env = clean_env(site)
    env["PYTHONPATH"] = os.pathsep.join([str(site / "mfd_sglang" / "cpu" / "sgl_kernel_standin"), str(site)])
    proc = subprocess.run([str(rehearsal["python"]), "-c", FORCED_CUDA_PROBE, json.dumps(CUDA_SERVER_MODULES)],
                          env=env, cwd=site.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["standin"].startswith(str(site)) and out["is_cuda"] and out["bound"]
    assert not out["failures"], out["failures"]
    assert out["diffs"] and all(d < 1e-5 for d in out["diffs"].values()), out["diffs"]



# --- the device call, rehearsed on CPU ------------------------------------------------------------------

CARRY = (".device-kit", ".gpu-check-pair")


def travelling_copy(dest: Path, kit: Path, pair: Path) -> Path:
    """The repository as a device call lays it out: the working tree git would send (tracked and
    untracked-not-ignored files) plus the carried paths, and nothing else (no .venv, no .git)."""
    tree = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                          check=True).stdout.decode().split("\0")
    for path in filter(None, tree):
        if (REPO / path).is_file():
            (dest / path).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / path, dest / path)
    shutil.copytree(kit, dest / ".device-kit")
    shutil.copytree(pair, dest / ".gpu-check-pair")
    return dest


def run_device_command(copy: Path, rehearsal_dir: Path, out: Path, site: Path) -> subprocess.CompletedProcess:
    """`bash scripts/gpu_check.sh --cpu` in the copy's root, with the rehearsal's python3 first on PATH."""
    env = clean_env(None)
    env.pop("OMP_NUM_THREADS")
    env.update(PATH=f"{rehearsal_dir / 'venv' / 'bin'}:{env['PATH']}", OUT=str(out), MFD_GPU_CHECK_SITE=str(site),
               MFD_DEVICE_KIT_COMPILED_WHEELS=str(rehearsal_dir / "cp311"), MFD_GPU_CHECK_SECONDS="2400")
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--cpu"], cwd=copy, env=env, capture_output=True,
                          text=True, timeout=2700)


@pytest.fixture(scope="module")
def device_call(kit, tiny_pair, tmp_path_factory) -> dict:
    rehearsal_dir = Path(run_checked([*KIT, "rehearsal-env"], timeout=3600).strip().splitlines()[-1])
    root = tmp_path_factory.mktemp("device-call")
    copy = travelling_copy(root / "repo", kit, tiny_pair)
    # as `gpu_check.sh prepare` puts it in the pair
    run_checked([sys.executable, "-m", "mfd_sglang", "gpu-ledger", "--round-cost-predictions",
                 str(copy / ".gpu-check-pair" / "round-cost-predictions.json"), "--batch-sizes", "1",
                 "--shapes", "qwen3-4b"], timeout=600)
    carried = sum(p.stat().st_size for p in copy.rglob("*") if p.is_file())  # before the call writes anything
    out = root / "out"
    out.mkdir()
    proc = run_device_command(copy, rehearsal_dir, out, root / "site")
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    return {"proc": proc, "report": report, "out": out, "copy": copy, "carried": carried}


def rows(report: dict, section: str) -> list[dict]:
    return report["sections"][section].get("rows", [])


def test_the_device_call_passes_on_cpu_with_every_cuda_section_named(device_call):
    proc, report = device_call["proc"], device_call["report"]
    assert report is not None, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0 and report["passed"], (report["failures"], proc.stdout[-4000:])
    # part 1 in its order, every section run (none cut by the deadline)
    assert list(report["sections"]) == ["env", "tree", "tree_mask", "graph_tests", "servers_tiny", "servers_4b",
                                        "attention", "sync", "round_cost", "servers_bf16", "tree_time",
                                        "attention_time"]
    assert not [n for n, e in report["sections"].items() if "not_run" in e or "error" in e]
    # what needs CUDA says so, and nothing else is skipped
    skipped = {n for n, e in report["sections"].items() if "skipped" in e}
    assert skipped == {"tree_time", "attention_time"}
    assert all(e["skipped"].startswith("needs CUDA") for n, e in report["sections"].items() if n in skipped)
    assert [r["skipped"][:10] for r in rows(report, "graph_tests")] == ["needs CUDA"]
    assert len(rows(report, "sync")) == 4 and all(r["skipped"].startswith("needs CUDA") for r in rows(report, "sync"))


def test_the_device_calls_round_cost_sits_beside_the_ledger_and_is_profiled(device_call):
    """Each round_cost row carries the ledger's prediction for its config at the 4B shapes (bs 1 here; 1 and 32
    on a GPU), and each round's profile is in round-profile.txt."""
    costs = rows(device_call["report"], "round_cost")
    assert [(r["config"], r["bs"]) for r in costs] == [("mfd", 1), ("mfd_d", 1), ("ddtree", 1)]
    for row in costs:
        predicted = row["predicted"]
        # the tree stage as the server runs it (DraftStage.tree_of): the mixture tree's two launches, the layout's walk
        assert predicted["shape"] == "qwen3-4b" and predicted["tree_launches"] == 3, row
        assert 0 < predicted["draft_ms"] < predicted["round_ms"] and row["launch_floor_us"] > 0, row
        assert "measured_over_predicted" not in row  # tiny shapes on a CPU: nothing to compare
    profile = (device_call["out"] / "round-profile.txt").read_text()
    assert [line.split(" (")[0] for line in profile.splitlines() if line.startswith("=====")] == [
        "===== mfd bs 1 K 8 B 64", "===== mfd_d bs 1 K 1 B 64", "===== ddtree bs 1 K 1 B 64"]
    assert "aten::mm" in profile


def test_the_device_call_registers_the_installed_plugin(device_call):
    """SGLang's engine imports against the kit and resolves MFD / MFD_D with the plugin from the kit's site,
    not from the copy's source folder."""
    probe = rows(device_call["report"], "env")[1]
    assert probe["ok"] and probe["MFD"] == "CustomSpecAlgo('MFD')", probe
    assert "/site/mfd_sglang/" in probe["mfd_sglang"] and str(device_call["copy"]) not in probe["mfd_sglang"]


def test_the_device_calls_servers_speculate_and_emit_the_plain_servers_tokens(device_call):
    from mfd_sglang.check.servers import TINY_ACCEPT_BOUNDS

    report = device_call["report"]
    tiny = rows(report, "servers_tiny")
    assert [r["server"] for r in tiny] == ["MFD", "MFD_D"]
    for row in tiny + rows(report, "servers_bf16"):  # the pair that accepts long paths
        assert row["ok"] and row["complete"] and row["mean_accept"] >= TINY_ACCEPT_BOUNDS[row["server"]], row
    assert all(r["exact"] for r in tiny), tiny
    random_rows = rows(report, "servers_4b")
    assert [r["server"] for r in random_rows] == ["MFD", "MFD_D"] and all(r["ok"] and r["exact"] for r in random_rows)
    print("tiny pair mean accept length:", {r["server"]: r["mean_accept"] for r in tiny})


def test_the_device_call_returns_what_the_device_tool_can_bring_back(device_call):
    """At most 8 files, 16 MiB each, no deeper than two folders, plain names (the device tool's limits);
    the server logs hold every server's start-up events."""
    files = [p for p in device_call["out"].rglob("*") if p.is_file()]
    assert 3 <= len(files) <= 8 and all(p.stat().st_size <= 16 * 2**20 for p in files), files
    assert {p.name for p in files} >= {"report.json", "rows.jsonl", "server-logs.txt", "console.log", "kit-install.log",
                                       "round-profile.txt"}
    logs = (device_call["out"] / "server-logs.txt").read_text()
    assert logs.count("===== ") == 3 * 3  # plain + MFD + MFD_D in each of the three server sections
    assert "MFD worker: drafter" in logs
    lines = (device_call["out"] / "rows.jsonl").read_text().splitlines()
    assert len(lines) == sum(len(e.get("rows", [])) for e in device_call["report"]["sections"].values())


def test_what_one_device_call_carries_fits_with_a_margin(device_call):
    """Repository + kit + carried pair within the call's 64 MiB, with at least 8 MiB to spare."""
    from gpu_check import CARRY_LIMIT, CARRY_MARGIN

    carried = device_call["carried"]
    print(f"one device call carries {carried / 2**20:.1f} MiB")
    assert carried <= CARRY_LIMIT - CARRY_MARGIN, f"{carried / 2**20:.1f} MiB"
