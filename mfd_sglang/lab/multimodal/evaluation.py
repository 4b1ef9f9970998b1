"""Evaluation of drafters on the universe with the reference engine: per-cell tallies against the known answer
(the ideal tree, the blind ceiling, chimeras), fork rounds and what the drafters know at a fork (mode
assignment, the gate at forks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...drafter import context_features
from ...hf import SamplingParams
from ...tree import build_mixture_tree, weigh_modes
from ..evaluate import RoundTally, chimera_count, node_paths
from .universe import (
    BLOCK_SIZE,
    CUE_DISTANCE,
    FUTURE_PROBS,
    FUTURES,
    Universe,
    chimera_bound,
    covered_mass,
    ideal_covered_mass,
    prefix_masses,
    splice_chimeras,
)


DRAFT_DEPTH = BLOCK_SIZE - 1


@dataclass
class Cell(RoundTally):
    """One method at one budget on one prompt set, temperature and kind of round."""
    mass: float = 0.0  # exact expected accepted draft tokens of the trees, summed over rounds (T = 1)
    ceiling_mass: float = 0.0  # the same for the best tree of the same budget at the same contexts
    oracle_tokens: int = 0  # the best tree's realised run on the same output
    oracle_rounds: int = 0
    blind_tokens: int = 0  # the same for the best tree of the cue-blind law
    blind_rounds: int = 0
    bound_checks: int = 0  # product trees holding two futures: chimeras counted against 2^(m-1) - 1
    bound_violations: int = 0
    off_universe: int = 0  # rounds whose context the universe cannot produce (a target error before)
    multimodal_rounds: int = 0  # rounds whose drafted block can hold more than one continuation (a fork in it)
    marker_rounds: int = 0  # rounds whose root is a marker: the fork is the block's first token

    def summary(self) -> dict:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "chimera_share": self.chimera_share,
            "expected_accepted": self.per_round(self.mass),
            "ceiling_expected_accepted": self.per_round(self.ceiling_mass),
            "ceiling_tau": self.oracle_tokens / self.oracle_rounds if self.oracle_rounds else None,
            "blind_ceiling_tau": self.blind_tokens / self.blind_rounds if self.blind_rounds else None,
            "bound_checks": self.bound_checks,
            "bound_violations": self.bound_violations,
            "off_universe_rounds": self.off_universe,
            "multimodal_round_share": self.per_round(self.multimodal_rounds),
            "marker_root_share": self.per_round(self.marker_rounds),
            "effective_modes": self.effective_modes,
        }


def ideal_tree(masses: dict[tuple, float], budget: int) -> set[tuple]:
    """The best tree's node paths (ties toward ancestors, so it is prefix-closed)."""
    return set(sorted(masses, key=lambda u: (-masses[u], len(u)))[:budget])


def accepted_length(tree: set[tuple], actual: tuple) -> int:
    """Draft tokens tree verification accepts when the target continues with `actual`."""
    n = 0
    while n < len(actual) and actual[: n + 1] in tree:
        n += 1
    return n


def oracle_run(universe: Universe, seq: list[int], start: int, max_new: int, budget: int, temperature: float,
               first_round_only: bool, stop: int | None = None, *, blind: bool = False) -> tuple[int, int]:
    """(tokens, rounds) of the best tree of `budget` nodes on the output `seq` (root at `start`),
    rounds cut as the engine cuts them: at T = 1 the exact top-`budget` prefixes of the universe, at
    T = 0 the target's own continuation (a point mass), at most DRAFT_DEPTH deep; blind: at either T
    the top-`budget` prefixes of the cue-blind law (what a drafter that cannot see the cue can know).
    Rounds whose root sits at or after `stop` (the first token off the universe) are not run."""
    tokens = rounds = 0
    emitted, pos = 1, start  # the prefill emitted the root
    while emitted < max_new and (stop is None or pos < stop):
        actual = tuple(seq[pos + 1: pos + 1 + DRAFT_DEPTH])
        if temperature > 0 or blind:
            law = universe.continuations(seq[: pos + 1], DRAFT_DEPTH, blind=blind)
            tree = ideal_tree(prefix_masses(law), budget)
        else:
            tree = {actual[:d] for d in range(1, min(budget, DRAFT_DEPTH) + 1)}
        emit = min(accepted_length(tree, actual) + 1, max_new - emitted)
        tokens, rounds, emitted, pos = tokens + emit, rounds + 1, emitted + emit, pos + emit
        if first_round_only:
            break
    return tokens, rounds


