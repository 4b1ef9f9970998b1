"""Acceptance evaluation on the reference engine: chain vs DDTree (single-mode drafter) vs MFD.

For each prompt set, method and budget: mean tau (tokens per verify round) and the speed-up over
plain autoregressive decoding (greedy) measured in the same run, at temperature T (0: greedy; T > 0:
the target's law, lossless, each prompt seeded alike for every method). Also:
  - chimera share of the single-mode tree: a valid node is a chimera when (1) its path is not a
    prefix of the continuation the run emitted from that root (the target's greedy one at T = 0),
    (2) every token of the path is the argmax of some MFD mode at its depth, and (3) no single mode's
    argmax chain holds the whole path, i.e. the path splices two or more modes' futures.
    Share = chimeras / valid nodes.
  - covered mass: the expected number of tree-path tokens a future drawn from the drafter's own
    mode mixture would match, sum over nodes u of (1/K) sum_k prod_i q_k,i(u_i).
  - mode usage of MFD: the effective number of modes, exp(entropy) of the best modes of accepted
    nodes (K when every mode is used equally, 1 when one mode does all the work).
"""

from __future__ import annotations

import datetime as dt
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..drafter import MFDDrafter, context_features
from ..hf import SamplingParams, SpeculativeGenerator
from ..tree import DraftTree


@dataclass
class MethodStats:
    tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0
    valid_nodes: int = 0
    chimeras: int = 0
    covered_mass: float = 0.0
    accepted_modes: Counter = field(default_factory=Counter)

    def summary(self, ar_tokens_per_second: float | None) -> dict:
        usage = sum(self.accepted_modes.values())
        entropy = -sum(c / usage * math.log(c / usage) for c in self.accepted_modes.values()) if usage else 0.0
        return {
            "tau": self.tokens / max(self.rounds, 1),
            "speedup": self.tokens / self.seconds / ar_tokens_per_second if self.seconds and ar_tokens_per_second else None,
            "covered_mass": self.covered_mass / max(self.rounds, 1),
            "chimera_share": self.chimeras / self.valid_nodes if self.valid_nodes else None,
            "effective_modes": math.exp(entropy),
            "rounds": self.rounds,
        }


def node_paths(tree: DraftTree, row: int) -> torch.Tensor:
    """[N, D] token path of every node of one tree row (-1 past the node's depth)."""
    parents, tokens, depths = tree.parents[row], tree.tokens[row], tree.depths[row]
    depth = int(depths.max())
    paths = torch.full((parents.shape[0], depth), -1, dtype=torch.long, device=tokens.device)
    node = torch.arange(parents.shape[0], device=tokens.device)
    level = depths - 1
    # Walk every node up to the root at once, writing the token of the node reached at its depth.
    for _ in range(depth):
        alive = node >= 0
        safe = node.clamp(min=0)
        paths[alive, level[alive]] = tokens[safe][alive]
        level = level - 1
        node = torch.where(alive, parents[safe], -1)
    return paths


def covered_mass(logprobs: torch.Tensor, paths: torch.Tensor, valid: torch.Tensor, to_draft_ids) -> float:
    """Expected matched path tokens under the drafter's uniform mode mixture ([K, D, V] log-probs).

    to_draft_ids maps target ids to the log-probs' vocabulary, -1 outside it (such a path has mass 0)."""
    mass = 0.0
    for path in paths[valid]:
        depth = int((path >= 0).sum())
        ids = to_draft_ids(path[:depth])
        if bool((ids < 0).any()):
            continue
        path_logprob = logprobs[:, torch.arange(depth), ids].sum(-1)  # [K]
        mass += float(path_logprob.exp().mean())
    return mass


def chimera_count(paths: torch.Tensor, valid: torch.Tensor, mode_chains: torch.Tensor, future: list[int]) -> int:
    """Chimeras among valid nodes (see the module docstring); mode_chains [K, D] MFD argmax tokens."""
    count = 0
    for path in paths[valid].tolist():
        path = [t for t in path if t >= 0]
        d = len(path)
        if path == future[:d]:
            continue
        chains = mode_chains[:, :d].tolist()
        on_some_mode = all(any(chain[i] == path[i] for chain in chains) for i in range(d))
        on_one_mode = any(chain == path for chain in chains)
        count += on_some_mode and not on_one_mode
    return count


