"""GPU cost ledger: the CUDA kernels of MFD's own round stages (draft, tree, verify layout, verify input,
accept, commit) as the serving worker runs them, at Qwen3-4B / Qwen3-8B drafter shapes, bs 1 / 8 / 32, MFD
(K = 8) and MFD_D's single-mode path, B = 16 / 64; their predicted H200 time from `gpu_cost`'s model, its
launch floor fitted to the one H200 log (`mfd_sglang/data/`: `round_cost`'s measured round, traced the same way); the round
at the default budget on CUDA (the schedule of `serving.budget.schedule`) beside a plain decode step for bs 1,
4, 8, 16, 32, 64 (`default_budget_rows`); and the sm_90a / sm_80 compiles of every Triton kernel at its serving
launch (`serving_compile_keys`: every distinct compile of the launches a server makes, over shapes, drafting paths,
budgets and batch sizes). What is counted and how: `gpu_cost`.
Runs from an installed wheel (its shapes and builders are `mfd_sglang.round_cost`'s, the log is package data):

    python -m mfd_sglang gpu-ledger --out benchmarks/results/gpu-ledger-DATE
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np
import torch

from . import round_cost as rc
from .gpu_cost import (FREE_OPS, H100, H200, SERIAL_LOOPS, DeviceModel, Kernel, KernelTrace, TritonLaunch,
                       attach_issue_times, by_stage, compile_kernel, fit_launch_floor, issue_seconds, log_rows, patched,
                       predicted_seconds, roofline_seconds, summarize, triton_launches)

# --- scenarios: the serving worker's stages and round_cost.py's round, on fake CUDA ----------------------

# The folder above the package: a checkout's root, or site-packages (reports name the log relative to it).
REPO = Path(__file__).resolve().parents[1]
STAGES = ("draft", "tree", "layout", "verify_input", "accept", "commit")
SHAPES = {"qwen3-4b": "qwen3_4b", "qwen3-8b": "qwen3_8b"}  # name -> round_cost.TargetConfig constructor
CONFIGS = {"mfd": False, "mfd_d": True}  # name -> single_mode (MFD_D's single-mode path of the same drafter)
NUM_MODES = 8
CONTEXT_LEN = 512  # committed tokens per request: round_cost's prompt length on a GPU
DTYPE = torch.bfloat16


def target_config(shape: str):
    return getattr(rc.TargetConfig, SHAPES[shape])()


@dataclass(frozen=True)
class Scenario:
    shape: str  # a key of SHAPES
    config: str  # a key of CONFIGS
    bs: int
    budget: int
    context_len: int = CONTEXT_LEN
    backend: str = "triton"  # the round's (`mfd_sglang.backend`): a CUDA server's --mfd-kernels auto
    # The mode gate's K' (`Arm.modes`): a drafter with a gate drafts each request's K' best modes, after the
    # gate's root-only pass (`MFDDrafter.gate_modes`); None: no gate, every mode (or MFD_D's one).
    gate: int | None = None

    @property
    def modes(self) -> int:
        return 1 if CONFIGS[self.config] else self.gate or NUM_MODES


def meta_drafter(cfg, num_modes: int, gated: bool = False):
    """round_cost's random drafter for target config cfg (gated: with a mode gate), built on the meta device (no
    storage); the fake mode cannot convert a module's dtype itself (`fake_cuda` moves it in)."""
    return rc.random_drafter(cfg, rc.spread_layer_ids(cfg.layers, cfg.draft_layers), num_modes, seed=num_modes,
                             device="meta", dtype=DTYPE, gated=gated)


def fake_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """module with every parameter and buffer replaced by a fake CUDA tensor of its shape and dtype (in
    place; call inside a `KernelTrace`)."""
    for m in module.modules():
        for tensors in (m._parameters, m._buffers):
            for name, t in tensors.items():
                if t is not None:
                    fake = torch.empty(t.shape, dtype=t.dtype, device="cuda")
                    tensors[name] = torch.nn.Parameter(fake, requires_grad=False) if tensors is m._parameters else fake
    return module


