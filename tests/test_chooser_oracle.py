"""The automatic budget's chooser (`mfd_sglang.serving.budget.rule.BudgetChooser`) against an oracle, on a
simulated clock: Qwen3-8B on an H100 and an H200, MFD_D's paths (the K = 8-mode draft and the single-mode
draft) at budgets 0 (plain decoding) to 64, batch sizes 1 to 64.

The laws, fixed and written down here:
  cost     `LEDGER_MS`: the GPU cost ledger's round of each arm (`gpu_ledger.arm_round_rows`, written by
           `python benchmarks/chooser_laws.py`), times the scenario's drift. The chooser sees it through
           noise: +-20% uniform jitter, and 5% of the rounds at 10x (a preemption, a page fault).
  accept   the paper's shape: the K-mode tree accepts TAU_64 tokens a round at budget 64 and 10% less per
           halving of the budget (the paper's Figure 1c: its speed-up grows with the budget up to 64); the
           single-mode tree 8% less than the K-mode one at every budget (MFD-D against MFD). Per request and
           round: tokens(b) = 1 + floor(A (tau(b) - 1) / (tau(64) - 1) + w), A ~ Exp(tau(64) - 1), w ~ U(0, 1),
           the same draws for every budget (so a smaller tree never commits more: the sub-budget structure).
The oracle plays, every round, the arm with the highest true tokens per second (expected tokens over
noise-free cost). The chooser must reach 0.97x the oracle's tokens per second at every batch size, and never
fall more than 3% below plain decoding over any 200 rounds (both by the true laws).
"""

from __future__ import annotations

import math
import random

import pytest

from mfd_sglang.serving.budget.rule import PLAIN, SINGLE_MODE, Arm, BudgetChooser, Path

PATHS = (Path(), SINGLE_MODE)  # MFD_D's: the K-mode draft and the single-mode draft
BUDGETS = (4, 8, 16, 32, 64)
ARMS = (PLAIN,) + tuple(Arm(False, b) for b in BUDGETS) + tuple(Arm(True, b) for b in BUDGETS)

# ms per round of ARMS (plain; K-mode B 4..64; single-mode B 4..64) by device and batch size:
# `gpu_ledger.arm_round_rows()` (Qwen3-8B, 512-token contexts, launch floor fitted to the H200 log), 2026-12-07.
LEDGER_MS = {
    "H100": {
        1: (8.839, 10.146, 10.153, 10.166, 10.193, 10.248, 10.117, 10.123, 10.136, 10.162, 10.215),
        2: (8.840, 10.200, 10.213, 10.243, 10.298, 10.429, 10.130, 10.143, 10.172, 10.225, 10.350),
        4: (8.864, 10.907, 10.937, 10.999, 11.137, 11.576, 10.180, 10.210, 10.272, 10.412, 10.849),
        8: (8.975, 12.795, 12.854, 13.001, 13.448, 18.056, 10.353, 10.413, 10.560, 11.008, 15.615),
        16: (9.197, 16.578, 16.730, 17.206, 21.957, 34.022, 10.708, 10.860, 11.338, 16.091, 28.159),
        32: (9.644, 24.191, 24.708, 29.808, 41.875, 66.453, 12.031, 12.548, 17.648, 29.715, 54.289),
        64: (10.540, 39.717, 45.413, 57.626, 82.218, 132.035, 15.390, 21.086, 33.298, 57.887, 107.697),
    },
    "H200": {
        1: (7.451, 8.463, 8.467, 8.476, 8.495, 8.533, 8.446, 8.450, 8.458, 8.476, 8.513),
        2: (7.452, 8.596, 8.604, 8.625, 8.662, 8.736, 8.455, 8.464, 8.485, 8.521, 8.595),
        4: (7.454, 9.450, 9.469, 9.508, 9.588, 10.384, 8.470, 8.489, 8.528, 8.609, 9.404),
        8: (7.520, 11.245, 11.287, 11.372, 12.228, 16.818, 8.577, 8.619, 8.705, 9.561, 14.151),
        16: (7.675, 14.865, 14.948, 15.940, 20.554, 31.104, 8.921, 9.005, 9.996, 14.610, 25.159),
        32: (7.986, 22.111, 23.347, 28.075, 38.645, 60.337, 10.191, 11.428, 16.155, 26.725, 48.416),
        64: (8.611, 38.158, 42.993, 53.738, 75.439, 119.484, 14.305, 19.140, 29.885, 51.584, 95.625),
    },
}
BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
SINGLE_MODE_SHARE = 0.92  # single-mode accept length / K-mode's, every budget
HALVING_LOSS = 0.10  # the accept length's loss per halving of the budget