def _pairs_in_tree(support: list[tuple], tree: set[tuple]):
    """For every two continuations of the support, their longest prefixes both in the tree (depth >= 2)."""
    for i, a in enumerate(support):
        for b in support[i + 1:]:
            d = min(len(a), len(b))
            while d >= 2 and not (a[:d] in tree and b[:d] in tree):
                d -= 1
            if d >= 2 and a[:d] != b[:d]:
                yield a[:d], b[:d]


def run_cell(engine, universe: Universe, prompts: list[list[int]], max_new: int, temperature: float, seed: int,
             budget: int | None, *, first_round_only: bool, product_tree: bool):
    """Generate every prompt (one batch) and measure its rounds: (Cell, the generated ids per row).

    first_round_only: only each row's first round (the fork rounds: root = a marker). A round counts
    while its context is one the universe can produce: after a target error (a token the universe
    does not allow, which a T = 1 sample can draw) the known answer no longer applies, so that row's
    later rounds are counted as `off_universe` only, for every method and the ceiling alike."""
    kept: dict[int, list[dict]] = {}

    def on_round(row, length, logprobs, tree, result):
        local = result.accepted_local_indices[row]
        kept.setdefault(row, []).append({
            "length": length, "paths": node_paths(tree, row).clone(), "valid": tree.valid[row].clone(),
            "modes": tree.modes[row, local[local >= 0] - 1].tolist()})

    params = SamplingParams(temperature=temperature, seed=seed)
    outs = engine.generate_batch(prompts, max_new, params=params, on_round=on_round)
    cell = Cell()
    for row, (prompt, out) in enumerate(zip(prompts, outs)):
        seq = list(prompt) + out.token_ids
        off = universe.first_off_universe(seq)
        records = kept.get(row, [])[:1] if first_round_only else kept.get(row, [])
        for r, stats in zip(records, out.rounds):  # on_round runs once per round of an active row, in order
            length = r["length"]
            if off is not None and off <= length:
                cell.off_universe += 1
                continue
            ctx, actual = seq[: length + 1], seq[length + 1: length + 1 + DRAFT_DEPTH]
            paths = [tuple(t for t in p if t >= 0) for p, v in zip(r["paths"].tolist(), r["valid"].tolist()) if v]
            support = list(universe.continuations(ctx, DRAFT_DEPTH, blind=True))
            chimeras = chimera_count(r["paths"], r["valid"], torch.tensor(support), actual)
            cell.add_round(stats.emitted, len(paths), chimeras, r["modes"])
            cell.multimodal_rounds += len(support) > 1
            cell.marker_rounds += universe.phase(length) == 0
            if temperature > 0:
                masses = prefix_masses(universe.continuations(ctx, DRAFT_DEPTH))
                cell.mass += covered_mass(masses, paths)
                cell.ceiling_mass += ideal_covered_mass(masses, budget or DRAFT_DEPTH)
            if product_tree:
                for a, b in _pairs_in_tree(support, set(paths)):
                    cell.bound_checks += 1
                    cell.bound_violations += splice_chimeras(paths, a, b) < chimera_bound(a, b)
        for blind in (False, True):
            t, n = oracle_run(universe, seq, len(prompt), max_new, budget or DRAFT_DEPTH, temperature,
                              first_round_only, stop=off, blind=blind)
            if blind:
                cell.blind_tokens, cell.blind_rounds = cell.blind_tokens + t, cell.blind_rounds + n
            else:
                cell.oracle_tokens, cell.oracle_rounds = cell.oracle_tokens + t, cell.oracle_rounds + n
    return cell, [o.token_ids for o in outs]


