"""The GPU cost ledger's deterministic checks (`mfd_sglang.gpu_ledger`; no GPU, no timing):

- every Triton kernel of the project compiles for sm_90a and sm_80 at its serving shapes (Qwen3-4B, bs 1,
  K = 8, B = 64), and at the largest a launch allows (B = `MAX_BUDGET`, at bs 1 and `LARGEST_BS`), with no
  local memory (beyond today's recorded bytes, `SPILL_BARS`) and its shared memory within the device's
  per-block limit; so does every distinct compile of every drafting path's round at both shapes at each budget
  the CUDA default plays (B = 4 .. 64, bs 1); with MFD_EVERY_COMPILE=1, every distinct compile of the launches
  a server makes (`serving_compile_keys`: Qwen3-4B and 8B, every drafting path, budget and batch size up to
  256) against the same bars; the collection covers every drafting path's mode attention at both shapes;
- each stage of a round at the Qwen3-4B shapes launches at most its bar (`LAUNCH_BARS`): a regression bar
  that fails when, e.g., a per-chunk loop comes back;
- the tree's two kernels issue at most their bars of instructions per warp scheduler (`ISSUED_BARS`: a warp's
  instructions x ceil(warps / 4), the count the issue-bound model charges; bs 1, K = 8, B = 64: ~0.06 ms with the
  launch floors; goal 0.10), the vocabulary's two at most theirs over the whole grid (`GRID_ISSUED_BARS`);
- the tracer counts a toy function's kernels exactly (views launch nothing; a matmul is one kernel with its
  FLOPs and bytes), and the fit recovers a known launch floor from synthetic rows.
"""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from mfd_sglang.gpu_cost import (SERIAL_LOOPS, SHARED_LIMIT, KernelTrace, by_stage, compile_kernel,
                                 fit_launch_floor, predicted_seconds, warp_instructions)
from mfd_sglang.gpu_ledger import (NUM_MODES, SERVED_PATHS, SHAPES, STAGES, Scenario, project_kernels,
                                   served_budgets, serving_compile_keys, serving_launches, trace_worker_round)
from mfd_sglang.serving.budget.rule import mode_paths
from mfd_sglang.serving.launch.options import MAX_BUDGET

# Kernel launches per stage of one round at the Qwen3-4B shapes (bs 8, B = 64), at most: today's counts
# (benchmarks/results/gpu-ledger-2026-12-07-block-input.md; the baseline's were draft 1350, commit 162, layout
# 61, verify input 14, accept 68). Lower them as the stages are fused.
LAUNCH_BARS = {
    "mfd": {"draft": 59, "tree": 2, "layout": 1, "verify_input": 2, "accept": 2, "commit": 9},
    "mfd_d": {"draft": 59, "tree": 2, "layout": 1, "verify_input": 2, "accept": 2, "commit": 9},
}
# Bytes of local memory that compiles have today, at most, at the serving shapes and at the largest ones (their
# launches do not depend on the budget); every other compile has none. Register spills, and (norm + rope)
# libdevice sin / cos's Payne-Hanek array (28 bytes, read past 105615 rad only), not a spill.
SPILL_BARS = {("_mode_attention_kernel", 80): 568, ("_norm_rope_kernel", 90): 32, ("_norm_rope_kernel", 80): 32}
# Instructions one warp scheduler issues for a program of the tree's kernels at the 4B serving shapes (bs 1,
# K = 8, B = 64), at most, on sm_90a and sm_80: today's counts (gpu-ledger-2026-12-06-tree) rounded up; the
# all-pairs dedupe and the unpruned beam of gpu-ledger-2026-12-06-fused-draft issued ~1.18M and ~133k.
ISSUED_BARS = {"_beam_kernel": 41_000, "_merge_select_kernel": 61_000}
# Warp instructions of the vocabulary's kernels over their grid at the same shapes, at most: today's counts
# (gpu-ledger-2026-12-06-short-keys) rounded up; its tiles ranked on int64 keys, 32 rows a program
# (gpu-ledger-2026-12-06-fused-steps), issued ~297M.
GRID_ISSUED_BARS = {"_vocab_top_kernel": 158_000_000, "_vocab_finish_kernel": 9_000_000}
# The largest batch whose launches are compiled beside bs 1: SGLang's largest default decode CUDA-graph batch size
# (512; MFD's default --max-running-requests is 48). Past the vocabulary's launch plan (its rows a program and
# splits, which bs 1 and 512 bound from both sides) only the custom mask's lanes over the batch grow with bs.
LARGEST_BS = 512
# Every served compile (`serving_compile_keys`: 177 distinct compiles per arch) is compiled when this is set: ~2
# minutes of tracing, then ~450 s for sm_90a and ~500 s for sm_80 on one core with a cold Triton cache (~75 s and
# ~60 s warm; measured with each compile's SASS disassembled, which `over_resources` now skips: ~0.4-1 s a
# compile), more than CI affords (docs/development.md, Budgets that compile).
EVERY_COMPILE = os.environ.get("MFD_EVERY_COMPILE") == "1"


