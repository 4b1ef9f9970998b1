"""The automatic tree budget (--mfd-auto-budget): for each decode batch, the drafting path and
budget that commit the most tokens per second, from acceptance and cost measured while serving and
costs calibrated at start-up.

Arms. An arm is (path, budget): budget from `candidate_budgets` (0, 4, 8, 16, ... up to the launch
budget B, which is always one), where budget 0 is plain decoding (no draft: only the root is verified,
and the target's token after it is the round's one token). A path (`Path`) is the K-mode draft, MFD_D's
single-mode path, or, for a drafter with a mode gate, each request's K' best modes under the gate
(`mode_paths`: K' = K/2 and 1 beside K, so that a large batch can draft fewer modes per request).

Acceptance, per (path, budget): tokens committed per request and round, plain decoding's one plus each
budget's gain over the next smaller one, each a decayed mean over the request-rounds that measured it. A
round at budget b measures every budget <= b of its path at once and exactly
(`verify.sub_budget_accept_lens`: the first b' nodes of a mixture tree are the tree of budget b'), so a
budget played less is valued by the smaller ones every round measures plus its own rounds' gain. It does
not depend on the batch size (a request's acceptance is its own); it counts from `min_requests`
request-rounds, so a generation's first rounds do not carry a choice alone.

Cost, per (batch-size bucket, arm): seconds per round, the robust mean of the arm's latest round times
there (`RecentCost`: the median of the last 16), from one decode round's start to
the next's (`RoundClock`): the scheduler's share and, under overlap scheduling, the pipeline's pace are
in it, and it needs no device sync. An outlier (a preempted round) does not move it on its own; a drift
(contexts grow, the machine's load changes) does within a window. Buckets are powers of two (bs 3 counts
as 4). Before an arm is timed at a bucket, its cost is estimated from the start-up calibration
(`budget.calibration`: its draft + verify on placeholder requests) plus the bucket's overhead, the least
amount by which the arms timed there cost more than calibrated (0 until one is timed). A calibration above
the served rounds of the same arm was taken under load: it is dropped and taken again
(`check_calibration`).

Choice, per round (`BudgetChooser.choose`, each rule in its own method with its reason): the arm with
the most tokens per request per second, tokens(path, b) / seconds(bucket, arm), optimistic where a value
is missing: a path whose acceptance is unmeasured plays the largest tree the bucket affords
(`unmeasured_path`), its larger budgets bounded (`tokens_bound`); a timed arm whose acceptance may still
beat the choice is played (`contender`); an arm
never timed at the bucket is bounded below (`cost_floor`) and played when its bound could win
(`most_promising`); the choice changes only past a margin (`keep_current`); a settled choice is probed
now and then, plain decoding and the smaller and larger budgets alike, at intervals that double while
it holds (`probe`). The choice is host-side Python over a few dozen numbers; it is logged when it
changes, with its measured speed beside plain decoding's (`summary`, also in /server_info).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
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
    """A mean whose old samples fade: each new sample scales the past weight by `decay`; with the samples'
    spread, for the mean's standard error."""

    decay: float
    total: float = 0.0
    squares: float = 0.0
    weight: float = 0.0
    samples: int = 0
    largest_update: int = 0  # the most samples one update brought (for acceptance: requests in one round)

    def update(self, total: float, count: int, squares: float) -> None:
        """Add `count` samples summing to `total`, their squares summing to `squares`."""
        fade = self.decay ** count
        self.total = fade * self.total + total
        self.squares = fade * self.squares + squares
        self.weight = fade * self.weight + count
        self.samples += count
        self.largest_update = max(self.largest_update, count)

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None

    @property
    def variance_of_mean(self) -> float:
        """The squared standard error of `value` (the samples' variance over their effective count)."""
        mean = self.value
        return max(self.squares / self.weight - mean * mean, 0.0) / self.weight if self.weight > 0 else math.inf


