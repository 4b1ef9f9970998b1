"""The paper's diagnostics of where a tree's budget goes (its Figure 3 and its fork analysis), by replay.

As in evaluate.py, each prompt is decoded once by the target alone (greedy, T = 0), and at every
position of that continuation a round could start from (an anchor: committed length L, root
sequence[L]) both drafters draft and every tree is built: DDTree (the single-mode drafter's product
tree) and MFD (the mixture tree), at each budget. Every anchor counts once (not only the anchors one
method's walk reaches), so the two methods are compared at the same anchors. Then:

  - the target scores every node of every tree in one forward per anchor chunk (the reference
    engine's verify forward, hf.SpeculativeGenerator.verify: [root, nodes] with the ancestor mask over
    the continuation's own KV before the anchor), which gives the target's probability of each
    node's last step given its path, p(u_d | context, u_1..u_{d-1}), and of its whole path, the
    product along it. Probabilities are the target's softmax (its T = 1 law), as in the paper;
  - Figure 3 left, per depth d: the share of the valid nodes at depth d whose last step the target
    takes with probability below `UNLIKELY` (1%): budget the target all but never follows;
  - Figure 3 right, per depth d: the covered target mass, the sum over the nodes at depth d of the
    target's probability of the node's path, per anchor (distinct prefixes of one depth are disjoint,
    so it is <= 1; summed over depths it is the expected number of accepted draft tokens when the
    target samples at T = 1);
  - forks: an anchor is a fork when, at one of the D steps the tree can reach (the target's
    distributions for sequence[L+1..L+D]), a token other than the one the continuation takes has
    probability >= `FORK` (10%): the runner-up leads elsewhere. Reported: the share of such anchors
    (and of the anchors whose first fork is at depth <= d), and per budget the share of MFD's gain over
    DDTree (accepted tokens + bonus at each anchor, `round_outcomes`) that the fork anchors carry;
  - beside them, this project's own numbers of the same trees (evaluate.py): the drafter's covered
    mass and the chimera share of the DDTree tree.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..drafter import MFDDrafter
from ..hf import additive_mask
from ..tree import DraftTree, build_mixture_tree, top_candidates, weigh_modes
from ..tree_layout import local_parents, tree_ancestor_mask
from .evaluate import Continuation, RoundOutcome, continue_prompt, drafts_at_round_starts, round_outcomes

UNLIKELY = 0.01  # a node's last step below this target probability is budget the target all but never takes
FORK = 0.10  # a runner-up token at least this likely makes an anchor a fork
METHODS = ("ddtree", "mfd")


@dataclass
class TargetPass:
    """The target's forward over the continuation and its lookahead: its KV, and per position whether a
    token other than the next one has probability >= FORK."""

    keys_values: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [1, heads, S, head_dim]
    fork_after: torch.Tensor  # bool [S - 1]: at position i, a token != tokens[i + 1] has p >= FORK


@torch.inference_mode()
def target_pass(target, cont: Continuation) -> TargetPass:
    tokens = cont.sequence + cont.lookahead
    device = next(target.parameters()).device
    cache = DynamicCache(config=target.config)
    out = target(torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True)
    return TargetPass([(layer.keys, layer.values) for layer in cache.layers],
                      fork_steps(out.logits[0, :-1].float(), torch.tensor(tokens[1:], device=device)))


def fork_steps(logits: torch.Tensor, taken: torch.Tensor) -> torch.Tensor:
    """bool [S]: logits [S, V] of the target at S positions, taken [S] the token each one is followed by;
    True where some other token has probability >= FORK."""
    probs = torch.softmax(logits, dim=-1)
    others = probs.scatter(1, taken[:, None], 0.0)
    return others.max(dim=-1).values >= FORK


def first_fork_depths(fork_after: torch.Tensor, starts: torch.Tensor, depth: int) -> torch.Tensor:
    """[n] the first depth d in 1..depth at which the anchor's step forks (fork_after[L + d - 1]), 0 when
    none of the steps that exist does."""
    positions = starts[:, None] + torch.arange(depth, device=starts.device)
    inside = positions < fork_after.shape[0]
    forks = fork_after[positions.clamp(max=fork_after.shape[0] - 1)] & inside
    first = forks.int().argmax(dim=1) + 1
    return torch.where(forks.any(dim=1), first, 0)


@torch.inference_mode()
def node_target_logprobs(target, tp: TargetPass, tree: DraftTree, starts: torch.Tensor,
                         roots: torch.Tensor) -> torch.Tensor:
    """[n, N] the target's log-probability of each node's token after its parent's path: one forward of
    [root, nodes] per anchor (positions L + depth, the ancestor mask) over the continuation's KV before
    L, as the engine verifies (hf.SpeculativeGenerator.verify)."""
    n, width = starts.shape[0], int(starts.max())
    cache = DynamicCache(config=target.config)
    for layer, (k, v) in enumerate(tp.keys_values):
        cache.update(k[:, :, :width].expand(n, -1, -1, -1), v[:, :, :width].expand(n, -1, -1, -1), layer)
    tree_mask = tree_ancestor_mask(tree)
    prefix = torch.arange(width, device=starts.device)[None] < starts[:, None]
    visible = torch.cat([prefix[:, None, :].expand(-1, tree_mask.shape[1], -1), tree_mask], dim=2)
    depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
    dtype = next(target.parameters()).dtype
    logits = target(torch.cat([roots[:, None], tree.tokens], dim=1), position_ids=starts[:, None] + depths,
                    attention_mask=additive_mask(visible, dtype), past_key_values=cache).logits.float()
    parents = local_parents(tree)[:, 1:]  # [n, N] the local index whose logits give each node's token
    rows = torch.arange(n, device=starts.device)[:, None]
    return logits[rows, parents, tree.tokens] - logits.logsumexp(dim=-1)[rows, parents]


def path_logprobs(tree: DraftTree, last: torch.Tensor) -> torch.Tensor:
    """[n, N] log-probability of each node's whole path: its last steps' log-probs [n, N] summed along
    its ancestors."""
    total, node = last.clone(), tree.parents
    for _ in range(int(tree.depths.max()) - 1):
        above = node >= 0
        total = total + torch.where(above, last.gather(1, node.clamp(min=0)), 0.0)
        node = torch.where(above, tree.parents.gather(1, node.clamp(min=0)), -1)
    return total


@dataclass
class TreeTally:
    """One (method, budget)'s nodes over all anchors, per depth 1..D, and its anchors' outcomes."""

    depth: int
    nodes: list[int] = field(default_factory=list)
    unlikely: list[int] = field(default_factory=list)  # nodes whose last step has target p < UNLIKELY
    target_mass: list[float] = field(default_factory=list)  # sum of the nodes' target path probabilities
    anchors: int = 0
    emitted: int = 0
    drafter_mass: float = 0.0
    chimeras: int = 0

    def __post_init__(self):
        for name in ("nodes", "unlikely", "target_mass"):
            getattr(self, name).extend([0] * (self.depth - len(getattr(self, name))))

    def add(self, tree: DraftTree, last: torch.Tensor, outcomes: list[RoundOutcome]) -> None:
        """Adds the anchors of one tree batch: last [n, N] the target's log-probs of each node's last step."""
        path_prob = path_logprobs(tree, last).exp()
        for d in range(1, self.depth + 1):
            at = tree.valid & (tree.depths == d)
            self.nodes[d - 1] += int(at.sum())
            self.unlikely[d - 1] += int((at & (last < math.log(UNLIKELY))).sum())
            self.target_mass[d - 1] += float(path_prob[at].sum())
        self.anchors += len(outcomes)
        self.emitted += sum(o.emitted for o in outcomes)
        self.drafter_mass += sum(o.covered_mass for o in outcomes)
        self.chimeras += sum(o.chimeras for o in outcomes)

    def summary(self) -> dict:
        per_anchor = lambda total: total / max(self.anchors, 1)
        valid = sum(self.nodes)
        return {
            "anchors": self.anchors,
            "tau": per_anchor(self.emitted),
            "unlikely_share": sum(self.unlikely) / max(valid, 1),
            "unlikely_share_per_depth": [u / n if n else None for u, n in zip(self.unlikely, self.nodes)],
            "nodes_per_depth": [per_anchor(n) for n in self.nodes],
            "target_mass": per_anchor(sum(self.target_mass)),
            "target_mass_per_depth": [per_anchor(m) for m in self.target_mass],
            "drafter_mass": per_anchor(self.drafter_mass),
            "chimera_share": self.chimeras / max(valid, 1),
        }


@dataclass
class ForkTally:
    """Anchors by the depth of their first fork, and per budget each method's tokens at fork and other anchors."""

    depth: int
    first_fork: list[int] = field(default_factory=list)  # [0]: no fork within depth; [d]: first fork at d
    emitted: dict = field(default_factory=dict)  # (budget, method, first fork depth or 0) -> tokens

    def __post_init__(self):
        self.first_fork.extend([0] * (self.depth + 1 - len(self.first_fork)))

    def add(self, first: torch.Tensor, per_method: dict[tuple[int, str], list[int]]) -> None:
        for d in first.tolist():
            self.first_fork[d] += 1
        for (budget, method), emitted in per_method.items():
            for e, d in zip(emitted, first.tolist()):
                key = (budget, method, d)
                self.emitted[key] = self.emitted.get(key, 0) + e

    def summary(self, budgets: list[int]) -> dict:
        anchors = sum(self.first_fork)
        forks = anchors - self.first_fork[0]
        within, seen = [], 0
        for count in self.first_fork[1:]:
            seen += count
            within.append(seen / max(anchors, 1))
        gains = {}
        for budget in budgets:
            tokens = {m: [self.emitted.get((budget, m, d), 0) for d in range(self.depth + 1)] for m in METHODS}
            by_depth = [a - b for a, b in zip(tokens["mfd"], tokens["ddtree"])]  # [0]: anchors without a fork
            total, gain_fork = sum(by_depth), sum(by_depth[1:])
            gains[str(budget)] = {
                "gain_tokens": total,
                "gain_tokens_at_forks": gain_fork,
                "gain_share_at_forks": gain_fork / total if total else None,
                "gain_tokens_by_first_fork_depth": by_depth,
                "tau_at_forks": {m: sum(tokens[m][1:]) / max(forks, 1) for m in METHODS},
                "tau_elsewhere": {m: tokens[m][0] / max(anchors - forks, 1) for m in METHODS},
            }
        return {"anchors": anchors, "fork_share": forks / max(anchors, 1), "fork_share_within_depth": within,
                "per_budget": gains}