def tau(arm: Arm, tau_64: float) -> float:
    if arm.budget == 0:
        return 1.0
    k_mode = tau_64 * (1 - HALVING_LOSS) ** math.log2(64 / arm.budget)
    return 1 + (k_mode - 1) * (SINGLE_MODE_SHARE if arm.single_mode else 1.0)


class Clock:
    """A server's rounds under the laws above at one batch size. drift(arm, t) scales an arm's cost at round t
    of the run; calibration_load scales the start-up calibration (1: taken on an idle machine)."""

    def __init__(self, device: str, bs: int, tau_64: float, seed: int, *, drift=lambda arm, t: 1.0,
                 noise: bool = True):
        self.ms = dict(zip(ARMS, LEDGER_MS[device][bs]))
        self.bs, self.tau_64, self.drift, self.noise = bs, tau_64, drift, noise
        self.rng = random.Random(seed)

    def seconds(self, arm: Arm, t: int) -> float:
        """The true (noise-free) cost of a round."""
        return self.ms[arm] * self.drift(arm, t) / 1e3

    def observed(self, arm: Arm, t: int) -> float:
        seconds = self.seconds(arm, t)
        if not self.noise:
            return seconds
        seconds *= self.rng.uniform(0.8, 1.2)
        return seconds * 10 if self.rng.random() < 0.05 else seconds

    def committed(self, budgets: list[int], single_mode: bool) -> list[int]:
        """One request's tokens at each budget of a round (the sub-budget accept lengths)."""
        a, w = self.rng.expovariate(1 / (self.tau_64 - 1)), self.rng.random()
        return [1 if b == 0 else 1 + int(a * (tau(Arm(single_mode, b), self.tau_64) - 1) / (self.tau_64 - 1) + w)
                for b in budgets]

    def calibration(self, load: float = 1.0) -> dict:
        """Start-up costs of every arm at this batch size's bucket (draft + verify: the ledger's round),
        within 10% (a short timing) and times load."""
        return {(self.bs, arm): self.seconds(arm, 0) * self.rng.uniform(0.9, 1.1) * load for arm in ARMS}

    def run(self, chooser: BudgetChooser, rounds: int, calibration_load: float = 1.0) -> list[Arm]:
        chooser.calibrate(self.calibration(calibration_load))
        played = []
        for t in range(rounds):
            if chooser.take_recalibration() is not None:
                chooser.calibrate(self.calibration())  # taken again, the machine quiet now
            arm = chooser.choose(self.bs)
            budgets = chooser.measured_budgets(arm)
            chooser.record_acceptance(arm, [self.committed(budgets, arm.single_mode) for _ in range(self.bs)])
            chooser.record_round_time(self.bs, arm, self.observed(arm, t))
            played.append(arm)
        return played

    def rates(self, played: list[Arm]) -> tuple[float, float, list[float]]:
        """(the chooser's true tokens per second, the oracle's, the chooser's rate over plain decoding's in
        every window of 200 rounds)."""
        def value(arm, t):
            return tau(arm, self.tau_64) / self.seconds(arm, t)

        tokens = [tau(arm, self.tau_64) for arm in played]
        seconds = [self.seconds(arm, t) for t, arm in enumerate(played)]
        best = [max(ARMS, key=lambda arm: value(arm, t)) for t in range(len(played))]
        oracle = sum(tau(arm, self.tau_64) for arm in best) / sum(self.seconds(arm, t) for t, arm in enumerate(best))
        plain = [self.seconds(PLAIN, t) for t in range(len(played))]
        windows = [sum(tokens[i:i + 200]) / sum(seconds[i:i + 200]) / (200 / sum(plain[i:i + 200]))
                   for i in range(0, len(played) - 199, 50)]
        return sum(tokens) / sum(seconds), oracle, windows


