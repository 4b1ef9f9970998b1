"""The automatic budget (MFD_SGLANG_AUTO_BUDGET=1, `mfd_sglang.serving.budget.rule`): the chooser against
simulated servers whose best arm and costs are known (with and without a start-up calibration; a drafter
that accepts nothing gets plain decoding), and MFD_D servers with it on CPU (tiny pair, fp32), held to what
does not depend on their round times: exact greedy output across batch sizes while it switches budgets,
every request's rounds (as the round-trace test plugin logs them: the arm the draft stage drafted, the
tokens accepted) the reference engine's for the same arms round by round, the start-up calibration of
every arm (positive, finite), seeded sampling unchanged, logprobs of the emitted tokens, no leak; with a
drafter that accepts nothing, exact."""

from __future__ import annotations

import concurrent.futures
import json
import math
import random
import re

import pytest
import requests
import torch

from conftest import reference_drafter, target_greedy
from mfd_sglang.checkpoint import load_drafter, save_drafter
from mfd_sglang.serving.budget import rule as budget_module
from mfd_sglang.serving.budget.rule import (PLAIN, SINGLE_MODE, Arm, BudgetChooser, Path, RoundClock, batch_bucket,
                                            candidate_budgets, mode_paths)
from mfd_sglang.serving.launch.options import read_options
from references import TOP_K_ALL, assert_served_as_reference_rounds, reference_sample
from servers import (admitted_together, generate_ids, log_tail, plugin_env, round_traces, run_six_and_one, run_six_long,
                     served_without_leaks, start_server)


K_MODES = Path()
MFD_D = (K_MODES, SINGLE_MODE)  # MFD_D's paths without a mode gate


def test_candidate_budgets_and_buckets():
    assert candidate_budgets(16) == (0, 4, 8, 16)
    assert candidate_budgets(64) == (0, 4, 8, 16, 32, 64)
    assert candidate_budgets(5) == (0, 4, 5)
    assert candidate_budgets(1) == (0, 1)
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]


class SimulatedServer:
    """Rounds of a server whose acceptance and cost are known. A request's round draws u ~ U(0, 1) and
    commits 1 + floor(depth(path) * u * log2(1 + b) / log2(1 + B)) tokens at budget b (the same draw
    for every budget: what a smaller tree would have committed never exceeds the larger's). A round
    costs base + per_token * bs * (b + 1) + draft(path) * bs (b > 0), +-5% noise."""

    def __init__(self, max_budget: int, depth: dict, base: float, per_token: float, draft: dict, seed: int = 0):
        self.max_budget, self.depth, self.base, self.per_token, self.draft = max_budget, depth, base, per_token, draft
        self.rng = random.Random(seed)

    def committed(self, path: Path, budgets: list[int], u: float) -> list[int]:
        scale = torch.log2(torch.tensor(1.0 + self.max_budget)).item()
        return [1 + int(self.depth[path] * u * torch.log2(torch.tensor(1.0 + b)).item() / scale) for b in budgets]

    def cost(self, bs: int, arm) -> float:
        path, b = arm.path, arm.budget
        return self.base + self.per_token * bs * (b + 1) + (self.draft[path] * bs if b else 0.0)

    def value(self, bs: int, arm) -> float:
        """Expected tokens per request per second of an arm (the mean over u on a fine grid)."""
        path, b = arm.path, arm.budget
        grid = [(i + 0.5) / 2000 for i in range(2000)]
        tokens = sum(self.committed(path, [b], u)[0] for u in grid) / len(grid)
        return tokens / self.cost(bs, arm)

    def run(self, chooser: BudgetChooser, bs: int, rounds: int) -> list:
        played = []
        for _ in range(rounds):
            arm = chooser.choose(bs)
            budgets = chooser.measured_budgets(arm)
            chooser.record_acceptance(arm, [self.committed(arm.path, budgets, self.rng.random()) for _ in range(bs)])
            chooser.record_round_time(bs, arm, self.cost(bs, arm) * self.rng.uniform(0.95, 1.05))
            played.append(arm)
        return played


# A gated drafter of K = 4 modes: the gate's best 2 accept almost as much as all 4 for half the draft.
SUBSETS = mode_paths(4, gated=True, mode_subsets=True, single_mode_path=False)
HALF, ONE = Path(modes=2), Path(modes=1)


