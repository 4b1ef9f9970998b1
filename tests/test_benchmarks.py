"""Benchmarks run and report well-formed results (no timing is asserted); the GPU check fails when
something is wrong."""

import dataclasses
import json
import subprocess
import sys
import time
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


CHECK_RUN = """
import sys
sys.path.insert(0, "benchmarks")
import gpu_check
from gpu_check import Section, StructuralSkip

def mismatch(check):
    yield {"bs": 1, "ok": True}
    yield {"bs": 2, "ok": False}

def boom(check):
    yield {"case": "first", "ok": True}
    raise RuntimeError("kernel exploded")

def timing(check):
    yield {"bs": 1, "torch_ms": 0.5}

def cuda_only(check):
    raise StructuralSkip("needs CUDA: timings")

def slow(check):
    yield {"ok": True}

gpu_check.PARTS["1"] = [Section("tree", mismatch, True, 0), Section("attention", boom, True, 0),
                        Section("tree_time", timing, False, 0), Section("attention_time", cuda_only, False, 0),
                        Section("servers_tiny", slow, True, float(sys.argv[2]))]
sys.argv = ["gpu_check.py", "--cpu", "--out-dir", sys.argv[1]]
gpu_check.main()
"""


def test_gpu_check_records_every_row_and_fails_on_a_mismatch_an_error_and_what_the_deadline_cut(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-c", CHECK_RUN, str(out), "100000"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads((out / "report.json").read_text())
    sections = report["sections"]
    assert sections["tree"]["rows"] == [{"bs": 1, "ok": True}, {"bs": 2, "ok": False}]
    # the row before the exception is kept; the exception is the section's error
    assert sections["attention"]["rows"] == [{"case": "first", "ok": True}]
    assert "RuntimeError: kernel exploded" in sections["attention"]["error"]
    assert sections["tree_time"]["rows"] == [{"bs": 1, "torch_ms": 0.5}]
    assert sections["attention_time"] == {"skipped": "needs CUDA: timings", "seconds": 0.0}  # structural: passes
    assert sections["servers_tiny"]["not_run"].endswith(" s left before the call's deadline")
    assert report["passed"] is False
    assert [f.split(":")[0] for f in report["failures"]] == ["tree[1]", "attention", "servers_tiny"], report["failures"]
    assert "RESULT: FAIL (3 items)" in proc.stdout
    # every row also went to rows.jsonl as it finished
    lines = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
    assert [(r["section"], r.get("bs", r.get("case"))) for r in lines] == [
        ("tree", 1), ("tree", 2), ("attention", "first"), ("tree_time", 1)]


def test_gpu_check_passes_with_structural_skips_only(tmp_path):
    from gpu_check import Section, StructuralSkip, failures

    def cuda_only(check):
        raise StructuralSkip("needs CUDA")

    sections = [Section("tree", None, True, 0), Section("tree_mask", None, True, 0), Section("tree_time", None, False, 0),
                Section("attention_time", cuda_only, False, 0)]
    good = {"sections": {"tree": {"rows": [{"ok": True}]},
                         "tree_mask": {"rows": [{"ok": True}, {"skipped": "FlashInfer is not installed"}]},
                         "tree_time": {"rows": [{"torch_ms": 1.0}]}, "attention_time": {"skipped": "needs CUDA"}}}
    assert failures(good, sections) == []
    bad = json.loads(json.dumps(good))
    bad["sections"]["tree"]["rows"] = []  # a correctness section that checked nothing
    bad["sections"]["tree_time"]["rows"] = [{"torch_ms": 1.0, "triton_error": "OutOfResources: smem"}]
    bad["sections"]["tree_mask"]["rows"][0]["ok"] = False
    assert [f.split(":")[0] for f in failures(bad, sections)] == ["tree", "tree_mask[0]", "tree_time[0]"]
    bad["sections"]["tree"] = {"not_run": "12 s left before the call's deadline"}
    assert failures(bad, sections)[0] == "tree: NOT RUN (12 s left before the call's deadline)"


def test_a_gpu_check_row_records_its_error_and_keeps_what_it_measured():
    """`measured_row`, every kernel row's pattern: a row that raises fails (ok False) with the exception as its
    error, a measurement row (no verdict) gets the error only; what was recorded before the exception stays."""
    from gpu_check import measured_row

    def one_timing_then_boom(row):
        row["torch_ms"] = 0.5
        raise RuntimeError("triton exploded")

    labels = {"bs": 2}
    assert measured_row({"bs": 1}, lambda row: row.update(ok=True)) == {"bs": 1, "ok": True}
    assert measured_row(labels, one_timing_then_boom) == \
        {"bs": 2, "torch_ms": 0.5, "ok": False, "error": "RuntimeError: triton exploded"}
    assert measured_row(labels, one_timing_then_boom, verdict=False) == \
        {"bs": 2, "torch_ms": 0.5, "error": "RuntimeError: triton exploded"}
    assert labels == {"bs": 2}  # every row starts from its own copy of the labels


TIGHT = {"MFD": 2.0}


def server_pair(bounds=None):
    from mfd_sglang.check.servers import Pair

    return Pair("test pair", Path("t"), Path("d"), ((0,), (0,)), bounds)


def test_server_rows_require_exactness_in_fp32_completion_and_the_accept_bound():
    from mfd_sglang.check.servers import Server, ServerConfig, compare

    plain = {"ids": [[1, 2, 3], [4, 5, 6]], "startup_s": 1.0, "accept_length": [None, None],
             "fallback_to_triton_logged": False, "log_events": []}
    spec = lambda ids, accept=(2.5, 2.5): {**plain, "ids": ids, "accept_length": list(accept)}  # noqa: E731
    fp32 = ServerConfig("float32", True, "triton", "why")
    row = lambda s, ref=plain, bounds=None: compare(None, server_pair(bounds), fp32, Server("MFD", "MFD", 16), s,  # noqa: E731
                                                    ref, 3)
    assert row(spec(plain["ids"]))["ok"] and row(spec(plain["ids"]))["exact"]
    parted = row(spec([[1, 2, 3], [4, 9, 9]]))
    assert not parted["ok"] and parted["first_divergence"] == [None, 1]
    assert not row(spec([[1, 2, 3], [4, 5]]))["ok"]  # every request must complete
    # a pair that accepts drafts: below its bound fails, though the tokens are exact
    assert row(spec(plain["ids"], (2.5, 2.0)), bounds=TIGHT)["ok"]
    low = row(spec(plain["ids"], (2.0, 1.5)), bounds=TIGHT)
    assert not low["ok"] and low["exact"] and low["mean_accept"] == 1.75
    failed = row(spec(plain["ids"]), {"error": "RuntimeError: server exited"})
    assert not failed["ok"] and "plain: RuntimeError: server exited" in failed["error"]


def test_bf16_rows_pass_a_divergence_only_at_a_near_tie_of_the_plain_server(monkeypatch):
    from mfd_sglang.check import servers as check_servers
    from mfd_sglang.check.servers import NEAR_TIE_NATS, Launch, Server, ServerConfig, ServerLogs, compare

    launch = Launch("cpu", time.time() + 600, Path("."), ServerLogs(None))
    plain = {"ids": [[1, 2, 3], [4, 5, 6]], "startup_s": 1.0, "accept_length": [None, None],
             "fallback_to_triton_logged": False, "log_events": []}
    parted = {**plain, "ids": [[1, 2, 3], [4, 9, 9]], "accept_length": [2.0, 2.0]}
    bf16 = ServerConfig("bfloat16", True, "triton", "why")
    asked = []

    def answer(top):
        def post(server, path, payload, timeout):
            asked.append(payload["input_ids"])
            return {"meta_info": {"output_top_logprobs": [top]}}
        return post

    def row(top):
        monkeypatch.setattr(check_servers, "post_json", answer(top))
        return compare(launch, server_pair(), bf16, Server("MFD", "MFD", 16), parted, plain, 3,
                       plain_server=lambda: object())

    tie = row([[-0.60, 5, None], [-0.60 - NEAR_TIE_NATS / 2, 9, None]])
    assert tie["ok"] and tie["near_ties"][0] == {"at": 1, "tokens": [5, 9], "top2": [5, 9],
                                                  "gap": round(NEAR_TIE_NATS / 2, 4), "ok": True}
    assert asked == [[0, 4]]  # the prompt plus the common prefix, asked of the plain server
    assert not row([[-0.1, 5, None], [-3.0, 9, None]])["ok"]  # no near-tie: a bug, not rounding
    assert not row([[-0.6, 5, None], [-0.61, 7, None]])["ok"]  # the speculative token is not the runner-up
    assert compare(None, server_pair(), bf16, Server("MFD", "MFD", 16), plain, plain, 3)["ok"]  # exact needs no question


def test_the_near_tie_question_reads_a_real_plain_servers_top_logprobs(plain_server, tiny_pair):
    """`near_tie` against a real SGLang server: the plain server's own second choice after a prefix is a
    divergence it explains exactly when the gap is within NEAR_TIE_NATS."""
    from mfd_sglang.check.servers import NEAR_TIE_NATS, Launch, ServerLogs, near_tie
    from servers import generate_ids, post_json

    prompt = [3, 4, 5, 6]
    ids, _ = generate_ids(plain_server, prompt, 4)
    out = post_json(plain_server, "/generate", {"input_ids": prompt + ids[:2], "return_logprob": True,
                                                 "top_logprobs_num": 2,
                                                 "sampling_params": {"temperature": 0, "max_new_tokens": 1}})
    (lp1, first, _), (lp2, second, _) = out["meta_info"]["output_top_logprobs"][0][:2]
    assert first == ids[2]
    launch = Launch("cpu", time.time() + 300, Path("."), ServerLogs(None))
    tie = near_tie(launch, plain_server, prompt, ids, ids[:2] + [second, 0])
    assert tie["at"] == 2 and tie["top2"] == [first, second] and tie["tokens"] == [first, second]
    assert tie["gap"] == round(lp1 - lp2, 4) and tie["ok"] == (lp1 - lp2 <= NEAR_TIE_NATS)


def test_round_cost_of_a_server_is_its_time_per_round_in_plain_decode_steps():
    """Two requests alone on each server: plain 10 + 30 tokens in 1 + 3 s (0.1 s a step); the speculative
    server the same 40 tokens in 10 rounds and 2 s (0.2 s a round): 2 steps a round, 2x plain, 4 tokens a round."""
    from mfd_sglang.check.servers import round_cost

    plain = [{"seconds": 1.0, "tokens": 10, "rounds": 10}, {"seconds": 3.0, "tokens": 30, "rounds": 30}]
    spec = [{"seconds": 0.5, "tokens": 10, "rounds": 3}, {"seconds": 1.5, "tokens": 30, "rounds": 7}]
    assert round_cost(spec, plain) == {"round_ms": 200.0, "plain_step_ms": 100.0, "round_cost": 2.0, "speedup": 2.0,
                                       "tokens_per_round": 4.0}


def test_the_automatic_budget_row_requires_a_verify_graph_for_every_budget_within_its_plan():
    """With CUDA graphs on, the automatic-budget server's row passes only when its start-up log listed a
    tree-verify graph for every candidate budget's window (B = 16: 0, 4, 8, 16 -> 1, 5, 9, 17 tokens) and
    the memory the extra windows took is more than nothing and within what the launch plan counted."""
    from mfd_sglang.check.servers import AUTO, Server, ServerConfig, compare

    plain = {"ids": [[1, 2, 3]], "startup_s": 1.0, "accept_length": [None], "fallback_to_triton_logged": False,
             "log_events": []}
    graphs, eager = ServerConfig("float32", True, "triton", "why"), ServerConfig("float32", False, "triton", "why")

    def row(widths, measured=700, planned=2126, config=graphs):
        spec = {**plain, "verify_graph_widths": widths, "verify_graph_mib": {"measured": measured, "planned": planned}}
        pair = dataclasses.replace(server_pair(), prompts=((0,),))
        return compare(None, pair, config, Server(AUTO, "MFD_D", 16), spec, plain, 3)

    assert row([1, 5, 9, 17])["ok"] and row([1, 5, 9, 17])["verify_graph_widths"] == [1, 5, 9, 17]
    assert row([1, 5, 9, 17])["verify_graph_mib"] == {"measured": 700, "planned": 2126}
    assert not row([17])["ok"] and not row(None)["ok"]
    assert not row([1, 5, 9, 17], measured=2200)["ok"]  # took more than planned
    assert not row([1, 5, 9, 17], measured=0)["ok"]  # measured nothing: the measurement missed the graphs
    assert not row([1, 5, 9, 17], planned=None)["ok"] and not row([1, 5, 9, 17], measured=None)["ok"]
    assert row(None, None, None, eager)["ok"]  # no graphs to require


def test_the_server_log_gives_the_verify_graph_widths_and_memory(tmp_path, monkeypatch):
    """The figures the row above reads, parsed from the lines the plugin logs (the worker's capture, the
    launch plan's warning under a given --mem-fraction-static)."""
    import logging

    from mfd_sglang.check import servers as check_servers
    from mfd_sglang.serving.launch.memory import MemoryPlan, reserve_in_mem_fraction
    from mfd_sglang.serving.verify_graph import VerifyGraphsByWidth

    log = tmp_path / "server.log"
    handler = logging.FileHandler(log)
    loggers = [logging.getLogger(f"mfd_sglang.serving.{name}") for name in ("launch.memory", "verify_graph")]
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

    written = log

    class Server:  # stands in for a started ServerProcess: the log is already written
        log_path = written

        def log(self):
            return written.read_text()

        def stop(self):
            pass

    monkeypatch.setattr(check_servers, "start_server", lambda *a, **k: Server())
    monkeypatch.setattr(check_servers, "generate_all", lambda launch, server, prompts, n: [([1, 2], {})])
    out = check_servers.serve(None, server_pair(), check_servers.ServerConfig("float32", True, None, ""),
                              check_servers.Server("MFD_D", "MFD_D", 16), "test", 2)
    assert out["verify_graph_widths"] == [1, 5, 9, 17]
    assert out["verify_graph_mib"] == {"measured": 0, "planned": 2126}


@pytest.mark.parametrize("dtype,want", [("float32", "triton"), ("bfloat16", None)])
def test_server_groups_name_their_attention_backend(dtype, want):
    from mfd_sglang.check.servers import attention_choice

    backend, why = attention_choice(dtype)
    assert backend in ("triton", "flashinfer") and why
    if want is not None:
        assert backend == want


def test_a_server_starts_in_its_log_folder_never_the_repository_root(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: a server started in the repository root
    would import the source folder `mfd_sglang/` (no patches/, no kernels/) instead of the installed
    plugin. The GPU check's servers start in their log folder."""
    from mfd_sglang.check import servers as check_servers
    from mfd_sglang.check.servers import Launch, ServerConfig, ServerLogs, start_server

    started = {}

    class Process:
        def __init__(self, cmd, log, **kwargs):
            started.update(kwargs, cmd=cmd)

        def start(self):
            return self

    monkeypatch.setattr(check_servers, "ServerProcess", Process)
    launch = Launch("cpu", time.time() + 600, tmp_path, ServerLogs(None))
    start_server(launch, server_pair(), ServerConfig("float32", False, None, ""), check_servers.PLAIN, "g")
    assert started["cwd"] == tmp_path and Path(started["cwd"]).resolve() != REPO
    with pytest.raises(TimeoutError, match="deadline"):  # nothing starts past the call's deadline
        start_server(Launch("cpu", time.time() + 20, tmp_path, ServerLogs(None)), server_pair(),
                     ServerConfig("float32", False, None, ""), check_servers.PLAIN, "g")


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

    # The automatic budget with and without the mode subsets (`@auto-kmodes`: all K modes only).
    assert split_config("mfd@auto-kmodes") == ("mfd", "auto-kmodes")
    results["mfd@auto-kmodes"] = {"1": run(10.0), "4": run(25.0)}
    report = compare_auto(results)
    assert report["mfd@auto"]["4"] == {"vs_ar": pytest.approx(0.5), "vs_auto_kmodes": pytest.approx(0.8)}
    assert report["mfd@auto-kmodes"]["4"] == {"vs_ar": pytest.approx(0.625)}

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
