"""The default budget schedule on CUDA (`mfd_sglang.serving.budget.schedule`; no GPU, no timing):

- the rule: every budget it picks keeps the predicted round within ROUND_STEPS plain steps, plain decoding only
  where no tree does, no other tree promising more tokens per second under the prior; the largest tree where
  the verify is weight-bound (bs 1); each path costed as drafted; its model's products are the ledger's roofline
  of the same matmul;
- when it applies: CUDA, neither --speculative-num-draft-tokens nor --mfd-auto-budget;
- the worker honours it (`MFDWorkerV2.choose_arm`, `budget.playable`, `scheduled_batch_size`, the idle attention-DP
  rank's window) on a worker-like object;
- the ledger prints the round at the default budget beside a plain step for bs 1, 4, 8, 16, 32, 64, and by the
  ledger's own model (launch floor fitted to the H200 log) no row needs more than ROUND_STEPS accepted tokens to
  break even.
"""

from __future__ import annotations

import collections
from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.gpu_ledger import (DEFAULT_BATCH_SIZES, NUM_MODES, SERVERS, default_budget_markdown,
                                   default_budget_rows, default_schedule, drafter_and_target_configs,
                                   plain_step_floor)
from mfd_sglang.serving.budget.playable import fixed_playable, schedule_playable
from mfd_sglang.serving.budget.rule import PLAIN, SINGLE_MODE, Arm, Path, candidate_budgets
from mfd_sglang.serving.budget.schedule import ROUND_STEPS, BudgetSchedule, RoundModel, budget_schedule, prior_tokens
from mfd_sglang.serving.launch.options import MFDOptions

MAX_REQUESTS = 64


def launch_args(device="cuda", num_draft_tokens=None, tp_size=1, max_requests=MAX_REQUESTS):
    """A resolved record as the worker sees it: SGLang's raw input says what the user typed."""
    return SimpleNamespace(device=device, tp_size=tp_size, max_running_requests=max_requests,
                           _raw_input={"speculative_num_draft_tokens": num_draft_tokens})


@pytest.mark.parametrize("shape", ["qwen3-4b", "qwen3-8b"])
@pytest.mark.parametrize("threshold", [None, 3])
def test_rule_keeps_every_round_within_the_bound_and_picks_the_most_promising_tree(shape, threshold):
    drafter, target = drafter_and_target_configs(shape)
    model = RoundModel.of(drafter, target)
    schedule = BudgetSchedule(model, 64, MAX_REQUESTS, switch_threshold=threshold)
    drafted = [b for b in candidate_budgets(64) if b > 0]
    assert schedule.budget(1) == 64  # one request: the verify reads the target's weights whatever the window
    for n in range(1, MAX_REQUESTS + 1):
        b, modes = schedule.budget(n), schedule.modes(schedule.path(n))
        plain = model.plain_seconds(n)
        if b == 0:
            assert all(model.round_seconds(n, d, modes) > ROUND_STEPS * plain for d in drafted), n
            continue
        assert model.round_seconds(n, b, modes) <= ROUND_STEPS * plain, (n, b)
        for d in drafted:  # no other tree within the bound promises more tokens per second
            if model.round_seconds(n, d, modes) <= ROUND_STEPS * plain:
                gain = prior_tokens(d) / prior_tokens(b)
                assert gain / model.round_seconds(n, d, modes) <= 1 / model.round_seconds(n, b, modes), (n, b, d)
    # The path is costed as drafted: MFD_D's single-mode path (1/K of the rows) still drafts where K modes would
    # lose, and plain decoding takes over past the GPU's compute bound either way.
    k_mode = BudgetSchedule(model, 64, MAX_REQUESTS)
    single = BudgetSchedule(model, 64, MAX_REQUESTS, switch_threshold=1)
    assert any(single.budget(n) > 0 == k_mode.budget(n) for n in range(1, MAX_REQUESTS + 1))
    assert k_mode.budget(MAX_REQUESTS) == 0