def test_mode_paths():
    assert SUBSETS == (K_MODES, HALF, ONE)
    assert mode_paths(4, gated=True, mode_subsets=True, single_mode_path=True) == (K_MODES, HALF, ONE, SINGLE_MODE)
    assert mode_paths(2, gated=True, mode_subsets=True, single_mode_path=False) == (K_MODES, ONE)
    assert mode_paths(8, gated=True, mode_subsets=True, single_mode_path=False) == (K_MODES, Path(modes=4), ONE)
    for gated, subsets in ((False, True), (True, False)):
        assert mode_paths(4, gated=gated, mode_subsets=subsets, single_mode_path=True) == MFD_D
    assert mode_paths(1, gated=True, mode_subsets=True, single_mode_path=False) == (K_MODES,)
    # MFD_SGLANG_NUM_MODES=4 on a gated drafter of 8: the top path is each request's 4 best, not all 8
    assert mode_paths(8, gated=True, mode_subsets=True, single_mode_path=False, gated_modes=4) == (Path(modes=4), HALF, ONE)


@pytest.mark.parametrize("case", ["speculation-pays", "verify-too-dear", "mfd_d", "mode-subsets"])
def test_the_chooser_settles_on_the_best_arm_at_every_batch_size(case):
    """After a short exploration (the first 200 of 600 rounds: each path is measured on 64 request-rounds first) the arms the chooser plays are worth >= 96%
    of the best one (by the simulation's own law) on average over four seeds, and >= 85% for each seed,
    at each batch size in turn; where speculation does not pay it plays plain decoding (budget 0).
    (Per seed, arms within a few percent of each other trade places: the acceptance they are told
    apart by is a mean over a few hundred noisy request-rounds.)"""
    paths = {"mfd_d": MFD_D, "mode-subsets": SUBSETS}.get(case, (K_MODES,))
    # K modes win at bs 1, MFD_D's single mode (or the gate's best 2 modes) at 2 and 4, plain decoding at
    # 8 (unless the verify is too dear for any tree)
    worth = {bs: [] for bs in (1, 2, 4, 8)}
    for seed in range(4):
        sim = SimulatedServer(16, depth={K_MODES: 6.0, SINGLE_MODE: 4.5, HALF: 5.7, ONE: 4.3}, base=0.02, seed=seed,
                              per_token=0.0008 if case != "verify-too-dear" else 0.01,
                              draft={K_MODES: 0.006, SINGLE_MODE: 0.0005, HALF: 0.0032, ONE: 0.0018})
        chooser = BudgetChooser(16, paths=paths)
        best_arms = {}
        for bs in worth:
            values = {arm: sim.value(bs, arm) for arm in chooser.arms}
            best_arms[bs] = max(values, key=values.get)
            played = sim.run(chooser, bs, 600)[200:]
            worth[bs].append(sum(values[arm] for arm in played) / len(played) / values[best_arms[bs]])
    for bs, shares in worth.items():
        assert sum(shares) / len(shares) >= 0.96 and min(shares) >= 0.85, (bs, best_arms[bs], shares)
    if case == "verify-too-dear":
        assert all(arm == PLAIN for arm in best_arms.values())
    else:  # the simulations are built so that the choice changes with the batch size
        assert len(set(best_arms.values())) > 1, best_arms
    if case == "mfd_d":
        assert {arm.path for arm in best_arms.values()} == set(MFD_D), best_arms
    if case == "mode-subsets":
        assert {arm.path for arm in best_arms.values()} == {K_MODES, HALF}, best_arms


def test_a_larger_batch_does_not_retime_trees_a_smaller_one_ruled_out():
    """Where the verify is too dear for any tree, the first batch size times the trees once; at the
    larger ones, where each tree costs relatively more still, the trees' relative cost at the smaller
    size bounds theirs, so at most the smallest tree (worth 0.87x plain decoding at bs 1: its bound is
    close) is timed and the probes play it (the simulation's trees cost 2.5x plain decoding at bs 1 and
    more above; without the bound every tree is timed again at every size)."""
    sim = SimulatedServer(16, depth={K_MODES: 6.0}, base=0.02, per_token=0.01, draft={K_MODES: 0.006})
    chooser = BudgetChooser(16)
    first = sim.run(chooser, 1, 100)
    assert len({arm for arm in first if arm.budget > 0}) == 3  # every tree timed at bs 1
    for bs in (2, 4, 8):
        played = sim.run(chooser, bs, 100)
        trees = [arm for arm in played if arm.budget > 0]
        assert set(trees) <= {Arm(False, 4)} and len(trees) <= chooser.min_timings + 2, (bs, trees)
        assert chooser.chosen[bs] == PLAIN, bs