def trace_worker_round(s: Scenario) -> list[Kernel]:
    """The kernels of one decode round's own stages (`STAGES`) as `MFDWorkerV2.forward_decode` runs them on
    CUDA at batch size bs, every request `context_len` tokens in (greedy, no penalties, TP 1):
      draft         `DraftStage.candidates` over the context pool read in place (Triton mode attention; with
                    `gate`, a gated drafter's root-only pass first, then its K' modes per request);
      tree          `DraftStage.tree_of` up to its layout: the Triton mixture tree, draft -> target ids;
      layout        `tree_to_verify_layout` (SGLang's traversal + the ancestor mask);
      verify_input  `layout_verify_input`: SGLang's flat custom mask of the windows;
      accept        `accept_tree` over the target's logits [bs * (B + 1), V] (float32: SGLang 0.5.23's logits
                    processor casts them), `pad_result`;
      commit        `commit_round`: the drafter context K/V of root + path into the pool (at budget 0, plain
                    decoding, the worker batches these writes: counted each round here, an upper bound).
    Not counted: SGLang's own work around them (`eagle_prepare_for_verify`, the target forward,
    `move_accept_tokens_to_target_kvcache`)."""
    from types import SimpleNamespace

    from mfd_sglang.serving import draft_stage
    from mfd_sglang.serving.accept import accept_tree, pad_result
    from mfd_sglang.serving.budget.rule import Arm
    from mfd_sglang.serving.commit import commit_round
    from mfd_sglang.serving.verify import layout_verify_input
    from mfd_sglang.tree import empty_tree

    cfg = target_config(s.shape)
    nodes = s.budget + 1
    drafter = meta_drafter(cfg, NUM_MODES, gated=s.gate is not None)
    with KernelTrace(s.context_len) as trace:
        fake_cuda(drafter)
        embed = torch.empty(cfg.vocab, cfg.hidden, device="cuda", dtype=DTYPE)
        stage = draft_stage.DraftStage(drafter, embed, drafter.head_weight(embed), backend=s.backend)
        max_len = s.context_len + nodes
        req_to_token = torch.arange(s.bs * max_len, device="cuda", dtype=torch.int32).view(s.bs, max_len)
        stage.init_context_pool(s.bs * max_len, SimpleNamespace(req_to_token=req_to_token), device="cuda", dtype=DTYPE)
        roots = torch.zeros(s.bs, dtype=torch.int64, device="cuda")
        seq_lens = torch.full((s.bs,), s.context_len, dtype=torch.int64, device="cuda")
        requests = torch.arange(s.bs, device="cuda")
        logits = torch.empty(s.bs * nodes, cfg.vocab, device="cuda", dtype=torch.float32)
        hidden = torch.empty(s.bs, nodes, drafter.fc.in_features, device="cuda", dtype=DTYPE)
        window_slots = torch.empty(s.bs, nodes, device="cuda", dtype=torch.int64)
        batch = SimpleNamespace(sampling_info=SimpleNamespace(is_all_greedy=True, logit_bias=None,
                                                              penalizer_orchestrator=None))
        candidates = None
        with trace.stage("draft"):
            if s.budget:  # budget 0 (plain decoding) drafts nothing: the root alone
                arm = Arm(CONFIGS[s.config], s.budget, s.gate)
                candidates = stage.paged_candidates(roots, seq_lens, requests, arm)
        layout_step = trace.labelled("layout", draft_stage.tree_to_verify_layout)
        with trace.stage("tree"), patched(draft_stage, "tree_to_verify_layout", layout_step):
            tree, layout = (stage.tree_of(candidates, roots, seq_lens, s.budget) if s.budget else
                            stage.with_layout(empty_tree(s.bs, "cuda"), roots, seq_lens))
        with trace.stage("verify_input"):
            layout_verify_input(layout, seq_lens, s.bs * s.context_len, drafter.num_draft_positions, stage.backend)
        with trace.stage("accept"):
            result = pad_result(accept_tree(tree, layout, logits, batch, seq_lens, backend=stage.backend)[0], nodes)
        with trace.stage("commit"):
            commit_round(result, hidden, seq_lens, window_slots, stage.context_pool, drafter, lambda path: None)
    return trace.kernels


def _cpu_generator(device=None):
    """A CUDA generator cannot exist without a GPU; fake tensors' values are never drawn, so round_cost's
    StaticTarget gets a CPU one while it is built."""
    return _TORCH_GENERATOR("cpu")


_TORCH_GENERATOR = torch.Generator


def trace_round_cost(config: str, bs: int, shape: str = "qwen3-4b") -> list[Kernel]:
    """The kernels of round_cost's measured round (`SpecRound`: stages draft, tree (its layout included), verify
    (the target's forward included), commit, as captured on a GPU, B = round_cost.BUDGET) and of its plain decode step
    (stage "ar_step"), at the GPU check's prompt length."""
    cfg = target_config(shape)
    modes, single_mode = rc.CONFIGS[config]
    drafter = meta_drafter(cfg, modes)
    with KernelTrace(CONTEXT_LEN) as trace:
        with patched(torch, "Generator", _cpu_generator):
            target = rc.StaticTarget(cfg, "cuda", DTYPE, seed=0)
        target.allocate(bs, CONTEXT_LEN + rc.BUDGET + 1)
        # On its (fake) CUDA weights, in the serving draft stage on the Triton backend, as round_cost runs on a GPU.
        spec = rc.SpecRound(target, fake_cuda(drafter), budget=rc.BUDGET, single_mode=single_mode, backend="triton")
        roots = torch.zeros(bs, dtype=torch.int64, device="cuda")
        cache_lens = torch.full((bs,), CONTEXT_LEN, dtype=torch.int64, device="cuda")
        with trace.stage("ar_step"):
            target.decode(roots, cache_lens).argmax(-1)  # capture_decode_step's step
        with trace.stage("draft"):
            candidates = spec.draft(roots, cache_lens)
        with trace.stage("tree"):
            tree, layout = spec.tree(candidates, roots, cache_lens)
        with trace.stage("verify"):
            result, features = spec.verify(tree, layout, cache_lens)
        with trace.stage("commit"):
            spec.commit(result, features, cache_lens)
    return trace.kernels


