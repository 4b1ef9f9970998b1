"""Time build_mixture_tree per round for a grid of shapes (CPU or GPU).

    python benchmarks/tree_build.py --bs 1 4 --budgets 16 64 --vocab 4096 --device cpu
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from mfd_sglang.timing import mean_ms
from mfd_sglang.tree import build_mixture_tree


def time_build(bs: int, k: int, d: int, v: int, budget: int, device: str, backend: str, repeats: int,
               dtype: torch.dtype = torch.float32) -> float:
    """Mean milliseconds of one build on random drafter log-probs [bs, K, D, V]."""
    logprobs = torch.log_softmax(torch.randn(bs, k, d, v, device=device) * 3.0, dim=-1).to(dtype)
    return mean_ms(lambda: build_mixture_tree(logprobs, budget, backend=backend), device, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bs", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--modes", type=int, nargs="+", default=[8])
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--backend", default="torch")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    args = parser.parse_args()
    rows = []
    for bs, k, v, budget in itertools.product(args.bs, args.modes, args.vocab, args.budgets):
        ms = time_build(bs, k, args.depth, v, budget, args.device, args.backend, args.repeats)
        rows.append({"bs": bs, "K": k, "D": args.depth, "V": v, "B": budget, "ms": round(ms, 4),
                     "device": args.device, "backend": args.backend})
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'bs':>3} {'K':>3} {'D':>3} {'V':>7} {'B':>4} {'ms/round':>10}")
    for r in rows:
        print(f"{r['bs']:>3} {r['K']:>3} {r['D']:>3} {r['V']:>7} {r['B']:>4} {r['ms']:>10.3f}")


if __name__ == "__main__":
    main()