def test_a_start_up_calibration_spares_the_exploration_of_arms_it_rules_out():
    """Calibrated costs that leave out a per-round overhead the arms share (the scheduler, accept,
    commit: here the simulation's base cost) and are off by up to 10% per arm: over six seeds, the
    chooser plays fewer rounds on arms worth < 90% of the best than without the calibration, settles as
    well (<= 5 such rounds of the last 100 at each batch size), and leaves arms the calibration rules
    out untimed."""
    sim = SimulatedServer(16, depth={K_MODES: 6.0, SINGLE_MODE: 4.5}, base=0.02, per_token=0.0008,
                          draft={K_MODES: 0.006, SINGLE_MODE: 0.0005})
    wasted = {"calibrated": 0, "online": 0}
    for seed in range(6):
        noise = random.Random(seed)
        choosers = {name: BudgetChooser(16, paths=MFD_D) for name in wasted}
        choosers["calibrated"].calibrate({(bs, arm): (sim.cost(bs, arm) - sim.base) * noise.uniform(0.9, 1.1)
                                          for bs in (1, 2, 4, 8) for arm in choosers["online"].arms})
        for bs in (1, 2, 4, 8):
            values = {arm: sim.value(bs, arm) for arm in choosers["online"].arms}
            poor = {arm for arm, v in values.items() if v < 0.9 * max(values.values())}
            for name, chooser in choosers.items():
                sim.rng = random.Random(seed * 100 + bs)  # both see the same acceptance draws
                played = sim.run(chooser, bs, 200)
                wasted[name] += sum(arm in poor for arm in played)
                if name == "calibrated":
                    assert sum(arm in poor for arm in played[100:]) <= 5, (seed, bs, played[100:])
        untimed = [arm for arm in choosers["calibrated"].arms if choosers["calibrated"].cost(8, arm) is None]
        assert untimed, (seed, "every arm was timed at bs 8 despite the calibration")
    assert wasted["calibrated"] < wasted["online"], wasted


# What a round costs beyond the calibrated draft + verify (the scheduler's share, accept, commit).
OVERHEAD = 0.002


def calibrated(sim: SimulatedServer, chooser: BudgetChooser) -> dict:
    return {(bs, arm): sim.cost(bs, arm) - OVERHEAD for bs in (1, 2, 4, 8) for arm in chooser.arms}


def test_a_calibration_that_rules_out_plain_decoding_spares_timing_it():
    """A good drafter and a cheap verify, so that a tree beats plain decoding at every batch size: calibrated
    at start-up, the chooser's first arm at each batch size is a tree and it never plays (so never times)
    plain decoding; without the calibration it has to time plain decoding to rule it out."""
    for seed in range(4):
        sim = SimulatedServer(16, depth={K_MODES: 6.0, SINGLE_MODE: 4.5}, base=0.02, per_token=0.0002,
                              draft={K_MODES: 0.001, SINGLE_MODE: 0.0002}, seed=seed)
        with_calibration, without = BudgetChooser(16, paths=MFD_D), BudgetChooser(16, paths=MFD_D)
        with_calibration.calibrate(calibrated(sim, with_calibration))
        for bs in (1, 2, 4, 8):
            values = {arm: sim.value(bs, arm) for arm in with_calibration.arms}
            assert max(values, key=values.get) != PLAIN, (bs, values)  # the premise: a tree pays
            played = sim.run(with_calibration, bs, 200)
            assert played[0] != PLAIN and PLAIN not in played, (seed, bs, played[:20])
        assert PLAIN in sim.run(without, 1, 200), seed