@dataclass
class RecentCost:
    """An arm's round time at a bucket from its last `window` samples, robust to noise: their median. So
    samples far from their peers (a preempted round, a page fault) move it only once they are half the
    window, while a drift moves it within a window of rounds. `timed_at`: the bucket's round count at the
    last sample (how old the value is)."""

    window: int
    recent: deque = field(default_factory=deque)
    timed_at: int = 0

    def update(self, seconds: float, at: int) -> None:
        self.recent.append(seconds)
        if len(self.recent) > self.window:
            self.recent.popleft()
        self.timed_at = at

    @property
    def value(self) -> float | None:
        return statistics.median(self.recent) if self.recent else None

    @property
    def optimistic(self) -> float | None:
        """`value`, or until the window is full the fastest sample where the median is over twice it: noise
        only ever slows a round, so an arm timed a few times in unlucky rounds (a preemption, a neighbour's
        burst) is not written off by them (`BudgetChooser.upper_value`); ordinary jitter keeps the median."""
        fastest, median = min(self.recent), self.value
        return fastest if len(self.recent) < self.window and median > 2 * fastest else median


@dataclass
class BudgetChooser:
    max_budget: int
    paths: tuple[Path, ...] = (Path(),)  # `mode_paths`
    probe_every: int = 32
    max_probe_interval: int = 512
    probe_floor: float = 0.7
    min_timings: int = 3  # rounds timed before an arm's cost counts as measured (a median of 3 rejects one outlier)
    cost_window: int = 16  # the latest round times an arm's cost is the robust mean of (`RecentCost`)
    min_requests: int = 64  # request-rounds before an arm's acceptance counts as measured (`tokens`)
    acceptance_decay: float = 0.999  # per request-round (a request's acceptance changes slowly)
    confidence: float = 3.0  # standard errors of optimism in an arm's acceptance (`upper_value`)
    hysteresis: float = 0.02  # another arm takes over when it is this much better than the current one
    ratio_slack: float = 0.9  # a cost ratio from a smaller bucket bounds this one's after this discount
    stale_rounds: int = 2048  # a cost older than this many rounds of its bucket is probed whatever its value
    calibration_tolerance: float = 1.5  # a calibration above this times the served round is taken under load
    max_recalibrations: int = 2  # per bucket; past them its calibration stays dropped
    explore_cost: float = 2.0  # a path's acceptance is first measured on rounds costing at most this many plain ones
    unmeasured_growth: float = 1.5  # optimism per budget doubling for an unmeasured budget's drafts (`tokens_bound`)
    budgets: tuple[int, ...] = field(init=False)
    acceptance: dict[Arm, DecayedMean] = field(init=False)  # gain over the next smaller budget (`tokens`)
    costs: dict[tuple[int, Arm], RecentCost] = field(init=False)
    calibrated: dict[int, dict[Arm, float]] = field(init=False)  # bucket: arm: start-up seconds (`budget.calibration`)
    rounds: dict[int, int] = field(init=False)
    chosen: dict[int, Arm] = field(init=False)
    explored: set[tuple[int, Arm]] = field(init=False)
    next_probe: dict[int, tuple[int, int]] = field(init=False)  # bucket: (round of the next probe, interval)
    probe_turns: dict[int, int] = field(init=False)  # bucket: probe rounds played (which neighbour is next)
    recalibrations: dict[int, int] = field(init=False)  # bucket: calibrations dropped as taken under load
    recalibration_due: set[int] = field(init=False)  # buckets whose calibration the server should take again

    def __post_init__(self) -> None:
        self.budgets = candidate_budgets(self.max_budget)
        self.acceptance = {}
        self.costs, self.calibrated, self.rounds, self.chosen, self.explored = {}, {}, {}, {}, set()
        self.next_probe, self.probe_turns = {}, {}
        self.recalibrations, self.recalibration_due = {}, set()

    @property
    def arms(self) -> list[Arm]:
        return [PLAIN] + [path.at(b) for path in self.paths for b in self.budgets[1:]]

    # --- measurements ------------------------------------------------------------------------
    def record_acceptance(self, arm: Arm, committed: list[list[int]]) -> None:
        """committed[r][i]: tokens request r committed, or would have had its tree held only
        budgets[i] nodes, for every budget <= arm's (`sub_budget_accept_lens` at `measured_budgets`).
        Kept per drafted budget as the gain over the next smaller one (plain decoding's one token below
        the smallest), measured on the same requests and rounds."""
        for i, b in enumerate(self.measured_budgets(arm)):
            if b > 0:
                gain = self.acceptance.setdefault(arm.path.at(b), DecayedMean(self.acceptance_decay))
                gains = [row[i] - row[i - 1] for row in committed]
                gain.update(float(sum(gains)), len(gains), float(sum(g * g for g in gains)))

    def calibrate(self, costs: dict[tuple[int, Arm], float]) -> None:
        """Seconds of (bucket, arm)'s draft + verify (`calibration.calibrate_round_costs`): at start-up, or
        again for the buckets of `take_recalibration`; each bucket's replaces what it had."""
        fresh: dict[int, dict[Arm, float]] = {}
        for (bucket, arm), seconds in costs.items():
            fresh.setdefault(bucket, {})[arm] = seconds
        self.calibrated.update(fresh)

    def record_round_time(self, bs: int, arm: Arm, seconds: float) -> None:
        bucket = batch_bucket(bs)
        cost = self.costs.setdefault((bucket, arm), RecentCost(self.cost_window))
        cost.update(seconds, self.rounds.get(bucket, 0))
        self.check_calibration(bucket, arm)

    def check_calibration(self, bucket: int, arm: Arm) -> None:
        """A calibration measures part of a round (draft + verify), so one above `calibration_tolerance`
        times the served rounds of the same arm was taken while something else held the machine: it is
        dropped (estimates fall back to measurements) and, up to `max_recalibrations` times per bucket,
        due again (`take_recalibration`)."""
        calibrated, served = self.calibrated.get(bucket, {}).get(arm), self.cost(bucket, arm)
        if calibrated is None or served is None or calibrated <= self.calibration_tolerance * served:
            return
        del self.calibrated[bucket]
        again = self.recalibrations.get(bucket, 0) < self.max_recalibrations
        if again:
            self.recalibrations[bucket] = self.recalibrations.get(bucket, 0) + 1
            self.recalibration_due.add(bucket)
        logger.warning("MFD auto budget: the calibration of %s at batch size <= %d (%.1f ms) exceeds its "
                       "served rounds (%.1f ms): it was taken under load; %s", describe(arm), bucket,
                       1e3 * calibrated, 1e3 * served,
                       "calibrating that batch size again" if again else "timing the arms while serving instead")

    def take_recalibration(self) -> int | None:
        """A bucket whose calibration `check_calibration` dropped and the server should take again, once."""
        return self.recalibration_due.pop() if self.recalibration_due else None

    def measured_budgets(self, arm: Arm) -> list[int]:
        """The budgets a round at arm measures the acceptance of (all <= its budget)."""
        return [b for b in self.budgets if b <= arm.budget]

    # --- values ------------------------------------------------------------------------------
    def tokens(self, arm: Arm) -> float | None:
        """Tokens a round at arm commits per request: plain decoding's one plus each budget's measured gain
        over the next smaller one up to arm's. So an arm played less is valued by the budgets below it,
        which every round of its path measures, plus its own rounds' gain, measured on the same requests;
        None until each gain is `measured`."""
        total = 1.0  # plain decoding commits one token per round, always
        for b in self.budgets[1:]:
            if b > arm.budget:
                break
            gain = self.acceptance.get(arm.path.at(b))
            if gain is None or not self.measured(gain):
                return None
            total += gain.value
        return total

    def measured(self, gain: DecayedMean) -> bool:
        """A gain counts from `min_requests` request-rounds, or a round of half as many requests: a
        generation's rounds are alike, its first ones where drafters accept most, so a few generations'
        first rounds do not carry a choice on their own, while one round of many requests spans many."""
        return gain.samples >= self.min_requests or 2 * gain.largest_update >= self.min_requests

    def cost(self, bucket: int, arm: Arm) -> float | None:
        mean = self.costs.get((bucket, arm))
        return None if mean is None or len(mean.recent) < self.min_timings else mean.value

    def estimate(self, bucket: int, arm: Arm) -> float | None:
        """The calibrated cost plus the bucket's overhead: the least timed minus calibrated cost over the
        arms timed at the bucket (what calibration leaves out and every arm pays: the scheduler, accept,
        commit; the least, as what an arm pays beyond it is its own: a tree's verify grows with the
        contexts, a few timings may all have been slowed)."""
        at_bucket = self.calibrated.get(bucket, {})
        calibrated = at_bucket.get(arm)
        if calibrated is None:
            return None
        overheads = [self.cost(bucket, a) - c for a, c in at_bucket.items() if self.cost(bucket, a) is not None]
        return calibrated + max(min(overheads, default=0.0), 0.0)  # below 0: taken under load (`check_calibration`)

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
        unmeasured = self.unmeasured_path(bucket)
        if unmeasured is not None:
            return self.explore(bucket, unmeasured)
        timed, bounds = {}, {}  # tokens per second: measured, or an upper bound for untimed arms
        for arm in self.arms:
            cost, tokens = self.cost(bucket, arm), self.tokens(arm)
            if cost is not None and tokens is not None:
                timed[arm] = tokens / cost
                continue
            floor = self.costs[bucket, arm].optimistic if cost is not None else self.cost_floor(bucket, arm)
            if floor <= 0:
                return self.explore(bucket, arm)  # nothing to bound it with yet: time it
            bounds[arm] = (tokens if tokens is not None else self.tokens_bound(arm)) / floor
        best = self.keep_current(bucket, timed)
        promising = self.most_promising(bounds, timed, best)
        if promising is not None:
            return self.explore(bucket, promising)
        self.settle(bucket, best, count)
        contender = self.contender(bucket, best, timed)
        if contender is not None:
            return contender
        return self.probe(bucket, best, count, timed, bounds)

    def upper_value(self, bucket: int, arm: Arm) -> float:
        """Tokens per second with the acceptance `confidence` standard errors up (each budget's gain's error,
        as if independent) over the optimistic cost (`RecentCost.optimistic`): what the arm may be worth given
        how little it was measured."""
        spread = sum(self.acceptance[arm.path.at(b)].variance_of_mean for b in self.budgets[1:] if b <= arm.budget)
        return (self.tokens(arm) + self.confidence * math.sqrt(spread)) / self.costs[bucket, arm].optimistic

    def contender(self, bucket: int, best: Arm, timed: dict[Arm, float]) -> Arm | None:
        """Optimism in acceptance: the timed arm of the highest `upper_value`, when that beats the choice's
        own; played until its acceptance is measured well enough to rule it in or out. Acceptance varies
        per request (a few dozen request-rounds leave an error of 10-20%), so the first rounds of a path
        alone do not decide against it; an arm far below the choice stops after a few rounds, one close to
        it costs little per round."""
        upper = {arm: self.upper_value(bucket, arm) for arm in timed}
        contender = max(upper, key=upper.get)
        return contender if contender != best and upper[contender] > upper[best] else None

    def unmeasured_path(self, bucket: int) -> Arm | None:
        """A path whose acceptance is not yet `measured` plays the largest tree the bucket affords to measure
        it (`exploration_budget`): one round measures every budget up to it."""
        for path in self.paths:
            if self.tokens(path.at(self.budgets[1])) is None:
                return path.at(self.exploration_budget(bucket, path))
        return None

    def exploration_budget(self, bucket: int, path: Path) -> int:
        """The largest budget whose round costs at most `explore_cost` plain rounds at the bucket by its
        measured or calibrated cost (every budget where neither is known), else the smallest: where the
        verify is dear (a large batch), measuring a path's acceptance costs little against plain decoding;
        the larger budgets are then bounded (`tokens_bound`) and measured only where they could win."""
        plain = self.cost(bucket, PLAIN) or self.estimate(bucket, PLAIN)

        def affordable(b: int) -> bool:
            cost = self.cost(bucket, path.at(b)) or self.estimate(bucket, path.at(b))
            return plain is None or cost is None or cost <= self.explore_cost * plain

        return max((b for b in self.budgets[1:] if affordable(b)), default=self.budgets[1])

    def tokens_bound(self, arm: Arm) -> float:
        """An optimistic bound of the tokens of an arm whose acceptance is unmeasured: its path's largest
        measured budget's, the accepted drafts (past the bonus token) times `unmeasured_growth` per doubling
        beyond it (the accept length grows by 5-15% per doubling in practice: docs/results.md, the paper's
        Figure 1c)."""
        measured = max(b for b in self.budgets[1:] if b < arm.budget and self.tokens(arm.path.at(b)) is not None)
        drafts = self.tokens(arm.path.at(measured)) - 1
        return 1 + drafts * self.unmeasured_growth ** math.log2(arm.budget / measured)

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
        choice = self.choice_row(bucket)
        plain = choice["plain_tokens_per_s"]
        logger.info("MFD auto budget: batch size <= %d -> %s (%.2f tokens per request per round, %.1f ms per round: "
                    "%.1f tokens per request per second; plain decoding %s)", bucket, describe(best), self.tokens(best),
                    1e3 * self.cost(bucket, best), choice["tokens_per_s"],
                    "not timed" if plain is None else f"{plain:.1f}")

    def summary(self) -> dict[int, dict]:
        """`choice_row` of every batch-size bucket with a choice, for /server_info."""
        return {bucket: self.choice_row(bucket) for bucket in sorted(self.chosen)}

    def choice_row(self, bucket: int) -> dict:
        """A bucket's choice: the arm, its measured tokens per request per second and plain decoding's (None
        until timed there), for the log and /server_info."""
        arm, plain = self.chosen[bucket], self.cost(bucket, PLAIN)
        return {"arm": describe(arm), "budget": arm.budget, "path": describe_path(arm.path),
                "tokens_per_s": self.tokens(arm) / self.cost(bucket, arm),
                "plain_tokens_per_s": None if plain is None else 1.0 / plain}

    def probe(self, bucket: int, best: Arm, count: int, timed: dict[Arm, float], bounds: dict[Arm, float]) -> Arm:
        """best, or on a probe round one of its neighbours (`probes`, in turn), so that acceptance and cost
        around the choice stay current as requests, lengths and the machine's load change (a path's
        acceptance is measured only by its own rounds). Probes come `probe_every` rounds after the choice
        changed, then at twice the last interval (up to `max_probe_interval`) while it holds, so a settled
        choice pays little for them; a neighbour measured (or, untimed, bounded) at under `probe_floor` of
        the choice's value is not played (its acceptance would have to grow by that factor to matter) unless
        its cost is older than `stale_rounds` rounds of the bucket (costs drift: contexts grow, load comes and
        goes)."""
        probe_round, interval = self.next_probe[bucket]
        if count < probe_round:
            return best
        self.next_probe[bucket] = (count + 2 * interval, min(2 * interval, self.max_probe_interval))
        neighbours = self.probes(best)
        turn = self.probe_turns[bucket] = self.probe_turns.get(bucket, -1) + 1
        neighbour = neighbours[turn % len(neighbours)]
        measured = self.costs.get((bucket, neighbour))
        stale = measured is not None and count - measured.timed_at > self.stale_rounds
        if stale or timed.get(neighbour, bounds.get(neighbour, 0.0)) >= self.probe_floor * timed[best]:
            return neighbour if neighbour in timed else self.explore(bucket, neighbour)
        return best

    def explore(self, bucket: int, arm: Arm) -> Arm:
        if (bucket, arm) not in self.explored:
            self.explored.add((bucket, arm))
            logger.info("MFD auto budget: timing %s at batch size <= %d", describe(arm), bucket)
        return arm

    def probes(self, arm: Arm) -> list[Arm]:
        """The arms a probe round after arm plays in turn: the next smaller and the next larger budget of its
        path (after plain decoding: the smallest drafted budget of each path), the other paths at its budget,
        and plain decoding, which is probed like any arm."""
        if arm.budget == 0:
            return [p.at(self.budgets[1]) for p in self.paths]
        smaller = [b for b in self.budgets if 0 < b < arm.budget][-1:]
        larger = [b for b in self.budgets if b > arm.budget][:1]
        return ([arm.path.at(b) for b in smaller + larger] + [p.at(arm.budget) for p in self.paths if p != arm.path]
                + [PLAIN])


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
