"""`python -m mfd_sglang check` (mfd_sglang/check/selfcheck.py), rehearsed on CPU on the tiny pair: Triton under
the interpreter, the servers through the CPU launcher, the CUDA-graph section a structural skip.

The check runs in a subprocess started outside the repository, through a wrapper that reports which files of
the process came from the repository's benchmarks/ or scripts/ (none may: the check runs from an installed
wheel) and, for the failure test, replaces one kernel with a wrong one first (a monkeypatch in that process
only: no switch of the plugin can do it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mfd_sglang.check.servers import TINY_ACCEPT_BOUNDS

REPO = Path(__file__).resolve().parents[1]

# argv[1]: JSON list of the check's arguments; argv[2]: Python run first (the injected kernel), may be empty.
WRAPPER = """
import json, sys
exec(sys.argv[2])
from mfd_sglang.cli import main
try:
    code = main(["check", *json.loads(sys.argv[1])])
finally:
    loaded = [getattr(m, "__file__", None) or "" for m in list(sys.modules.values())]
    print("LOADED_FROM_REPO_SCRIPTS " + json.dumps([f for f in loaded if "/benchmarks/" in f or "/scripts/" in f]))
sys.exit(code)
"""

# SGLang's custom mask of the last request with its last cell (the last node's own column: True) flipped.
WRONG_MASK = """
import mfd_sglang.kernels.verify_mask as verify_mask
right = verify_mask.full_custom_mask_triton
def wrong(*args, **kwargs):
    mask = right(*args, **kwargs)
    mask[-1] = ~mask[-1]
    return mask
verify_mask.full_custom_mask_triton = wrong
"""


def run_check(tiny_pair: Path, cwd: Path, *args: str, inject: str = "") -> tuple[subprocess.CompletedProcess, dict]:
    out = cwd / "report"
    argv = ["--target", str(tiny_pair / "target"), "--drafter", str(tiny_pair / "drafter"), "--budget", "16",
            "--prompts", str(tiny_pair / "prompts.json"), "--max-new-tokens", "32", "--out", str(out), *args]
    # TRITON_INTERPRET before the injected code imports a kernel (the check itself sets it, later, on a CPU)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(argv), inject], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=1500)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").is_file() else None
    assert report is not None, proc.stdout[-4000:] + proc.stderr[-6000:]
    loaded = json.loads(proc.stdout.split("LOADED_FROM_REPO_SCRIPTS ")[1].splitlines()[0])
    assert loaded == [], loaded  # nothing of benchmarks/ or scripts/ in the process
    return proc, report


def rows(report: dict, section: str) -> list[dict]:
    return report["sections"][section].get("rows", [])


@pytest.fixture(scope="module")
def passing_check(tiny_pair, tmp_path_factory):
    return run_check(tiny_pair, tmp_path_factory.mktemp("self-check"))


def test_the_self_check_passes_on_the_tiny_pair_with_every_kernel_compared(passing_check):
    proc, report = passing_check
    assert proc.returncode == 0 and report["passed"], (report["failures"], proc.stdout[-4000:], proc.stderr[-4000:])
    assert list(report["sections"]) == ["env", "tree", "vocab", "attention", "drafter_steps", "commit", "graphs",
                                        "servers"]
    assert report["budget"] == 16 and report["kernels"] == {"flag": "auto", "round": "torch"}
    assert report["pair"]["K"] == 4 and report["pair"]["block"] == 8
    # every kernel section compared something, at the pair's shapes and the budget, and nothing was skipped
    for section in ("tree", "vocab", "attention", "drafter_steps", "commit"):
        assert rows(report, section) and all(r["ok"] for r in rows(report, section)), section
    assert {(r["K"], r["B"], r["D"]) for r in rows(report, "tree")} == {(4, 16, 7), (1, 16, 7)}
    assert max(r["walk_accept_len"] for r in rows(report, "tree")) > 1  # the walks were checked past the root
    assert {r["step"] for r in rows(report, "drafter_steps")} == {"norm_rope", "residual_mlp", "block_input", "drafter"}
    assert {r["window"] for r in rows(report, "commit")} == {17}
    assert report["sections"]["graphs"]["skipped"].startswith("needs CUDA")
    env, probe = rows(report, "env")
    assert all(env["env"][name][0].isdigit() for name in ("sglang", "torch", "triton", "transformers", "mfd_sglang"))
    assert probe["ok"] and probe["MFD_D"] == "CustomSpecAlgo('MFD_D')", probe
    assert "RESULT: PASS" in proc.stdout and "=== MFD self-check" in proc.stdout


def test_the_self_checks_servers_speculate_and_emit_the_plain_servers_tokens(passing_check):
    _, report = passing_check
    servers = rows(report, "servers")
    assert [r["server"] for r in servers] == ["MFD", "MFD_D"]
    for row in servers:  # exact over real speculation: the tiny pair accepts long paths
        assert row["ok"] and row["exact"] and row["complete"] and row["B"] == 16, row
        assert row["mean_accept"] >= TINY_ACCEPT_BOUNDS[row["server"]], row
        assert row["round_ms"] > 0 and row["plain_step_ms"] > 0 and row["tokens_per_round"] > 1, row
    print("self-check accept lengths:", {r["server"]: r["mean_accept"] for r in servers})


def test_the_self_check_fails_naming_a_wrong_kernel(tiny_pair, tmp_path):
    proc, report = run_check(tiny_pair, tmp_path, "--only", "tree", "commit", inject=WRONG_MASK)
    assert proc.returncode == 1 and not report["passed"]
    assert all(r["ok"] for r in rows(report, "commit"))  # only the broken kernel's rows fail
    failed = [r for r in rows(report, "tree") if not r["ok"]]
    assert failed and all(r["mismatch"] == "custom_mask" for r in failed), failed
    assert report["failures"] and all(line.startswith("tree[") and "custom_mask" in line for line in report["failures"])
    assert "RESULT: FAIL" in proc.stdout and "custom_mask" in proc.stdout.split("RESULT: FAIL")[1]


def test_with_the_torch_path_the_kernel_sections_are_skipped_with_the_reason(tiny_pair, tmp_path):
    proc, report = run_check(tiny_pair, tmp_path, "--mfd-kernels", "torch", "--only", "tree", "vocab", "commit")
    assert proc.returncode == 0 and report["passed"], report
    assert report["kernels"] == {"flag": "torch", "round": "torch"}
    for section in ("tree", "vocab", "commit"):
        assert report["sections"][section]["skipped"].startswith("--mfd-kernels torch"), section