def trace_target_forward(shape: str, bs: int, window: int) -> list[Kernel]:
    """The kernels of round_cost.py's target (`StaticTarget`: the target whose measured decode steps the launch
    floor is fitted to) over `window` tokens per request at batch size bs, `CONTEXT_LEN` tokens in: window 1 is
    a plain decode step with its greedy pick (`trace_round_cost`'s ar_step), a wider one the target's forward
    of a verify window, logits of every node (SGLang's verify; MFD's accept is the worker's own stage). A torch
    Qwen3 of ~1,900 launches a step, more than SGLang's fused target: what the ledger can model of the
    target, not SGLang's own forward."""
    cfg = target_config(shape)
    with KernelTrace(CONTEXT_LEN) as trace:
        with patched(torch, "Generator", _cpu_generator):
            target = rc.StaticTarget(cfg, "cuda", DTYPE, seed=0)
        target.allocate(bs, CONTEXT_LEN + max(window, rc.BUDGET + 1))  # round_cost's cache: the fitted step's
        tokens = torch.zeros(bs, window, dtype=torch.int64, device="cuda")
        cache_lens = torch.full((bs,), CONTEXT_LEN, dtype=torch.int64, device="cuda")
        with trace.stage("target"):
            if window == 1:
                target.decode(tokens[:, 0], cache_lens).argmax(-1)
            else:
                ancestors = torch.ones(bs, window, window, dtype=torch.bool, device="cuda")
                target.verify(tokens, cache_lens[:, None] + target.slots[:window], ancestors, cache_lens)
    return by_stage(trace.kernels)["target"]


DEFAULT_BATCH_SIZES = (1, 4, 8, 16, 32, 64)
SERVERS = ("mfd", "mfd_d")  # --speculative-algorithm MFD / MFD_D at their default flags


def drafter_and_target_configs(shape: str) -> tuple:
    """(drafter config, target text config) of the ledger's drafter (K = 8) on `shape`'s Qwen3 target, as a
    server reads them (`checkpoint.parse_drafter_config`, the target's config.json fields)."""
    from mfd_sglang.checkpoint import parse_drafter_config

    cfg = target_config(shape)
    drafter = parse_drafter_config(rc.drafter_raw_config(cfg, rc.spread_layer_ids(cfg.layers, cfg.draft_layers),
                                                         NUM_MODES))
    target = {"hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
              "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate,
              "vocab_size": cfg.vocab}
    return drafter, target


def default_schedule(shape: str, server: str, max_requests: int):
    """The default budget schedule on CUDA (`serving.budget.schedule`) of an MFD or MFD_D server at default
    flags (B = 64, MFD_D's switch at 3 requests) with the ledger's drafter on `shape`'s target, TP 1, for
    batches of up to max_requests requests."""
    from mfd_sglang.serving.budget.schedule import BudgetSchedule, RoundModel
    from mfd_sglang.serving.launch.options import (DEFAULT_SWITCH_THRESHOLD, budget_from_num_draft_tokens,
                                                   default_num_draft_tokens)

    launch_budget = budget_from_num_draft_tokens(default_num_draft_tokens("cuda"))
    return BudgetSchedule(RoundModel.of(*drafter_and_target_configs(shape)), launch_budget, max_requests,
                          switch_threshold=DEFAULT_SWITCH_THRESHOLD if server == "mfd_d" else None)