@torch.inference_mode()
def mode_argmax_chains(engine: SpeculativeGenerator, sequence: list[int], lengths: list[int]) -> torch.Tensor:
    """[rounds, K, D] argmax tokens of every MFD mode at the given committed lengths of a sequence."""
    drafter, device = engine.drafter, engine.device
    ids = torch.tensor([sequence], device=device)
    features = context_features(engine.target(ids, output_hidden_states=True).hidden_states, drafter.cfg.target_layer_ids)
    n, width = len(lengths), len(sequence)
    slots = torch.arange(width, device=device)[None].expand(n, -1)
    length = torch.tensor(lengths, device=device)[:, None]
    context = drafter.context_kv(features.expand(n, -1, -1), slots, slots < length)
    logprobs = engine.draft_blocks(ids[0, length[:, 0]], length[:, 0], context)
    return drafter.to_target_ids(logprobs.argmax(-1))


def load_inputs(target_path, single_path, mfd_path, dtype: torch.dtype, sets: list[str] | None = None,
                limit: int | None = None, prompts_file=None):
    """(target, {"single": drafter, "mfd": drafter}, {set: [chat-templated prompt ids]}, eos ids) for an
    evaluation: drafters checked against the target; prompts from the held-out split of `sets`, or the
    raw texts of `prompts_file` (a JSON list) as the one set "prompts"."""
    from transformers import AutoTokenizer

    from ..checkpoint import check_fits_target, load_drafter
    from ..hf import eos_token_ids, load_target

    drafters = {}
    for role, path in (("single", single_path), ("mfd", mfd_path)):
        ckpt = load_drafter(path)
        check_fits_target(ckpt, target_path)
        drafters[role] = MFDDrafter.from_checkpoint(ckpt, dtype=dtype)
    target = load_target(target_path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    prompt_sets = {}
    if prompts_file:
        texts = json.loads(Path(prompts_file).read_text())[:limit]
        prompt_sets["prompts"] = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        from .prompts import load_prompts

        for name in sets:
            prompt_sets[name] = [
                list(tokenizer.apply_chat_template([{"role": "user", "content": p.text}], add_generation_prompt=True,
                                                   tokenize=True, return_dict=True)["input_ids"])
                for p in load_prompts(name, split="heldout", limit=limit)
            ]
    return target, drafters, prompt_sets, eos_token_ids(tokenizer, target.config)


def run_method(engine: SpeculativeGenerator, prompts: list[list[int]], max_new: int, eos: set[int],
               chimera_reference: SpeculativeGenerator | None = None,
               params: SamplingParams | None = None, batch_size: int = 1) -> tuple[MethodStats, list[list[int]]]:
    """Generate every prompt (batch_size at a time, timed) and gather the statistics."""
    stats = MethodStats()
    outputs = []
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first : first + batch_size]
        rounds = [[] for _ in batch]  # per row: (committed length, node paths, valid) of each round

        def on_round(row, length, logprobs, tree, result):
            paths = node_paths(tree, row)
            valid = tree.valid[row]
            rounds[row].append((length, paths, valid))
            stats.valid_nodes += int(valid.sum())
            stats.covered_mass += covered_mass(logprobs[row], paths, valid, engine.drafter.to_draft_ids)
            local = result.accepted_local_indices[row]
            stats.accepted_modes.update(tree.modes[row, local[local >= 0] - 1].tolist())

        start = time.perf_counter()
        outs = engine.generate_batch(batch, max_new, params=params, eos_token_ids=eos, on_round=on_round)
        stats.seconds += time.perf_counter() - start
        for ids, out, row_rounds in zip(batch, outs, rounds):
            stats.tokens += sum(r.emitted for r in out.rounds)
            stats.rounds += len(out.rounds)
            outputs.append(out.token_ids)
            if chimera_reference is not None and row_rounds:
                sequence = list(ids) + out.token_ids
                chains = mode_argmax_chains(chimera_reference, sequence, [length for length, _, _ in row_rounds])
                for (length, paths, valid), mode_chains in zip(row_rounds, chains):
                    stats.chimeras += chimera_count(paths, valid, mode_chains, sequence[length + 1:])
    return stats, outputs


def ar_tokens_per_second(engine: SpeculativeGenerator, prompts: list[list[int]], max_new: int, eos: set[int]) -> float:
    """Plain greedy decoding speed of the engine's target over the prompts (batch 1): the baseline."""
    start = time.perf_counter()
    tokens = sum(len(engine.autoregressive(ids, max_new, eos)) for ids in prompts)
    return tokens / (time.perf_counter() - start)


