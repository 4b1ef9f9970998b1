"""Benchmarks run and report well-formed results (no timing is asserted)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_tree_build_benchmark_reports_every_shape():
    proc = subprocess.run(
        [sys.executable, "benchmarks/tree_build.py", "--bs", "1", "2", "--modes", "2", "--depth", "3",
         "--vocab", "16", "--budgets", "4", "8", "--repeats", "1", "--device", "cpu", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {(r["bs"], r["B"]) for r in rows} == {(1, 4), (1, 8), (2, 4), (2, 8)}
    assert all(r["ms"] > 0 and r["K"] == 2 and r["V"] == 16 for r in rows)


def test_gpu_check_script_runs_and_records_json(tmp_path):
    """The one-call GPU check, smoke-run on CPU (Triton under the interpreter): its JSON is complete."""
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--device", "cpu", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["env"]["torch"] and report["date"]
    assert report["tree"] and all(row["identical"] for row in report["tree"]), report["tree"]
    assert report["tree_time"] and all(row["torch_ms"] > 0 for row in report["tree_time"])
    assert report["attention"] and all(row["ok"] for row in report["attention"]), report["attention"]
    assert report["round_cost"] and all(row["round_cost"] > 0 for row in report["round_cost"]), report
    assert {row["config"] for row in report["round_cost"]} == {"mfd", "mfd_d", "ddtree"}
    assert all(row["graph_equals_eager"] for row in report["round_cost"])
    # Real CPU servers on a random target: MFD and MFD_D emit the plain server's tokens.
    assert [row["server"] for row in report["servers"]] == ["MFD", "MFD_D"], report.get("servers_error")
    assert all(row["exact"] for row in report["servers"]), report["servers"]
    assert str(out) in proc.stdout