def test_a_drafter_that_accepts_nothing_settles_on_plain_decoding():
    """No draft token is ever accepted (every tree commits one token, as plain decoding does, at a higher
    cost): after each path's largest tree has measured that, the chooser's choice is plain decoding at
    every batch size, calibrated or not, and only its probes play a tree now and then."""
    for calibrate in (False, True):
        sim = SimulatedServer(16, depth={K_MODES: 0.0, SINGLE_MODE: 0.0}, base=0.02, per_token=0.0008,
                              draft={K_MODES: 0.006, SINGLE_MODE: 0.0005})
        chooser = BudgetChooser(16, paths=MFD_D)
        if calibrate:
            chooser.calibrate(calibrated(sim, chooser))
        for bs in (1, 2, 4, 8):
            played = sim.run(chooser, bs, 300)  # at bs 1 each path's first 64 rounds measure it
            assert chooser.chosen[batch_bucket(bs)] == PLAIN, (calibrate, bs, played[200:])
            assert played[200:].count(PLAIN) >= 95, (calibrate, bs, played[200:])


def test_the_calibrated_estimate_adds_the_overhead_the_timed_arms_show():
    chooser = BudgetChooser(16)
    chooser.calibrate({(1, Arm(False, 0)): 0.010, (1, Arm(False, 16)): 0.030, (2, Arm(False, 16)): 0.050})
    assert chooser.estimate(1, Arm(False, 16)) == pytest.approx(0.030)  # nothing timed yet: no overhead
    assert chooser.estimate(1, Arm(False, 8)) is None  # never calibrated
    for _ in range(chooser.min_timings):
        chooser.record_round_time(1, Arm(False, 0), 0.014)
    assert chooser.estimate(1, Arm(False, 16)) == pytest.approx(0.034)
    assert chooser.estimate(2, Arm(False, 16)) == pytest.approx(0.050)  # another bucket's overhead is its own
    assert chooser.cost_floor(1, Arm(False, 16)) == pytest.approx(chooser.ratio_slack * 0.034)


def test_the_summary_shows_each_choice_with_its_measured_speed_beside_plain_decodings(caplog):
    """What the log and /server_info show per batch-size bucket once the choice settled: the chosen arm, its
    measured tokens per request per second (its tokens over its round time) and plain decoding's (1 over its
    round time; none where it was not timed), the same numbers the log line of the choice carries."""
    sim = SimulatedServer(16, depth={K_MODES: 6.0, SINGLE_MODE: 4.5}, base=0.02, per_token=0.0008,
                          draft={K_MODES: 0.006, SINGLE_MODE: 0.0005})
    chooser = BudgetChooser(16, paths=MFD_D)
    chooser.calibrate(calibrated(sim, chooser))
    with caplog.at_level("INFO", logger=budget_module.__name__):
        for bs in (1, 8):
            sim.run(chooser, bs, 300)
    summary = chooser.summary()
    assert set(summary) == {1, 8}
    for bucket, row in summary.items():
        arm = chooser.chosen[bucket]
        assert row["arm"] == budget_module.describe(arm) and row["budget"] == arm.budget
        assert row["tokens_per_s"] == pytest.approx(chooser.tokens(arm) / chooser.cost(bucket, arm))
        plain = chooser.cost(bucket, PLAIN)  # None where the calibration spared timing it
        assert row["plain_tokens_per_s"] == (None if plain is None else pytest.approx(1 / plain))
    last = [r.getMessage() for r in caplog.records if "batch size <= 8 ->" in r.getMessage()][-1]
    assert "plain decoding " in last and "tokens per request per second" in last, last


def test_acceptance_of_every_smaller_budget_is_kept_from_one_round():
    chooser = BudgetChooser(16, paths=MFD_D, min_requests=8)
    assert chooser.measured_budgets(Arm(True, 8)) == [0, 4, 8]
    chooser.record_acceptance(Arm(True, 8), [[1, 2, 3], [1, 1, 5]])
    assert chooser.tokens(Arm(True, 8)) is None  # 2 request-rounds: too few to count (min_requests 8)
    for _ in range(3):
        chooser.record_acceptance(Arm(True, 8), [[1, 2, 3], [1, 1, 5]])
    assert chooser.tokens(Arm(True, 4)) == pytest.approx(1.5) and chooser.tokens(Arm(True, 8)) == pytest.approx(4.0)
    assert chooser.tokens(Arm(False, 4)) is None and chooser.tokens(Arm(True, 16)) is None
    assert chooser.tokens(Arm(False, 0)) == 1.0


