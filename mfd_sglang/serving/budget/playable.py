"""What each batch-size bucket can play: the one definition that the draft graphs' capture, the memory plan,
the start-up warm-up and the round's choice of arm all read.

A bucket is a draft graph's batch size (`cuda_graph.default_buckets(max_requests)`: 1, 2, 4, 8, then every 8
up to --max-running-requests); a round of n requests runs in the smallest bucket >= n (padded there on CUDA).
`Playable.arms_at[i]` are the arms (path, budget, modes; `budget.rule.Arm`) that a round whose batch falls in
bucket i may draft, plain decoding (budget 0) included where a round can play it:

  a fixed budget      --speculative-num-draft-tokens, the CPU default: the K-mode path (or the gate's K' modes)
                      at B wherever a batch can run it, and MFD_D's single-mode path at B in the buckets that hold
                      a batch of >= --mfd-switch-threshold requests (a batch below the threshold drafts K modes);
  the default schedule on CUDA (`budget.schedule`): the arm the schedule gives each batch size the bucket holds;
                      under attention DP a rank drafts its own requests' path (its bucket's) at the budget of every
                      rank's requests together (at least its own): each such path at every budget the schedule
                      gives a batch of at least that many requests;
  the automatic budget (`budget.rule.BudgetChooser`): every arm of the chooser in every bucket.

So the working sets the memory plan counts are those of the arms the graphs are captured for, the warm-up
compiles exactly what rounds launch, and a round never drafts an arm its bucket did not capture.
Deterministic: a pure function of the launch, the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from mfd_sglang.cuda_graph import default_buckets, smallest_bucket

from mfd_sglang.serving.budget.rule import PLAIN, SINGLE_MODE, Arm, BudgetChooser, Path, describe, mode_paths


@dataclass(frozen=True)
class Playable:
    """The arms each batch-size bucket can play (module docstring)."""

    buckets: tuple[int, ...]  # ascending; the last is the most requests a round can hold
    arms_at: tuple[tuple[Arm, ...], ...]  # per bucket, in the order rounds first play them

    def __post_init__(self) -> None:
        if len(self.buckets) != len(self.arms_at) or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets {self.buckets} and their arms do not match")

    @property
    def max_requests(self) -> int:
        return self.buckets[-1]

    def bucket(self, bs: int) -> int:
        """The bucket a round of bs requests runs in; ValueError past the largest."""
        return smallest_bucket(self.buckets, bs)

    def arms(self, bs: int) -> tuple[Arm, ...]:
        """What a round of bs requests can play."""
        return self.arms_at[self.buckets.index(self.bucket(bs))]

    def pairs(self) -> list[tuple[int, Arm]]:
        """Every (bucket, arm) that drafts (budget > 0): what the draft graphs capture."""
        return [(size, arm) for size, arms in zip(self.buckets, self.arms_at) for arm in arms if arm.budget > 0]

    def rounds(self, num_modes: int) -> tuple[tuple[int, int, int], ...]:
        """(bucket size, budget, modes drafted) of every arm of every bucket (`memory.MemoryPlan.rounds`);
        num_modes: the K-mode path's modes."""
        return tuple((size, arm.budget, 1 if arm.single_mode else arm.modes or num_modes)
                     for size, arms in zip(self.buckets, self.arms_at) for arm in arms)

    def all_arms(self) -> tuple[Arm, ...]:
        return tuple(dict.fromkeys(arm for arms in self.arms_at for arm in arms))

    def budgets(self) -> tuple[int, ...]:
        """The budgets rounds verify (each a window of budget + 1 tokens), ascending."""
        return tuple(sorted({arm.budget for arm in self.all_arms()}))

    def describe(self) -> str:
        """Ranges of batch sizes and what they play, e.g. '1-4: budget 64, K-mode draft; 5-8: ...'."""
        spans, low = [], 1
        for i, (size, arms) in enumerate(zip(self.buckets, self.arms_at)):
            if i + 1 == len(self.buckets) or self.arms_at[i + 1] != arms:
                sizes = f"{low}" if low == size else f"{low}-{size}"
                spans.append(f"{sizes}: {' / '.join(describe(arm) for arm in arms)}")
                low = size + 1
        return "; ".join(spans)