def rounds_at(bs: int) -> int:
    return 4000 if bs <= 4 else 1500


def growing_verify(arm: Arm, t: int) -> float:
    """Contexts grow over the run: the large windows' verify grows (budget 64 by up to 60%, 32 by up to 30%),
    the others' not."""
    return 1 + {64: 0.6, 32: 0.3}.get(arm.budget, 0.0) * min(t / 1500, 1.0)


SCENARIOS = {
    "paper accept": dict(tau_64=7.0),
    "short accept": dict(tau_64=1.8),
    "drift": dict(tau_64=7.0, drift=growing_verify),
    "calibrated under load": dict(tau_64=7.0, calibration_load=35.0),
}


@pytest.mark.parametrize("device", ["H100", "H200"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_chooser_reaches_the_oracle_and_never_falls_below_plain_decoding(device, scenario):
    """At each batch size (a fresh chooser per batch size and seed, 2 seeds): the chooser's true tokens per
    second >= 0.97x the oracle's over the run, and >= 0.97x plain decoding's in every window of 200 rounds."""
    params = dict(SCENARIOS[scenario])
    load = params.pop("calibration_load", 1.0)
    for bs in BATCH_SIZES:
        for seed in range(2):
            clock = Clock(device, bs, seed=seed, **params)
            played = clock.run(BudgetChooser(64, paths=PATHS), rounds_at(bs), calibration_load=load)
            chooser, oracle, windows = clock.rates(played)
            assert chooser >= 0.97 * oracle, (bs, seed, chooser / oracle)
            assert min(windows) >= 0.97, (bs, seed, min(windows))


def test_trees_where_they_clearly_win_and_plain_decoding_where_they_lose():
    """The premises, by the laws, and the choice: at bs 1 with the paper's accept length a tree is the oracle's
    arm on both GPUs and the chooser speculates in >= 95% of its settled rounds; at bs 64 with a short accept
    length plain decoding is, and the chooser decodes plain in >= 95% of them."""
    for device in LEDGER_MS:
        for bs, tau_64, speculate in ((1, 7.0, True), (64, 1.8, False)):
            clock = Clock(device, bs, tau_64, seed=0)
            best = max(ARMS, key=lambda arm: tau(arm, tau_64) / clock.seconds(arm, 0))
            assert (best != PLAIN) == speculate, (device, bs, best)
            played = clock.run(BudgetChooser(64, paths=PATHS), 1500)[500:]
            share = sum((arm != PLAIN) == speculate for arm in played) / len(played)
            assert share >= 0.95, (device, bs, share)


def test_a_calibration_taken_under_load_is_noticed_and_taken_again():
    """A start-up calibration at 35x the served rounds' cost (a busy neighbour during start-up) is dropped once
    the served rounds show it, and the bucket is due a new one, once."""
    clock = Clock("H100", 1, 7.0, seed=0)
    chooser = BudgetChooser(64, paths=PATHS)
    chooser.calibrate(clock.calibration(load=35.0))
    due = []
    for t in range(100):
        bucket = chooser.take_recalibration()
        if bucket is not None:
            due.append(bucket)
            chooser.calibrate(clock.calibration())
        arm = chooser.choose(1)
        chooser.record_acceptance(arm, [clock.committed(chooser.measured_budgets(arm), arm.single_mode)])
        chooser.record_round_time(1, arm, clock.observed(arm, t))
    assert due == [1], due
    assert chooser.calibrated[1][PLAIN] < 2 * clock.seconds(PLAIN, 0)