def tree_at(drafter: MFDDrafter, logprobs: torch.Tensor, log_prior, budgets: list[int]) -> dict[int, DraftTree]:
    """{budget: the tree an engine builds from the draft (target ids)}: evaluate.prompt_outcomes's rule."""
    candidates = top_candidates(weigh_modes(logprobs, log_prior), max(budgets))
    trees = {}
    for budget in budgets:
        tree = build_mixture_tree(candidates, budget)
        tree.tokens = drafter.to_target_ids(tree.tokens)
        trees[budget] = tree
    return trees


def prefix_of(small: DraftTree, big: DraftTree) -> bool:
    """Whether `small`'s nodes are `big`'s first nodes (trees are in rank order: a smaller budget's tree
    usually is), so their target log-probs can be read from big's forward."""
    b = small.tokens.shape[1]
    return all(bool((getattr(small, f) == getattr(big, f)[:, :b]).all()) for f in ("tokens", "parents", "valid"))


def diagnose_prompt(target, single: MFDDrafter, mfd: MFDDrafter, cont: Continuation, budgets: list[int],
                    groups: list[tuple[dict, ForkTally]]) -> None:
    """Adds one continuation's anchors to each group's tallies {(method, budget): TreeTally} and forks."""
    tp = target_pass(target, cont)
    sequence = torch.tensor(cont.sequence, device=tp.fork_after.device)
    drafts = zip(drafts_at_round_starts(target, mfd, cont, single_mode=False),
                 drafts_at_round_starts(target, single, cont, single_mode=True))
    for (starts, mfd_logprobs, log_prior), (_, single_logprobs, _) in drafts:
        chains = mfd.to_target_ids(mfd_logprobs.argmax(dim=-1))  # the chimera count's mode chains
        emitted: dict = {}
        for method, drafter, logprobs, prior in (("ddtree", single, single_logprobs, None),
                                                  ("mfd", mfd, mfd_logprobs, log_prior)):
            trees = tree_at(drafter, logprobs, prior, budgets)
            biggest = trees[max(budgets)]
            last_big = node_target_logprobs(target, tp, biggest, starts, sequence[starts])
            for budget, tree in trees.items():
                last = last_big[:, :budget] if prefix_of(tree, biggest) else \
                    node_target_logprobs(target, tp, tree, starts, sequence[starts])
                outcomes = round_outcomes(tree, logprobs, starts, cont, drafter,
                                          chains if method == "ddtree" else None, prior)
                emitted[budget, method] = [o.emitted for o in outcomes]
                for tallies, _ in groups:
                    tallies[method, budget].add(tree, last, outcomes)
        first = first_fork_depths(tp.fork_after, starts, groups[0][1].depth)
        for _, forks in groups:
            forks.add(first, emitted)


