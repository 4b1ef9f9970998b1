"""Benchmarks run and report well-formed results (no timing is asserted)."""

import json
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
