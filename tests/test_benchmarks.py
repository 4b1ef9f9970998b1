"""Benchmarks run and report well-formed results (no timing is asserted); the GPU check fails when
something is wrong."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))


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
    """The one-call GPU check, smoke-run on CPU (Triton under the interpreter) with --allow-skip: every
    section runs except the Triton timings, which need a GPU, and every correctness item passes."""
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--device", "cpu", "--allow-skip", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=900, env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    report = json.loads(out.read_text())
    assert report["env"]["torch"] and report["date"]
    # the order of the one device call: kernel exactness, the server part, then costs and timings
    ran = [k.removesuffix("_seconds") for k in report if k.endswith("_seconds")]
    assert ran == ["tree", "vocab", "attention", "sync", "tree_mask", "servers", "round_cost", "tree_time",
                   "attention_time", "vocab_time", "hybrid_servers"]
    assert [k for k in report if k.endswith("_skipped")] == ["attention_time_skipped", "vocab_time_skipped",
                                                           "hybrid_servers_skipped"], report
    assert report["vocab"] and all(row["ok"] and row["shared"] == 1.0 for row in report["vocab"]), report["vocab"]
    # The host-sync cases run on CPU but can only be checked on CUDA: skipped rows, not passes.
    assert report["sync"] and all("skipped" in row and "error" not in row for row in report["sync"]), report["sync"]
    assert report["tree"] and all(row["identical"] for row in report["tree"]), report["tree"]
    assert report["tree_time"] and all(row["torch_ms"] > 0 for row in report["tree_time"])
    assert report["attention"] and all(row["ok"] for row in report["attention"]), report["attention"]
    assert report["round_cost"] and all(row["round_cost"] > 0 for row in report["round_cost"]), report
    assert {row["config"] for row in report["round_cost"]} == {"mfd", "mfd_d", "ddtree"}
    assert all(row["graph_equals_eager"] for row in report["round_cost"])
    # Real CPU servers on a random target: MFD_D emits the plain server's tokens.
    assert [row["server"] for row in report["servers"]] == ["MFD_D"], report.get("servers_error")
    assert all(row["exact"] and row["ok"] and row["complete"] for row in report["servers"]), report["servers"]
    assert str(out) in proc.stdout
    # On CPU the tree-mask rows are the CPU backends, eager; all must pass.
    assert {(row["backend"], row["mode"]) for row in report["tree_mask"]} == {("mfd_cpu", "eager"), ("triton", "eager")}
    assert all(row["ok"] for row in report["tree_mask"]), report["tree_mask"]
    assert proc.returncode == 0 and report["passed"] and report["failures"] == [], proc.stdout[-3000:]
    assert "RESULT: PASS" in proc.stdout


FAILING_RUN = """
import sys
sys.path.insert(0, "benchmarks")
import gpu_check

def mismatch(device, quick):
    return [{"bs": 1, "identical": True}, {"bs": 2, "identical": False}]

def boom(device, quick):
    raise RuntimeError("kernel exploded")

def timing(device, quick):
    return [{"bs": 1, "B": 8, "V": 16, "torch_ms": 0.5}]

