"""The automatic tree budget (--mfd-auto-budget): for each decode batch, the drafting path and
budget that commit the most tokens per second, from acceptance and cost measured while serving and
costs calibrated at start-up.

Arms. An arm is (path, budget): budget from `candidate_budgets` (0, 4, 8, 16, ... up to the launch
budget B, which is always one), where budget 0 is plain decoding (no draft: only the root is verified,
and the target's token after it is the round's one token). A path (`Path`) is the K-mode draft, MFD_D's
single-mode path, or, for a drafter with a mode gate, each request's K' best modes under the gate
(`mode_paths`: K' = K/2 and 1 beside K, so that a large batch can draft fewer modes per request).

Acceptance, per (path, budget): tokens committed per request and round, a decayed mean over the
rounds that measured it. A round at budget b measures every budget <= b of its path at once and
exactly (`verify.sub_budget_accept_lens`: the first b' nodes of a mixture tree are the tree of
budget b'). It does not depend on the batch size (a request's acceptance is its own).

Cost, per (batch-size bucket, arm): seconds per round, a decayed mean of the time from one decode
round's start to the next's (`RoundClock`): the scheduler's share and, under overlap scheduling, the
pipeline's pace are in it, and it needs no device sync. Buckets are powers of two (bs 3 counts as 4).
Before an arm is timed at a bucket, its cost is estimated from the start-up calibration
(`budget.calibration`: its draft + verify on placeholder requests) plus the bucket's overhead, the mean
amount by which the arms timed there cost more than calibrated (0 until one is timed).

Choice, per round (`BudgetChooser.choose`, each rule in its own method with its reason): the arm with
the most tokens per request per second, tokens(path, b) / seconds(bucket, arm), optimistic where a value
is missing: a path whose acceptance is unmeasured plays its largest tree (`unmeasured_path`); an arm
never timed at the bucket is bounded below (`cost_floor`) and played when its bound could win
(`most_promising`); the choice changes only past a margin (`keep_current`); a settled choice is probed
now and then (`probe`). The choice is host-side Python over a few dozen numbers; it is logged when it
changes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import NamedTuple

logger = logging.getLogger(__name__)


class Path(NamedTuple):
    """How a round drafts: MFD_D's single-mode path, or the K-mode draft of every mode (modes None) or of
    each request's `modes` best modes under the drafter's mode gate (`MFDDrafter.gate_modes`)."""

    single_mode: bool = False
    modes: int | None = None

    def at(self, budget: int) -> "Arm":
        return Arm(self.single_mode, budget, self.modes)


class Arm(NamedTuple):
    """What a round drafts: its path and its tree budget (equal to the plain tuple `(single_mode, budget,
    modes)`)."""

    single_mode: bool  # MFD_D's single-mode draft; False: the K-mode draft
    budget: int  # tree nodes; 0: plain decoding (no draft, the root alone)
    modes: int | None = None  # the gate's `modes` best modes per request; None: every mode (`Path`)

    @property
    def path(self) -> Path:
        return Path(self.single_mode, self.modes)


PLAIN = Arm(False, 0)
SINGLE_MODE = Path(single_mode=True)


def mode_paths(num_modes: int, *, gated: bool, mode_subsets: bool, single_mode_path: bool,
               gated_modes: int | None = None) -> tuple[Path, ...]:
    """The paths the automatic budget chooses from: the K-mode draft, of the drafter's num_modes modes or
    with a mode gate of each request's gated_modes best (--mfd-num-modes); with a gate and
    mode_subsets, also each request's K/2 and 1 best (a K'-mode draft costs about K'/K of K's, plus the
    gate's root-only pass, and at the small budgets a large batch affords keeps most of K's acceptance:
    docs/algorithm.md, "Fewer modes per request, measured"); MFD_D's single-mode path."""
    k = gated_modes or num_modes
    counts = sorted({k // 2, 1} - {0, k}, reverse=True) if gated and mode_subsets else []
    return ((Path(modes=gated_modes),) + tuple(Path(modes=count) for count in counts)
            + ((SINGLE_MODE,) if single_mode_path else ()))


def candidate_budgets(max_budget: int) -> tuple[int, ...]:
    """0, then powers of two from 4 below max_budget, then max_budget itself."""
    budgets, b = [0], 4
    while b < max_budget:
        budgets.append(b)
        b *= 2
    return tuple(budgets + [max_budget])


def batch_bucket(bs: int) -> int:
    """The power of two >= bs."""
    return 1 << max(bs - 1, 0).bit_length()


@dataclass
class DecayedMean:
    """A mean whose old samples fade: each new sample scales the past weight by `decay`."""

    decay: float
    total: float = 0.0
    weight: float = 0.0
    samples: int = 0

    def update(self, total: float, count: int) -> None:
        """Add `count` samples summing to `total`."""
        fade = self.decay ** count
        self.total = fade * self.total + total
        self.weight = fade * self.weight + count
        self.samples += count

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


@dataclass
class BudgetChooser:
    max_budget: int
    paths: tuple[Path, ...] = (Path(),)  # `mode_paths`
    probe_every: int = 32
    max_probe_interval: int = 512
    probe_floor: float = 0.7
    min_timings: int = 2  # rounds timed before an arm's cost counts as measured
    min_requests: int = 8  # request-rounds before an arm's acceptance counts as measured
    acceptance_decay: float = 0.995  # per request-round (a request's acceptance changes slowly)
    hysteresis: float = 0.02  # another arm takes over when it is this much better than the current one
    cost_decay: float = 0.8  # per timed round
    ratio_slack: float = 0.9  # a cost ratio from a smaller bucket bounds this one's after this discount
    budgets: tuple[int, ...] = field(init=False)
    acceptance: dict[Arm, DecayedMean] = field(init=False)
    costs: dict[tuple[int, Arm], DecayedMean] = field(init=False)
    calibrated: dict[int, dict[Arm, float]] = field(init=False)  # bucket: arm: start-up seconds (`budget.calibration`)
    rounds: dict[int, int] = field(init=False)
    chosen: dict[int, Arm] = field(init=False)
    explored: set[tuple[int, Arm]] = field(init=False)
    next_probe: dict[int, tuple[int, int]] = field(init=False)  # bucket: (round of the next probe, interval)
    probe_turns: dict[int, int] = field(init=False)  # bucket: probe rounds played (which neighbour is next)

    def __post_init__(self) -> None:
        self.budgets = candidate_budgets(self.max_budget)
        self.acceptance = {}
        self.costs, self.calibrated, self.rounds, self.chosen, self.explored = {}, {}, {}, {}, set()
        self.next_probe, self.probe_turns = {}, {}

    @property
    def arms(self) -> list[Arm]:
        return [PLAIN] + [path.at(b) for path in self.paths for b in self.budgets[1:]]

    # --- measurements ------------------------------------------------------------------------
    def record_acceptance(self, arm: Arm, committed: list[list[int]]) -> None:
        """committed[r][i]: tokens request r committed, or would have had its tree held only
        budgets[i] nodes, for every budget <= arm's (`sub_budget_accept_lens` at `measured_budgets`)."""
        for i, b in enumerate(self.measured_budgets(arm)):
            key = PLAIN if b == 0 else arm.path.at(b)
            mean = self.acceptance.setdefault(key, DecayedMean(self.acceptance_decay))
            mean.update(float(sum(row[i] for row in committed)), len(committed))

    def calibrate(self, costs: dict[tuple[int, Arm], float]) -> None:
        """Start-up seconds of (bucket, arm)'s draft + verify (`calibration.calibrate_round_costs`)."""
        self.calibrated = {}
        for (bucket, arm), seconds in costs.items():
            self.calibrated.setdefault(bucket, {})[arm] = seconds

    def record_round_time(self, bs: int, arm: Arm, seconds: float) -> None:
        self.costs.setdefault((batch_bucket(bs), arm), DecayedMean(self.cost_decay)).update(seconds, 1)

    def measured_budgets(self, arm: Arm) -> list[int]:
        """The budgets a round at arm measures the acceptance of (all <= its budget)."""
        return [b for b in self.budgets if b <= arm.budget]

    # --- values ------------------------------------------------------------------------------
    def tokens(self, arm: Arm) -> float | None:
        if arm.budget == 0:
            return 1.0  # plain decoding commits one token per round, always
        mean = self.acceptance.get(arm)
        return None if mean is None or mean.samples < self.min_requests else mean.value

    def cost(self, bucket: int, arm: Arm) -> float | None:
        mean = self.costs.get((bucket, arm))
        return None if mean is None or mean.samples < self.min_timings else mean.value

    def estimate(self, bucket: int, arm: Arm) -> float | None:
        """The calibrated cost plus the bucket's overhead: the mean of timed minus calibrated cost over
        the arms timed at the bucket (what calibration leaves out: the scheduler, accept, commit)."""
        at_bucket = self.calibrated.get(bucket, {})
        calibrated = at_bucket.get(arm)
        if calibrated is None:
            return None
        overheads = [self.cost(bucket, a) - c for a, c in at_bucket.items() if self.cost(bucket, a) is not None]
        return max(calibrated + (sum(overheads) / len(overheads) if overheads else 0.0), 0.0)

    def cost_floor(self, bucket: int, arm: Arm) -> float:
        """A lower bound of an untimed arm's cost (0 when there is none), the largest of: the dearest
        timed arm of its path with a smaller budget (a bigger tree costs no less); plain decoding's; plain
        decoding's times the arm's cost over plain decoding's at the nearest smaller bucket where both are
        timed, and the calibrated estimate, these two less `ratio_slack` for noise (a bigger batch does not
        make a tree relatively cheaper: the verify window grows with it while plain decoding's one token
        does not). So a new bucket does not replay the dear arms the smaller ones already ruled out, and
        with a calibration its first rounds play the arm calibrated best instead of timing each in turn."""
        below = [self.cost(bucket, arm.path.at(b)) for b in self.budgets if 0 < b < arm.budget]
        plain = self.cost(bucket, PLAIN)
        below.append(plain)
        estimate = self.estimate(bucket, arm)
        if estimate is not None:
            below.append(self.ratio_slack * estimate)
        if plain is not None:
            smaller = bucket // 2
            while smaller >= 1 and (self.cost(smaller, arm) is None or self.cost(smaller, PLAIN) is None):
                smaller //= 2
            if smaller >= 1:
                below.append(self.ratio_slack * plain * self.cost(smaller, arm) / self.cost(smaller, PLAIN))
        return max((c for c in below if c is not None), default=0.0)

    # --- the choice --------------------------------------------------------------------------
    def choose(self, bs: int) -> Arm:
        """This round's arm for a decode batch of bs requests."""
        bucket = batch_bucket(bs)
        count = self.rounds[bucket] = self.rounds.get(bucket, 0) + 1
        unmeasured = self.unmeasured_path()
        if unmeasured is not None:
            return self.explore(bucket, unmeasured)
        timed, bounds = {}, {}  # tokens per second: measured, or an upper bound for untimed arms
        for arm in self.arms:
            cost = self.cost(bucket, arm)
            if cost is not None:
                timed[arm] = self.tokens(arm) / cost
                continue
            floor = self.cost_floor(bucket, arm)
            if floor <= 0:
                return self.explore(bucket, arm)  # nothing to bound it with yet: time it
            bounds[arm] = self.tokens(arm) / floor
        best = self.keep_current(bucket, timed)
        promising = self.most_promising(bounds, timed, best)
        if promising is not None:
            return self.explore(bucket, promising)
        self.settle(bucket, best, count)
        return self.probe(bucket, best, count, timed, bounds)

    def unmeasured_path(self) -> Arm | None:
        """A path whose acceptance was measured on fewer than `min_requests` request-rounds plays its
        largest tree: one round measures every budget of the path."""
        for path in self.paths:
            if self.tokens(path.at(self.max_budget)) is None:
                return path.at(self.max_budget)
        return None

    def keep_current(self, bucket: int, timed: dict[Arm, float]) -> Arm | None:
        """The best timed arm, unless the current choice is within `hysteresis` of it (noise would flip
        the choice back and forth)."""
        best = max(timed, key=timed.get) if timed else None
        current = self.chosen.get(bucket)
        if best is not None and current in timed and timed[best] <= (1 + self.hysteresis) * timed[current]:
            return current
        return best

    @staticmethod
    def most_promising(bounds: dict[Arm, float], timed: dict[Arm, float], best: Arm | None) -> Arm | None:
        """Optimism: of the untimed arms whose best case (`cost_floor`) beats the best timed one, the one
        with the highest bound is timed; so only arms that might win are explored."""
        promising = [arm for arm, bound in bounds.items() if best is None or bound > timed[best]]
        return max(promising, key=bounds.get) if promising else None

    def settle(self, bucket: int, best: Arm, count: int) -> None:
        """Make best the bucket's choice; a change restarts the probes at `probe_every` rounds."""
        if self.chosen.get(bucket) == best:
            return
        self.chosen[bucket] = best
        self.next_probe[bucket] = (count + self.probe_every, self.probe_every)
        logger.info("MFD auto budget: batch size <= %d -> %s (%.2f tokens per request per round, "
                    "%.1f ms per round)", bucket, describe(best), self.tokens(best), 1e3 * self.cost(bucket, best))

    def probe(self, bucket: int, best: Arm, count: int, timed: dict[Arm, float], bounds: dict[Arm, float]) -> Arm:
        """best, or on a probe round one of its neighbours (`probes`, in turn), so that acceptance and cost
        around the choice stay current as requests and lengths change (a path's acceptance is measured
        only by its own rounds). Probes come `probe_every` rounds after the choice changed, then at twice
        the last interval (up to `max_probe_interval`) while it holds, so a settled choice pays little for
        them; a neighbour measured (or, untimed, bounded) at under `probe_floor` of the choice's value is
        not played (its acceptance would have to grow by that factor to matter)."""
        probe_round, interval = self.next_probe[bucket]
        if count < probe_round:
            return best
        self.next_probe[bucket] = (count + 2 * interval, min(2 * interval, self.max_probe_interval))
        neighbours = self.probes(best)
        turn = self.probe_turns[bucket] = self.probe_turns.get(bucket, -1) + 1
        neighbour = neighbours[turn % len(neighbours)]
        if timed.get(neighbour, bounds.get(neighbour, 0.0)) >= self.probe_floor * timed[best]:
            return neighbour if neighbour in timed else self.explore(bucket, neighbour)
        return best

    def explore(self, bucket: int, arm: Arm) -> Arm:
        if (bucket, arm) not in self.explored:
            self.explored.add((bucket, arm))
            logger.info("MFD auto budget: timing %s at batch size <= %d", describe(arm), bucket)
        return arm

    def probes(self, arm: Arm) -> list[Arm]:
        """The arms a probe round after arm plays in turn: the next larger budget of its path (after
        plain decoding: the smallest drafted budget of each path) and the other paths at its budget;
        arm itself when there is none (MFD's largest budget)."""
        if arm.budget == 0:
            return [p.at(self.budgets[1]) for p in self.paths]
        larger = [arm.path.at(b) for b in self.budgets if b > arm.budget][:1]
        return larger + [p.at(arm.budget) for p in self.paths if p != arm.path] or [arm]


def describe(arm: Arm) -> str:
    if arm.budget == 0:
        return "plain decoding (budget 0)"
    return f"budget {arm.budget}, {describe_path(arm.path)}"


def describe_path(path: Path) -> str:
    if path.modes is not None:
        return f"gate's best {path.modes} mode(s)"
    return "single-mode draft" if path.single_mode else "K-mode draft"


class RoundClock:
    """The time from one decode round's start to the next's, attributed to the first round's arm and
    batch size. A prefill (or anything that is not a decode round) in between drops the interval."""

    def __init__(self) -> None:
        self.last: tuple[float, int, Arm] | None = None

    def decode_round(self, bs: int, arm: Arm) -> tuple[int, Arm, float] | None:
        """Mark a decode round's start; returns the previous round's (bs, arm, seconds) when it ran
        right before this one."""
        now = time.perf_counter()
        previous, self.last = self.last, (now, bs, arm)
        if previous is None:
            return None
        start, prev_bs, prev_arm = previous
        return prev_bs, prev_arm, now - start

    def other_forward(self) -> None:
        self.last = None