def test_model_products_are_the_ledgers_roofline_of_the_matmul():
    """`RoundModel.product_seconds` is the ledger's per-kernel roofline of the same product traced on fake CUDA
    (gpu_cost), less the activations' bytes, which the model leaves out."""
    from mfd_sglang.gpu_cost import H200, KernelTrace

    drafter, target = drafter_and_target_configs("qwen3-4b")
    model = RoundModel.of(drafter, target)
    hidden, out = 2560, 9728
    for rows in (1, 64, 4096):
        with KernelTrace() as trace, trace.stage("mm"):
            x = torch.empty(rows, hidden, device="cuda", dtype=torch.bfloat16)
            w = torch.empty(out, hidden, device="cuda", dtype=torch.bfloat16)
            torch.nn.functional.linear(x, w)
        (kernel,) = trace.kernels
        activations = 2 * rows * (hidden + out)
        ledger = max((kernel.bytes - activations) / H200.hbm_bytes_per_s, kernel.flops / H200.flops_per_s)
        assert model.product_seconds(out * hidden, rows) == pytest.approx(ledger, rel=1e-12)


def test_schedule_applies_to_cuda_launches_without_a_budget_or_the_automatic_budget():
    drafter, target = drafter_and_target_configs("qwen3-4b")

    def schedule(args, options=MFDOptions(), algorithm="MFD"):
        return budget_schedule(args, options, drafter, target, budget=64, algorithm=algorithm)

    default = schedule(launch_args())
    assert default is not None and default.max_requests == MAX_REQUESTS and default.switch_threshold is None
    assert schedule(launch_args(num_draft_tokens=65)) is None  # an explicit budget is served as given
    assert schedule(launch_args(device="cpu")) is None
    assert schedule(launch_args(), MFDOptions(auto_budget=True)) is None
    assert schedule(SimpleNamespace(device="cuda", tp_size=1, max_running_requests=48)) is None  # no raw input
    assert schedule(launch_args(), algorithm="MFD_D").switch_threshold == MFDOptions().switch_threshold
    assert schedule(launch_args(tp_size=2)).model.target_weights == default.model.target_weights // 2
    # A target config the model cannot read is refused at launch, naming the field and the way around.
    without_mlp = {key: value for key, value in target.items() if key != "intermediate_size"}
    with pytest.raises(ValueError, match="intermediate_size.*--speculative-num-draft-tokens N"):
        budget_schedule(launch_args(), MFDOptions(), drafter, without_mlp, budget=64, algorithm="MFD")
    # The launch log names every batch size's budget, in ranges.
    text = default.describe()
    for n in (1, MAX_REQUESTS):
        b = default.budget(n)
        assert ("plain decoding" if b == 0 else f"budget {b}") in text
    assert f"<= {ROUND_STEPS:g} plain decode steps" in text


LAUNCH_ON_A_GPU = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import sglang.srt.arg_groups.memory_hook as memory_hook
import sglang.srt.utils.common as common
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
from sglang.srt.server_args import ServerArgs
import mfd_sglang.plugin

mfd_sglang.plugin.register()
common.get_device_memory_capacity = memory_hook.get_device_memory_capacity = lambda device=None: 143_771.0
args = ServerArgs(model_path=sys.argv[1] + "/target", device="cuda", speculative_algorithm="MFD",
                  speculative_draft_model_path=sys.argv[1] + "/drafter", attention_backend="flashinfer")
run_resolution_pipeline(args)
print("RESOLVED", *(resolution_result(args, field) for field in ("speculative_num_draft_tokens",
                                                                  "max_running_requests")))
