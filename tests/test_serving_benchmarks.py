"""The closed-loop benchmark, the reference-engine speed table and the demo, run small on the tiny
pair (CPU servers, fp32): they finish, and the acceptance they report is what the reference engine
does on the same prompts (fp32 greedy, or sampling with the same seed). No timing is asserted; a
speed-up is checked against its definition only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mfd_sglang.hf import SamplingParams, SpeculativeGenerator, eos_token_ids
from servers import chat_template_ids

REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc


def test_closed_loop_benchmark_writes_json_and_png(tiny_pair, tiny_dflash_drafter, tmp_path):
    """Three configurations served at once (SGLang's DFLASH among them) and measured in turns (--repeats 2),
    the median reported."""
    out = tmp_path / "closed.json"
    proc = _run(["benchmarks/closed_loop.py", "--target", str(tiny_pair / "target"),
                 "--mfd-drafter", str(tiny_pair / "drafter"), "--configs", "ar,mfd,dflash",
                 "--single-drafter", str(tiny_dflash_drafter),
                 "--prompts-file", str(tiny_pair / "prompts.json"), "--limit", "3", "--batch-sizes", "1", "2",
                 "--requests-per-size", "3", "--max-tokens", "12", "--dtype", "float32", "--budget", "8",
                 "--repeats", "2", "--device", "cpu", "--out", str(out)], timeout=900)
    report = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert set(report["results"]) == {"ar", "mfd", "dflash"}
    for name, runs in report["results"].items():
        assert set(runs) == {"1", "2"}
        for b, run in runs.items():
            assert run["requests"] == 3 and run["errors"] == 0, run
            # measured twice, the servers taking turns; the slower run is the (lower) median
            assert run["decode_tokens_per_second"] == min(run["repeats_decode_tokens_per_second"])
            assert len(run["repeats_decode_tokens_per_second"]) == 2
            ar_speed = report["results"]["ar"][b]["decode_tokens_per_second"]
            assert run["speedup"] == pytest.approx(run["decode_tokens_per_second"] / ar_speed)
            ar_repeats = report["results"]["ar"][b]["repeats_decode_tokens_per_second"]
            assert run["speedup_paired"] == pytest.approx(sum(
                mine / ar for mine, ar in zip(run["repeats_decode_tokens_per_second"], ar_repeats)) / 2)
    assert all(run["tau"] is None for run in report["results"]["ar"].values())
    # Each batch size sends each of the 3 chat prompts once. tau here is SGLang's spec_accept_length:
    # completion tokens (the prefill's one included) per verify round, over the requests.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    # DFLASH verifies its drafter's chain (block 8: 7 drafted tokens), as the reference engine's chain does.
    for name, engine in (
            ("mfd", SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_pair / "drafter", budget=8)),
            ("dflash", SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_dflash_drafter, tree="chain",
                                                       budget=7, single_mode=True))):
        eos = eos_token_ids(tokenizer, engine.target.config)
        outputs = [engine.generate(chat_template_ids(tokenizer, [{"role": "user", "content": text}]), 12,
                                   eos_token_ids=eos)
                   for text in json.loads((tiny_pair / "prompts.json").read_text())[:3]]
        tau = sum(len(o.token_ids) for o in outputs) / sum(len(o.rounds) for o in outputs)
        assert [run["tau"] for run in report["results"][name].values()] == [pytest.approx(tau)] * 2, name
    assert "ar" in proc.stdout and "mfd" in proc.stdout and "dflash" in proc.stdout


def test_closed_loop_configurations_and_speedups():
    """--configs names every row or fails naming the bad one; each row's speed-up is over AR's at its b, and
    paired (the median of the per-turn ratios) only when both were measured in the same turns."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from closed_loop import add_speedups, parse_configs

    rows = "ar,dflash,ddtree,mfd,mfd_d,mfd_d@auto,mfd@auto-kmodes,mfd@8"
    assert parse_configs(rows + ",") == rows.split(",")
    for bad, message in (("ar,eagle", "unknown configuration 'eagle'"), ("dflash@8", "only ('mfd', 'mfd_d', 'ddtree')"),
                         ("ar@auto", "take a tree budget"), ("mfd@0", "integer >= 1"), ("mfd@x", "integer >= 1"),
                         ("mfd@auto-k", "'auto' or 'auto-kmodes'"),
                         ("ar,mfd,ar", "named twice")):
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_configs(bad)

    def run(median, repeats=None):
        return {"decode_tokens_per_second": median,
                **({"repeats_decode_tokens_per_second": repeats} if repeats else {})}

    results = {"ar": {"1": run(10.0, [10.0, 12.0, 8.0]), "2": run(0.0)},
               "dflash": {"1": run(12.0, [15.0, 12.0, 12.0]), "2": run(5.0)},
               "mfd": {"1": run(9.0), "2": run(4.0)}}
    add_speedups(results)
    assert results["dflash"]["1"]["speedup"] == pytest.approx(1.2)
    assert results["dflash"]["1"]["speedup_paired"] == pytest.approx(1.5)  # median of 1.5, 1.0, 1.5
    assert results["mfd"]["1"] == {**run(9.0), "speedup": pytest.approx(0.9)}  # one run: no pairs
    assert results["ar"]["1"]["speedup"] == 1.0 and results["ar"]["1"]["speedup_paired"] == 1.0
    assert [results[name]["2"]["speedup"] for name in results] == [None] * 3  # AR measured nothing


def test_hf_speed_benchmark_table(tiny_pair, tiny_dflash_drafter, tmp_path):
    out, md = tmp_path / "speed.json", tmp_path / "speed.md"
    _run(["benchmarks/hf_speed.py", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter),
          "--mfd", str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"), "--limit", "2",
          "--budgets", "4", "8", "--max-new-tokens", "16", "--dtype", "float32", "--out", str(out),
          "--markdown", str(md)], timeout=600)
    results = json.loads(out.read_text())["results"]["prompts"]
    # Every row's tau is the reference engine's on the same 2 prompts: greedy at T = 0, and at T = 1
    # the same seeded sampling (seed 0, the script's default).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"]
               for t in json.loads((tiny_pair / "prompts.json").read_text())[:2]]
    single = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_dflash_drafter, tree="chain", single_mode=True)
    mfd = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_pair / "drafter")
    eos = eos_token_ids(tokenizer, single.target.config)
    engines = {("chain", "7"): single}
    for budget in (4, 8):
        engines["ddtree", str(budget)] = SpeculativeGenerator(single.target, single.drafter, budget=budget,
                                                              single_mode=True)
        engines["mfd", str(budget)] = SpeculativeGenerator(mfd.target, mfd.drafter, budget=budget)
    for temperature in ("0.0", "1.0"):
        assert set(results[temperature]) == {"chain", "ddtree", "mfd"}
        assert set(results[temperature]["mfd"]) == {"4", "8"} and set(results[temperature]["chain"]) == {"7"}
        params = SamplingParams(temperature=float(temperature), seed=0 if temperature == "1.0" else None)
        for (method, budget), engine in engines.items():
            rounds = [r for ids in prompts for r in engine.generate(ids, 16, params=params, eos_token_ids=eos).rounds]
            assert results[temperature][method][budget]["tau"] == sum(r.emitted for r in rounds) / len(rounds), (
                temperature, method, budget)
    table = md.read_text()
    assert table.count("| prompts |") == 6 and "| mfd |" in table


