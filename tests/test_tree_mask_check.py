"""The GPU check's tree-mask section (`benchmarks/tree_mask_check.py`) on CPU.

With the worker's FULL_MASK, every backend MFD allows on CPU (mfd_cpu, Triton under the interpreter)
passes eagerly, and the rows it cannot run say why. The check can fail: fed a chain mask (causal over
the flat verify window, what a backend that ignores the tree mask computes) it reports the sibling leak;
fed a mask that hides the root from its descendants (siblings still apart) the path comparison fails.
The graph mode's replay path (static buffers, `init_forward_metadata_out_graph` on SGLang's replay
view) runs on CPU without the capture, for Triton.

Everything runs in one subprocess: TRITON_INTERPRET must be set before triton kernels are imported,
and the attention test kit SGLang ships changes process-wide parallel settings when imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    sys.path.insert(0, "benchmarks")
    import tree_mask_check as check
    from mfd_sglang.tree_layout import full_custom_mask

    def chain(ancestor, seq_lens, total):
        return full_custom_mask(torch.ones_like(ancestor).tril(), seq_lens, total)

    def rootless(ancestor, seq_lens, total):
        mask = ancestor.clone()
        mask[:, 1:, 0] = False
        return full_custom_mask(mask, seq_lens, total)

    def replay_path(builder):
        setup = check.Setup("triton", "cpu", check.shapes("cpu", True), builder, graph=True)
        try:
            inputs = [setup.qkv, setup.changed_a()]
            outs, _ = check.run_graph(setup, inputs, capture=False)
            return {**check.measure(setup, inputs, outs), "backend_topk": setup.backend.topk}
        finally:
            setup.close()

    report = {name: check.tree_mask_section("cpu", True, mask_builder=builder)
              for name, builder in (("full", full_custom_mask), ("chain", chain), ("rootless", rootless))}
    report["replay_full"] = replay_path(full_custom_mask)
    report["replay_chain"] = replay_path(chain)
    json.dump(report, open(sys.argv[1], "w"))
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tree_mask") / "report.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def ran(rows):
    return [r for r in rows if "skipped" not in r]


def test_cpu_backends_apply_the_tree_mask(report):
    rows = report["full"]
    assert {(r["backend"], r["mode"]) for r in ran(rows)} == {("triton", "eager"), ("mfd_cpu", "eager")}
    for r in ran(rows):
        assert r["ok"], r
        assert r["sibling_max_diff"] == 0 and r["a_subtree_changed"] and r["path_max_err"] <= r["tol"] == 1e-4
    assert len(rows) == 2  # the CPU backends, eager: nothing skipped


def test_a_chain_mask_fails_on_the_sibling_leak(report):
    rows = ran(report["chain"])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    for r in rows:
        assert not r["ok"] and r["sibling_max_diff"] > 1e-3, r


def test_a_rootless_mask_fails_on_the_path_comparison(report):
    rows = ran(report["rootless"])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    for r in rows:
        assert r["sibling_max_diff"] == 0, r  # siblings still apart: only the path check can see this
        assert not r["ok"] and r["path_max_err"] > 1e-2, r


def test_graph_replay_path_applies_the_mask_on_cpu(report):
    good, bad = report["replay_full"], report["replay_chain"]
    assert good["sibling_max_diff"] == 0 and good["a_subtree_changed"] and good["path_max_err"] <= 1e-4, good
    assert good["backend_topk"] == 1  # built under MFD's top-k 1 setting, where kernels may skip the mask
    assert bad["sibling_max_diff"] > 1e-3 and bad["path_max_err"] > 1e-2, bad