def test_round_clock_times_consecutive_decode_rounds_only(monkeypatch):
    now = iter([10.0, 10.25, 11.0, 12.0])  # perf_counter at each decode_round call
    monkeypatch.setattr(budget_module.time, "perf_counter", lambda: next(now))
    clock = RoundClock()
    assert clock.decode_round(2, Arm(False, 8)) is None
    assert clock.decode_round(3, Arm(False, 4)) == (2, Arm(False, 8), 0.25)  # the first round's, at its batch size
    clock.other_forward()  # a prefill in between: the interval is not a round's
    assert clock.decode_round(3, Arm(False, 4)) is None
    assert clock.decode_round(1, Arm(True, 16)) == (3, Arm(False, 4), 1.0)


def test_the_option_is_checked():
    assert read_options(environ={"MFD_SGLANG_AUTO_BUDGET": "1"}).auto_budget
    assert not read_options(environ={}).auto_budget
    with pytest.raises(ValueError, match="MFD_SGLANG_AUTO_BUDGET='yes'"):
        read_options(environ={"MFD_SGLANG_AUTO_BUDGET": "yes"})
    with pytest.raises(ValueError, match="drop MFD_SGLANG_SWITCH_THRESHOLD=2"):
        read_options(environ={"MFD_SGLANG_AUTO_BUDGET": "1", "MFD_SGLANG_SWITCH_THRESHOLD": "2"})


# --- a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def auto_server(tiny_pair, tmp_path_factory):
    """MFD_D with the automatic budget, at most B = 16, INFO log; no --max-running-requests, as the README
    launches it (MFD resolves 48 at launch: every scheduler process must read that, not the unset flag)."""
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 16,
                       log_level="info", extra_args=("--mfd-auto-budget",),
                       extra_env=plugin_env("round_trace", "hold_admission"))
    yield from served_without_leaks(srv)


def calibrated_costs(log: str) -> dict[str, list[float]]:
    """{arm: milliseconds per bucket} of the start-up calibration table in a server log."""
    table = log.split("MFD auto budget: calibration", 1)[1].split("\n")[2:9]
    rows = [re.match(r"(.+?)\s{2,}([\d. ]+)$", line) for line in table]
    return {m.group(1).strip(): [float(x) for x in m.group(2).split()] for m in rows if m}


def test_auto_budget_drafts_the_arms_it_chooses_and_stays_exact(auto_server, reference_target, tiny_pair,
                                                                 hf_target, tiny_prompts):
    """Exact output while the chooser switches between the trees of both drafting paths (what it plays first,
    whatever the times, on a batch long enough to measure both: their acceptance is not measured yet) and
    whatever the round times
    make it choose next (the policy itself: the simulations above; /server_info shows each bucket's choice as
    the log announced it last; the simulations check its values). Every request's rounds are the
    reference engine's for the arms the draft stage drafted, round by round; drafting the launch arm
    (B = 16, K modes) every round accepts otherwise on some request, so a worker that ignored the chosen
    arm fails it. It was calibrated at start-up: every arm at every batch-size bucket up to the 48 running
    requests the launch resolved (1, 2, ..., 64), each a positive, finite time; its memory line is at 48."""
    served = run_six_long(auto_server, hf_target, tiny_prompts, 48) + run_six_and_one(auto_server, hf_target,
                                                                                       tiny_prompts)
    traces = round_traces(auto_server)
    paths = {r.arm[0] for rounds in traces.values() for r in rounds if r.arm[1] > 0}
    assert paths == {False, True}, f"the paths the draft stage drafted (single_mode): {paths}"
    runs = assert_served_as_reference_rounds(served, traces, reference_target, reference_drafter(tiny_pair / "drafter"),
                                             ignored_arm=(False, 16, None))
    print(f"lone request's rounds (arm, accepted): {list(zip(*runs[-1]))}")
    log = auto_server.log()
    assert re.search(r"MFD memory: .* at most 48 requests", log), log_tail(auto_server.log_path)
    costs = calibrated_costs(log)
    assert len(costs) == 7 and all(len(ms) == batch_bucket(48).bit_length() for ms in costs.values()), costs
    assert all(0 < t < math.inf for ms in costs.values() for t in ms), costs
    # /server_info: the choice per bucket as the log announced it last (none where a batch size is still being
    # explored), its measured speed beside plain decoding's
    states = requests.get(auto_server.base_url + "/server_info", timeout=60).json()["internal_states"]
    choices = states[0]["mfd_auto_budget"]
    announced = dict(re.findall(r"MFD auto budget: batch size <= (\d+) -> (.*?) \(\d", log))
    assert {bucket: c["arm"] for bucket, c in choices.items()} == announced, (choices, announced)
    assert all(c["tokens_per_s"] > 0 and (c["plain_tokens_per_s"] is None or c["plain_tokens_per_s"] > 0)
               for c in choices.values()), choices