def evaluate(target, single: MFDDrafter, mfd: MFDDrafter, prompt_sets: dict[str, list[list[int]]],
             budgets: list[int], max_new: int, eos: set[int], log=print, temperature: float = 0.0,
             seed: int = 0, batch_size: int = 1) -> dict:
    """Every set x method x budget; returns {set: {method: {budget: summary}}} plus the AR baseline.
    temperature > 0 samples every method with the same seed. batch_size > 1 generates that many prompts
    at once (acceptance only: the speed-ups, measured at batch 1, are None and AR is not run)."""
    params = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else None
    results: dict = {}
    for name, prompts in prompt_sets.items():
        # The single-mode drafter always drafts its default path (its only mode when K = 1).
        chain = SpeculativeGenerator(target, single, tree="chain", single_mode=True)
        ar_tps = ar_tokens_per_second(chain, prompts, max_new, eos) if batch_size == 1 else None
        set_results = {"ar_tokens_per_second": ar_tps, "prompts": len(prompts)}
        stats, _ = run_method(chain, prompts, max_new, eos, params=params, batch_size=batch_size)
        set_results["chain"] = {str(single.cfg.block_size - 1): stats.summary(ar_tps)}
        mfd_reference = SpeculativeGenerator(target, mfd)
        for method, drafter in (("ddtree", single), ("mfd", mfd)):
            set_results[method] = {}
            for budget in budgets:
                engine = SpeculativeGenerator(target, drafter, budget=budget, single_mode=method == "ddtree")
                stats, _ = run_method(engine, prompts, max_new, eos, params=params, batch_size=batch_size,
                                      chimera_reference=mfd_reference if method == "ddtree" else None)
                set_results[method][str(budget)] = stats.summary(ar_tps)
                log(f"  {name:<6} {method:<7} B={budget:<4} tau {set_results[method][str(budget)]['tau']:.2f}")
        results[name] = set_results
    return results


def format_table(results: dict, budgets: list[int]) -> str:
    """tau (speed-up, when measured) per set, method and budget; chimera share and effective modes below
    each set."""
    w = max(len(name) for name in results) + 2

    def row(label: str, method: str, cells: list[str]) -> str:
        return f"{label:<{w}}{method:<9}" + "".join(f"{c:>16}" for c in cells)

    def cell(summary: dict) -> str:
        speedup = summary["speedup"]
        return f"{summary['tau']:.2f}" + ("" if speedup is None else f" ({speedup:.2f}x)")

    lines = [row("set", "method", [f"B={b}" for b in budgets])]
    for name, per_set in results.items():
        chain = next(iter(per_set["chain"].values()))
        lines.append(row(name, "chain", [cell(chain), "(no budget)"]))
        for method in ("ddtree", "mfd"):
            lines.append(row("", method, [cell(per_set[method][str(b)]) for b in budgets]))
        shares = [per_set["ddtree"][str(b)]["chimera_share"] for b in budgets]
        lines.append(row("", "chimeras", ["-" if s is None else f"{s:.3f}" for s in shares]))
        lines.append(row("", "modes", [f"{per_set['mfd'][str(b)]['effective_modes']:.2f}" for b in budgets]))
    return "\n".join(lines)


def plot(results: dict, budgets: list[int], path: Path) -> None:
    """Speed-up over autoregressive decoding (tau when speed-ups were not measured) against the budget,
    one line per method (mean over sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    sets = list(results.values())
    metric = "tau" if next(iter(sets[0]["chain"].values()))["speedup"] is None else "speedup"
    chain = sum(next(iter(s["chain"].values()))[metric] for s in sets) / len(sets)
    ax.plot(budgets, [chain] * len(budgets), "--", label="DFlash chain", color="gray")
    for method, label in (("ddtree", "DDTree (single-mode)"), ("mfd", "MFD")):
        ax.plot(budgets, [sum(s[method][str(b)][metric] for s in sets) / len(sets) for b in budgets],
                marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget B")
    ax.set_ylabel("speed-up over autoregressive" if metric == "speedup" else "tau (tokens per round)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_json(results: dict, path: Path, command: str, budgets: list[int], temperature: float = 0.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.date.today().isoformat(), "command": command, "budgets": budgets,
               "temperature": temperature, "results": results}
    path.write_text(json.dumps(payload, indent=1) + "\n")
