"""Start-up cost calibration of the automatic budget (`budget`): before the first request, the
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
import statistics
import time
from typing import Callable

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from .budget import Arm, batch_bucket, describe

logger = logging.getLogger(__name__)

CONTEXT_LEN = 256  # committed tokens before each placeholder request's root
REPEATS = 3  # timed runs per measurement (after one untimed), their median kept


def calibration_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, ... below max_bs, then max_bs: one batch size per bucket up to max_bs's."""
    sizes, bs = [], 1
    while bs < max_bs:
        sizes.append(bs)
        bs *= 2
    return sizes + [max_bs]


def median_seconds(fn: Callable[[], object], device, repeats: int = REPEATS) -> float:
    """Median wall time of fn() over `repeats` runs after one untimed run, the device synchronised."""
    on_cuda = str(device).startswith("cuda")
    times = []
    for i in range(repeats + 1):
        if on_cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if on_cuda:
            torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


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


def calibrate_round_costs(worker, arms: list[Arm], max_bs: int) -> dict[tuple[int, Arm], float]:
    """{(bucket, arm): seconds of the arm's draft + tree + verify forward} for every arm at every
    batch size of `calibration_sizes(max_bs)`; logged as a table (milliseconds)."""
    device = worker.device
    row_len = worker.model_runner.req_to_token_pool.req_to_token.shape[1]
    context_len = max(min(CONTEXT_LEN, row_len - max(budget for _, budget in arms) - 1), 1)
    costs = {}
    start = time.perf_counter()
    for bs in calibration_sizes(max_bs):
        bucket, verify_costs = batch_bucket(bs), {}
        roots = torch.zeros(bs, dtype=torch.int64, device=device)
        seq_lens = torch.full((bs,), context_len, dtype=torch.int64, device=device)
        slots = torch.zeros(bs, dtype=torch.int64, device=device)
        for arm in arms:
            def draft():
                return worker.draft_tree(roots, seq_lens, slots, context_len, arm)

            draft_seconds = median_seconds(draft, device) if arm[1] > 0 else 0.0
            width = arm[1] + 1
            if width not in verify_costs:  # both drafting paths verify the same window
                _, layout = draft()
                verify_input = worker.verify_input(layout, seq_lens, bs * context_len)
                forward_batch = placeholder_verify_batch(worker.model_runner, verify_input, seq_lens)
                if worker.verify_graphs is not None:
                    worker.verify_graphs.activate(width)
                verify_costs[width] = median_seconds(lambda: worker.target_worker.forward_batch_generation(
                    batch=None, forward_batch=forward_batch, is_verify=True), device)
            costs[bucket, arm] = draft_seconds + verify_costs[width]
    logger.info("MFD auto budget: start-up calibration (%.1f s; draft + tree + verify in ms per round, "
                "%d-token contexts):\n%s", time.perf_counter() - start, context_len, cost_table(costs, arms))
    return costs


def cost_table(costs: dict[tuple[int, Arm], float], arms: list[Arm]) -> str:
    buckets = sorted({bucket for bucket, _ in costs})
    lines = ["batch size <= " + " ".join(f"{b:>7d}" for b in buckets)]
    for arm in arms:
        lines.append(f"{describe(arm):<32} " + " ".join(f"{1e3 * costs[b, arm]:7.1f}" for b in buckets))
    return "\n".join(lines)