@pytest.fixture(scope="module")
def launches():
    return serving_launches()


@pytest.fixture(scope="module")
def largest_launches():
    """Each distinct launch of every kernel at B = MAX_BUDGET, at bs 1 and LARGEST_BS (most are the same at both)."""
    distinct = {}
    for bs in (1, LARGEST_BS):
        for launch in serving_launches(bs=bs, budget=MAX_BUDGET).values():
            distinct.setdefault(launch.key(), launch)
    return list(distinct.values())


def test_every_kernel_has_a_serving_launch(launches):
    assert set(launches) == project_kernels()


def over_resources(launches, arch: int, sites=None) -> list[str]:
    """Each launch's compile for sm_<arch> with more local memory than its SPILL_BARS or more shared memory
    than the device's per-block limit, in words (sites: where each launch is made, named with it)."""
    failures = []
    for i, launch in enumerate(launches):
        compiled = compile_kernel(launch, arch, sass=False)
        name = launch.name if sites is None else f"{launch.name} {launch.constexprs()} at {sites[i]}"
        if compiled.local_bytes > SPILL_BARS.get((launch.name, arch), 0):
            failures.append(f"{name}: {compiled.local_bytes} bytes of spills ({compiled.registers} registers)")
        if compiled.shared_bytes > SHARED_LIMIT[arch]:
            failures.append(f"{name}: {compiled.shared_bytes} bytes of shared memory > {SHARED_LIMIT[arch]}")
    return failures


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_without_spills_within_shared_memory(launches, arch):
    failures = over_resources(launches.values(), arch)
    assert not failures, f"sm_{arch}: " + "; ".join(failures)


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_compile_at_the_largest_budget_and_batch(largest_launches, arch):
    """The launch refuses budgets past MAX_BUDGET (`options.budget_from_num_draft_tokens`): at it every kernel
    fits. Its new compiles (the tree's, the walks', the vocabulary's, the custom mask's) take ~35 s for sm_90a and
    ~50 s for sm_80 on one core, the tree's beam and merge kernels most of it (docs/development.md, Budgets that
    compile)."""
    failures = over_resources(largest_launches, arch)
    assert not failures, f"sm_{arch} at B = {MAX_BUDGET}: " + "; ".join(failures)


@pytest.fixture(scope="module")
def path_compiles():
    """The distinct compiles of every drafting path's round at both shapes, B = 64, bs 1 (a slice of
    `serving_compile_keys`: a few seconds of tracing)."""
    return serving_compile_keys(budgets=(64,), batch_sizes=(1,), vocab_sweep=False)


