"""Which rule should weigh the modes? The max rule (what the engines build) against the mixture rule, on
the multimodal universe's drafters (a `make-multimodal` OUTDIR), at every cell of its evaluation.

  max      s(u) = max_k [log pi_k + sum_i log q_k,i(u_i)]: the score of the prefix's best mode;
  mixture  s(u) = log sum_k pi_k prod_i q_k,i(u_i): the drafter's own probability of the prefix.

The mixture is the covered mass itself, so its top-B tree is the best tree the drafter can know; it
is monotone along a path (an extension never adds mass), so a best-first search finds that tree
exactly (`mixture_tree`, here on the host: the engines would need a new builder, since a prefix of
the mixture's top-B need not be in any one mode's top-B and the per-mode beams no longer suffice).
Both rules see the same drafter, gate and prompts; the unweighted max rule (no gate) is run beside
them. The reference engine runs every cell (`multimodal.run_cell`), as make-multimodal does.

    python benchmarks/mode_rules.py runs/multimodal --out benchmarks/results/mode-rules-multimodal.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import itertools
import json
import sys
from pathlib import Path

import torch

from mfd_sglang.hf import SpeculativeGenerator
from mfd_sglang.lab import multimodal as mm
from mfd_sglang.tree import DraftTree

RULES = ("max", "mixture", "max_unweighted")


def mixture_tree(logprobs: torch.Tensor, budget: int) -> DraftTree:
    """The `budget` prefixes with the highest log sum_k prod_i exp(logprobs[k, i, u_i]) of one request's
    weighted log-probs [K, D, V] (log pi_k folded into depth 1), by best-first search; equal scores to the
    smaller depth first. Fields as `mfd_sglang.tree.DraftTree` ([budget], padding last); `modes` is each
    node's most probable mode (lowest index on ties), `scores` its mixture log-probability."""
    num_modes, depth, vocab = logprobs.shape
    lp = logprobs.double()
    order = itertools.count()
    heap = [(-0.0, 0, next(order), -1, 0, torch.zeros(num_modes, dtype=torch.float64))]
    nodes = []  # (token, parent node or -1, depth, score, mode)
    while heap and len(nodes) < budget:
        neg, d, _, parent, token, per_mode = heapq.heappop(heap)
        if d > 0:
            nodes.append((token, parent, d, -neg, int(per_mode.argmax())))
        if d == depth:
            continue
        here = len(nodes) - 1 if d > 0 else -1
        children = per_mode[:, None] + lp[:, d]  # [K, V]
        mixed = torch.logsumexp(children, dim=0)
        top = mixed.topk(min(budget, vocab))  # no more than `budget` children of one node can be taken
        for score, child in zip(top.values.tolist(), top.indices.tolist()):
            if score > float("-inf"):
                heapq.heappush(heap, (-score, d + 1, next(order), here, child, children[:, child]))
    pad = budget - len(nodes)
    tokens, parents, depths, scores, modes = (list(col) for col in zip(*nodes)) if nodes else ([], [], [], [], [])
    return DraftTree(
        tokens=torch.tensor(tokens + [0] * pad, dtype=torch.int64),
        parents=torch.tensor(parents + [-1] * pad, dtype=torch.int64),
        depths=torch.tensor(depths + [1] * pad, dtype=torch.int64),
        scores=torch.tensor(scores + [float("-inf")] * pad, dtype=torch.float32),
        modes=torch.tensor(modes + [0] * pad, dtype=torch.int64),
        valid=torch.tensor([True] * len(nodes) + [False] * pad))


class MixtureRuleGenerator(SpeculativeGenerator):
    """The reference engine with the mixture rule's tree (host best-first search per request)."""

    @torch.inference_mode()
    def build_tree(self, logprobs: torch.Tensor) -> DraftTree:
        trees = [mixture_tree(row.cpu(), self.budget) for row in logprobs]
        tree = DraftTree(**{f: torch.stack([getattr(t, f) for t in trees]).to(logprobs.device) for f in vars(trees[0])})
        tree.tokens = self.drafter.to_target_ids(tree.tokens)
        return tree


def compare(outdir: Path, log=print) -> dict:
    """{T: {set: {kind: {rule: {B: summary}}}}} over the OUTDIR's own evaluation prompts and settings."""
    run = mm.load_run(outdir)
    target, mfd = run.target, run.mfd
    if mfd.mode_prior is None:
        raise SystemExit(f"{outdir}/drafters/mfd has no mode gate: the two rules would weigh nothing")
    engines = {"max": lambda b: SpeculativeGenerator(target, mfd, budget=b),
               "mixture": lambda b: MixtureRuleGenerator(target, mfd, budget=b),
               "max_unweighted": lambda b: SpeculativeGenerator(target, mfd.without_mode_gate(), budget=b)}
    return mm.evaluate_engines(run, engines, log=log)


def markdown(results: dict) -> str:
    def tau(rule):
        return lambda block, b: f"{block[rule][str(b)]['tau']:.2f}"

    def mixture_over_max(block, b):
        return f"{block['mixture'][str(b)]['tau'] / block['max'][str(b)]['tau']:.3f}x"

    return mm.cell_table(results, "rule", [(f"tau {rule}", tau(rule)) for rule in RULES]
                         + [("mixture / max", mixture_over_max)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path, help="a make-multimodal OUTDIR (its MFD drafter has a mode gate)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the table as .md next to it)")
    args = parser.parse_args()
    results = compare(args.outdir, log=lambda *a: print(*a, file=sys.stderr))
    table = markdown(results)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/mode_rules.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps({"date": dt.date.today().isoformat(), "command": command,
                                        "results": results}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
