"""Acceptance evaluation by replay: chain vs DDTree (single-mode drafter) vs MFD, per budget.

Every method emits the same tokens: the target's own continuation of the prompt (greedy at T = 0;
at T > 0 plain sampling with the coin of (the request's seed, the position), see acceptance.py). So a
round's outcome depends only on where it starts: the tree drafted at that committed length and the
continuation after it. The evaluation therefore decodes each prompt once with the target alone
(`continue_prompt`, keeping its hidden states), drafts at every position a round can start from
(`drafts_at_round_starts`), walks each method's tree there against the continuation
(`round_outcomes`, with acceptance.py's own `accept_path`), and follows each method's rounds from the
first start (`walk`). These are the reference engine's rounds, round for round (tests/test_evaluate.py
holds them equal), for one target decode plus the drafting instead of a verify forward of B + 1
tokens per round, method and budget. Speed is not measured here (benchmarks/hf_speed.py times the
engine).

Reported per set, method and budget:
  - tau: mean tokens per round (accepted draft tokens + the bonus);
  - chimera share of the single-mode tree: a valid node is a chimera when (1) its path is not a
    prefix of the continuation from that root, (2) every token of the path is the argmax of some MFD
    mode at its depth, and (3) no single mode's argmax chain holds the whole path, i.e. the path
    splices two or more modes' futures. Share = chimeras / valid nodes;
  - covered mass: the expected number of tree-path tokens a future drawn from the drafter's own
    mode mixture would match, sum over nodes u of sum_k pi_k prod_i q_k,i(u_i) (pi: the mode gate's
    weights, 1/K each without a gate);
  - mode usage of MFD: the effective number of modes, exp(entropy) of the best modes of accepted
    nodes (K when every mode is used equally, 1 when one mode does all the work).

An MFD drafter with a mode gate is replayed twice from the same draft: "mfd" weighs the modes by the
gate, as every engine does, and "mfd_uniform" builds the same drafter's unweighted tree (the rule of a
drafter without a gate).

With `fp8`, every method is replayed a second time with FP8 copies of both drafters (attention and MLP
linears in e4m3, `MFDDrafter.quantize_linears_fp8`: what a server with
--speculative-draft-model-quantization fp8 drafts with) over the same continuations; the output is the
target's either way, so the two differ only in what the drafters propose.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..drafter import DraftContext, MFDDrafter, context_features
from ..hf import SamplingParams, batch_sampling
from ..tree import DraftTree, build_chain, build_mixture_tree, top_candidates, weigh_modes
from ..tree_layout import with_root
from ..acceptance import Sampling, accept_path, sample_from_logits


@dataclass
class Continuation:
    """A prompt and the target's own continuation of it (ended by an EOS token or the token limit)."""

    prompt_len: int
    sequence: list[int]  # prompt + continuation
    hidden_states: tuple[torch.Tensor, ...]  # the target's (HF) hidden states of sequence[:-1], each [1, S, H]
    # The target's tokens after the end, as the engine's last verify sees them (past an EOS too): a
    # tree may match them, though its round emits nothing beyond the end.
    lookahead: list[int] = field(default_factory=list)

    @property
    def round_starts(self) -> range:
        """The committed lengths L a round can start from: root sequence[L], and a token left after it."""
        return range(self.prompt_len, len(self.sequence) - 1)


@dataclass
class RoundOutcome:
    """What one method's tree, drafted at one round start, does against the continuation."""

    emitted: int  # accepted draft tokens + the bonus, cut at the continuation's end
    valid_nodes: int
    accepted_modes: list[int]  # best mode of each accepted node
    covered_mass: float
    chimeras: int = 0  # counted for the single-mode tree only