def test_served_compiles_cover_every_drafting_path_at_both_shapes(path_compiles):
    """The collection reaches mode attention's every launch at Qwen3-4B and 8B: the K-mode block, a gated
    drafter's root-only pass (`MFDDrafter.gate_modes`: the K copies of [root]) and its K' = 4 and 1 best modes,
    MFD_D's single mode; and every kernel of the project."""
    # The full collection's paths are the automatic budget's of a gated drafter with mode subsets, its budgets
    # the default schedule's and the automatic budget's, and the largest.
    assert {(config == "mfd_d", gate) for config, gate in SERVED_PATHS} == set(
        mode_paths(NUM_MODES, gated=True, mode_subsets=True, single_mode_path=True))
    assert served_budgets() == (4, 8, 16, 32, 64, MAX_BUDGET)
    block = 16  # Qwen3 DFlash drafters' block
    attention = {}  # (ROWS, BLOCK_T) -> {(shape, config, gate)}
    for served in path_compiles.values():
        if served.launch.name == "_mode_attention_kernel":
            c = served.launch.constexprs()
            attention.setdefault((c["ROWS"], c["BLOCK_T"]), set()).update(
                (site.shape, site.config, site.gate) for site in served.sites)
    k, half = NUM_MODES, NUM_MODES // 2
    assert attention == {
        (k * block, block): {(shape, "mfd", None) for shape in SHAPES},
        (k, 1): {(shape, "mfd", gate) for shape in SHAPES for gate in (half, 1)},  # the gate's root-only pass
        (half * block, block): {(shape, "mfd", half) for shape in SHAPES},
        (block, block): {(shape, *path) for shape in SHAPES for path in (("mfd", 1), ("mfd_d", None))},
    }
    assert {served.launch.name for served in path_compiles.values()} == project_kernels()


@pytest.fixture(scope="module")
def default_budget_compiles():
    """The distinct compiles of every drafting path's round (`SERVED_PATHS`) at both shapes, at every budget
    the CUDA default plays (`served_budgets` but MAX_BUDGET: 4 .. 64), bs 1 (~10 s of tracing)."""
    budgets = tuple(b for b in served_budgets() if b != MAX_BUDGET)
    return budgets, serving_compile_keys(budgets=budgets, batch_sizes=(1,), vocab_sweep=False, wrappers=False)


@pytest.mark.parametrize("arch", [90, 80])
def test_every_drafting_path_compiles_within_the_bars_at_the_default_budgets(default_budget_compiles, arch):
    """Every distinct compile of the rounds a server plays at its default budgets, on every drafting path (the
    K-mode draft, a gated drafter's K' = 4 and K' = 1 after its root-only pass, MFD_D's single mode), bs 1,
    against the bars: the slice of `test_every_served_compile_within_the_bars` CI affords (the gate's K' = 4 merge
    at B = 64 and one mode's vocabulary top-B at B = 32 and 64 spilled there, unseen by the tests above). 66 distinct
    compiles (the 8B shape adds none): ~80 s of one core for sm_90a and ~95 s for sm_80 with a cold Triton cache,
    ~70 s each after the serving shapes' test has compiled its share; the merge kernel's 15 about half of it."""
    budgets, served = default_budget_compiles
    traced = {(site.shape, site.config, site.gate, site.budget) for c in served.values() for site in c.sites}
    assert traced == {(shape, config, gate, budget) for shape in SHAPES for config, gate in SERVED_PATHS
                      for budget in budgets}
    compiles = list(served.values())
    failures = over_resources([c.launch for c in compiles], arch, [c.sites[0] for c in compiles])
    assert not failures, f"sm_{arch}, {len(compiles)} compiles: " + "; ".join(failures)


@pytest.fixture(scope="module")
def served_compiles():
    return serving_compile_keys()


@pytest.mark.skipif(not EVERY_COMPILE, reason="every served compile (177 per arch) takes ~450 s for sm_90a and ~500 s "
                    "for sm_80 on one core (cold cache), more than CI affords: set MFD_EVERY_COMPILE=1 "
                    "(docs/development.md, Budgets that compile)")
@pytest.mark.parametrize("arch", [90, 80])
def test_every_served_compile_within_the_bars(served_compiles, arch):
    """Every distinct compile of the launches a server makes (`serving_compile_keys`) against the bars."""
    compiles = list(served_compiles.values())
    failures = over_resources([c.launch for c in compiles], arch, [c.sites[0] for c in compiles])
    assert not failures, f"sm_{arch}, {len(compiles)} compiles: " + "; ".join(failures)