gpu_check.SECTIONS = {"tree": mismatch, "attention": boom, "tree_time": timing}
sys.argv = ["gpu_check.py", "--device", "cpu", "--out", sys.argv[1]] + sys.argv[2:]
gpu_check.main()
"""


def test_gpu_check_fails_on_a_mismatch_and_an_error_and_keeps_what_finished(tmp_path):
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "-c", FAILING_RUN, str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["tree"] == [{"bs": 1, "identical": True}, {"bs": 2, "identical": False}]
    assert "RuntimeError: kernel exploded" in report["attention_error"] and report["attention"] == []
    assert report["tree_time"] == [{"bs": 1, "B": 8, "V": 16, "torch_ms": 0.5}]
    assert report["passed"] is False
    assert [f.split(":")[0] for f in report["failures"]] == ["tree[1]", "attention"], report["failures"]
    assert "RESULT: FAIL (2 items)" in proc.stdout


def test_gpu_check_passes_only_when_every_item_passed():
    from gpu_check import failures

    good = {"tree": [{"identical": True}], "servers": [{"ok": True, "exact": True}], "tree_time": [{"torch_ms": 1.0}],
            "attention": [{"ok": True, "max_abs_error": 2e-7}]}  # a measured error is no error
    assert failures(good, ["tree", "servers", "tree_time", "attention"], allow_skip=False) == []
    assert failures({"attention": [{"ok": False, "max_abs_error": 0.5}]}, ["attention"], allow_skip=False)
    # a skipped section fails unless skips are allowed
    skipped = {**good, "servers": [], "servers_skipped": "sglang is not importable"}
    assert failures(skipped, ["tree", "servers"], allow_skip=False) == ["servers: SKIPPED sglang is not importable"]
    assert failures(skipped, ["tree", "servers"], allow_skip=True) == []
    # a skipped row likewise; a row with an error always fails, also in a timing section
    rows = {"tree_mask": [{"ok": True}, {"ok": False, "skipped": "FlashInfer needs CUDA"}],
            "tree_time": [{"torch_ms": 1.0, "triton_ms": None, "triton_error": "OutOfResources: smem"}]}
    assert failures(rows, ["tree_mask", "tree_time"], allow_skip=True) == [
        "tree_time[0]: ERROR triton_error: OutOfResources: smem"]
    assert len(failures(rows, ["tree_mask", "tree_time"], allow_skip=False)) == 2
    # a correctness section that checked nothing, or never ran, is a failure
    assert failures({"tree": []}, ["tree"], allow_skip=True) == ["tree: no rows (nothing was checked)"]
    assert failures({}, ["tree"], allow_skip=True) == ["tree: did not run"]
    assert failures({"servers": [{"ok": False, "exact": False}]}, ["servers"], allow_skip=True)


def test_server_rows_require_exactness_in_fp32_and_completion_always():
    from server_exactness import ServerConfig, compare

    plain = {"ids": [[1, 2, 3], [4, 5, 6]], "startup_s": 1.0, "accept_length": [None, None]}
    parted = {"ids": [[1, 2, 3], [4, 9, 9]], "startup_s": 1.0, "accept_length": [1.5, 1.2]}
    short = {"ids": [[1, 2, 3], [4, 5]], "startup_s": 1.0, "accept_length": [1.5, 1.2]}
    fp32, bf16 = (ServerConfig(d, True, "triton", "why") for d in ("float32", "bfloat16"))
    row = lambda cfg, spec, ref=plain: compare("MFD", cfg, spec, ref, 64, [[0], [0]], 3)
    assert row(fp32, plain)["ok"] and row(fp32, plain)["exact"]
    assert not row(fp32, parted)["ok"] and row(fp32, parted)["first_divergence"] == [None, 1]
    # bf16: the verify forward and the decode round differently, so parting is recorded, not failed
    assert row(bf16, parted)["ok"] and not row(bf16, parted)["exact"]
    assert not row(bf16, short)["ok"]  # but every request must complete
    failed = row(bf16, plain, {"error": "RuntimeError: server exited"})
    assert not failed["ok"] and "plain: RuntimeError: server exited" in failed["error"]


def test_the_automatic_budget_row_requires_a_verify_graph_for_every_budget_within_its_plan():
    """With CUDA graphs on, the automatic-budget server's row passes only when its start-up log listed a
    tree-verify graph for every candidate budget's window (B = 16: 0, 4, 8, 16 -> 1, 5, 9, 17 tokens) and
    the memory the extra windows took is within what the launch plan counted for them."""
    from server_exactness import AUTO_SERVER, ServerConfig, compare

    plain = {"ids": [[1, 2, 3]], "startup_s": 1.0, "accept_length": [None]}
    graphs, eager = ServerConfig("float32", True, "triton", "why"), ServerConfig("float32", False, "triton", "why")

    def row(widths, measured=700, planned=2126, config=graphs):
        spec = {**plain, "verify_graph_widths": widths, "verify_graph_mib": {"measured": measured, "planned": planned}}
        return compare(AUTO_SERVER[0], config, spec, plain, 16, [[0]], 3)

    assert row([1, 5, 9, 17])["ok"] and row([1, 5, 9, 17])["verify_graph_widths"] == [1, 5, 9, 17]
    assert row([1, 5, 9, 17])["verify_graph_mib"] == {"measured": 700, "planned": 2126}
    assert not row([17])["ok"] and not row(None)["ok"]
    assert not row([1, 5, 9, 17], measured=2200)["ok"]  # took more than planned
    assert not row([1, 5, 9, 17], planned=None)["ok"] and not row([1, 5, 9, 17], measured=None)["ok"]
    assert row(None, None, None, eager)["ok"]  # no graphs to require


def test_the_server_log_gives_the_verify_graph_widths_and_memory(tmp_path, monkeypatch):
    """The figures the row above reads, parsed from the lines the plugin logs (the worker's capture, the
    launch plan's warning under a given --mem-fraction-static)."""
    import logging

    import server_exactness
    from mfd_sglang.serving.memory import MemoryPlan, reserve_in_mem_fraction
    from mfd_sglang.serving.verify_graph import VerifyGraphsByWidth

    log = tmp_path / "server.log"
    handler = logging.FileHandler(log)
    loggers = [logging.getLogger(f"mfd_sglang.serving.{name}") for name in ("memory", "verify_graph")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:  # as a server logs them: at INFO
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        plan = MemoryPlan(weight_bytes=0, context_bytes_per_token=0, hidden=8, intermediate=8, attention_width=8,
                          num_modes=1, block=2, budget=16, vocab=8, draft_vocab=8, dtype_bytes=2,
                          verify_graph_bytes=2126 * 2**20)
        reserve_in_mem_fraction(SimpleNamespace(max_running_requests=8, mem_fraction_static=0.8), plan,
                                gpu_mem_mib=143_000, user_set=True)
        runner = SimpleNamespace(attn_backend="backend 17", decode_cuda_graph_runner="runner 17")
        monkeypatch.setattr("mfd_sglang.serving.verify_graph.get_spec",
                            lambda: SimpleNamespace(speculative_num_draft_tokens=17))
        VerifyGraphsByWidth(runner, [1, 5, 9, 17], capture=lambda model_runner, width: (width, width))
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        handler.close()

    class Server:  # stands in for ServerProcess: the log is already written
        def __init__(self, cmd, log_path, **kwargs):
            log_path.write_text(log.read_text())

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(server_exactness, "ServerProcess", Server)
    monkeypatch.setattr(server_exactness, "generate_ids", lambda server, prompt, n: ([1, 2], {}))
    out = server_exactness.serve_and_generate(
        tmp_path, tmp_path, "MFD_D", [[0]], device="cpu", config=server_exactness.ServerConfig("float32", True, None, ""),
        budget=16, max_new_tokens=2, logdir=tmp_path, mem_fraction=0.5, startup_timeout=1)
    assert out["verify_graph_widths"] == [1, 5, 9, 17]
    assert out["verify_graph_mib"] == {"measured": 0, "planned": 2126}


@pytest.mark.parametrize("dtype,want", [("float32", "triton"), ("bfloat16", None)])
def test_server_section_names_its_attention_backend(dtype, want):
    from server_exactness import attention_choice, server_configs

    backend, why = attention_choice(dtype)
    assert backend in ("triton", "flashinfer") and why
    if want is not None:
        assert backend == want
    configs = server_configs("cuda")
    assert [(c.dtype, c.cuda_graphs, c.page_size) for c in configs] == [
        ("float32", True, 1), ("bfloat16", True, 1), ("float32", True, 16), ("float32", False, 1),
        ("bfloat16", False, 1)]
    assert [c.dtype for c in server_configs("cpu")] == ["float32"]


def test_server_section_adds_the_automatic_budget_on_a_gpu():
    from server_exactness import servers

    assert [name for name, _, _ in servers("cpu")] == ["plain", "MFD_D"]
    assert [name for name, _, _ in servers("cuda")] == ["plain", "MFD", "MFD_D", "MFD_D auto"]
    assert servers("cuda")[-1] == ("MFD_D auto", "MFD_D", {"MFD_SGLANG_AUTO_BUDGET": "1"})


def test_closed_loop_compares_auto_with_ar_and_the_best_fixed_budget():
    from closed_loop import compare_auto, split_config

    assert [split_config(n) for n in ("ar", "mfd_d@8", "mfd_d@auto")] == [("ar", None), ("mfd_d", "8"), ("mfd_d", "auto")]

    def run(speed):
        return {"decode_tokens_per_second": speed}

    results = {"ar": {"1": run(10.0), "4": run(40.0)}, "mfd_d@8": {"1": run(15.0), "4": run(30.0)},
               "mfd_d@16": {"1": run(12.0), "4": run(36.0)}, "mfd_d@auto": {"1": run(14.4), "4": run(39.2)},
               "mfd@auto": {"1": run(11.0), "4": run(20.0)}}
    report = compare_auto(results)
    assert report["mfd_d@auto"]["1"] == {"vs_ar": pytest.approx(1.44), "best_fixed": "mfd_d@8",
                                         "vs_best_fixed": pytest.approx(0.96)}
    assert report["mfd_d@auto"]["4"]["best_fixed"] == "mfd_d@16"
    assert report["mfd@auto"]["4"] == {"vs_ar": pytest.approx(0.5)}  # no fixed mfd budget was run

    # Repeats: the median of the ratios within each turn, beside the ratio of the medians.
    results = {"ar": {"2": {"decode_tokens_per_second": 20.0, "repeats_decode_tokens_per_second": [24.0, 20.0, 16.0]}},
               "mfd_d@4": {"2": {"decode_tokens_per_second": 9.0, "repeats_decode_tokens_per_second": [9.0, 12.0, 6.0]}},
               "mfd_d@auto": {"2": {"decode_tokens_per_second": 18.0, "repeats_decode_tokens_per_second": [24.0, 18.0, 16.8]}}}
    assert compare_auto(results)["mfd_d@auto"]["2"] == {
        "vs_ar": pytest.approx(0.9), "vs_ar_paired": pytest.approx(1.0), "best_fixed": "mfd_d@4",
        "vs_best_fixed": pytest.approx(2.0), "vs_best_fixed_paired": pytest.approx(2.6666667)}


def eval_json(path: Path, temperature: float, sets: dict, budgets=(8, 16)) -> Path:
    """An `mfd_sglang eval` JSON: sets {name: (prompts, chain tau, {b: (ddtree tau, mfd tau)})}."""
    results = {}
    for name, (prompts, chain, taus) in sets.items():
        results[name] = {
            "prompts": prompts, "chain": {"15": {"tau": chain}},
            "ddtree": {str(b): {"tau": taus[b][0], "chimera_share": 0.1 * b} for b in budgets},
            "mfd": {str(b): {"tau": taus[b][1], "effective_modes": 2.0} for b in budgets},
        }
    path.write_text(json.dumps({"temperature": temperature, "budgets": list(budgets), "results": results}))
    return path


def test_acceptance_summary_means_over_sets_per_pair_and_temperature(tmp_path):
    from acceptance_summary import group_results, markdown, plot, summarize

    files = [
        eval_json(tmp_path / "mfd4-T1-code.json", 1, {"code": (3, 1.5, {8: (2.0, 3.0), 16: (2.0, 2.0)})}),
        eval_json(tmp_path / "mfd4-T1-chat.json", 1, {"chat": (5, 2.5, {8: (4.0, 3.0), 16: (1.0, 3.0)})}),
        eval_json(tmp_path / "mfd4-T0-code.json", 0, {"code": (3, 1.0, {8: (1.0, 2.0), 16: (1.0, 1.0)})}),
    ]
    groups = group_results(files)
    assert set(groups) == {("mfd4", 1.0), ("mfd4", 0.0)}
    summary = summarize(groups[("mfd4", 1.0)])
    assert summary["sets"] == ["code", "chat"] and summary["prompts"] == 8 and summary["chain"] == 2.0
    assert summary["budgets"][8] == {"ddtree": 3.0, "mfd": 3.0, "mfd_over_ddtree": 1.0,
                                     "chimera_share": 0.8, "effective_modes": 2.0}
    assert summary["budgets"][16]["mfd_over_ddtree"] == 2.5 / 1.5
    table = markdown(groups)
    assert "| mfd4 | 1 | code,chat (8) | chain tau | 2.000 (any budget) |" in table
    assert "| | | | MFD / DDTree | 1.000x | 1.667x |" in table
    plot(groups, tmp_path / "summary.png")
    assert (tmp_path / "summary.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_acceptance_summary_refuses_different_budgets_in_one_group(tmp_path):
    from acceptance_summary import group_results

    files = [eval_json(tmp_path / "p-T0-code.json", 0, {"code": (1, 1.0, {8: (1.0, 1.0), 16: (1.0, 1.0)})}),
             eval_json(tmp_path / "p-T0-chat.json", 0, {"chat": (1, 1.0, {8: (1.0, 1.0)})}, budgets=(8,))]
    with pytest.raises(ValueError, match="budgets"):
        group_results(files)