@dataclass
class RoundTally:
    """A method's rounds added up: the numbers every acceptance evaluation (this one, make-multimodal's)
    reports of them."""

    tokens: int = 0  # emitted: accepted draft tokens + the bonus
    rounds: int = 0
    valid_nodes: int = 0
    chimeras: int = 0
    accepted_modes: Counter = field(default_factory=Counter)  # best mode of each accepted node: count

    def add_round(self, emitted: int, valid_nodes: int, chimeras: int, accepted_modes: list[int]) -> None:
        self.tokens += emitted
        self.rounds += 1
        self.valid_nodes += valid_nodes
        self.chimeras += chimeras
        self.accepted_modes.update(accepted_modes)

    @property
    def tau(self) -> float | None:
        """Mean tokens per round; None without rounds."""
        return self.tokens / self.rounds if self.rounds else None

    def per_round(self, total: float) -> float:
        """total / rounds (total itself without rounds)."""
        return total / max(self.rounds, 1)

    @property
    def chimera_share(self) -> float | None:
        """Chimeras / valid nodes; None without valid nodes."""
        return self.chimeras / self.valid_nodes if self.valid_nodes else None

    @property
    def effective_modes(self) -> float:
        """exp(entropy) of the accepted nodes' best modes: K when K modes share the work equally, 1 when one
        mode does it all (or nothing was accepted)."""
        usage = sum(self.accepted_modes.values())
        entropy = -sum(c / usage * math.log(c / usage) for c in self.accepted_modes.values()) if usage else 0.0
        return math.exp(entropy)