@pytest.fixture(scope="module")
def mismatched_server(tiny_pair, tmp_path_factory):
    """MFD_D with the automatic budget and a drafter that agrees with the target on next to nothing (the
    tiny drafter's weight rows shuffled, seeded)."""
    ckpt = load_drafter(tiny_pair / "drafter")
    g = torch.Generator().manual_seed(0)
    weights = {n: t[torch.randperm(t.shape[0], generator=g)] if t.dim() == 2 else t for n, t in ckpt.weights.items()}
    drafter = tmp_path_factory.mktemp("mismatched") / "drafter"
    save_drafter(drafter, json.loads((tiny_pair / "drafter" / "config.json").read_text()), weights)
    srv = start_server(tmp_path_factory, tiny_pair, drafter, "MFD_D", 16, max_running=6,
                       log_level="info", extra_args=("--mfd-auto-budget",),
                       extra_env=plugin_env("round_trace", "hold_admission"))
    srv.drafter = drafter
    yield from served_without_leaks(srv)


def test_auto_budget_stays_exact_with_a_drafter_that_accepts_nothing(mismatched_server, reference_target, hf_target,
                                                                    tiny_prompts):
    """With a drafter that accepts next to nothing the chooser plays each path's largest tree until their
    acceptance is measured, then what the round times make it choose (plain decoding, by the policy's
    simulation above); the output stays the target's through those switches, and every request's rounds
    are the reference engine's for the arms the draft stage drafted."""
    served = run_six_and_one(mismatched_server, hf_target, tiny_prompts)
    traces = round_traces(mismatched_server)
    drafted = {r.arm for rounds in traces.values() for r in rounds}
    assert {(False, 16, None), (True, 16, None)} <= drafted, f"the arms the draft stage drafted: {drafted}"
    assert_served_as_reference_rounds(served, traces, reference_target, reference_drafter(mismatched_server.drafter),
                                      ignored_arm=None)


def test_auto_budget_keeps_seeded_sampling_and_logprobs(auto_server, hf_target, tiny_prompts):
    """A seeded T > 0 request gives plain sampling with its seed's coins, alone and among others; a
    greedy request's returned logprobs are the target's log-softmax at each emitted token."""
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    law, n = dict(temperature=1.5, top_p=0.95, min_p=0.02), 20
    expected = reference_sample(model, ids, n, (1.5, TOP_K_ALL, 0.95, 0.02), seed=3)

    def run(i):
        extra = {"sampling_seed": 3} if i == 0 else {}
        return generate_ids(auto_server, ids, n if i == 0 else 2 * n, **law, **extra)[0]

    assert run(0) == expected
    with admitted_together(auto_server, 4), concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(run, range(4)))[0] == expected

    prompt = tok(tiny_prompts[0], add_special_tokens=False)["input_ids"]
    response = requests.post(auto_server.base_url + "/generate", json={
        "input_ids": prompt, "return_logprob": True,
        "sampling_params": {"max_new_tokens": 24, "temperature": 0}}, timeout=600).json()
    pairs = response["meta_info"]["output_token_logprobs"]
    tokens = [t for _, t, _ in pairs]
    assert tokens == target_greedy(model, prompt, 24)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    expected_logprobs = logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    assert torch.allclose(torch.tensor([lp for lp, _, _ in pairs]), expected_logprobs, atol=1e-4)
