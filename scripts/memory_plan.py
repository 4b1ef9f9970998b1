"""What an MFD server adds to SGLang's memory at the released drafters' shapes: the plugin's own plan
(`mfd_sglang.serving.launch.memory.memory_plan`, what the launch logs as `MFD memory at launch` and takes out of
`--mem-fraction-static`), computed from the drafters' shapes without downloading them.

    python scripts/memory_plan.py                        # the defaults on CUDA: MFD, the budget schedule, 48 requests
    python scripts/memory_plan.py --algorithm MFD_D
    python scripts/memory_plan.py --num-draft-tokens 65  # a fixed B = 64 at every batch size
    python scripts/memory_plan.py --max-running-requests 16 --num-draft-tokens 33 --fp8-draft

Prints one row per drafter: its weights, the draft + tree working set of the largest draft and the verify working
set of the largest verify (T > 0: the sampling law's work over the full vocabulary per verified node) among the
rounds the server plays (`serving/budget/playable.py`: without --num-draft-tokens the default budget schedule's
rounds up to --max-running-requests, `serving/budget/schedule.py`, else that budget; each at its batch-size
bucket), their sum with the draft graphs' buffers (outside SGLang's KV plan; the verify graphs of the schedule's
other windows are not counted: they depend on the attention backend), and the drafter context per KV token (inside SGLang's
KV plan, beside the target's own KV). The shapes are the released drafters' (model cards; `SHAPES` below); the weight count
is that of the DFlash tensors plus `mode_embed` and the `mode_gate` linear (K x H + K) of the MFD cards,
which matches the cards' parameter counts (tests/test_memory_plan.py).
"""

from __future__ import annotations

import argparse
import math

from dataclasses import replace

from mfd_sglang.checkpoint import expected_shapes, parse_drafter_config
from mfd_sglang.serving.budget.playable import fixed_playable, schedule_playable
from mfd_sglang.serving.budget.rule import Path
from mfd_sglang.serving.budget.schedule import BudgetSchedule, RoundModel
from mfd_sglang.serving.launch.memory import draft_graph_buffer_bytes, memory_plan
from mfd_sglang.serving.launch.options import DEFAULT_SWITCH_THRESHOLD, budget_from_num_draft_tokens

