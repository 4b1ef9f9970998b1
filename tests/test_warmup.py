"""The start-up warm-up (`mfd_sglang.serving.warmup`) leaves nothing to compile for the rounds that follow it.

On fake CUDA tensors (no GPU; `compile_keys.CompileKeys` records Triton's own compile key of every launch: its
constexprs, types, divisibility by 16 and equality to 1, pointer dtypes and alignment): a worker stand-in with a
Qwen3-shaped random drafter on the Triton backend runs `warm_up` for what its batch-size buckets can play
(`budget.playable`: a fixed MFD_D budget, the automatic budget's arms, the default schedule), then a serving sweep
drives a round's stages (the draft, eagerly: a server without draft graphs; the custom mask, the verify window's
KV slots, the accept walk, the commit with SGLang's KV move of the accepted path) at every batch size from 1 to
the maximum, every arm each can play, with lengths that grow and differ round by round. The sweep adds no compile
key. What is not modelled: the target's verify forward (SGLang's, captured or warmed in step 1 on a GPU) and the
KV pool's own copy kernel (a stand-in here).
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from compile_keys import CompileKeys
from mfd_sglang import round_cost as rc
from mfd_sglang.gpu_ledger import drafter_and_target_configs, fake_cuda
from mfd_sglang.serving.budget.playable import Playable, chooser_playable, fixed_playable, schedule_playable
from mfd_sglang.serving.budget.rule import SINGLE_MODE, BudgetChooser, Path
from mfd_sglang.serving.budget.schedule import BudgetSchedule, RoundModel

ROW_LEN = 700  # a request's row of req_to_token
SWEEP_ROUNDS = 2


def schedule_of_qwen3_4b(max_requests: int) -> Playable:
    drafter, target = drafter_and_target_configs("qwen3-4b")
    return schedule_playable(BudgetSchedule(RoundModel.of(drafter, target), 64, max_requests, switch_threshold=3))


PLAYABLES = {
    "MFD_D B16": lambda: fixed_playable(12, 16, switch_threshold=3),
    "auto B16": lambda: chooser_playable(12, BudgetChooser(16, paths=(Path(), SINGLE_MODE)).arms),
    "schedule": lambda: schedule_of_qwen3_4b(40),
}


@pytest.fixture
def sglang_on_cuda(monkeypatch):
    """SGLang's index kernels take their CUDA (Triton) branch, as on a GPU."""
    import sglang.kernels.ops.speculative.cache_locs as cache_locs
    import sglang.kernels.ops.speculative.eagle as eagle

    monkeypatch.setattr(cache_locs, "_is_cuda", True)
    for module in (cache_locs, eagle):
        monkeypatch.setattr(module, "_is_cpu", False)


def meta_drafter():
    """A random drafter of Qwen3-4B's released drafter shape (block 16: windows of 5 and 9 tokens commit all of
    theirs, wider ones 16) on the meta device (made outside the fake mode)."""
    cfg = rc.TargetConfig.qwen3_4b()
    return cfg, rc.random_drafter(cfg, rc.spread_layer_ids(cfg.layers, cfg.draft_layers), 4, seed=0, device="meta",
                                  dtype=torch.bfloat16)


def worker_stand_in(playable: Playable, budget: int, cfg, drafter):
    """An `MFDWorkerV2` as far as the warm-up and a round's stages read it, on fake CUDA (call inside CompileKeys)."""
    from mfd_sglang.serving.draft_stage import DraftStage
    from mfd_sglang.serving.worker import MFDWorkerV2

    fake_cuda(drafter)
    embed = torch.empty(cfg.vocab, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    stage = DraftStage(drafter, embed, drafter.head_weight(embed), backend="triton")
    requests = SimpleNamespace(req_to_token=torch.zeros(playable.max_requests + 1, ROW_LEN, dtype=torch.int32,
                                                        device="cuda"))
    stage.init_context_pool(8192, requests, device="cuda", dtype=torch.bfloat16, deferred_rows=256, page_size=1)
    worker = MFDWorkerV2.__new__(MFDWorkerV2)
    kv_pool = SimpleNamespace(move_kv_cache=lambda target_slots, source_slots: None)
    worker.__dict__.update(
        playable=playable, device="cuda", backend="triton", drafting=stage, recurrent_target=False, attention_dp=False,
        speculative_num_draft_tokens=budget + 1, auto_budget=None, verify_windows=None,
        model_runner=SimpleNamespace(req_to_token_pool=requests,
                                     token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kv_pool)))
    worker.placeholder_verify = lambda layout, seq_lens, lens_sum: (lambda: None)
    return worker


def serving_sweep(worker, seed: int = 0) -> int:
    """SWEEP_ROUNDS rounds at every batch size and arm it can play: the draft (eager), then `eager_stages`, lengths
    growing by round and differing by request (their host-side sum is what varies the kernels' arguments)."""
    from mfd_sglang.serving.warmup import eager_stages

    rng, rounds = random.Random(seed), 0
    for r in range(SWEEP_ROUNDS):
        for bs in range(1, worker.playable.max_requests + 1):
            for arm in worker.playable.arms(bs):
                lengths = [rng.randrange(1, 80) + 200 * r for _ in range(bs)]
                roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
                seq_lens = torch.zeros(bs, dtype=torch.int64, device="cuda")
                tree, layout = worker.drafting.tree(roots, seq_lens, roots, max(lengths), arm)
                eager_stages(worker, tree, layout, seq_lens, sum(lengths))
                rounds += 1
    return rounds


@pytest.mark.parametrize("launch", list(PLAYABLES))
def test_a_serving_sweep_after_the_warm_up_compiles_nothing(launch, sglang_on_cuda):
    from mfd_sglang.serving.warmup import warm_up

    playable = PLAYABLES[launch]()
    budget = max(playable.budgets())
    cfg, drafter = meta_drafter()
    with CompileKeys() as keys:
        worker = worker_stand_in(playable, budget, cfg, drafter)
        warmed_rounds = warm_up(worker)
        warmed = keys.snapshot()
        swept_rounds = serving_sweep(worker)
        added = keys.snapshot() - warmed
    kernels = {name for name, _ in warmed}
    # the round's eager kernels and SGLang's were launched by the warm-up, not only the draft's
    assert {"_tree_cells_kernel", "_accept_path_kernel", "_commit_rows_kernel", "assign_extend_cache_locs",
            "fill_accept_out_cache_loc", "assign_extend_cache_locs_uniform"} <= kernels, kernels
    assert swept_rounds > warmed_rounds / 2
    assert not added, f"{len(added)} compile keys after the warm-up ({launch}: {playable.describe()}): " + \
        "; ".join(f"{name} {key[:200]}" for name, key in sorted(added)[:5])
