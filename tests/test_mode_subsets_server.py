"""Fewer modes per request (issue 43 item 4) in real SGLang CPU servers (tiny pair, fp32), with the tiny MFD
drafter given a random mode gate (K = 4): each request drafts its K' best modes under the gate.

Both servers take the options as the README writes them (no --max-running-requests: MFD's 48).

- `--mfd-num-modes 2` with a fixed budget: every round drafts the gate's 2 best modes of each request;
  greedy output is the target's, six at a time and alone (`servers.run_six_and_one`); alone, a request's
  rounds are the reference engine's with the gate's 2 best modes (as many rounds, the same histogram of
  accepted draft tokens) on prompts where drafting all 4 modes accepts otherwise (so a worker that drafted
  every mode would fail it), the accept length asserted and reported; seeded sampling on a law with spread
  is the reference sampler's.
- `--mfd-auto-budget --mfd-mode-subsets on`: its paths are K, the gate's best 2 and best 1
  (`budget.mode_paths`); it plays each path's largest tree first (their acceptance is unmeasured), so rounds
  of every path run; the output stays the target's through the switches, and every request's rounds, as the
  round-trace test plugin logs them (the arm the draft stage drafted, the tokens accepted), are the reference
  engine's for the same arms round by round, which drafting every round with all modes is not.
- MFD_SGLANG_MODE_SUBSETS=1 is refused on SGLang's real argument resolution without a gate or without the
  automatic budget.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import reference_drafter
from mfd_sglang.checkpoint import load_drafter, save_drafter
from mfd_sglang.hf import SpeculativeGenerator
from references import (SPREAD_LAW, assert_served_as_reference_rounds, request_law, served_summary, spread_samples,
                        verify_summary)
from servers import (generate_ids, log_tail, plugin_env, resolve_cases, round_traces, run_six_and_one, run_six_long,
                     served_without_leaks, start_server)

BUDGET = 16
MAX_NEW = 24


@pytest.fixture(scope="module")
def gated_drafter(tiny_pair, tmp_path_factory):
    """The tiny MFD drafter with a random mode gate (seeded; weights large enough that requests differ in
    the modes they get)."""
    ckpt = load_drafter(tiny_pair / "drafter")
    raw = json.loads((tiny_pair / "drafter" / "config.json").read_text())
    raw["mfd_config"] = {**raw["mfd_config"], "mode_prior": "gate"}
    num_modes, hidden = ckpt.weights["mode_embed"].shape
    gen = torch.Generator().manual_seed(0)
    gate = {"mode_prior.weight": 0.3 * torch.randn(num_modes, hidden, generator=gen),
            "mode_prior.bias": torch.randn(num_modes, generator=gen)}
    path = tmp_path_factory.mktemp("gated") / "drafter"
    save_drafter(path, raw, {**ckpt.weights, **gate})
    return path


@pytest.fixture(scope="module")
def two_modes_server(tiny_pair, gated_drafter, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, gated_drafter, "MFD", BUDGET, log_level="info",
                       extra_args=("--mfd-num-modes", "2"), extra_env=plugin_env("hold_admission"))
    yield from served_without_leaks(srv)


@pytest.fixture(scope="module")
def auto_server(tiny_pair, gated_drafter, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, gated_drafter, "MFD", BUDGET, log_level="info",
                       extra_args=("--mfd-auto-budget", "--mfd-mode-subsets", "on"),
                       extra_env=plugin_env("round_trace", "hold_admission"))
    yield from served_without_leaks(srv)


def test_the_gates_two_best_modes_decode_exactly_as_the_reference_rounds(two_modes_server, reference_target,
                                                                         gated_drafter, hf_target, tiny_prompts):
    log = two_modes_server.log()
    assert "K = 4 mode(s), each request's 2 best by the mode gate" in log, log_tail(two_modes_server.log_path)
    run_six_and_one(two_modes_server, hf_target, tiny_prompts)
    _, tok = hf_target
    drafter = reference_drafter(gated_drafter)
    two, four = (SpeculativeGenerator(reference_target, drafter, budget=BUDGET, num_modes=k) for k in (2, 4))
    differing, tokens, rounds = 0, 0, 0
    for text in tiny_prompts[:4]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        got, meta = generate_ids(two_modes_server, ids, MAX_NEW)
        reference = two.generate(ids, MAX_NEW)
        assert got == reference.token_ids
        assert served_summary(meta) == verify_summary(reference), (text, meta)
        differing += verify_summary(four.generate(ids, MAX_NEW)) != verify_summary(reference)
        tokens, rounds = tokens + meta["completion_tokens"], rounds + meta["spec_verify_ct"]
    assert differing >= 2, f"all 4 modes accept as the gate's best 2 on {4 - differing} of 4 prompts: no proof"
    print(f"accept length, the gate's 2 best of 4 modes, B = {BUDGET}, alone: {tokens / rounds:.2f} "
          f"({differing} of 4 prompts accept otherwise with all 4 modes)")
    assert tokens / rounds > 3


def test_the_gates_two_best_modes_keep_seeded_sampling(two_modes_server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    for seed, expected in zip((5, 6), spread_samples(model, ids, 20, [5, 6])):
        got, _ = generate_ids(two_modes_server, ids, 20, **request_law(SPREAD_LAW), sampling_seed=seed)
        assert got == expected, seed


def test_the_automatic_budget_drafts_every_mode_subset_as_the_reference_rounds(auto_server, reference_target,
                                                                                gated_drafter, hf_target, tiny_prompts):
    # three paths, each measured from 64 request-rounds in turn, then the choice among them
    served = run_six_long(auto_server, hf_target, tiny_prompts, 128) + run_six_and_one(auto_server, hf_target,
                                                                                        tiny_prompts)
    log = auto_server.log()
    assert "paths: K-mode draft, gate's best 2 mode(s), gate's best 1 mode(s)" in log, log_tail(auto_server.log_path)
    traces = round_traces(auto_server)
    drafted = {r.arm[2] for rounds in traces.values() for r in rounds if r.arm[1] > 0}
    assert drafted == {None, 2, 1}, f"the modes the draft stage drafted: {drafted}"
    runs = assert_served_as_reference_rounds(served, traces, reference_target, reference_drafter(gated_drafter),
                                             ignored_arm=(False, BUDGET, None))
    print(f"lone request's rounds (arm, accepted): {list(zip(*runs[-1]))}")


def test_mode_subsets_are_refused_without_a_gate_or_the_automatic_budget(tiny_pair, gated_drafter):
    gated = ["--speculative-draft-model-path", str(gated_drafter)]
    both = {"MFD_SGLANG_MODE_SUBSETS": "1", "MFD_SGLANG_AUTO_BUDGET": "1"}
    no_auto, ok, ungated, off = resolve_cases(tiny_pair, [(gated, {"MFD_SGLANG_MODE_SUBSETS": "1"}), (gated, both),
                                                          ([], both), ([], {"MFD_SGLANG_MODE_SUBSETS": "0"})])
    assert "MFD_SGLANG_MODE_SUBSETS=1: the automatic budget" in no_auto.get("error", "") and \
        "needs --mfd-auto-budget. Drop it." in no_auto.get("error", ""), no_auto
    assert "error" not in ok, ok
    assert "needs a drafter with a mode gate (the one at" in ungated.get("error", ""), ungated
    assert "error" not in off, off
