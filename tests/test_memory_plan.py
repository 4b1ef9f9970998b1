"""The plugin's memory plan: the draft + tree working set and the verify working set it plans are upper
bounds of what one round really allocates (measured on a Qwen3-4B-shaped drafter; on Qwen3's vocabulary),
and not loose ones; the drafter context it
leaves to SGLang is what SGLang reserves; the automatic budget's extra verify windows are counted as
SGLang's backends allocate them; at launch it comes out of SGLang's default static fraction."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from mfd_sglang.checkpoint import load_drafter, parse_drafter_config
from mfd_sglang.serving.budget.rule import Arm
from mfd_sglang.serving.launch.memory import VerifyGraphPlan, memory_plan, reserve_in_mem_fraction, verify_graph_plan

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from draft_memory import QWEN3_4B_DRAFTER  # noqa: E402
from verify_memory import KINDS as VERIFY_KINDS, measure  # noqa: E402


def test_planned_draft_memory_bounds_the_measured_allocations():
    out = subprocess.run([sys.executable, "benchmarks/draft_memory.py", "--batch-sizes", "1"], cwd=REPO,
                         capture_output=True, text=True, timeout=1800, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["bs"] for r in rows] == [1]  # batch 1 for CI time; docs/memory.md: `--batch-sizes 1 2` (and growth: below)
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


def test_a_budget_schedule_plans_its_largest_rounds():
    """Under the default budget schedule (`MemoryPlan.rounds`: what each batch-size bucket plays, at the bucket's
    size, `budget.playable`) the working sets are those of the largest rounds the server plays, not bs requests
    at the launch budget: the largest draft (the draft graphs' pool keeps it) plus the largest verify. At 48
    requests MFD's schedule on Qwen3-4B shapes plays 32 nodes at most up to 7 requests, 16 at 8-11 and plain
    decoding from 12 (tests/test_budget_schedule.py): its largest draft and verify are bucket 16's at budget 16
    (9-16 requests, padded to 16: 16 x 8 blocks drafted, 272 tokens verified), far below 48 x 65 verified
    tokens."""
    import dataclasses

    from mfd_sglang.serving.budget.playable import schedule_playable
    from mfd_sglang.serving.budget.schedule import BudgetSchedule, RoundModel

    plan = _plan()
    target = {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936}
    schedule = BudgetSchedule(RoundModel.of(parse_drafter_config(QWEN3_4B_DRAFTER), target), 64, 48)
    playable = schedule_playable(schedule)
    scheduled = dataclasses.replace(plan, rounds=playable.rounds(plan.num_modes))
    per_round = [(bs, dataclasses.replace(plan, budget=arm.budget)) for bs, arm in playable.pairs()]
    draft = max(p.draft_bytes(bs) for bs, p in per_round)
    verify = max(p.verify_bytes(bs) for bs, p in per_round)
    assert scheduled.extra_bytes(48) == plan.weight_bytes + draft + verify
    assert [(n, p.budget) for n, p in (scheduled.largest_draft(48), scheduled.largest_verify(48))] == [(16, 16)] * 2
    assert scheduled.extra_bytes(48) < plan.extra_bytes(48) / 5
    assert scheduled.extra_bytes(2) == plan.extra_bytes(2)  # budget 64 up to 3 requests: bucket 2 plays it
    assert "draft 16 at budget 16, verify 16 at budget 16" in scheduled.describe(48)
    assert dataclasses.replace(plan, budget=0).draft_bytes(48) == 0  # plain decoding drafts nothing


@pytest.mark.parametrize("max_requests", [48, 256])
@pytest.mark.parametrize("algorithm", ["MFD", "MFD_D"])
def test_the_plan_covers_every_draft_graph_the_server_captures(monkeypatch, max_requests, algorithm):
    """Qwen3-8B's released drafter shape at the CUDA defaults: the draft graphs `DraftStage.capture_graphs` captures
    (recorded from the worker's own code path) hold at most what the launch plan counts: the largest captured
    graph's working set (one pool, reused graph to graph) plus every graph's static inputs and outputs, and the
    verify working set of the largest captured round."""
    import dataclasses

    import torch

    from mfd_sglang.gpu_ledger import drafter_and_target_configs
    from mfd_sglang.serving import draft_stage
    from mfd_sglang.serving.budget.playable import server_playable
    from mfd_sglang.serving.budget.schedule import budget_schedule
    from mfd_sglang.serving.launch.memory import draft_graph_buffer_bytes
    from mfd_sglang.serving.launch.options import MFDOptions

    cfg, target = drafter_and_target_configs("qwen3-8b")
    args = SimpleNamespace(device="cuda", tp_size=1, max_running_requests=max_requests, dp_size=1,
                           enable_dp_attention=False, _raw_input={"speculative_num_draft_tokens": None})
    schedule = budget_schedule(args, MFDOptions(), cfg, target, budget=64, algorithm=algorithm)
    playable = server_playable(args, MFDOptions(), cfg, budget=64, algorithm=algorithm, schedule=schedule)

    captured = []

    class Recorder:  # BatchGraphs as the draft stage drives it: what would be captured, nothing run
        def __init__(self, fn, example_inputs, buckets, *, use_graph):
            self.buckets = list(buckets)

        def capture_pairs(self, pairs):
            captured.extend(pairs)

    monkeypatch.setattr(draft_stage, "BatchGraphs", Recorder)
    stage = draft_stage.DraftStage.__new__(draft_stage.DraftStage)
    stage.paged, stage.backend, stage.embed_weight = True, "triton", torch.empty(0)
    stage.capture_graphs(playable)
    assert captured and all(arm.budget > 0 for _, arm in captured)

    plan = dataclasses.replace(memory_plan(cfg, 1_000_000_000, dtype_bytes=2, budget=64, vocab=target["vocab_size"]),
                               rounds=playable.rounds(cfg.num_modes),
                               draft_graph_bytes=sum(draft_graph_buffer_bytes(bs, arm.budget) for bs, arm in
                                                     playable.pairs()))

    def round_plan(arm):
        return dataclasses.replace(plan, budget=arm.budget, rounds=(), draft_graph_bytes=0,
                                   num_modes=1 if arm.single_mode else arm.modes or cfg.num_modes)
    pool = max(round_plan(arm).draft_bytes(bs) for bs, arm in captured)
    buffers = sum(draft_graph_buffer_bytes(bs, arm.budget) for bs, arm in captured)
    verify = max(round_plan(arm).verify_bytes(bs) for bs, arm in captured)
    planned = plan.extra_bytes(max_requests) - plan.weight_bytes
    assert pool + buffers + verify <= planned, (pool, buffers, verify, planned)
    # At the launch budget in every bucket (what the server captured before the plan counted it) it would not fit.
    every = [(bs, Arm(False, 64)) for bs in playable.buckets]
    assert max(round_plan(arm).draft_bytes(bs) + round_plan(arm).verify_bytes(bs) for bs, arm in every) > planned


def test_the_released_drafter_shapes_have_their_model_cards_parameter_counts():
    """scripts/memory_plan.py (the README's memory at the defaults) plans the released drafters from their
    shapes; the MFD cards state their parameter counts (1,049M for Qwen3-8B, 634M for Qwen3.5-4B), which
    a wrong width, head shape, MLP or layer count in those shapes would miss."""
    sys.path.insert(0, str(REPO / "scripts"))
    from memory_plan import SHAPES, drafter_parameters

    assert round(drafter_parameters(SHAPES["Qwen3-8B"], 8) / 1e6) == 1049
    assert round(drafter_parameters(SHAPES["Qwen3.5-4B"], 8) / 1e6) == 634


@pytest.mark.parametrize("bs", [1, 3])
def test_planned_verify_memory_bounds_what_a_round_holds(bs):
    """One verify + accept round at B = 16 over Qwen3's vocabulary (151936), measured on CPU by the live
    tensor bytes it holds (`benchmarks/verify_memory.py`): the plan bounds every request kind, and it is
    not a loose bound for the dearest, T > 0 (the largest term of the whole plan: 16 GB at 48 requests
    and B = 64)."""
    rows = {kind: measure(bs, 16, 151936, kind) for kind in VERIFY_KINDS}
    for row in rows.values():
        assert row["measured"] <= row["planned"], row
    dearest = max(rows.values(), key=lambda row: row["measured"])
    assert dearest["kind"].startswith("sampled") and dearest["planned"] <= 1.1 * dearest["measured"], rows


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


def _graph_plan(backend: str, **overrides) -> VerifyGraphPlan:
    # Qwen3-8B-shaped at an H200's default graph batch sizes: the large terms dominate the small state.
    shape = dict(backends=(backend,), capture_bs=(1, 2, 4, 8, 16, 32, 64, 128, 256), context_len=40960,
                 heads=32, head_dim=128, kv_splits=8, workspace_bytes=512 * 2**20, wrapper_kinds=1, widths=(1, 5, 9))
    return VerifyGraphPlan(**{**shape, **overrides})


def _tensor_bytes(backend) -> int:
    """Bytes of the distinct tensors a backend holds (attributes, in lists, or in a struct's buffer)."""
    import torch

    seen, total = set(), 0
    for value in vars(backend).values():
        for item in value if isinstance(value, (list, tuple)) else [getattr(value, "buffer", value)]:
            if isinstance(item, torch.Tensor) and id(item) not in seen:
                seen.add(id(item))
                total += item.numel() * item.element_size()
    return total


@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("width", [1, 5, 9])
def test_verify_graph_plan_counts_what_sglangs_backends_allocate_for_a_window(backend, width, monkeypatch):
    """SGLang 0.5.23's own `init_cuda_graph_state` of each backend, run for a window of `width` tokens per
    request with fake device tensors (shapes without memory, so CUDA-sized state is measured on CPU): the
    plan's per-window state is at least what it allocates and at most the small-state allowance above it.
    The FlashInfer workspace and wrappers come from its __init__ and flashinfer (not installed here); the
    GPU check holds the whole plan against the device memory the capture took."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sglang.srt.layers.attention import verify_mask
    from sglang.srt.layers.attention.flashinfer_backend import FlashInferAttnBackend
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.srt.speculative.eagle_utils import TreeMaskMode

    from mfd_sglang.serving.launch.memory import FLASHINFER_WRAPPER_INT_WORKSPACE, SMALL_GRAPH_STATE

    # A GPU's tree mask (this machine's SGLang picks the CPU kernels' small one).
    monkeypatch.setattr(verify_mask, "default_tree_mask_mode", lambda: TreeMaskMode.FULL_MASK)
    plan = _graph_plan(backend)
    max_bs = max(plan.capture_bs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        if backend == "triton":
            state = object.__new__(TritonAttnBackend)
            vars(state).update(dllm_attention=None, num_head=plan.heads, max_kv_splits=plan.kv_splits,
                               v_head_dim=plan.head_dim, swa_v_head_dim=None, lean_total_programs=132,
                               lean_block_m=16, device="cuda", max_context_len=plan.context_len,
                               is_draft_runner=False, skip_prefill=False, num_draft_tokens=width,
                               sliding_window_size=None, use_sliding_window_kv_pool=False)
            fixed = 0
        else:
            state = object.__new__(FlashInferAttnBackend)
            vars(state).update(max_context_len=plan.context_len, num_wrappers=plan.wrapper_kinds,
                               use_sliding_window_kv_pool=False, skip_prefill=False,
                               kv_indptr=[torch.zeros(max_bs + 1, dtype=torch.int32, device="cuda")])
            fixed = plan.workspace_bytes + len(plan.capture_bs) * plan.wrapper_kinds * FLASHINFER_WRAPPER_INT_WORKSPACE
        before = _tensor_bytes(state)
        state.init_cuda_graph_state(max_bs, max_bs * width)
        measured = _tensor_bytes(state) - before
    planned = plan.width_bytes(width) - fixed
    assert planned - SMALL_GRAPH_STATE <= measured <= planned, (measured, planned)


def test_verify_graph_plan_at_launch_follows_the_servers_arguments(tiny_pair, monkeypatch):
    """From SGLang's resolved arguments and the target's ModelConfig: the candidate windows other than the
    launch one, the captured batch sizes up to --max-running-requests, the backends a verify runs on; none
    without CUDA graphs (without the automatic budget the launch plans none: the next test)."""
    from sglang.srt.arg_groups import overrides
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.cuda_graph_config import Backend

    model = ModelConfig(str(tiny_pair / "target"))
    monkeypatch.setattr(overrides, "model_config_of", lambda server_args: model)

    def args(**overrides_):
        decode = SimpleNamespace(backend=Backend.FULL, bs=[1, 2, 4, 8, 16, 24, 32, 64])
        return SimpleNamespace(**{**dict(
            cuda_graph_config=SimpleNamespace(decode=decode), disable_cuda_graph=False, max_running_requests=48,
            enable_deterministic_inference=False, triton_attention_split_tile_size=None,
            triton_attention_num_kv_splits=8, attention_backend="flashinfer", decode_attention_backend=None,
            prefill_attention_backend=None, tp_size=1), **overrides_})

    plan = verify_graph_plan(args(), 16)
    assert plan.widths == (1, 5, 9) and plan.capture_bs == (1, 2, 4, 8, 16, 24, 32, 48)
    assert plan.backends == ("flashinfer",) and plan.context_len == model.context_len
    assert plan.heads == model.get_max_num_attention_heads() and plan.workspace_bytes >= 512 * 2**20
    assert verify_graph_plan(args(disable_cuda_graph=True), 16) is None
    hybrid = verify_graph_plan(args(decode_attention_backend="triton", tp_size=2), 16)
    assert hybrid.backends == ("flashinfer", "triton") and hybrid.heads == -(-model.get_max_num_attention_heads() // 2)
    assert hybrid.total_bytes() > plan.total_bytes()
    deterministic = verify_graph_plan(args(enable_deterministic_inference=True), 16)
    assert deterministic.kv_splits == -(-model.context_len // 256) and deterministic.workspace_bytes == 2048 * 2**20

    cfg = parse_drafter_config(QWEN3_4B_DRAFTER)
    with_graphs = memory_plan(cfg, 0, dtype_bytes=2, budget=16, vocab=cfg.vocab_size,
                              verify_graph_bytes=plan.total_bytes())
    without = memory_plan(cfg, 0, dtype_bytes=2, budget=16, vocab=cfg.vocab_size)
    assert with_graphs.extra_bytes(8) - without.extra_bytes(8) == plan.total_bytes()
    assert "verify graphs of the other windows" in with_graphs.describe(8)


RESOLVE_ON_A_GPU = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
import sglang.srt.arg_groups.memory_hook as memory_hook
import sglang.srt.utils.common as common
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
from sglang.srt.server_args import ServerArgs
import mfd_sglang.plugin

mfd_sglang.plugin.register()
# An H200's capacity: what SGLang's memory settings and MFD's plan read on a GPU.
common.get_device_memory_capacity = memory_hook.get_device_memory_capacity = lambda device=None: 143_771.0
args = ServerArgs(model_path=sys.argv[1] + "/target", device="cuda", speculative_algorithm="MFD",
                  speculative_draft_model_path=sys.argv[1] + "/drafter", speculative_num_draft_tokens=17,
                  attention_backend="flashinfer")
run_resolution_pipeline(args)
print(json.dumps({"mem_fraction_static": resolution_result(args, "mem_fraction_static")}))
"""


@pytest.mark.parametrize("auto_budget", [False, True])
def test_a_gpu_launch_reserves_the_automatic_budgets_verify_graphs(tiny_pair, auto_budget):
    """SGLang's own argument resolution of an MFD server at device cuda (run on CPU, an H200's capacity
    reported): with the automatic budget the plan logged and taken out of the static fraction includes
    the FlashInfer backends of windows 1, 5 and 9 (each a new 512 MiB workspace at least); without it,
    none."""
    env = dict(os.environ, MFD_SGLANG_AUTO_BUDGET="1" if auto_budget else "0")
    out = subprocess.run([sys.executable, "-c", RESOLVE_ON_A_GPU, str(tiny_pair)], cwd=REPO, capture_output=True,
                         text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    fraction = json.loads(out.stdout.splitlines()[-1])["mem_fraction_static"]
    planned = re.search(r"MFD: --mem-fraction-static ([\d.]+) -> ([\d.]+) to leave (\d+) MiB", out.stderr)
    graphs = re.search(r"verify graphs of the other windows (\d+) MiB", out.stderr)
    assert planned and float(planned.group(2)) == fraction
    assert float(planned.group(1)) - fraction == pytest.approx(int(planned.group(3)) / 143_771.0, abs=1e-3)
    if auto_budget:
        assert graphs and int(graphs.group(1)) >= 3 * 512 and int(planned.group(3)) > int(graphs.group(1))
    else:
        assert graphs is None and int(planned.group(3)) < 512