@dataclass
class MethodStats(RoundTally):
    covered_mass: float = 0.0

    def add(self, outcome: RoundOutcome) -> None:
        self.add_round(outcome.emitted, outcome.valid_nodes, outcome.chimeras, outcome.accepted_modes)
        self.covered_mass += outcome.covered_mass

    def summary(self) -> dict:
        return {
            "tau": self.per_round(self.tokens),  # 0.0 without rounds: the table formats a number
            "covered_mass": self.per_round(self.covered_mass),
            "chimera_share": self.chimera_share,
            "effective_modes": self.effective_modes,
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


def covered_mass(logprobs: torch.Tensor, paths: torch.Tensor, valid: torch.Tensor, to_draft_ids,
                 log_prior: torch.Tensor | None = None) -> float:
    """Expected matched path tokens under the drafter's mode mixture ([K, D, V] log-probs, unweighted;
    log_prior [K]: the mode weights, uniform when None).

    to_draft_ids maps target ids to the log-probs' vocabulary, -1 outside it (such a path has mass 0)."""
    on_path = paths >= 0
    ids = to_draft_ids(paths.clamp(min=0))
    outside = ((ids < 0) & on_path).any(dim=-1)
    depth = torch.arange(paths.shape[1], device=paths.device)
    per_token = logprobs[:, depth[None, :], ids.clamp(min=0)]  # [K, N, depth]
    path_logprob = torch.where(on_path, per_token, 0.0).sum(dim=-1)  # [K, N]
    mass = path_logprob.exp().mean(dim=0) if log_prior is None else (path_logprob + log_prior[:, None]).exp().sum(0)
    return float(mass[valid & ~outside].sum())


def chimera_count(paths: torch.Tensor, valid: torch.Tensor, mode_chains: torch.Tensor, future: list[int]) -> int:
    """Chimeras among valid nodes (see the module docstring); mode_chains [K, >= depth] MFD argmax tokens."""
    on_path = paths >= 0  # [N, depth]
    depth = paths.shape[1]
    hits = paths[None] == mode_chains[:, None, :depth]  # [K, N, depth]
    on_some_mode = (hits.any(dim=0) | ~on_path).all(dim=-1)
    on_one_mode = (hits | ~on_path).all(dim=-1).any(dim=0)
    prefix = torch.full((depth,), -1, dtype=paths.dtype, device=paths.device)
    prefix[: min(depth, len(future))] = torch.tensor(future[:depth], dtype=paths.dtype, device=paths.device)
    on_future = ((paths == prefix) | ~on_path).all(dim=-1)
    return int((valid & ~on_future & on_some_mode & ~on_one_mode).sum())


@torch.inference_mode()
def continue_prompt(target, prompt: list[int], max_new: int, eos: set[int],
                    sampling: Sampling | None = None, lookahead: int = 0) -> Continuation:
    """Plain decoding of the target (KV cache, batch 1): greedy, or one draw per token with the coin of
    (sampling.seeds[0], the position before it) under sampling's law, as the engine draws every token.
    The continuation ends after an `eos` token or max_new tokens; `lookahead` more tokens follow."""
    device = next(target.parameters()).device
    cache = DynamicCache(config=target.config)
    sequence, steps = list(prompt), []
    end = None
    ids = torch.tensor([sequence], device=device)
    while end is None or len(sequence) < end + lookahead:
        out = target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        steps.append(out.hidden_states)
        logits = out.logits[:, -1].float()
        if sampling is None:
            token = int(logits.argmax())
        else:
            token = int(sample_from_logits(logits, sampling, torch.tensor([len(sequence) - 1], device=device)))
        sequence.append(token)
        if end is None and (len(sequence) - len(prompt) >= max_new or token in eos):
            end = len(sequence)
        ids = torch.tensor([[token]], device=device)
    hidden = tuple(torch.cat(layer, dim=1)[:, : end - 1] for layer in zip(*steps))
    return Continuation(len(prompt), sequence[:end], hidden, sequence[end:])


@torch.inference_mode()
def drafts_at_round_starts(target, drafter: MFDDrafter, cont: Continuation, *, single_mode: bool,
                           chunk: int = 16):
    """Yields (starts [n], log-probs [n, K', D, Vd], mode log-prior [n, K'] or None) over the
    continuation's round starts, `chunk` at a time: the block the drafter writes at committed length L,
    over the context of sequence[:L], as the engine drafts it (the context's keys and values are
    computed once and masked per start). The log-probs are unweighted: `weigh_modes(logprobs, log_prior)`
    is what the engine's tree reads (`MFDDrafter.block_logprobs`)."""
    device = next(target.parameters()).device
    features = context_features(cont.hidden_states, drafter.cfg.target_layer_ids)
    slots = torch.arange(features.shape[1], device=device)[None]
    context = drafter.context_kv(features, slots)
    sequence = torch.tensor(cont.sequence, device=device)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    starts_all = torch.tensor(cont.round_starts, device=device)
    for starts in starts_all.split(chunk):
        n = starts.shape[0]
        masked = DraftContext([k.expand(n, -1, -1, -1) for k in context.keys],
                              [v.expand(n, -1, -1, -1) for v in context.values],
                              slots.expand(n, -1), slots < starts[:, None])
        hidden, log_prior = drafter.block_hidden(sequence[starts], starts, masked, embed, single_mode=single_mode)
        yield starts, drafter.logprobs(hidden, head), log_prior


def round_outcomes(tree: DraftTree, logprobs: torch.Tensor, starts: torch.Tensor, cont: Continuation,
                   drafter: MFDDrafter, mode_chains: torch.Tensor | None = None,
                   log_prior: torch.Tensor | None = None) -> list[RoundOutcome]:
    """Each row's outcome: tree [n, N] (target ids) drafted from log-probs [n, K', D, Vd] (unweighted; mode
    weights log_prior [n, K'] or None) at round starts [n]. A node at depth d is matched against the
    continuation's token d + 1 places after the root, exactly what the target draws there; mode_chains
    [n, K, D]: count chimeras against them."""
    width = int(tree.depths.max()) + 1  # the root's token and one per depth
    sequence = torch.tensor(cont.sequence + cont.lookahead + [-1] * width, device=starts.device)
    futures = sequence[starts[:, None] + 1 + torch.arange(width, device=starts.device)]  # -1 past the end
    result = accept_path(tree, futures.gather(1, with_root(0, tree.depths)))
    outcomes = []
    for row, start in enumerate(starts.tolist()):
        local = result.accepted_local_indices[row]
        paths, valid = node_paths(tree, row), tree.valid[row]
        future = cont.sequence[start + 1:]
        outcomes.append(RoundOutcome(
            emitted=min(int(result.accept_lens[row]), len(future)),
            valid_nodes=int(valid.sum()),
            accepted_modes=tree.modes[row, local[local >= 0] - 1].tolist(),
            covered_mass=covered_mass(logprobs[row], paths, valid, drafter.to_draft_ids,
                                      None if log_prior is None else log_prior[row]),
            chimeras=0 if mode_chains is None else chimera_count(paths, valid, mode_chains[row], future)))
    return outcomes


def walk(outcomes: dict[int, RoundOutcome], cont: Continuation) -> list[RoundOutcome]:
    """A method's rounds: from the first start, each round's outcome says where the next one starts."""
    rounds, length = [], cont.prompt_len
    while length in outcomes:
        rounds.append(outcomes[length])
        length += outcomes[length].emitted
    return rounds


def prompt_outcomes(target, single: MFDDrafter, mfd: MFDDrafter, cont: Continuation,
                    budgets: list[int]) -> dict[tuple[str, str], dict[int, RoundOutcome]]:
    """{(method, budget): {round start: outcome}} of the chain and DDTree (the single-mode drafter's
    default path) and MFD at every budget (with a mode gate also "mfd_uniform", the same draft's
    unweighted tree), over one continuation."""
    def target_tree(drafter: MFDDrafter, tree: DraftTree) -> DraftTree:
        tree.tokens = drafter.to_target_ids(tree.tokens)
        return tree

    cells: dict = defaultdict(dict)
    chains = {}
    for starts, logprobs, log_prior in drafts_at_round_starts(target, mfd, cont, single_mode=False):
        chains.update(zip(starts.tolist(), mfd.to_target_ids(logprobs.argmax(dim=-1))))
        rules = {"mfd": log_prior} if log_prior is None else {"mfd": log_prior, "mfd_uniform": None}
        for method, weights in rules.items():
            # One vocabulary sort for every budget's tree.
            candidates = top_candidates(weigh_modes(logprobs, weights), max(budgets))
            for budget in budgets:
                tree = target_tree(mfd, build_mixture_tree(candidates, budget))
                cells[method, str(budget)].update(
                    zip(starts.tolist(), round_outcomes(tree, logprobs, starts, cont, mfd, log_prior=log_prior)))
    for starts, logprobs, _ in drafts_at_round_starts(target, single, cont, single_mode=True):
        chain = target_tree(single, build_chain(logprobs))
        cells["chain", str(single.cfg.block_size - 1)].update(
            zip(starts.tolist(), round_outcomes(chain, logprobs, starts, cont, single)))
        mode_chains = torch.stack([chains[s] for s in starts.tolist()])
        candidates = top_candidates(logprobs, max(budgets))
        for budget in budgets:
            tree = target_tree(single, build_mixture_tree(candidates, budget))
            cells["ddtree", str(budget)].update(
                zip(starts.tolist(), round_outcomes(tree, logprobs, starts, cont, single, mode_chains)))
    return cells


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


def evaluate(target, single: MFDDrafter, mfd: MFDDrafter, prompt_sets: dict[str, list[list[int]]],
             budgets: list[int], max_new: int, eos: set[int], log=print, temperature: float = 0.0,
             seed: int = 0, fp8: bool = False) -> dict:
    """Every set x method x budget: {set: {"prompts": n, method: {budget: summary}}}. At temperature > 0
    prompt i of a set is sampled with seed + i (the same continuation for every method). fp8: also the
    same with FP8 copies of both drafters, per set under "fp8" ({method: {budget: summary}})."""
    pairs = {"": (single, mfd)}
    if fp8:
        pairs["fp8"] = tuple(copy.deepcopy(d).quantize_linears_fp8() for d in (single, mfd))
    results: dict = {}
    device = next(target.parameters()).device
    depth = max(single.cfg.block_size, mfd.cfg.block_size) - 1  # the deepest tree node
    chain_budget = str(single.cfg.block_size - 1)
    for name, prompts in prompt_sets.items():
        stats: dict = {variant: defaultdict(MethodStats) for variant in pairs}
        for i, prompt in enumerate(tqdm(prompts, desc=f"eval {name}", unit="prompt", file=sys.stderr)):
            params = SamplingParams(temperature=temperature, seed=seed + i)
            sampling = None if params.greedy else batch_sampling(1, params, device)
            cont = continue_prompt(target, prompt, max_new, eos, sampling, lookahead=depth)
            for variant, drafters in pairs.items():
                for cell, outcomes in prompt_outcomes(target, *drafters, cont, budgets).items():
                    for outcome in walk(outcomes, cont):
                        stats[variant][cell].add(outcome)
        results[name] = {"prompts": len(prompts)}
        methods = tree_methods(mfd)
        for variant in pairs:
            summaries: dict = {"chain": {}, **{m: {} for m in methods}}
            for method, budget in [("chain", chain_budget)] + [(m, str(b)) for m in methods for b in budgets]:
                summaries[method][budget] = stats[variant][method, budget].summary()
                log(f"  {name:<6} {method + (' ' + variant if variant else ''):<11} B={budget:<4} "
                    f"tau {summaries[method][budget]['tau']:.2f}")
            if variant:
                results[name][variant] = summaries
            else:
                results[name].update(summaries)
    return results


def tree_methods(mfd: MFDDrafter) -> tuple[str, ...]:
    """The tree methods an evaluation reports: DDTree, MFD, and MFD's unweighted tree when it has a gate."""
    return ("ddtree", "mfd", "mfd_uniform") if mfd.mode_prior is not None else ("ddtree", "mfd")


def reported_methods(per_set: dict) -> tuple[str, ...]:
    return tuple(m for m in ("ddtree", "mfd", "mfd_uniform") if m in per_set)


def format_table(results: dict, budgets: list[int]) -> str:
    """tau per set, method and budget; chimera share and effective modes below each set."""
    w = max(len(name) for name in results) + 2

    def row(label: str, method: str, cells: list[str]) -> str:
        return f"{label:<{w}}{method:<11}" + "".join(f"{c:>16}" for c in cells)

    def cell(summary: dict) -> str:
        return f"{summary['tau']:.2f}"

    def fp8_cell(fp8: dict, base: dict) -> str:
        return f"{fp8['tau']:.2f} ({fp8['tau'] / base['tau']:.3f}x)"

    lines = [row("set", "method", [f"B={b}" for b in budgets])]
    for name, per_set in results.items():
        chain = next(iter(per_set["chain"].values()))
        lines.append(row(name, "chain", [cell(chain), "(no budget)"]))
        for method in reported_methods(per_set):
            lines.append(row("", method, [cell(per_set[method][str(b)]) for b in budgets]))
        if "fp8" in per_set:  # FP8 drafting, and its tau over the unquantized drafters'
            fp8 = per_set["fp8"]
            lines.append(row("", "chain fp8", [fp8_cell(next(iter(fp8["chain"].values())), chain), ""]))
            for method in reported_methods(fp8):
                lines.append(row("", f"{method} fp8",
                                 [fp8_cell(fp8[method][str(b)], per_set[method][str(b)]) for b in budgets]))
        shares = [per_set["ddtree"][str(b)]["chimera_share"] for b in budgets]
        lines.append(row("", "chimeras", ["-" if s is None else f"{s:.3f}" for s in shares]))
        lines.append(row("", "modes", [f"{per_set['mfd'][str(b)]['effective_modes']:.2f}" for b in budgets]))
    return "\n".join(lines)


def plot(results: dict, budgets: list[int], path: Path) -> None:
    """tau against the budget, one line per method (mean over sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    sets = list(results.values())
    chain = sum(next(iter(s["chain"].values()))["tau"] for s in sets) / len(sets)
    ax.plot(budgets, [chain] * len(budgets), "--", label="DFlash chain", color="gray")
    labels = {"ddtree": "DDTree (single-mode)", "mfd": "MFD", "mfd_uniform": "MFD, unweighted (no gate)"}
    for method in reported_methods(sets[0]):
        ax.plot(budgets, [sum(s[method][str(b)]["tau"] for s in sets) / len(sets) for b in budgets],
                marker="o", label=labels[method])
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("tree budget B")
    ax.set_ylabel("tau (tokens per round)")
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