def test_demo_code_path_short(tiny_pair, tmp_path):
    from mfd_sglang.demo import run_demo

    lines = []
    plain, mfd = run_demo(tiny_pair / "target", tiny_pair / "drafter", prompts=["one two three"], max_tokens=8,
                          budget=8, repeats=2, device="cpu", log_dir=tmp_path, say=lines.append)
    assert plain.completion_tokens == mfd.completion_tokens > 0
    assert mfd.answers == plain.answers  # float32 on the CPU by default: exact
    assert mfd.tau is not None and mfd.tau >= 1 and plain.tau is None  # auto may settle on plain decoding
    assert len(plain.pass_seconds) == len(mfd.pass_seconds) == 2
    text = "\n".join(lines)
    assert "starting the MFD server" in text and "speed of MFD against plain" in text
    assert "cpu, float32, MFD with automatic budget (at most 8)" in text and "median of 2 pass(es)" in text


def test_demo_reads_the_automatic_budgets_choice_from_the_log(caplog):
    """What the demo prints as the budget chosen is the chooser's own last log line for batches of 1."""
    import logging

    from mfd_sglang.demo import auto_budget_choice
    from mfd_sglang.serving.budget.rule import PLAIN, BudgetChooser, describe

    chooser = BudgetChooser(8)
    with caplog.at_level(logging.INFO, logger="mfd_sglang.serving.budget.rule"):
        assert auto_budget_choice(caplog.text) is None
        for _ in range(200):  # plain decoding is cheaper and a tree of any size accepts nothing here
            arm = chooser.choose(1)
            chooser.record_acceptance(arm, [[1] * len(chooser.measured_budgets(arm))])
            chooser.record_round_time(1, arm, 0.01 + 0.001 * arm.budget)
    assert auto_budget_choice(caplog.text) == describe(PLAIN) == "plain decoding (budget 0)"
