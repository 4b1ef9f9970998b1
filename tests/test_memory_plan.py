"""The plugin's memory plan: the draft + tree working set it plans is an upper bound of what one round
really allocates (measured on a Qwen3-4B-shaped drafter), and not a loose one; the drafter context it
leaves to SGLang is what SGLang reserves; at launch it comes out of SGLang's default static fraction."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mfd_sglang.checkpoint import load_drafter, parse_drafter_config
from mfd_sglang.serving.memory import memory_plan, reserve_in_mem_fraction

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from draft_memory import QWEN3_4B_DRAFTER  # noqa: E402


def test_planned_draft_memory_bounds_the_measured_allocations():
    out = subprocess.run([sys.executable, "benchmarks/draft_memory.py", "--batch-sizes", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["bs"] for r in rows] == [1]  # batch 1 for CI time; README: `--batch-sizes 1 2` (and growth: below)
    for row in rows:
        assert row["measured"] <= row["planned"] <= 1.5 * row["measured"], row


def test_context_bytes_per_token_equal_what_sglang_reserves_for_a_dflash_drafter(tiny_pair):
    """SGLang sizes its KV pool with the drafter's context per token (`dflash_draft_cell_size_per_token`,
    through `mem_cache.draft_kv_budget`); the plugin's pool must hold exactly that per slot, or the
    KV plan is off."""
    import torch
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.speculative.dflash_utils import dflash_draft_cell_size_per_token

    from mfd_sglang.drafter import MFDDrafter
    from mfd_sglang.serving.draft_context_pool import DraftContextPool

    ckpt = load_drafter(tiny_pair / "drafter")
    drafter = MFDDrafter.from_checkpoint(ckpt, dtype=torch.float32)
    pool = DraftContextPool(drafter, 10, device="cpu", dtype=torch.float32)
    pool_bytes = sum(t.numel() * t.element_size() for t in pool.keys + pool.values) // 10
    draft_config = ModelConfig(str(tiny_pair / "drafter"), dtype="float32", is_draft_model=True)
    sglang_bytes = dflash_draft_cell_size_per_token(draft_model_config=draft_config, tp_size=1,
                                                    draft_num_layers=ckpt.config.num_hidden_layers,
                                                    draft_kv_cache_dtype=torch.float32)
    plan = memory_plan(ckpt.config, 0, dtype_bytes=4, budget=8, vocab=ckpt.config.vocab_size)
    assert plan.context_bytes_per_token == pool_bytes == sglang_bytes


def _plan(budget=64):
    cfg = parse_drafter_config(QWEN3_4B_DRAFTER)
    return memory_plan(cfg, 500_000_000, dtype_bytes=2, budget=budget, vocab=cfg.vocab_size)


def test_plan_grows_with_batch_and_budget():
    plan = _plan()
    assert plan.weight_bytes == 1_000_000_000
    assert plan.extra_bytes(48) > plan.extra_bytes(8) > plan.extra_bytes(1)
    assert _plan(budget=128).verify_bytes(8) > plan.verify_bytes(8)
    # The verify logits of 48 requests x 65 nodes x 151936 float32, twice: 3.8 GB.
    assert plan.verify_bytes(48) == 2 * 48 * 65 * 151936 * 4


def test_tensor_parallel_ranks_count_the_gathered_vocabulary():
    """Each TP rank gathers the target's embeddings (and an untied head) whole for the drafter."""
    cfg = parse_drafter_config(QWEN3_4B_DRAFTER)
    one = memory_plan(cfg, 500_000_000, dtype_bytes=2, budget=64, vocab=cfg.vocab_size)
    tied = memory_plan(cfg, 500_000_000, dtype_bytes=2, budget=64, vocab=cfg.vocab_size, tp_size=2)
    untied = memory_plan(cfg, 500_000_000, dtype_bytes=2, budget=64, vocab=cfg.vocab_size, tp_size=4,
                         tied_embeddings=False)
    assert tied.weight_bytes - one.weight_bytes == cfg.vocab_size * cfg.hidden_size * 2
    assert untied.weight_bytes - one.weight_bytes == 2 * cfg.vocab_size * cfg.hidden_size * 2
    assert tied.draft_bytes(8) == one.draft_bytes(8) and tied.verify_bytes(8) == one.verify_bytes(8)


def test_launch_takes_the_plan_out_of_the_default_static_fraction(caplog):
    plan = _plan()
    args = SimpleNamespace(max_running_requests=48, mem_fraction_static=0.9)
    reserve_in_mem_fraction(args, plan, gpu_mem_mib=143_000, user_set=False)
    assert args.mem_fraction_static == pytest.approx(0.9 - plan.extra_bytes(48) / 2**20 / 143_000, abs=1e-3)
    args = SimpleNamespace(max_running_requests=48, mem_fraction_static=0.9)
    reserve_in_mem_fraction(args, plan, gpu_mem_mib=143_000, user_set=True)
    assert args.mem_fraction_static == 0.9 and "MFD needs about" in caplog.text
    with pytest.raises(ValueError, match="lower --max-running-requests"):
        reserve_in_mem_fraction(SimpleNamespace(max_running_requests=4096, mem_fraction_static=0.9), plan,
                                gpu_mem_mib=24_000, user_set=False)