def default_budget_rows(shape: str = "qwen3-4b", batch_sizes=DEFAULT_BATCH_SIZES, floor_s: float = 0.0,
                        compiles: dict | None = None, device: DeviceModel = H200,
                        progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Per server (`SERVERS`) and batch size, the round at the default budget beside a plain decode step, in
    the ledger's model (launch floor floor_s; compiles: Triton compiles for issue times, None: without them):
    the schedule's budget and path (`default_schedule`, batches up to the largest of batch_sizes), MFD's own
    stages there (`trace_worker_round`), the target's verify of bs (b + 1) tokens and its plain step of bs
    (`trace_target_forward`); the break-even accept length round / plain step; the schedule's own roofline
    ratio (`RoundModel`), which it bounds by `ROUND_STEPS`."""
    from mfd_sglang.serving.budget.rule import describe_path

    traced: dict = {}  # the servers share rounds and steps: each traced once

    def kernels(trace, *args) -> list[Kernel]:
        if (trace, args) not in traced:
            traced[trace, args] = trace(*args)
            if compiles is not None:
                attach_issue_times(traced[trace, args], compiles, device)
        return traced[trace, args]

    rows = []
    for server in SERVERS:
        schedule = default_schedule(shape, server, max(batch_sizes))
        for bs in batch_sizes:
            budget, path = schedule.budget(bs), schedule.path(bs)
            progress(f"tracing {shape} {server} bs {bs} at its default budget {budget}")
            own = kernels(trace_worker_round, Scenario(shape, "mfd_d" if path.single_mode else "mfd", bs, budget))
            verify = kernels(trace_target_forward, shape, bs, budget + 1)
            plain = kernels(trace_target_forward, shape, bs, 1)
            own_ms, verify_ms, plain_ms = (1e3 * predicted_seconds(roofline_seconds(kernels, device), floor_s)
                                           for kernels in (own, verify, plain))
            modes = schedule.modes(path)
            rows.append({"shape": shape, "server": server, "bs": bs, "path": describe_path(path), "K": modes,
                         "B": budget, "own_ms": round(own_ms, 4), "verify_ms": round(verify_ms, 4),
                         "round_ms": round(own_ms + verify_ms, 4), "plain_ms": round(plain_ms, 4),
                         "break_even": round((own_ms + verify_ms) / plain_ms, 3),
                         "rule_ratio": round(schedule.model.round_seconds(bs, budget, modes)
                                             / schedule.model.plain_seconds(bs), 3),
                         "launches": {"own": len(own), "verify": len(verify), "plain": len(plain)}})
    return rows


def wrapper_launches(shape: str = "qwen3-4b", bs: int = 1, budget: int = 64) -> list[TritonLaunch]:
    """The launches of the Triton wrappers off the default path, at the round's shapes (K = 8): the fused
    lm_head + top-B (`vocab_candidates_triton` over the draft's hidden states [bs, K, D, H]), the tree from full
    log-probabilities [bs, K, D, V] (`_vocab_topk_kernel`) and FP8 drafting's activation quantization (the input
    [bs * K * block, in] of each of its linears: `drafter.fp8_linear_shapes`)."""
    from mfd_sglang.drafter import fp8_linear_shapes
    from mfd_sglang.kernels.draft_fp8_quant import quantize_rows_triton
    from mfd_sglang.kernels.tree_mixture import build_mixture_tree_triton
    from mfd_sglang.kernels.draft_vocab import vocab_candidates_triton

    cfg = target_config(shape)
    depth = cfg.block_size - 1
    # The down_proj's input first (`serving_launches` keeps it): the widest.
    inputs = sorted({features for _, features in fp8_linear_shapes(drafter_and_target_configs(shape)[0])},
                    reverse=True)
    with KernelTrace(CONTEXT_LEN) as trace, trace.stage("wrappers"):
        vocab_candidates_triton(torch.empty(bs, NUM_MODES, depth, cfg.hidden, device="cuda", dtype=DTYPE),
                                torch.empty(cfg.vocab, cfg.hidden, device="cuda", dtype=DTYPE), budget)
        build_mixture_tree_triton(torch.empty(bs, NUM_MODES, depth, cfg.vocab, device="cuda"), budget)
        for features in inputs:
            quantize_rows_triton(torch.empty(bs * NUM_MODES * cfg.block_size, features, device="cuda", dtype=DTYPE))
    return list(triton_launches(trace.kernels))


def serving_launches(shape: str = "qwen3-4b", bs: int = 1, budget: int = 64) -> dict[str, TritonLaunch]:
    """One launch of every Triton kernel at the serving shapes (kernel name -> launch): those of the worker's
    MFD round (mode attention, beam, merge-select, ...) and, at the same shapes, those of the wrappers off the
    default path (`wrapper_launches`)."""
    launches = {l.name: l for l in triton_launches(trace_worker_round(Scenario(shape, "mfd", bs, budget)))}
    for launch in wrapper_launches(shape, bs, budget):
        launches.setdefault(launch.name, launch)
    return launches


# The drafting paths of a server's rounds (`serving.budget.rule.Path`), as (config, the gate's K'): the K-mode
# draft; a gated drafter's K/2 and 1 best modes per request (`mode_paths`: the automatic budget with
# --mfd-mode-subsets, or --mfd-num-modes), each after the gate's root-only pass; MFD_D's single mode.
SERVED_PATHS = (("mfd", None), ("mfd", NUM_MODES // 2), ("mfd", 1), ("mfd_d", None))
# Batch sizes a round is traced at for its compile keys: the first of each power-of-two range up to 256 requests
# (the custom mask's lanes are a power of two of bs). The vocabulary's launch plan (rows a program, splits,
# threshold) changes at other batch sizes too: `serving_compile_keys` sweeps it over every one.
KEY_BATCH_SIZES = (1, 2, 3, 5, 9, 17, 33, 65, 129, 256)
VOCAB_KERNELS = ("_vocab_top_kernel", "_vocab_finish_kernel")


def served_budgets() -> tuple[int, ...]:
    """The tree budgets a server plays: the default schedule's and the automatic budget's at the CUDA launch
    budget (`candidate_budgets(64)` but 0: 4 .. 64) and the largest a launch allows (`MAX_BUDGET`)."""
    from mfd_sglang.serving.budget.rule import candidate_budgets
    from mfd_sglang.serving.launch.options import (MAX_BUDGET, budget_from_num_draft_tokens,
                                                   default_num_draft_tokens)

    return candidate_budgets(budget_from_num_draft_tokens(default_num_draft_tokens("cuda")))[1:] + (MAX_BUDGET,)


class LaunchSite(NamedTuple):
    """Where a launch was traced: shape, path (config, the gate's K'), budget, batch size and source: "round"
    (`trace_worker_round`), "vocab sweep" (the round's vocabulary launch at every batch size) or "wrappers"
    (`wrapper_launches`)."""

    shape: str
    config: str
    gate: int | None
    budget: int
    bs: int
    source: str

    def __str__(self) -> str:
        path = {None: "K-mode" if self.config == "mfd" else "single mode"}.get(self.gate, f"gate K'={self.gate}")
        return f"{self.shape} {path} B {self.budget} bs {self.bs} ({self.source})"


@dataclass
class ServedCompile:
    """One distinct compile of the served launches (`serving_compile_keys`): its first launch traced and
    every site that launches it."""

    launch: TritonLaunch
    sites: list[LaunchSite]


def vocab_sweep_launches(shape: str, modes: int, budget: int, batch_sizes) -> dict[int, list[TritonLaunch]]:
    """The vocabulary launches (`vocab_candidates_triton`, the round's `MFDDrafter.block_candidates` on
    the "triton" backend: the draft's hidden states [bs, modes, D, H] against the head [V, H]) of budget
    `budget` at each batch size (bs -> launches)."""
    from mfd_sglang.kernels.draft_vocab import vocab_candidates_triton

    cfg = target_config(shape)
    launches = {}
    with KernelTrace(CONTEXT_LEN) as trace:
        head = torch.empty(cfg.vocab, cfg.hidden, device="cuda", dtype=DTYPE)
        for bs in batch_sizes:
            with trace.stage(str(bs)):
                vocab_candidates_triton(torch.empty(bs, modes, cfg.block_size - 1, cfg.hidden, device="cuda",
                                                    dtype=DTYPE), head, budget)
    for k in trace.kernels:
        if k.launch is not None:
            launches.setdefault(int(k.stage), []).append(k.launch)
    return launches


def serving_compile_keys(shapes=tuple(SHAPES), paths=SERVED_PATHS, budgets: tuple[int, ...] | None = None,
                         batch_sizes=KEY_BATCH_SIZES, vocab_sweep: bool = True, wrappers: bool = True,
                         progress: Callable[[str], None] = lambda line: None) -> dict[tuple, ServedCompile]:
    """Every distinct compile (`TritonLaunch.key`: kernel, constexprs, scalar types and specialization,
    options; not the grid) of the launches a server makes, key -> `ServedCompile`: the worker's round
    (`trace_worker_round`) at each shape, path (`SERVED_PATHS`), budget (`served_budgets`) and batch size of
    batch_sizes; with vocab_sweep, the round's vocabulary launch at every batch size up to the largest of
    them (its launch plan follows bs * K' * D, not a power of two of bs; checked to be the round's launch at
    the traced sizes); with wrappers, the wrappers off the default path (`wrapper_launches`) at each shape and
    budget."""
    budgets = budgets or served_budgets()
    distinct: dict[tuple, ServedCompile] = {}
    sweeps: dict[tuple, dict[int, list[TritonLaunch]]] = {}  # (shape, modes, budget): paths of as many modes share it

    def add(launch: TritonLaunch, site: LaunchSite) -> None:
        key = launch.key()
        if key not in distinct:
            distinct[key] = ServedCompile(launch, [])
        distinct[key].sites.append(site)

    for shape in shapes:
        for config, gate in paths:
            scenario = Scenario(shape, config, 1, 0, gate=gate)
            for budget in budgets:
                progress(f"tracing {shape} {config} K' {gate} B {budget}")
                round_vocab = {}
                for bs in batch_sizes:
                    traced = trace_worker_round(Scenario(shape, config, bs, budget, gate=gate))
                    for launch in triton_launches(traced):
                        add(launch, LaunchSite(shape, config, gate, budget, bs, "round"))
                        if launch.name in VOCAB_KERNELS:
                            round_vocab.setdefault(bs, []).append(launch.key())
                if not vocab_sweep:
                    continue
                if (shape, scenario.modes, budget) not in sweeps:
                    sweeps[shape, scenario.modes, budget] = vocab_sweep_launches(shape, scenario.modes, budget,
                                                                                 range(1, max(batch_sizes) + 1))
                swept = sweeps[shape, scenario.modes, budget]
                for bs, traced in round_vocab.items():
                    if [launch.key() for launch in swept[bs]] != traced:
                        raise AssertionError(f"the vocabulary sweep's launches at {shape} {config} K' {gate} B "
                                             f"{budget} bs {bs} are not the round's")
                for bs, launches in swept.items():
                    for launch in launches:
                        add(launch, LaunchSite(shape, config, gate, budget, bs, "vocab sweep"))
        for budget in budgets if wrappers else ():
            for launch in wrapper_launches(shape, 1, budget):
                add(launch, LaunchSite(shape, "mfd", None, budget, 1, "wrappers"))
    return distinct


def project_kernels() -> set[str]:
    """Names of the Triton kernels defined in mfd_sglang.kernels (JIT functions named *_kernel)."""
    import importlib
    import pkgutil

    import mfd_sglang.kernels as package
    from triton.runtime.jit import JITFunction

    names = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        names |= {name for name, value in vars(module).items()
                  if isinstance(value, JITFunction) and name.endswith("_kernel") and value.module == module.__name__}
    return names


# --- the report: fit, ledger, compiles; JSON, Markdown, plot --------------------------------------------

# The one GPU log (GPU check part 2 on an H200, benchmarks/fp8_draft.py), shipped with the ledger it is fitted to.
DEFAULT_LOG = Path(__file__).resolve().parent / "data" / "fp8-draft-h200-2026-12-04.log"
FIT_QUANTITIES = ("ar_step_ms", "draft_ms", "round_ms")  # the log's measured columns


def fit_rows(log: Path, compiles: dict, device: DeviceModel = H200) -> list[dict]:
    """Per measured quantity of the log's round rows (one ar_step row per batch size): the traced kernels'
    roofline times (`trace_round_cost`) and the measurement."""
    rows, seen = [], set()
    for measured in log_rows(log):
        kernels = trace_round_cost(measured["config"], measured["bs"])
        attach_issue_times(kernels, compiles, device)
        stages = by_stage(kernels)
        parts = {"ar_step_ms": stages["ar_step"], "draft_ms": stages["draft"],
                 "round_ms": [k for name in rc.STAGES for k in stages[name]]}
        for quantity, part in parts.items():
            label = f"bs {measured['bs']} plain decode step" if quantity == "ar_step_ms" else (
                f"{measured['config']} bs {measured['bs']} {quantity.removesuffix('_ms')}")
            if label not in seen:
                seen.add(label)
                rows.append({"row": label, "quantity": quantity, "launches": len(part),
                             "roofline_s": roofline_seconds(part, device), "measured_ms": measured[quantity]})
    return rows


def build_report(shapes=tuple(SHAPES), batch_sizes=(1, 8, 32), configs=tuple(CONFIGS), budgets=(16, 64),
                 log: Path = DEFAULT_LOG, fit_on=("ar_step_ms",), device: DeviceModel = H200,
                 progress: Callable[[str], None] = lambda line: None,
                 default_batch_sizes=DEFAULT_BATCH_SIZES) -> dict:
    """The ledger (module docstring): the launch floor fitted on the log's `fit_on` quantities, each row's
    residual; per scenario and stage launches, bytes, FLOPs and predicted ms; per shape the rounds at the
    default budget beside a plain step (`default_budget_rows`); the compiles of every Triton kernel at the
    serving shapes (Qwen3-4B, bs 1, K = 8, B = 64) for sm_90a and sm_80."""
    compiles: dict = {}
    progress("tracing round_cost.py's measured round")
    rows = fit_rows(log, compiles, device)
    floor = fit_launch_floor([(r["roofline_s"], r["measured_ms"] / 1e3) for r in rows if r["quantity"] in fit_on])
    fit = {"constant": "launch_floor_us", "launch_floor_us": round(floor * 1e6, 4), "fit_on": list(fit_on),
           "log": str(log.relative_to(REPO) if log.is_relative_to(REPO) else log), "rows": []}
    for r in rows:
        predicted = 1e3 * predicted_seconds(r["roofline_s"], floor)
        fit["rows"].append({"row": r["row"], "fitted": r["quantity"] in fit_on, "launches": r["launches"],
                            "measured_ms": r["measured_ms"], "predicted_ms": round(predicted, 4),
                            "residual": round(predicted / r["measured_ms"] - 1, 4)})
    ledger = []
    for shape in shapes:
        for config in configs:
            for budget in budgets:
                for bs in batch_sizes:
                    scenario = Scenario(shape, config, bs, budget)
                    progress(f"tracing {shape} {config} bs {bs} B {budget}")
                    kernels = trace_worker_round(scenario)
                    attach_issue_times(kernels, compiles, device)
                    stages = by_stage(kernels)
                    ledger.append({"shape": shape, "config": config, "K": scenario.modes, "bs": bs, "B": budget,
                                   "context_len": scenario.context_len,
                                   "stages": {name: summarize(stages.get(name, []), floor, device) for name in STAGES},
                                   "total": summarize(kernels, floor, device),
                                   "kernels": [{"name": k.name, "stage": k.stage, "source": k.source,
                                                "counted": k.counted, "bytes": k.bytes, "flops": k.flops,
                                                "issue_us": round(k.issue_s * 1e6, 3)} for k in kernels
                                               if k.source != "aten"]})
    defaults = [row for shape in shapes
                for row in default_budget_rows(shape, default_batch_sizes, floor, compiles, device, progress)]
    progress("compiling the Triton kernels for sm_90a and sm_80")
    triton_rows = []
    for name, launch in sorted(serving_launches().items()):
        for arch in (90, 80):
            compiled = compile_kernel(launch, arch)
            issue = issue_seconds(launch, compiled, device) if arch == 90 else None
            triton_rows.append({
                "kernel": name, "arch": "sm_90a" if arch == 90 else "sm_80", "grid": list(launch.grid),
                "num_warps": launch.num_warps, "constexprs": {k: v for k, v in launch.constexprs().items()},
                "registers": compiled.registers, "spill_bytes": compiled.local_bytes,
                "shared_bytes": compiled.shared_bytes, "shared_limit": compiled.shared_limit,
                "sass_instructions": compiled.sass_instructions,
                "loop_instructions": [last - first + 1 for first, last in compiled.loops],
                "loop_model": SERIAL_LOOPS.get(name, ("", None))[0],
                "loop_trips": SERIAL_LOOPS[name][1](launch) if name in SERIAL_LOOPS else None,
                "issue_bound_ms": None if issue is None else round(issue * 1e3, 4)})
    return {"device": vars(device), "model": MODEL_NOTE,
            "free_ops": sorted(FREE_OPS), "counting": COUNTING_NOTE, "fit": fit, "ledger": ledger,
            "defaults": defaults, "triton": triton_rows}


def plain_step_floor(log: Path = DEFAULT_LOG, shape: str = "qwen3-4b", device: DeviceModel = H200) -> float:
    """The launch floor fitted to the log's plain decode steps (`trace_target_forward` at window 1, the
    measured step's kernels): the ledger's default fit."""
    steps = {r["bs"]: r["ar_step_ms"] for r in log_rows(log)}
    return fit_launch_floor([(roofline_seconds(trace_target_forward(shape, bs, 1), device), ms / 1e3)
                             for bs, ms in steps.items()])


def round_cost_predictions(batch_sizes=(1, 32), shape: str = "qwen3-4b", log: Path = DEFAULT_LOG,
                           device: DeviceModel = H200) -> dict:
    """What the GPU check sets beside its round_cost rows: per config of round_cost.py and batch size, each
    stage's launches and predicted ms (`trace_round_cost`; the launch floor fitted on the log's plain decode
    steps, as the ledger's default)."""
    compiles: dict = {}
    traced: dict = {}

    def stages_of(config: str, bs: int) -> dict:
        if (config, bs) not in traced:
            kernels = trace_round_cost(config, bs, shape)
            attach_issue_times(kernels, compiles, device)
            traced[config, bs] = by_stage(kernels)
        return traced[config, bs]

    floor = plain_step_floor(log, shape, device)
    rows = []
    for config in rc.CONFIGS:
        for bs in batch_sizes:
            stages = stages_of(config, bs)
            parts = {"ar_step": stages["ar_step"], **{name: stages[name] for name in rc.STAGES},
                     "round": [k for name in rc.STAGES for k in stages[name]]}
            rows.append({"config": config, "bs": bs, "shape": shape,
                         **{f"{name}_ms": round(1e3 * predicted_seconds(roofline_seconds(part, device), floor), 4)
                            for name, part in parts.items()},
                         **{f"{name}_launches": len(part) for name, part in parts.items()}})
    return {"model": MODEL_NOTE, "launch_floor_us": round(floor * 1e6, 4), "device": device.name,
            "log": str(log.relative_to(REPO) if log.is_relative_to(REPO) else log), "rows": rows}


ARM_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
ARM_BUDGETS = (0, 4, 8, 16, 32, 64)  # the automatic budget's candidates at B = 64 (`budget.rule.candidate_budgets`)


def arm_round_rows(shape: str = "qwen3-8b", devices: tuple[DeviceModel, ...] = (H100, H200),
                   batch_sizes=ARM_BATCH_SIZES, budgets=ARM_BUDGETS, log: Path = DEFAULT_LOG,
                   progress: Callable[[str], None] = lambda line: None) -> list[dict]:
    """Per device, batch size and arm (path x budget: MFD's K modes, MFD_D's single mode; budget 0 is plain
    decoding), the ledger's predicted round: MFD's own stages (`trace_worker_round`) plus the target's
    forward over bs (b + 1) tokens (`trace_target_forward`), each kernel at max(roofline, launch floor), the
    floor fitted to the H200 log's plain steps (`plain_step_floor`). What the automatic budget's oracle test
    takes its clock from (tests/test_chooser_oracle.py). Without Triton issue times (they add < 2% here)."""
    floor = plain_step_floor(log, shape)
    traced: dict = {}

    def kernels(trace, *args) -> list[Kernel]:
        if (trace, args) not in traced:
            progress(f"tracing {trace.__name__}{args}")
            traced[trace, args] = trace(*args)
        return traced[trace, args]

    rows = []
    for device in devices:
        for bs in batch_sizes:
            for config in CONFIGS:
                for budget in budgets:
                    if budget == 0 and config != "mfd":
                        continue  # plain decoding drafts nothing: one row
                    own = kernels(trace_worker_round, Scenario(shape, config, bs, budget))
                    verify = kernels(trace_target_forward, shape, bs, budget + 1)
                    ms = 1e3 * sum(predicted_seconds(roofline_seconds(k, device), floor) for k in (own, verify))
                    rows.append({"device": device.name, "shape": shape, "bs": bs,
                                 "path": "plain" if budget == 0 else config, "budget": budget,
                                 "round_ms": round(ms, 4)})
    return rows


MODEL_NOTE = ("per kernel max(bytes / HBM bandwidth, FLOPs / peak, issue-bound time (Triton), launch floor); a "
              "stage is the sum of its kernels; one constant, the launch floor, fitted to the H200 log")
COUNTING_NOTE = {
    "aten": "traced: every non-free aten op on fake CUDA tensors is one kernel (a lower bound for sort / topk / "
            "cumsum, which launch several)",
    "triton": "traced: every kernel[grid](...) of the CUDA path recorded with its grid and constexprs; bytes and "
              "FLOPs modelled per kernel (gpu_cost.triton_bytes / triton_flops), issue-bound time from its sm_90a "
              "SASS (gpu_cost.SERIAL_LOOPS)",
    "sdpa": "modelled: F.scaled_dot_product_attention as one fused attention kernel",
}


def default_budget_markdown(rows: list[dict]) -> list[str]:
    """Markdown lines of `default_budget_rows`: per shape, the round at the default budget beside a plain step."""
    from mfd_sglang.serving.budget.schedule import ROUND_STEPS

    lines = []
    for shape in dict.fromkeys(row["shape"] for row in rows):
        lines += ["", f"## {shape}: rounds at the default budget on CUDA beside a plain decode step (context "
                  f"{CONTEXT_LEN} tokens per request)", "",
                  "The budget is the default schedule's (`serving/budget/schedule.py`: no --speculative-num-draft-"
                  "tokens, no --mfd-auto-budget; MFD_D's single-mode path from 3 requests); round = MFD's own "
                  "stages + the target's verify of bs (B + 1) tokens; plain = the target's decode step of bs tokens. "
                  "The target is round_cost.py's torch Qwen3 (the one the launch floor is fitted to, ~1,900 "
                  "launches a step), not SGLang's fused forward: its launch floors make small windows cost alike. "
                  "Break-even: the accept length (bonus included) at which the round pays, round / plain; "
                  f"rule: the schedule's own roofline ratio, which it keeps <= {ROUND_STEPS:g}.", "",
                  "| server | bs | path | B | own stages ms | verify ms | round ms | plain step ms | break-even | "
                  "rule |", "|---" * 10 + "|"]
        lines += [f"| {r['server']} | {r['bs']} | {r['path']} | {r['B']} | {r['own_ms']:.3f} | {r['verify_ms']:.3f} | "
                  f"{r['round_ms']:.3f} | {r['plain_ms']:.3f} | {r['break_even']:.2f} | {r['rule_ratio']:.2f} |"
                  for r in rows if r["shape"] == shape]
    return lines


def markdown(report: dict, command: str) -> str:
    """The report as Markdown: the command, the model and its fit, per shape the stage table (launches / ms),
    the Triton compile table."""
    fit = report["fit"]
    lines = [f"# GPU cost ledger ({report['device']['name']} model)", "", f"Command: `{command}`", "",
             f"Model: {report['model']}. Counting: " + "; ".join(f"{k}: {v}" for k, v in report["counting"].items())
             + ".", "",
             f"## Fit: launch floor {fit['launch_floor_us']} us (least squares of the relative error over the "
             f"{', '.join(fit['fit_on'])} rows of `{fit['log']}`)", "",
             "| row | fitted | launches | measured ms | predicted ms | residual |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['row']} | {'yes' if r['fitted'] else ''} | {r['launches']} | {r['measured_ms']:.3f} | "
              f"{r['predicted_ms']:.3f} | {100 * r['residual']:+.1f}% |" for r in fit["rows"]]
    for shape in dict.fromkeys(row["shape"] for row in report["ledger"]):
        lines += ["", f"## {shape}: launches / predicted ms per stage (context {CONTEXT_LEN} tokens per request)", "",
                  "| config | K | bs | B | " + " | ".join(STAGES) + " | total |", "|---" * (5 + len(STAGES)) + "|"]
        for row in (r for r in report["ledger"] if r["shape"] == shape):
            cells = [f"{row['stages'][name]['launches']} / {row['stages'][name]['ms']:.3f}" for name in STAGES]
            lines.append(f"| {row['config']} | {row['K']} | {row['bs']} | {row['B']} | " + " | ".join(cells)
                         + f" | {row['total']['launches']} / {row['total']['ms']:.3f} |")
    lines += default_budget_markdown(report.get("defaults", []))
    lines += ["", "## Triton kernels at the serving shapes (Qwen3-4B, bs 1, K = 8, B = 64)", "",
              "| kernel | arch | grid | warps | registers | spill bytes | shared bytes (limit) | SASS instructions | "
              "loops (instructions) | loop trips | issue-bound ms |", "|---" * 11 + "|"]
    for r in report["triton"]:
        issue = "" if r["issue_bound_ms"] is None else f"{r['issue_bound_ms']:.4f}"
        lines.append(f"| {r['kernel']} | {r['arch']} | {r['grid']} | {r['num_warps']} | {r['registers']} | "
                     f"{r['spill_bytes']} | {r['shared_bytes']} ({r['shared_limit']}) | {r['sass_instructions']} | "
                     f"{r['loop_instructions']} | {r['loop_trips']} | {issue} |")
    lines += ["", "Issue-bound model: " + issue_seconds.__doc__.split("(")[0].strip() + " = max(per program: warp "
              "instructions x ceil(warps / 4) / clock, grid: warp instructions x warps x programs / (SMs x 4 x "
              "clock)), warp instructions = sum over SASS instructions of the trips of the innermost loop holding "
              "them; loops: " + "; ".join(f"{k}: {v[0]}" for k, v in SERIAL_LOOPS.items()) + ". A lower bound.",
              "", "Constexprs: " + "; ".join(f"{r['kernel']} {r['constexprs']}" for r in report["triton"]
                                               if r["arch"] == "sm_90a")]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> bool:
    """Predicted ms and launches per stage, stacked, per scenario and shape; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(row["shape"] for row in report["ledger"]))
    fig, axes = plt.subplots(len(shapes), 2, figsize=(16, 5 * len(shapes)), squeeze=False)
    for axis_row, shape in zip(axes, shapes):
        rows = [r for r in report["ledger"] if r["shape"] == shape]
        labels = [f"{r['config']}\nbs{r['bs']} B{r['B']}" for r in rows]
        for ax, metric, title in ((axis_row[0], "ms", "predicted ms"), (axis_row[1], "launches", "kernel launches")):
            bottom = np.zeros(len(rows))
            for name in STAGES:
                values = np.array([r["stages"][name][metric] for r in rows], dtype=float)
                ax.bar(labels, values, bottom=bottom, label=name)
                bottom += values
            ax.set_title(f"{shape}: {title} per round (plugin stages)")
            ax.tick_params(axis="x", labelsize=7)
            ax.legend(fontsize=8)
    fig.suptitle(f"GPU cost ledger, {report['device']['name']} model, launch floor "
                 f"{report['fit']['launch_floor_us']} us")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def json_ready(report: dict) -> dict:
    """The report without numpy arrays (the fit rows' per-kernel times stay in memory only)."""
    import json

    return json.loads(json.dumps(report, default=lambda value: value.tolist() if isinstance(value, np.ndarray)
                                 else str(value)))


def write_outputs(report: dict, prefix: Path, command: str) -> list[Path]:
    """PREFIX.json, PREFIX.md and (with matplotlib) PREFIX.png; returns the paths written."""
    import json

    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = [prefix.with_name(prefix.name + ".json"), prefix.with_name(prefix.name + ".md")]
    paths[0].write_text(json.dumps({"command": command, **json_ready(report)}, indent=1) + "\n")
    paths[1].write_text(markdown(report, command))
    if plot(report, prefix.with_name(prefix.name + ".png")):
        paths.append(prefix.with_name(prefix.name + ".png"))
    return paths


def run(args, command: str) -> int:
    """Build the report from the parsed options of `python -m mfd_sglang gpu-ledger`, print its Markdown,
    write it with --out."""
    import json
    import sys

    if args.round_cost_predictions:
        predictions = round_cost_predictions(tuple(args.batch_sizes), args.shapes[0], args.log.resolve())
        Path(args.round_cost_predictions).write_text(json.dumps(predictions, indent=1) + "\n")
        print(f"wrote {args.round_cost_predictions}", file=sys.stderr)
        return 0
    report = build_report(tuple(args.shapes), tuple(args.batch_sizes), tuple(args.configs), tuple(args.budgets),
                          args.log.resolve(), tuple(args.fit_on), progress=lambda line: print(line, file=sys.stderr))
    print(markdown(report, command))
    if args.out:
        for path in write_outputs(report, Path(args.out), command):
            print(f"wrote {path}", file=sys.stderr)
    return 0
