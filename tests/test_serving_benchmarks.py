"""The closed-loop benchmark, the reference-engine speed table and the demo, run small on the tiny
pair (CPU servers, fp32): they finish and report well-formed results. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_closed_loop_benchmark_writes_json_and_png(tiny_pair, tmp_path):
    out = tmp_path / "closed.json"
    proc = _run(["benchmarks/closed_loop.py", "--target", str(tiny_pair / "target"),
                 "--mfd-drafter", str(tiny_pair / "drafter"), "--configs", "ar,mfd,dflash",
                 "--single-drafter", str(tiny_pair / "drafter"),
                 "--prompts-file", str(tiny_pair / "prompts.json"), "--limit", "3", "--batch-sizes", "1", "2",
                 "--requests-per-size", "3", "--max-tokens", "12", "--dtype", "float32", "--budget", "8",
                 "--out", str(out)], timeout=900)
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(report["results"]) == {"ar", "mfd"} and "dflash" in report["skipped"]
    for name, runs in report["results"].items():
        assert set(runs) == {"1", "2"}
        for run in runs.values():
            assert run["requests"] == 3 and run["errors"] == 0, run
            assert run["decode_tokens_per_second"] > 0 and run["speedup"] > 0 and run["mean_ttft_seconds"] > 0
    assert all(run["tau"] > 1 for run in report["results"]["mfd"].values())
    assert "ar" in proc.stdout and "mfd" in proc.stdout


def test_hf_speed_benchmark_table(tiny_pair, tiny_dflash_drafter, tmp_path):
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    _run(["benchmarks/hf_speed.py", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter),
          "--mfd", str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"), "--limit", "2",
          "--budgets", "4", "8", "--max-new-tokens", "16", "--dtype", "float32", "--out", str(out),
          "--markdown", str(md)], timeout=600)
    results = json.loads(out.read_text())["results"]["prompts"]
    for temperature in ("0.0", "1.0"):
        assert set(results[temperature]) == {"chain", "ddtree", "mfd"}
        assert set(results[temperature]["mfd"]) == {"4", "8"} and set(results[temperature]["chain"]) == {"7"}
        assert all(row["tau"] >= 1 and row["speedup"] > 0
                   for per_budget in results[temperature].values() for row in per_budget.values())
    table = md.read_text()
    assert table.count("| prompts |") == 6 and "| mfd |" in table


def test_demo_code_path_short(tiny_pair, tmp_path):
    from mfd_sglang.demo import run_demo

    lines = []
    plain, mfd = run_demo(tiny_pair / "target", tiny_pair / "drafter", prompts=["one two three"], max_tokens=8,
                          budget=8, device="cpu", dtype="float32", log_dir=tmp_path, say=lines.append)
    assert plain.completion_tokens == mfd.completion_tokens > 0
    assert mfd.answers == plain.answers  # fp32: exact
    assert mfd.tau is not None and mfd.tau > 1 and plain.tau is None
    text = "\n".join(lines)
    assert "starting the MFD server" in text and "speed of MFD against plain" in text
