"""Measured allocations of one MFD draft + tree round against `mfd_sglang.serving.launch.memory`'s plan.

    python benchmarks/draft_memory.py --batch-sizes 1 2 4            # on CPU (or --device cuda)
    python benchmarks/draft_memory.py --batch-sizes 1 --full          # the old full-vocabulary path

A random drafter of the released Qwen3-4B drafter's shape (5 layers of 2560, 32 / 8 heads of 128,
MLP 9728, block 16, K = 8 modes, vocabulary 151936, bf16), tree budget 64, 64-token contexts, runs the
serving path's draft (`MFDDrafter.block_candidates` over a `DraftContextPool`) + `build_mixture_tree`
+ `tree_to_verify_layout` once to warm up, then once measured: on CUDA the peak of
`torch.cuda.max_memory_allocated` above the resident tensors, on CPU the peak resident set above its
level before the round (VmHWM after resetting it through /proc/self/clear_refs; run with
MALLOC_MMAP_THRESHOLD_=65536, which this script sets for itself, so that freed blocks leave the RSS).
Each batch size runs in a fresh process. Prints one JSON line per batch size: measured, planned.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

QWEN3_4B_DRAFTER = {
    "hidden_size": 2560, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "intermediate_size": 9728, "vocab_size": 151936, "block_size": 16,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "mfd_config": {"num_modes": 8},
}
BUDGET, CONTEXT = 64, 64


def _resident_bytes(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measure(bs: int, device: str, full: bool) -> dict:
    """One draft + tree round at batch bs in this process: {"measured": bytes, "planned": bytes}."""
    import torch

    from mfd_sglang.checkpoint import parse_drafter_config
    from mfd_sglang.drafter import MFDDrafter
    from mfd_sglang.serving.draft_context_pool import DraftContextPool
    from mfd_sglang.serving.launch.memory import memory_plan
    from mfd_sglang.tree import build_mixture_tree
    from mfd_sglang.tree_layout import tree_to_verify_layout

    cfg = parse_drafter_config(QWEN3_4B_DRAFTER)
    dtype = torch.bfloat16
    backend = "triton" if device.startswith("cuda") else "torch"  # as a server's --mfd-kernels auto
    # joined as the serving stage holds it (DraftStage): its products read the weights in place
    drafter = MFDDrafter(cfg, context_features=len(cfg.target_layer_ids) * cfg.hidden_size).to(device, dtype)
    drafter.join_projections(backend)
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    embed = torch.empty(vocab, hidden, device=device, dtype=dtype).normal_(std=0.02)
    head = torch.empty(vocab, hidden, device=device, dtype=dtype).normal_(std=0.02)
    pool = DraftContextPool(drafter, bs * CONTEXT + 1, device=device, dtype=dtype)
    req_to_token = torch.arange(bs * CONTEXT, dtype=torch.int32, device=device).view(bs, CONTEXT)
    requests = torch.arange(bs, device=device)
    lens = torch.full((bs,), CONTEXT - 20, device=device)
    roots = torch.zeros(bs, dtype=torch.long, device=device)

    def round_():
        with torch.inference_mode():
            context = pool.paged(req_to_token, requests, lens, backend)
            if full:
                drafted = drafter.block_logprobs(roots, lens, context, embed, head)
            else:
                drafted = drafter.block_candidates(roots, lens, context, embed, head, BUDGET, backend=backend)
            tree = build_mixture_tree(drafted, BUDGET, backend=backend)
            tree_to_verify_layout(tree, roots, lens, backend)

    round_()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        round_()
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = _resident_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak resident set (VmHWM) to the current one
        round_()
        measured = _resident_bytes("VmHWM") - base
    weights = sum(p.numel() for p in drafter.parameters())
    plan = memory_plan(cfg, weights, dtype_bytes=2, budget=BUDGET, vocab=vocab)
    return {"bs": bs, "device": device, "path": "full" if full else "chunked", "measured": measured,
            "planned": plan.draft_bytes(bs)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--full", action="store_true", help="draft the full [bs, K, D, V] log-probs (before)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure this bs
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one, args.device, args.full)), flush=True)
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    for bs in args.batch_sizes:
        cmd = [sys.executable, __file__, "--one", str(bs), "--device", args.device] + (["--full"] if args.full else [])
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
        row = json.loads(out.strip().splitlines()[-1])
        row["ratio"] = round(row["planned"] / row["measured"], 2)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