"""


def test_a_gpu_launch_without_a_budget_logs_the_schedule_and_plans_its_windows(tiny_pair):
    """SGLang's own argument resolution of an MFD server at device cuda without --speculative-num-draft-tokens (run
    on CPU, an H200's capacity reported): N resolves to 65, the launch logs the schedule in force, the one the
    worker builds from the same configs, and its memory plan holds the FlashInfer backends of the schedule's
    other windows (a new 512 MiB workspace each). With the flag given the plan holds none
    (tests/test_memory_plan.py::test_a_gpu_launch_reserves_the_automatic_budgets_verify_graphs[False])."""
    import os
    import re
    import subprocess
    import sys

    from mfd_sglang.checkpoint import load_drafter, target_text_config

    out = subprocess.run([sys.executable, "-c", LAUNCH_ON_A_GPU, str(tiny_pair)], capture_output=True, text=True,
                         timeout=600, env={k: v for k, v in os.environ.items() if not k.startswith("MFD_SGLANG_")})
    assert out.returncode == 0, out.stderr[-3000:]
    num_draft_tokens, max_requests = map(int, out.stdout.split("RESOLVED ")[1].split())
    assert num_draft_tokens == 65
    schedule = budget_schedule(launch_args(max_requests=max_requests), MFDOptions(),
                               load_drafter(tiny_pair / "drafter").config, target_text_config(tiny_pair / "target"),
                               budget=64, algorithm="MFD")
    logged = re.search(r"MFD budget \(no --speculative-num-draft-tokens, no --mfd-auto-budget\): (.*); pass",
                       out.stderr)
    assert logged and logged.group(1) == schedule.describe(), out.stderr[-3000:]
    windows = [b for b in schedule.budgets() if b != 64]
    graphs = re.search(r"verify graphs of the other windows (\d+) MiB", out.stderr)
    assert len(windows) >= 2 and graphs and int(graphs.group(1)) >= 512 * len(windows)


def worker_like(schedule: BudgetSchedule | None, *, threshold=None, attention_dp=False, budget=64):
    """What `choose_arm`, `scheduled_batch_size`, `activate_window` and `forward_idle_verify` read of an
    `MFDWorkerV2` (built without SGLang)."""
    from mfd_sglang.serving.worker import MFDWorkerV2

    worker = MFDWorkerV2.__new__(MFDWorkerV2)
    worker.__dict__.update(auto_budget=None, budget_schedule=schedule, switch_threshold=threshold, single_mode=False,
                           gated_modes=None, budget=budget, attention_dp=attention_dp, verify_windows=None,
                           drafting=SimpleNamespace(num_modes=NUM_MODES), speculative_num_draft_tokens=budget + 1,
                           _target_worker=None, device="cpu")
    return worker


def test_worker_plays_the_schedules_budget_at_each_batch_size():
    drafter, target = drafter_and_target_configs("qwen3-4b")
    schedule = budget_schedule(launch_args(), MFDOptions(), drafter, target, budget=64, algorithm="MFD_D")
    worker = worker_like(schedule, threshold=3)
    playable = schedule_playable(schedule)  # what the draft graphs capture, per batch-size bucket
    played = collections.defaultdict(set)
    for n in range(1, MAX_REQUESTS + 1):
        arm = worker.choose_arm(n)
        assert arm.budget == schedule.budget(n)
        assert arm == PLAIN or arm.single_mode == (n >= 3)
        assert arm in playable.arms(n), (n, arm)  # every arm played has its bucket's draft graph
        played[playable.bucket(n)].add(arm)
    # and no graph is captured for an arm its bucket never plays
    assert {size: set(arms) for size, arms in zip(playable.buckets, playable.arms_at)} == played
    assert len({arm.budget for arms in played.values() for arm in arms}) > 2  # the budget follows the batch size
    # A fixed budget (the flag given) is played at every batch size, as before.
    fixed = worker_like(None, threshold=3, budget=16)
    assert [fixed.choose_arm(n) for n in (1, 2, 3, 40)] == [Arm(False, 16), Arm(False, 16), Arm(True, 16),
                                                             Arm(True, 16)]
    fixed_arms = fixed_playable(MAX_REQUESTS, 16, switch_threshold=3)
    assert [fixed_arms.arms(n) for n in (1, 2, 3, 4, 40)] == [(Arm(False, 16),), (Arm(False, 16),),
                                                             (Arm(True, 16),), (Arm(True, 16),), (Arm(True, 16),)]


def test_worker_reads_every_dp_ranks_requests_under_attention_dp(monkeypatch):
    """Under attention DP the budget is the schedule's for every DP rank's requests together (the counts SGLang
    gathered before the round), the drafting path the rank's own; an idle rank verifies that window too."""
    import mfd_sglang.serving.worker as worker_module

    drafter, target = drafter_and_target_configs("qwen3-4b")
    schedule = budget_schedule(launch_args(), MFDOptions(), drafter, target, budget=64, algorithm="MFD_D")
    worker = worker_like(schedule, threshold=3, attention_dp=True)
    counts = [2, 0, 30]
    batch = SimpleNamespace(reqs=[object()] * 2, global_num_tokens=counts)
    assert worker.scheduled_batch_size(batch) == 32
    assert schedule.budget(32) != schedule.budget(2)  # the two readings differ: the test can tell them apart
    arm = worker.choose_arm(2, worker.scheduled_batch_size(batch))
    assert arm == (PLAIN if schedule.budget(32) == 0 else Path().at(schedule.budget(32)))  # 2 requests: K modes
    every_path = schedule_playable(schedule, every_path=True)  # the graphs an attention-DP rank captures
    assert arm in every_path.arms(2)
    # 30 requests of its own: single-mode, at the budget of 30 or more on every rank
    assert schedule.arm(32, SINGLE_MODE) in every_path.arms(30) and schedule.arm(48, SINGLE_MODE) in every_path.arms(30)
    widths = []
    monkeypatch.setattr(worker_module, "idle_verify", lambda target_worker, batch, width: widths.append(width))
    worker.forward_idle_verify(SimpleNamespace(reqs=[], global_num_tokens=counts), None)
    assert widths == [schedule.budget(32) + 1]
    # Without attention DP the rank's own requests count, whatever SGLang gathered.
    assert worker_like(schedule, threshold=3).scheduled_batch_size(batch) == 2