def diagnose(target, single: MFDDrafter, mfd: MFDDrafter, prompt_sets: dict[str, list[list[int]]],
             budgets: list[int], max_new: int, eos: set[int]) -> dict:
    """{set name, and "all" over the sets: {"prompts", "forks": ForkTally summary, "trees": {method: {budget:
    TreeTally summary}}}} over every anchor of every prompt's greedy continuation."""
    depth = max(single.cfg.block_size, mfd.cfg.block_size) - 1
    groups = {name: ({(m, b): TreeTally(depth) for m in METHODS for b in budgets}, ForkTally(depth))
              for name in [*prompt_sets, "all"]}
    with tqdm(total=sum(map(len, prompt_sets.values())), desc="diagnose", unit="prompt", file=sys.stderr) as bar:
        for name, prompts in prompt_sets.items():
            for prompt in prompts:
                cont = continue_prompt(target, prompt, max_new, eos, lookahead=depth)
                diagnose_prompt(target, single, mfd, cont, budgets, [groups[name], groups["all"]])
                bar.update()
    return {name: {"prompts": len(prompt_sets[name]) if name in prompt_sets else sum(map(len, prompt_sets.values())),
                   "forks": forks.summary(budgets),
                   "trees": {m: {str(b): tallies[m, b].summary() for b in budgets} for m in METHODS}}
            for name, (tallies, forks) in groups.items()}