# Released drafters by target (z-lab's DFlash drafter and the MFD card fine-tuned from it share the shape).
SHAPES = {
    "Qwen3-4B": {"hidden_size": 2560, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936,
                 "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}},
    "Qwen3-8B": {"hidden_size": 4096, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936,
                 "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33]}},
    # Qwen3.5-4B's attention shape (16 / 4 heads of 256) and MLP 9216; its vocabulary of 248320.
    "Qwen3.5-4B": {"hidden_size": 2560, "num_hidden_layers": 6, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "head_dim": 256, "intermediate_size": 9216, "vocab_size": 248320,
                   "dflash_config": {"target_layer_ids": [1, 5, 9, 13, 17, 21, 25, 29]}},
}
# The targets' text configs (what the budget schedule reads: layer shapes, depth, vocabulary); Qwen3.5-4B's layers
# counted as dense attention layers, as the schedule counts a hybrid's.
TARGETS = {
    "Qwen3-4B": {"hidden_size": 2560, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936},
    "Qwen3-8B": {"hidden_size": 4096, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
                 "head_dim": 128, "intermediate_size": 12288, "vocab_size": 151936},
    "Qwen3.5-4B": {"hidden_size": 2560, "num_hidden_layers": 32, "num_attention_heads": 16, "num_key_value_heads": 4,
                   "head_dim": 256, "intermediate_size": 9216, "vocab_size": 248320},
}
DEFAULT_NUM_DRAFT_TOKENS = 65  # MFD's launch budget on CUDA (B = 64), the schedule's largest
NUM_MODES = 8  # the MFD cards' K
MASK_TOKEN = {"mask_token_id": 0}  # the config parser needs one; the plan does not read it


def drafter_config(raw: dict):
    return parse_drafter_config({**raw, "dflash_config": {**raw["dflash_config"], **MASK_TOKEN},
                                 "mfd_config": {"num_modes": NUM_MODES}})


def drafter_parameters(raw: dict, num_modes: int) -> int:
    """Floating-point parameters of a released MFD drafter of this config: the DFlash tensors, `mode_embed`
    [K, H] and the `mode_gate` linear [K, H] + [K]."""
    cfg = drafter_config(raw)
    dflash = sum(math.prod(shape) for shape in expected_shapes(cfg).values())
    return dflash + num_modes * cfg.hidden_size + num_modes * cfg.hidden_size + num_modes


def plan_rows(max_running_requests: int, num_draft_tokens: int | None, num_modes: int | None, fp8_draft: bool,
              algorithm: str = "MFD") -> list[dict]:
    """A row per target (module docstring); num_draft_tokens None: the default schedule of `algorithm`."""
    gib = 2**30
    rows = []
    for target, raw in SHAPES.items():
        cfg = drafter_config(raw)
        budget = budget_from_num_draft_tokens(num_draft_tokens or DEFAULT_NUM_DRAFT_TOKENS)
        plan = memory_plan(cfg, drafter_parameters(raw, NUM_MODES), dtype_bytes=2, budget=budget,
                           vocab=cfg.vocab_size, num_modes=num_modes, draft_quantization="fp8" if fp8_draft else None)
        schedule = None
        if num_draft_tokens is None:
            schedule = BudgetSchedule(RoundModel.of(cfg, TARGETS[target], num_modes=num_modes), budget,
                                      max_running_requests, k_path=Path(),
                                      switch_threshold=DEFAULT_SWITCH_THRESHOLD if algorithm == "MFD_D" else None)
        # What each batch-size bucket plays, as the server's worker computes it (`budget.playable`); the draft
        # graphs' buffers as on CUDA.
        playable = (schedule_playable(schedule) if schedule is not None else fixed_playable(
            max_running_requests, budget, switch_threshold=DEFAULT_SWITCH_THRESHOLD if algorithm == "MFD_D" else None))
        plan = replace(plan, rounds=playable.rounds(plan.num_modes), draft_graph_bytes=sum(
            draft_graph_buffer_bytes(bs, arm.budget) for bs, arm in playable.pairs()))
        bs = max_running_requests
        (n_draft, draft), (n_verify, verify) = plan.largest_draft(bs), plan.largest_verify(bs)
        rows.append({"target": target, "parameters_M": drafter_parameters(raw, NUM_MODES) / 1e6,
                     "largest_round": f"{n_draft} x B {draft.budget} / {n_verify} x B {verify.budget}",
                     "weights_GiB": plan.weight_bytes / gib, "draft_GiB": draft.draft_bytes(n_draft) / gib,
                     "verify_GiB": verify.verify_bytes(n_verify) / gib, "outside_kv_plan_GiB": plan.extra_bytes(bs) / gib,
                     "context_KiB_per_token": plan.context_bytes_per_token / 2**10})
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-running-requests", type=int, default=48, help="as the server flag (MFD's default 48)")
    parser.add_argument("--num-draft-tokens", type=int, default=None,
                        help="--speculative-num-draft-tokens: a fixed tree budget B + 1 (default: none given, the "
                             "budget schedule up to B = 64, as on CUDA)")
    parser.add_argument("--algorithm", choices=("MFD", "MFD_D"), default="MFD",
                        help="the schedule's paths: MFD's K modes, or MFD_D's single mode from 3 requests")
    parser.add_argument("--num-modes", type=int, default=None, help="--mfd-num-modes K' (default all 8)")
    parser.add_argument("--fp8-draft", action="store_true",
                        help="--speculative-draft-model-quantization fp8 (drafter linears in e4m3)")
    args = parser.parse_args(argv)
    budget = ("the default budget schedule (B <= 64)" if args.num_draft_tokens is None
              else f"B = {budget_from_num_draft_tokens(args.num_draft_tokens)}")
    print(f"{args.algorithm}, bf16, {budget}, {args.max_running_requests} running requests, "
          f"K = {args.num_modes or NUM_MODES}{', FP8 drafter linears' if args.fp8_draft else ''}")
    print("| target | drafter params | largest rounds (draft / verify) | weights | draft + tree | verify | outside SGLang's KV plan | "
          "drafter context per token |")
    print("|---|---|---|---|---|---|---|---|")
    for r in plan_rows(args.max_running_requests, args.num_draft_tokens, args.num_modes, args.fp8_draft,
                       args.algorithm):
        print(f"| {r['target']} | {r['parameters_M']:,.0f}M | {r['largest_round']} | {r['weights_GiB']:.2f} GiB | "
              f"{r['draft_GiB']:.2f} GiB | {r['verify_GiB']:.2f} GiB | {r['outside_kv_plan_GiB']:.2f} GiB | "
              f"{r['context_KiB_per_token']:.0f} KiB |")


if __name__ == "__main__":
    main()