def fixed_playable(max_requests: int, budget: int, *, k_path: Path = Path(),
                   switch_threshold: int | None = None) -> Playable:
    """A fixed budget: k_path at `budget` below the MFD_D switch threshold, the single-mode path from it."""
    def arms(low: int, high: int) -> tuple[Arm, ...]:
        below = switch_threshold is None or low < switch_threshold
        above = switch_threshold is not None and high >= switch_threshold
        return tuple(path.at(budget) for path, plays in ((k_path, below), (SINGLE_MODE, above)) if plays)

    return _by_bucket(max_requests, arms)


def schedule_playable(schedule, *, every_path: bool = False) -> Playable:
    """The default schedule's (`budget.schedule.BudgetSchedule`): each batch size's arm; every_path (attention DP):
    each path at every budget of a batch at least the bucket's smallest."""
    def arms(low: int, high: int) -> tuple[Arm, ...]:
        if not every_path:
            return _distinct(schedule.arm(n, schedule.path(n)) for n in range(low, high + 1))
        # a rank of `local` requests drafts its path at the budget of n >= local requests on every rank
        first_local = {}
        for local in range(low, high + 1):
            first_local.setdefault(schedule.path(local), local)
        return _distinct(schedule.arm(n, path) for path, local in first_local.items()
                         for n in range(local, schedule.max_requests + 1))

    return _by_bucket(schedule.max_requests, arms)


def chooser_playable(max_requests: int, arms: Iterable[Arm]) -> Playable:
    """The automatic budget's: every arm of its chooser (`BudgetChooser.arms`) in every bucket."""
    every = tuple(arms)
    return _by_bucket(max_requests, lambda low, high: every)


def _by_bucket(max_requests: int, arms_between) -> Playable:
    """The Playable whose bucket holding batch sizes low..high plays arms_between(low, high)."""
    buckets = tuple(default_buckets(max_requests))
    lows = (1,) + tuple(b + 1 for b in buckets[:-1])
    return Playable(buckets, tuple(arms_between(low, high) for low, high in zip(lows, buckets)))


def _distinct(arms: Iterable[Arm]) -> tuple[Arm, ...]:
    """Arms in first-played order, each once; plain decoding (no draft) last."""
    seen = tuple(dict.fromkeys(arms))
    return tuple(a for a in seen if a != PLAIN) + ((PLAIN,) if PLAIN in seen else ())


def drafted_modes(cfg, options) -> tuple[int, int | None, bool]:
    """(modes of the K-mode path, the gate's K' per request or None, whether the drafter has a mode gate) of
    drafter config `cfg` under `options` (--mfd-num-modes): without a gate the drafter keeps its first K'
    modes; with one every mode stays and each request drafts its K' best."""
    gated = cfg.mode_prior == "gate"
    if options.num_modes is None or options.num_modes >= cfg.num_modes:
        return cfg.num_modes, None, gated
    return (cfg.num_modes, options.num_modes, True) if gated else (options.num_modes, None, False)


def auto_paths(cfg, options, algorithm: str) -> tuple[Path, ...]:
    """The automatic budget's paths (`budget.rule.mode_paths`) for drafter config `cfg` under `options`."""
    num_modes, gated_modes, gated = drafted_modes(cfg, options)
    return mode_paths(num_modes, gated=gated, mode_subsets=options.mode_subsets is not False,
                      single_mode_path=algorithm == "MFD_D", gated_modes=gated_modes)


def server_playable(server_args, options, cfg, *, budget: int, algorithm: str, schedule) -> Playable:
    """What the server of `server_args` (SGLang's resolved arguments) plays: the launch's plan and every
    scheduler's worker compute it from the same arguments (budget: the launch's B; schedule: the default
    `BudgetSchedule` in force or None)."""
    from mfd_sglang.serving.launch.options import attention_dp_size

    max_requests = int(server_args.max_running_requests)
    if options.auto_budget:
        return chooser_playable(max_requests, BudgetChooser(budget, paths=auto_paths(cfg, options, algorithm)).arms)
    if schedule is not None:
        return schedule_playable(schedule, every_path=attention_dp_size(server_args) > 1)
    _, gated_modes, _ = drafted_modes(cfg, options)
    return fixed_playable(max_requests, budget, k_path=Path(modes=gated_modes),
                          switch_threshold=options.switch_threshold if algorithm == "MFD_D" else None)
