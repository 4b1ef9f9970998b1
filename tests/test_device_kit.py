"""The device kit (scripts/device_kit.sh) and its CPU rehearsal.

The kit must let the borrowed GPU machine (torch 2.11 / triton 3.6 / transformers 5.17, no SGLang, no
registry) run a real SGLang 0.5.23 server with this plugin, in at most 38 MiB next to the repository
(64 MiB per device call). The rehearsal proves that before any GPU minute is spent: a second
environment with the image's versions (torch 2.11.0, triton 3.6.0, transformers 5.17.0 and only those
of the image's other packages that SGLang imports; see device_kit.sh for the one version that differs)
plus ONLY the kit runs `mfd_sglang.cpu.launch_server` with MFD on the tiny pair, and its token ids
equal the target's own greedy decoding (on this machine's torch; a plain server is not started: MFD's
server runs all of SGLang a plain one does, and CI time is short).

Building the kit downloads ~52 MB of wheels, the rehearsal environment a few GB (torch 2.11.0 is PyPI's
CUDA build, which needs its nvidia libraries to load even on a CPU); both are cached (.device-kit/ and
~/.cache/mfd-sglang/device-rehearsal-<pins>). A failed download fails these tests: nothing is skipped.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import target_greedy
from servers import ServerProcess, free_port, generate_ids

REPO = Path(__file__).resolve().parents[1]
KIT_SCRIPT = REPO / "scripts" / "device_kit.sh"
LIMIT = 38 * 2**20
MAX_NEW = 16


def run(cmd: list[str], *, env: dict | None = None, timeout: float = 1800) -> str:
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def kit() -> Path:
    out = run(["bash", str(KIT_SCRIPT), "build"])
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
    run(["bash", str(KIT_SCRIPT), "build"], env={"MFD_DEVICE_KIT": str(again)})
    first = {f["path"]: f["sha256"] for f in json.loads((kit / "kit.json").read_text())["files"]}
    second = {f["path"]: f["sha256"] for f in json.loads((again / "kit.json").read_text())["files"]}
    assert first == second


# --- the CPU rehearsal --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def rehearsal(kit, tmp_path_factory) -> dict:
    """(python, site): the rehearsal venv's interpreter and the site folder the kit was installed into
    exactly as on the device (scripts/device_kit.sh install), with the cp311 builds of its compiled wheels."""
    env_dir = Path(run(["bash", str(KIT_SCRIPT), "rehearsal-env"], timeout=3600).strip().splitlines()[-1])
    python = env_dir / "venv" / "bin" / "python"
    site = tmp_path_factory.mktemp("rehearsal") / "site"
    run(["bash", str(KIT_SCRIPT), "install", str(site), "--compiled-wheels", str(env_dir / "cp311")],
        env={"PYTHON": str(python)})
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
    assert all(d < 1e-5 for d in out["diffs"].values()), out["diffs"]


@pytest.fixture(scope="module")
def rehearsal_ids(rehearsal, tiny_pair, tmp_path_factory) -> dict:
    """Token ids of an MFD (B = 8) server on the tiny pair, fp32, four requests at once. MFD_D runs the same
    worker code (its path choice is held by tests/test_mfd_server.py)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    prompts = json.loads((tiny_pair / "prompts.json").read_text())[:4]
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    logdir = tmp_path_factory.mktemp("rehearsal-logs")
    out = {"prompts": prompt_ids}
    port = free_port()
    cmd = [str(rehearsal["python"]), "-m", "mfd_sglang.cpu.launch_server", "--model-path", str(tiny_pair / "target"),
           "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--max-total-tokens", "4096",
           "--context-length", "1024", "--max-running-requests", "4", "--skip-tokenizer-init",
           "--speculative-algorithm", "MFD", "--speculative-draft-model-path", str(tiny_pair / "drafter"),
           "--speculative-num-draft-tokens", "9"]
    # cwd outside the repository: `python -m` puts the cwd first on sys.path, and the plugin must come
    # from the kit's site, laid out as on the device
    with ServerProcess(cmd, logdir / "MFD.log", port=port, env=clean_env(rehearsal["site"]),
                       cwd=logdir, startup_timeout=900) as server:
        with concurrent.futures.ThreadPoolExecutor(len(prompt_ids)) as pool:
            results = list(pool.map(lambda ids: generate_ids(server, ids, MAX_NEW), prompt_ids))
    out["MFD"] = [ids for ids, _ in results]
    out["MFD_accept"] = [meta.get("spec_accept_length") for _, meta in results]
    return out


def test_rehearsal_server_emits_the_targets_greedy_token_ids(rehearsal_ids, hf_target):
    mfd = rehearsal_ids["MFD"]
    assert [len(ids) for ids in mfd] == [MAX_NEW] * 4
    # the MFD server on torch 2.11 equals the target's greedy decoding on this machine's torch
    model, _ = hf_target
    assert mfd == [target_greedy(model, ids, MAX_NEW) for ids in rehearsal_ids["prompts"]]
    # the drafter really drafted: more than one token per verify round on average
    accept = [a for a in rehearsal_ids["MFD_accept"] if a is not None]
    assert accept and sum(accept) / len(accept) > 1.0, rehearsal_ids["MFD_accept"]