@pytest.fixture(scope="module")
def default_rows():
    return default_budget_rows("qwen3-4b", DEFAULT_BATCH_SIZES, plain_step_floor())


def test_ledger_prints_the_default_rounds_beside_a_plain_step(default_rows):
    assert [(r["server"], r["bs"]) for r in default_rows] == [(s, bs) for s in SERVERS for bs in DEFAULT_BATCH_SIZES]
    drafter, target = drafter_and_target_configs("qwen3-4b")
    table = "\n".join(default_budget_markdown(default_rows))
    for r in default_rows:
        # The ledger's budget is the one a CUDA server at default flags plays (the worker's schedule).
        serving = budget_schedule(launch_args(), MFDOptions(), drafter, target, budget=64,
                                  algorithm=r["server"].upper())
        assert r["B"] == serving.budget(r["bs"]) == default_schedule("qwen3-4b", r["server"], 64).budget(r["bs"])
        assert r["round_ms"] == pytest.approx(r["own_ms"] + r["verify_ms"], abs=1e-3)
        assert r["break_even"] == pytest.approx(r["round_ms"] / r["plain_ms"], abs=2e-3)
        # The verify is the target over bs (B + 1) tokens: the plain step's launches exactly at B = 0.
        assert (r["launches"]["verify"] == r["launches"]["plain"]) == (r["B"] == 0)
        # Does not lose badly: by the ledger's model a round pays from ROUND_STEPS accepted tokens at most.
        assert r["break_even"] <= ROUND_STEPS and r["rule_ratio"] <= ROUND_STEPS, r
        assert (f"| {r['server']} | {r['bs']} | {r['path']} | {r['B']} | {r['own_ms']:.3f} | {r['verify_ms']:.3f} | "
                f"{r['round_ms']:.3f} | {r['plain_ms']:.3f} | {r['break_even']:.2f} |") in table
