"""The automatic budget in a serving worker (--mfd-auto-budget): what the rule in `budget.rule` needs
from the server, owned in one place.

`AutoBudget` holds the chooser (`budget.BudgetChooser`: the rule), the round clock, the acceptance of
recent rounds on its way to the host, the candidate budgets on the device, the target's tree-verify
graphs at every candidate window (`verify_graph.VerifyGraphsByWidth`, GPU) and the start-up
calibration (`budget.calibration`). The worker talks to it through four calls:
  `choose(bs)`              this decode round's arm (it records the finished rounds' acceptance and
                            the last round's time first);
  `activate_window(width)`  the verify graphs (and attention backend) of the round's window;
  `after_round(arm, result)` start measuring what the round committed (no host sync);
  `other_forward()`         a prefill ran: the interval to the next decode round is not a round's.
and at start-up `capture_verify_graphs(model_runner)` then `calibrate(...)`; a calibration the served rounds
show was taken under load is taken again before a round (`recalibrate`).
"""

from __future__ import annotations

from collections import deque

import torch

from mfd_sglang.acceptance import TreeVerifyResult, sub_budget_accept_lens

from mfd_sglang.serving.budget.rule import Arm, BudgetChooser, Path, RoundClock, describe_path
from mfd_sglang.serving.budget.calibration import DraftFn, VerifyFn, calibrate_round_costs, calibration_sizes
from mfd_sglang.serving.verify_graph import VerifyGraphsByWidth, verify_graphs_by_width


class AutoBudget:
    def __init__(self, max_budget: int, *, paths: tuple[Path, ...], device):
        self.chooser = BudgetChooser(max_budget, paths=paths)
        self.clock = RoundClock()
        self.device = device
        # On the device once: a round measures a prefix of these (`measured_budgets`).
        self.candidate_budgets = torch.tensor(self.chooser.budgets, device=device)
        # (arm, committed tokens per request and budget [bs, budgets] on their way to the host, event) of
        # rounds whose acceptance is not yet recorded.
        self.pending: deque[tuple[Arm, torch.Tensor, torch.cuda.Event | None]] = deque()
        self.verify_graphs: VerifyGraphsByWidth | None = None
        self.calibrate_at = None  # bucket -> its costs (`calibrate`), kept to take a bucket's calibration again

    @property
    def arms(self) -> list[Arm]:
        return self.chooser.arms

    def describe(self) -> str:
        paths = ", ".join(describe_path(path) for path in self.chooser.paths)
        return f"auto (at most {self.chooser.max_budget}, from {self.chooser.budgets}; paths: {paths})"

    def choose(self, bs: int) -> Arm:
        self.record_finished_acceptance()
        self.recalibrate()
        arm = self.chooser.choose(bs)
        timing = self.clock.decode_round(bs, arm)
        if timing is not None:
            self.chooser.record_round_time(*timing)
        return arm

    def other_forward(self) -> None:
        self.clock.other_forward()

    def activate_window(self, width: int) -> None:
        if self.verify_graphs is not None:
            self.verify_graphs.activate(width)

    def after_round(self, arm: Arm, result: TreeVerifyResult) -> None:
        """Start the host copy of what every budget <= the round's would have committed; recorded once
        the copy is done (a later round), so the round never waits for it."""
        budgets = self.candidate_budgets[: len(self.chooser.measured_budgets(arm))]
        committed = sub_budget_accept_lens(result, budgets)
        done = None
        if committed.is_cuda:
            committed = committed.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending.append((arm, committed, done))

    def record_finished_acceptance(self) -> None:
        while self.pending and (self.pending[0][2] is None or self.pending[0][2].query()):
            arm, committed, _ = self.pending.popleft()
            self.chooser.record_acceptance(arm, committed.tolist())

    def capture_verify_graphs(self, model_runner) -> None:
        """The target's tree-verify graphs at every candidate window (SGLang captured the launch one's),
        when the target's decode graphs are MFD's tree-verify graphs (a GPU with CUDA graphs on)."""
        self.verify_graphs = verify_graphs_by_width(model_runner, self.chooser.budgets, "automatic budget")

    def calibrate(self, max_bs: int, row_len: int, *, draft: DraftFn, verify: VerifyFn) -> None:
        """Start-up costs of every arm (`calibration.calibrate_round_costs`), each verify on its window's
        graphs."""
        def verify_on_its_window(layout, seq_lens, lens_sum):
            run = verify(layout, seq_lens, lens_sum)
            width = layout.draft_token.shape[1]

            def timed():
                self.activate_window(width)
                return run()
            return timed

        def calibrate_at(sizes: list[int]) -> dict:
            with torch.inference_mode():
                return calibrate_round_costs(self.arms, sizes, row_len, self.device, draft=draft,
                                             verify=verify_on_its_window)

        self.calibrate_at = lambda bucket: calibrate_at([min(bucket, max_bs)])
        self.chooser.calibrate(calibrate_at(calibration_sizes(max_bs)))

    def recalibrate(self) -> None:
        """Take again the calibration of a bucket the chooser found taken under load
        (`BudgetChooser.check_calibration`), between two rounds (placeholder requests only, as at start-up);
        the interval to the next round is then not a round's."""
        bucket = self.chooser.take_recalibration()
        if bucket is None or self.calibrate_at is None:
            return
        self.chooser.calibrate(self.calibrate_at(bucket))
        self.clock.other_forward()
