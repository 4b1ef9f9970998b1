"""Fewer modes per request (issue 43 item 4) in real SGLang CPU servers (tiny pair, fp32), with the tiny MFD
drafter given a random mode gate (K = 4): each request drafts its K' best modes under the gate.

- MFD_SGLANG_NUM_MODES=2 with a fixed budget: every round drafts the gate's 2 best modes of each request;
  greedy output is the target's, six at a time and alone (`servers.run_six_and_one`), with speculation seen (the accept length is
  asserted and reported), and seeded T = 1 sampling is the reference sampler's.
- The automatic budget: its paths are K, the gate's best 2 and best 1 (`budget.mode_paths`); it plays
  each path's largest tree first (their acceptance is unmeasured), so rounds of every path run; the
  output stays the target's through the switches.
- MFD_SGLANG_MODE_SUBSETS=1 is refused on SGLang's real argument resolution without a gate or without the
  automatic budget.
"""

from __future__ import annotations

import json

import pytest
import torch

from mfd_sglang.checkpoint import load_drafter, save_drafter
from references import TOP_K_ALL, reference_sample
from servers import generate_ids, log_tail, resolve, run_six_and_one, served_without_leaks, start_server

BUDGET = 16


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
    srv = start_server(tmp_path_factory, tiny_pair, gated_drafter, "MFD", BUDGET, max_running=6, log_level="info",
                       extra_env={"MFD_SGLANG_NUM_MODES": "2", "MFD_SGLANG_AUTO_BUDGET": "0"})
    yield from served_without_leaks(srv)


@pytest.fixture(scope="module")
def auto_server(tiny_pair, gated_drafter, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, gated_drafter, "MFD", BUDGET, max_running=6, log_level="info",
                       extra_env={"MFD_SGLANG_AUTO_BUDGET": "1"})
    yield from served_without_leaks(srv)


def test_the_gates_two_best_modes_decode_exactly_with_speculation_seen(two_modes_server, hf_target, tiny_prompts):
    log = two_modes_server.log()
    assert "K = 4 mode(s), each request's 2 best by the mode gate" in log, log_tail(two_modes_server.log_path)
    meta = run_six_and_one(two_modes_server, hf_target, tiny_prompts)
    accept_length = meta["completion_tokens"] / meta["spec_verify_ct"]
    print(f"accept length, the gate's 2 best of 4 modes, B = {BUDGET}, alone: {accept_length:.2f}")
    assert accept_length > 3, meta


def test_the_gates_two_best_modes_keep_seeded_sampling(two_modes_server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    expected = reference_sample(model, ids, 20, (1.0, TOP_K_ALL, 0.95, 0.0), seed=5)
    got, _ = generate_ids(two_modes_server, ids, 20, temperature=1.0, top_p=0.95, sampling_seed=5)
    assert got == expected


def test_the_automatic_budget_plays_every_mode_subset_and_stays_exact(auto_server, hf_target, tiny_prompts):
    run_six_and_one(auto_server, hf_target, tiny_prompts)
    log = auto_server.log()
    assert "paths: K-mode draft, gate's best 2 mode(s), gate's best 1 mode(s)" in log, log_tail(auto_server.log_path)
    for path in ("K-mode draft", "gate's best 2 mode(s)", "gate's best 1 mode(s)"):
        assert f"timing budget {BUDGET}, {path}" in log, log_tail(auto_server.log_path)


def test_mode_subsets_are_refused_without_a_gate_or_the_automatic_budget(tiny_pair, gated_drafter):
    gated = ["--speculative-draft-model-path", str(gated_drafter)]
    [no_auto] = resolve(tiny_pair, gated, env={"MFD_SGLANG_MODE_SUBSETS": "1"})
    assert "needs MFD_SGLANG_AUTO_BUDGET=1. Unset it." in no_auto.get("error", ""), no_auto
    [ok] = resolve(tiny_pair, gated, env={"MFD_SGLANG_MODE_SUBSETS": "1", "MFD_SGLANG_AUTO_BUDGET": "1"})
    assert "error" not in ok, ok
    [ungated] = resolve(tiny_pair, [], env={"MFD_SGLANG_MODE_SUBSETS": "1", "MFD_SGLANG_AUTO_BUDGET": "1"})
    assert "needs a drafter with a mode gate (the one at" in ungated.get("error", ""), ungated
    [off] = resolve(tiny_pair, [], env={"MFD_SGLANG_MODE_SUBSETS": "0"})
    assert "error" not in off, off