def format_table(results: dict, budgets: list[int]) -> str:
    """Markdown: per group, the fork numbers and per method and budget the paper's and this project's tree
    numbers; then the per-depth rows (Figure 3) at the largest budget."""
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"
    lines = []
    for name, group in results.items():
        forks = group["forks"]
        within = forks["fork_share_within_depth"]
        lines += [f"### {name}: {group['prompts']} prompts, {forks['anchors']} anchors", "",
                  f"Anchors with a runner-up >= {FORK:.0%} within the tree's depth: {pct(forks['fork_share'])} "
                  f"(at depth 1: {pct(within[0])}, within 2: {pct(within[1])}, within 4: {pct(within[3])}).", "",
                  "| B | method | tau at every anchor | last step p < 1% | target mass | drafter mass | chimeras "
                  "| tau at forks | tau elsewhere | MFD gain at forks |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for b in budgets:
            gain = forks["per_budget"][str(b)]
            for m in METHODS:
                t = group["trees"][m][str(b)]
                share = "" if m == "ddtree" else \
                    f"{gain['gain_tokens_at_forks']} of {gain['gain_tokens']} tokens ({pct(gain['gain_share_at_forks'])})"
                lines.append(f"| {b} | {m} | {t['tau']:.3f} | {pct(t['unlikely_share'])} | {t['target_mass']:.3f} "
                             f"| {t['drafter_mass']:.3f} | {pct(t['chimera_share']) if m == 'ddtree' else ''} "
                             f"| {gain['tau_at_forks'][m]:.3f} | {gain['tau_elsewhere'][m]:.3f} | {share} |")
        b = str(max(budgets))
        depths = [d for d, n in enumerate(group["trees"]["ddtree"][b]["nodes_per_depth"], 1)
                  if n or group["trees"]["mfd"][b]["nodes_per_depth"][d - 1]]
        lines += ["", f"Per depth at B = {b} (nodes per anchor; share of them with last step p < 1%; target mass):", "",
                  "| depth | " + " | ".join(map(str, depths)) + " |", "|---|" + "---|" * len(depths)]
        for m in METHODS:
            t = group["trees"][m][b]
            lines.append(f"| {m} nodes | " + " | ".join(f"{t['nodes_per_depth'][d - 1]:.1f}" for d in depths) + " |")
            lines.append(f"| {m} p < 1% | " + " | ".join(pct(t['unlikely_share_per_depth'][d - 1]) for d in depths) + " |")
            lines.append(f"| {m} mass | " + " | ".join(f"{t['target_mass_per_depth'][d - 1]:.3f}" for d in depths) + " |")
        lines.append("")
    return "\n".join(lines)


def write_results(results: dict, path: Path, command: str, budgets: list[int]) -> None:
    """JSON at path, the Markdown table next to it (.md)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.date.today().isoformat(), "command": command, "budgets": budgets, "temperature": 0.0,
               "unlikely": UNLIKELY, "fork": FORK, "results": results}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    path.with_suffix(".md").write_text(f"`{command}`\n\n{format_table(results, budgets)}\n")
