"""Shared fixtures: the make-tiny pair (built once per test session) and its plain-DFlash twin; and what the
kit tests share: a checked subprocess run and the prelude of a probe that imports modules as on an H200."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from mfd_sglang.hf import plain_greedy
from mfd_sglang.lab.tiny import make_tiny

REPO = Path(__file__).resolve().parents[1]

# Under pytest-xdist (scripts/test.sh: two workers on this 2-core machine) a worker and the servers it starts take
# one OpenMP thread each: two workers' default threads would contend for the same two cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The modules that take longest (2 to 12 minutes each: servers, kits, the interpreter; measured by a two-worker
# run's junit report), handed out first so that the workers finish together (xdist's loadfile hands modules out
# in collection order); the others keep theirs.
LONGEST_FIRST = ("test_sglang_kits", "test_released_formats", "test_device_kit", "test_serving", "test_mfd_server",
                 "test_gpu_ledger", "test_scale_out", "test_self_check", "test_hybrid_target", "test_pd_disaggregation",
                 "test_serving_benchmarks", "test_tp_server", "test_flashinfer_kit", "test_auto_budget",
                 "test_dflash_server", "test_tree_triton", "test_warmup")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest in their order


# The start of a `python -c` probe run as on an H200 (torch.cuda forced available; sglang.srt.utils.is_cuda()
# also needs torch.version.cuda, which a CUDA build of torch has): it imports every module named in the JSON
# list sys.argv[1] and keeps each failure's traceback in `failures`.
FORCED_H200_IMPORTS = r"""
import importlib, json, sys, traceback
import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "NVIDIA H200"
failures = {}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)
    except Exception:
        failures[name] = traceback.format_exc()[-2500:]
"""


def run_checked(cmd: list, *, env: dict | None = None, timeout: float = 1800, cwd: Path = REPO) -> str:
    """`cmd`'s stdout; the test fails naming the command, its exit status and the tails of its output when it
    exits non-zero. `env` is the whole environment (None: this process's)."""
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env or os.environ)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `build(folder)` fills, built once per test run: pytest-xdist's workers share their base
    folder's parent, where the first worker builds it under a lock while the others wait, then reuse it."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        folder = tmp_path_factory.mktemp(name)
        build(folder)
        return folder
    shared = tmp_path_factory.getbasetemp().parent
    folder = shared / name
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            build(folder)
            (folder / ".built").touch()
    return folder


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> Path:
    """OUTDIR with target/, drafter-dflash/ (single-mode), drafter/ (MFD, K = 4) and prompts.json.
    MFD_SGLANG_TINY_PAIR names one already built with the same settings (the GPU check carries it: make-tiny
    writes the same bytes per seed)."""
    if os.environ.get("MFD_SGLANG_TINY_PAIR"):
        return Path(os.environ["MFD_SGLANG_TINY_PAIR"])
    return built_once(tmp_path_factory, "tiny", lambda out: make_tiny(out, seed=0, num_modes=4, log=lambda *a: None))


@pytest.fixture(scope="session")
def hybrid_pair(tmp_path_factory) -> Path:
    """make-tiny's hybrid pair (a Qwen3.5-shaped target: two Gated DeltaNet layers, then full attention; drafters
    as tiny_pair's), built once for the modules that serve hybrid targets."""
    return built_once(tmp_path_factory, "tiny_hybrid",
                      lambda out: make_tiny(out, seed=0, num_modes=4, hybrid=True, log=lambda *a: None))


@pytest.fixture(scope="session")
def tiny_dflash_drafter(tiny_pair) -> Path:
    """The pair's single-mode drafter, a plain DFlash checkpoint (K = 1, no mode_embed, no mfd_config), trained
    as the MFD drafter is (same continuations, same steps)."""
    return tiny_pair / "drafter-dflash"


@pytest.fixture(scope="session")
def hf_target(tiny_pair):
    """(the tiny target as an fp32 HF model, its tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair / "target", dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_pair / "target")


@pytest.fixture(scope="session")
def plain_server(tiny_pair, tmp_path_factory):
    """A plain SGLang CPU server on the tiny pair (fp32, 8 running requests), shared by the modules that
    hold MFD's servers to it (one start less in CI). Without overlap scheduling: with it, SGLang 0.5.23's
    plain server counts a request's output for penalties one token late (its first decode step counts
    the last prompt token instead of the first output token: `ScheduleBatch.cumulate_penalty_output_tokens`
    reads req.output_ids before the previous step's result is in). MFD counts every output token when it
    is output. Sampling is the same law either way (the sampler runs on the step's own logits)."""
    from servers import start_server

    srv = start_server(tmp_path_factory, tiny_pair, None, None, None, max_running=8,
                       extra_args=("--disable-overlap-schedule",))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def tiny_prompts(tiny_pair) -> list[str]:
    return json.loads((tiny_pair / "prompts.json").read_text())


@pytest.fixture(scope="session")
def reference_target(tiny_pair):
    """The tiny target as the reference engine loads it (fp32, SDPA attention)."""
    from mfd_sglang.hf import load_target

    return load_target(tiny_pair / "target")


def reference_drafter(path: Path):
    """A drafter checkpoint as the reference engine loads it (fp32)."""
    from mfd_sglang.checkpoint import load_drafter
    from mfd_sglang.drafter import MFDDrafter

    return MFDDrafter.from_checkpoint(load_drafter(path), dtype=torch.float32)


# The ground truth every test holds a speculative path to: the target's plain greedy decoding.
target_greedy = plain_greedy