def fork_blocks(target, drafter, universe: Universe, sequences: list[list[int]], *, single_mode: bool):
    """Teacher-forced blocks rooted at every marker with a marker CUE_DISTANCE before it: (kind, index
    of the future that follows, the drafter's log-probs [K', D, V] (unweighted), its mode log-prior [K']
    or None) per marker."""
    sites = [(i, m) for i, seq in enumerate(sequences) for m in universe.marker_positions(len(seq))
             if m > CUE_DISTANCE and m + DRAFT_DEPTH < len(seq)]
    ids = torch.tensor(sequences)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    with torch.inference_mode():
        features = context_features(target(ids, output_hidden_states=True).hidden_states, drafter.cfg.target_layer_ids)
        rows = torch.tensor([i for i, _ in sites])
        starts = torch.tensor([m for _, m in sites])
        slots = torch.arange(ids.shape[1])[None].expand(len(sites), -1)
        context = drafter.context_kv(features[rows], slots, slots < starts[:, None])
        hidden, log_prior = drafter.block_hidden(ids[rows, starts], starts, context, embed, single_mode=single_mode)
        logprobs = drafter.logprobs(hidden, head)
    priors = [None] * len(sites) if log_prior is None else list(log_prior)
    return [(universe.fork_kind(sequences[i], m), universe.future_of_first[sequences[i][m + 1]], lp, prior)
            for (i, m), lp, prior in zip(sites, logprobs, priors)]


def drafter_fork_knowledge(universe: Universe, blocks) -> dict:
    """What a single-mode drafter knows at forks: its mean probability of each future's first token,
    at random forks (the known answer: FUTURE_PROBS) and at cued forks for the cued future (a drafter
    that reads the cue: 1; one that cannot: 1 / M)."""
    random_probs, cued = [], []
    first_ids = [f[0] for f in universe.future_ids]
    for kind, j, lp, _ in blocks:
        probs = lp[0, 0].exp()
        if kind == "random":
            random_probs.append([float(probs[t]) for t in first_ids])
        else:
            cued.append(float(probs[first_ids[j]]))
    return {"random_fork_future_probs": _mean_rows(random_probs), "random_forks": len(random_probs),
            "cued_fork_cued_future_prob": sum(cued) / max(len(cued), 1), "cued_forks": len(cued)}


def mode_assignment(drafter, universe: Universe, blocks, min_agree: int = 5) -> list[dict]:
    """Per mode: the share of fork blocks (root = a marker, so the drafted block is one future) whose
    argmax chain follows future F_j (>= min_agree of its 7 tokens), else "mixed"."""
    counts = [dict() for _ in range(drafter.cfg.num_modes)]
    for _, _, lp, _ in blocks:
        for k, j in enumerate(chain_futures(drafter, universe, lp, min_agree)):
            name = "mixed" if j is None else future_name(j)
            counts[k][name] = counts[k].get(name, 0) + 1
    return [{name: c / max(sum(row.values()), 1) for name, c in sorted(row.items())} for row in counts]


def chain_futures(drafter, universe: Universe, logprobs: torch.Tensor, min_agree: int = 5) -> list[int | None]:
    """Per mode of a fork block's log-probs [K, D, V]: the future its argmax chain follows (>= min_agree
    of its 7 tokens), else None."""
    out = []
    for chain in drafter.to_target_ids(logprobs.argmax(-1)).tolist():
        agree = [sum(a == b for a, b in zip(chain, f)) for f in universe.future_ids]
        j = max(range(len(agree)), key=agree.__getitem__)
        out.append(j if agree[j] >= min_agree else None)
    return out


def gate_at_forks(drafter, universe: Universe, blocks) -> dict:
    """What the MFD drafter's mode gate says at fork blocks, per kind of fork: the mean weight it gives
    the modes whose chain follows each future (at random forks the known answer is FUTURE_PROBS), and
    the share of blocks whose top-weighted mode's chain is the future that came."""
    out = {}
    if drafter.mode_prior is None:
        return out
    for kind in ("random", "cued"):
        rows = [(j, chain_futures(drafter, universe, lp), prior.exp()) for k, j, lp, prior in blocks if k == kind]
        if not rows:
            continue
        on_future = [[float(sum(p for f, p in zip(futures, pi.tolist()) if f == j)) for j in range(len(FUTURES))]
                     for _, futures, pi in rows]
        hits = [futures[int(pi.argmax())] == j for j, futures, pi in rows]
        out[kind] = {"weight_on_future": _mean_rows(on_future), "top_mode_follows_it": sum(hits) / len(hits),
                     "blocks": len(rows)}
    return out


def future_name(j: int) -> str:
    return f"F{j} {FUTURES[j][0]}"


