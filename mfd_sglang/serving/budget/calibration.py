"""Start-up cost calibration of the automatic budget (`budget.rule`): before the first request, the
seconds of each arm's draft + tree and of the target's verify forward over the arm's window, at
one batch size per batch-size bucket the server will run.

What it times is a real round's draft and verify on placeholder requests: token 0 after a context
of `CONTEXT_LEN` tokens (fewer where a request's row holds fewer with the largest window after them),
every request in request slot 0, its verify window
written to KV slot 0. KV slot 0 is SGLang's padding slot (the allocator never hands it out), and
request slot 0's row of req_to_token maps every position to it before any request ran, so the
calibration reads and writes no request's KV (nor the drafter's context of one). The verify goes
through the same `forward_batch_generation` as a round's: on a GPU a replay of the window's captured
tree-verify graph when the batch size has one, else eagerly.

Batch sizes: powers of two below --max-running-requests, then that: the sizes the server will run
anyway.

Not timed: what every arm pays alike to first order (the scheduler, accept, commit); the chooser
learns it per bucket from the running round times (`BudgetChooser.estimate`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from mfd_sglang.timing import median_seconds
from mfd_sglang.tree import DraftTree
from mfd_sglang.tree_layout import VerifyLayout

from mfd_sglang.serving.budget.rule import Arm, batch_bucket, describe

DraftFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, Arm], tuple[DraftTree, VerifyLayout]]
VerifyFn = Callable[[VerifyLayout, torch.Tensor, int], Callable[[], object]]

logger = logging.getLogger(__name__)

CONTEXT_LEN = 256  # committed tokens before each placeholder request's root


def calibration_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, ... below max_bs, then max_bs: one batch size per bucket up to max_bs's."""
    sizes, bs = [], 1
    while bs < max_bs:
        sizes.append(bs)
        bs *= 2
    return sizes + [max_bs]


def placeholder_verify_batch(model_runner, verify_input, seq_lens: torch.Tensor) -> ForwardBatch:
    """The TARGET_VERIFY ForwardBatch of `verify_input` for placeholder requests (request slot 0, the
    window in KV slot 0): the fields SGLang's `ForwardBatch.init_new` sets for a tree verify."""
    bs, width = seq_lens.shape[0], verify_input.draft_token_num
    zeros = torch.zeros(bs * width, dtype=torch.int64, device=seq_lens.device)
    seq_lens_cpu = seq_lens.cpu()
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY,
        batch_size=bs,
        input_ids=verify_input.draft_token,
        req_pool_indices=zeros[:bs],
        seq_lens=seq_lens,
        out_cache_loc=zeros,
        seq_lens_sum=int(seq_lens_cpu.sum()),
        seq_lens_cpu=seq_lens_cpu,
        orig_seq_lens=seq_lens,
        positions=verify_input.positions,
        return_logprob=False,
        global_forward_mode=ForwardMode.TARGET_VERIFY,
        spec_algorithm=model_runner.spec_algorithm,
        spec_info=verify_input,
        capture_hidden_mode=CaptureHiddenMode.FULL,
    )
    translator = model_runner.kv_index_translator
    translator.own_plan(forward_batch).bind(forward_batch, translator, cols=None)
    return forward_batch


def calibrate_round_costs(arms: list[Arm], sizes: list[int], row_len: int, device, *, draft: DraftFn,
                          verify: VerifyFn) -> dict[tuple[int, Arm], float]:
    """{(bucket, arm): seconds of the arm's draft + tree + verify forward} for every arm at every batch
    size of `sizes` (at start-up `calibration_sizes(max_bs)`), logged as a table (milliseconds). row_len: the width of a
    request's row of req_to_token; draft(roots, seq_lens, req_pool_indices, max_len, arm) -> (tree,
    layout): a round's draft stage; verify(layout, seq_lens, lens_sum): a function running the verify
    forward of that layout's window for placeholder requests."""
    context_len = max(min(CONTEXT_LEN, row_len - max(arm.budget for arm in arms) - 1), 1)
    costs = {}
    start = time.perf_counter()
    for bs in sizes:
        bucket, verify_costs = batch_bucket(bs), {}
        roots = torch.zeros(bs, dtype=torch.int64, device=device)
        seq_lens = torch.full((bs,), context_len, dtype=torch.int64, device=device)
        slots = torch.zeros(bs, dtype=torch.int64, device=device)
        for arm in arms:
            def draft_arm():
                return draft(roots, seq_lens, slots, context_len, arm)

            draft_seconds = median_seconds(draft_arm, device) if arm.budget > 0 else 0.0
            width = arm.budget + 1
            if width not in verify_costs:  # every path verifies the same window at a budget
                _, layout = draft_arm()
                verify_costs[width] = median_seconds(verify(layout, seq_lens, bs * context_len), device)
            costs[bucket, arm] = draft_seconds + verify_costs[width]
    logger.info("MFD auto budget: calibration (%.1f s; draft + tree + verify in ms per round, "
                "%d-token contexts):\n%s", time.perf_counter() - start, context_len, cost_table(costs, arms))
    return costs


def cost_table(costs: dict[tuple[int, Arm], float], arms: list[Arm]) -> str:
    buckets = sorted({bucket for bucket, _ in costs})
    width = max(len(describe(arm)) for arm in arms) + 2
    lines = [f"{'batch size <=':<{width}}" + " ".join(f"{b:>7d}" for b in buckets)]
    for arm in arms:
        lines.append(f"{describe(arm):<{width}}" + " ".join(f"{1e3 * costs[b, arm]:7.1f}" for b in buckets))
    return "\n".join(lines)