@pytest.mark.parametrize("arch", [90, 80])
def test_kernels_within_their_instruction_bars(launches, arch):
    counts = {}
    for name in ISSUED_BARS | GRID_ISSUED_BARS:
        launch = launches[name]
        per_warp = warp_instructions(compile_kernel(launch, arch), SERIAL_LOOPS[name][1](launch))
        # Per warp scheduler of one program (the tree's: one program per request), or over the grid.
        scale = -(-launch.num_warps // 4) if name in ISSUED_BARS else launch.num_warps * math.prod(launch.grid)
        counts[name] = None if per_warp is None else per_warp * scale
    over = {name: f"{counts[name]} > {bar}" for name, bar in (ISSUED_BARS | GRID_ISSUED_BARS).items()
            if counts[name] is None or counts[name] > bar}
    assert not over, f"sm_{arch}: warp instructions over the bar (None: SASS loops are not the listed ones): {over}"


@pytest.mark.parametrize("config", ["mfd", "mfd_d"])
def test_stage_launches_at_most_the_bars(config):
    stages = by_stage(trace_worker_round(Scenario("qwen3-4b", config, bs=8, budget=64)))
    counts = {name: len(stages.get(name, [])) for name in STAGES}
    over = {name: f"{counts[name]} > {bar}" for name, bar in LAUNCH_BARS[config].items() if counts[name] > bar}
    assert not over, f"{config}: launches over the bar: {over}"
    # The Triton kernels are recorded as one launch each: the block input (embeddings, modes, positions, the
    # first norm); per drafter layer its norm + rope, mode attention, two residual adds + norms (the last one the
    # final norm's) and SiLU x up; the vocabulary top-B once (the lm_head fused in) and its finish (no torch
    # top-k), the tree's two, the walks, the mask's tree cells, the commit's rows and its keys' norm + rope.
    draft = [k.name for k in stages["draft"]]
    expected = {"_block_input_kernel": 1, "_norm_rope_kernel": 5, "_mode_attention_kernel": 5,
                "_add_rms_norm_kernel": 10, "_silu_mul_kernel": 5, "_vocab_top_kernel": 1, "_vocab_finish_kernel": 1,
                "topk": 0, "_fused_rms_norm": 0}
    assert {name: draft.count(name) for name in expected} == expected, draft
    assert [k.name for k in stages["tree"]] == ["_beam_kernel", "_merge_select_kernel"]
    assert [k.name for k in stages["layout"]] == ["_verify_layout_kernel"]
    assert [k.name for k in stages["accept"]] == ["argmax", "_accept_path_kernel"]
    assert "_tree_cells_kernel" in [k.name for k in stages["verify_input"]]
    commit = [k.name for k in stages["commit"]]
    assert (commit.count("_commit_rows_kernel"), commit.count("_norm_rope_kernel"), commit.count("gather")) == (1, 1, 0)


def test_tracer_counts_a_toy_function():
    with KernelTrace() as trace, trace.stage("toy"):
        a = torch.empty(4, 8, device="cuda")
        b = torch.empty(8, 16, device="cuda")
        a.view(8, 4).t().unsqueeze(0).expand(3, 4, 8).transpose(1, 2)[0].reshape(8, 4).squeeze(0)  # views only
        product = a @ b
        product + 1.0
    assert [(k.name, k.stage) for k in trace.kernels] == [("mm", "toy"), ("add", "toy")]
    matmul, add = trace.kernels
    assert matmul.flops == 2 * 4 * 8 * 16
    assert matmul.bytes == 4 * (4 * 8 + 8 * 16 + 4 * 16)
    assert add.flops == 4 * 16 and add.bytes == 4 * (2 * 4 * 16)


def test_fit_reproduces_a_known_floor():
    rng = np.random.default_rng(0)
    floor = 2.7e-6
    rows = [(roofline, predicted_seconds(roofline, floor))
            for roofline in (rng.uniform(0, 6e-6, n) for n in (50, 400, 2000))]
    assert fit_launch_floor(rows) == pytest.approx(floor, abs=1e-10)