def known_answer_at_fork(universe: Universe, budgets) -> dict:
    """A random fork, in closed form (no training involved): the drafted block is one whole future,
    F_j with probability FUTURE_PROBS[j]. Per budget, the expected accepted draft tokens of
      - the product tree (DDTree) of a perfectly calibrated single-mode drafter: the exact per-position
        marginals of the mixture, and its chimera share;
      - the unweighted mixture tree (MFD without a gate) of a perfect K = M drafter: mode j is F_j
        (probability 1 - 1e-6), every mode's chain equally likely;
      - the weighted mixture tree of the same drafter with a perfect gate, pi_j = P(F_j)
        (`weigh_modes`: MFD's rule with a gate);
      - the best tree (the ceiling)."""
    vocab = max(universe.ids.values()) + 1
    futures = universe.future_ids
    masses = prefix_masses({f: p for f, p in zip(futures, FUTURE_PROBS)})

    def log_table(dists: list[dict]) -> torch.Tensor:
        table = torch.full((DRAFT_DEPTH, vocab), 1e-6 / vocab, dtype=torch.float64)
        for d, dist in enumerate(dists):
            for token, p in dist.items():
                table[d, token] += p * (1 - 1e-6)
        return table.log()

    marginals = [dict() for _ in range(DRAFT_DEPTH)]
    for f, p in zip(futures, FUTURE_PROBS):
        for d, token in enumerate(f):
            marginals[d][token] = marginals[d].get(token, 0.0) + p
    product = log_table(marginals)[None]
    mixture = torch.stack([log_table([{t: 1.0} for t in f]) for f in futures])
    with_priors = weigh_modes(mixture, torch.tensor(FUTURE_PROBS, dtype=torch.float64).log())

    def tree(logprobs, budget):
        """(node paths, node_paths tensor, valid) of the tree of these log-probs [K, D, V]."""
        built = build_mixture_tree(logprobs[None], budget)
        paths_t, valid = node_paths(built, 0), built.valid[0]
        paths = [tuple(t for t in p if t >= 0) for p, v in zip(paths_t.tolist(), valid.tolist()) if v]
        return paths, paths_t, valid

    out = {}
    for budget in budgets:
        p_paths, p_tensor, p_valid = tree(product, budget)
        m_paths, _, _ = tree(mixture, budget)
        w_paths, _, _ = tree(with_priors, budget)
        chimeras = chimera_count(p_tensor, p_valid, torch.tensor(futures), [])
        out[str(budget)] = {"product": covered_mass(masses, p_paths), "mixture": covered_mass(masses, m_paths),
                            "mixture_with_priors": covered_mass(masses, w_paths),
                            "best": ideal_covered_mass(masses, budget),
                            "product_chimera_share": chimeras / max(len(p_paths), 1)}
    return out


def target_fit(target, universe: Universe, sequences: list[list[int]]) -> dict:
    """Teacher-forced on universe samples: what the target learned against the known answer."""
    with torch.inference_mode():
        probs = torch.softmax(target(torch.tensor(sequences)).logits.float(), -1)
    random_forks, cued, cued_hit, deterministic, cue_markers = [], [], [], [], []
    for seq, p in zip(sequences, probs):
        for pos in range(1, len(seq)):
            q, dist = p[pos - 1], universe.next_token_distribution(seq[:pos])
            if universe.phase(pos) == 1 and universe.fork_kind(seq[:pos], pos - 1) == "random":
                random_forks.append([float(q[f[0]]) for f in universe.future_ids])
            elif universe.phase(pos) == 1:
                cued.append(float(q[seq[pos]]))
                cued_hit.append(int(q.argmax()) == seq[pos])
            elif len(dist) == 1:
                deterministic.append(float(q[seq[pos]]))
            else:
                cue_markers.append([float(q[c]) for c in universe.cue_ids])
    return {
        "random_fork_future_probs": _mean_rows(random_forks), "known_future_probs": list(FUTURE_PROBS),
        "cued_future_prob": sum(cued) / max(len(cued), 1),
        "cued_argmax_accuracy": sum(cued_hit) / max(len(cued_hit), 1),
        "deterministic_token_prob": sum(deterministic) / max(len(deterministic), 1),
        "cue_marker_probs": _mean_rows(cue_markers),
    }


def _mean_rows(rows: list[list[float]]) -> list[float]:
    return [sum(col) / len(rows) for col in zip(*rows)] if rows else []


