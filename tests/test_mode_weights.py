"""The weighted mixture tree: the tree of `weigh_modes(logprobs, log_prior)` holds the B prefixes with the
highest s(u) = max_k [log pi_k + sum_i logprobs_k,i(u_i)], exactly, ties included, for the torch backend
and (under the Triton interpreter, through tests/interpreted.py as the kernel tests run) the Triton one.

The reference enumerates every prefix and sums its scores in the tree's documented order and float type,
(log pi_k + lp_k,1) + lp_k,2 + ..., so scores compare exactly. With ties, which of several equal-score
prefixes of one depth the tree takes is the builders' own choice: the reference holds the tree to the
exact (score, depth) sequence of the best B prefixes, and every node to its own path's exact score and
lowest best mode.
"""

from __future__ import annotations

import itertools

import torch

from interpreted import main, run_cases
from mfd_sglang.tree import DraftCandidates, DraftTree, build_mixture_tree, top_candidates, weigh_modes


def all_prefixes(logprobs: torch.Tensor, log_prior: torch.Tensor) -> dict[tuple, tuple]:
    """{path: (score, lowest best mode)} of every prefix of one item ([K, D, V] log-probs, [K] log-prior),
    each mode's score summed in the tree's order and float type."""
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    lp, prior = logprobs.to(dtype), log_prior.to(dtype)
    num_modes, depth, vocab = lp.shape
    out = {}
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            per_mode = prior + lp[:, 0, path[0]]
            for i in range(1, d):
                per_mode = per_mode + lp[:, i, path[i]]
            best = per_mode.max()
            if best > float("-inf"):
                out[path] = (best, int((per_mode == best).nonzero()[0]))
    return out


def node_path_list(tree: DraftTree) -> list[tuple]:
    """Every valid node's token path (unbatched tree), checking that parents precede children."""
    paths = []
    for i, (token, parent, depth) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist())):
        if not tree.valid[i]:
            break
        assert parent < i and (parent < 0 or tree.valid[parent]), "parents precede children"
        prefix = paths[parent] if parent >= 0 else ()
        assert depth == len(prefix) + 1
        paths.append(prefix + (token,))
    return paths


def check_weighted_tree(tree: DraftTree, logprobs: torch.Tensor, log_prior: torch.Tensor, budget: int) -> None:
    """One item's tree ([budget] fields) against the reference, ties allowed (see the module docstring)."""
    prefixes = all_prefixes(logprobs, log_prior)
    ranked = sorted(((float(score), len(path)) for path, (score, _) in prefixes.items()),
                    key=lambda key: (-key[0], key[1]))[:budget]
    paths = node_path_list(tree)
    assert len(paths) == len(ranked) and len(set(paths)) == len(paths), "B distinct prefixes (or all there are)"
    assert tree.valid.tolist() == [True] * len(paths) + [False] * (budget - len(paths))
    assert [(float(s), len(p)) for s, p in zip(tree.scores, paths)] == ranked, "best first, ties to ancestors"
    for i, path in enumerate(paths):
        score, mode = prefixes[path]
        assert tree.scores[i] == score and tree.scores.dtype == score.dtype, (path, tree.scores[i], score)
        assert int(tree.modes[i]) == mode, (path, "lowest mode reaching the score")
    tail = slice(len(paths), None)
    assert (tree.tokens[tail] == 0).all() and (tree.parents[tail] == -1).all() and (tree.depths[tail] == 1).all()
    assert (tree.modes[tail] == 0).all() and (tree.scores[tail] == float("-inf")).all()


def item(tree: DraftTree, b: int) -> DraftTree:
    return DraftTree(**{name: value[b] for name, value in vars(tree).items()})


def cases(dtype=torch.float64):
    """(log-probs [bs, K, D, V], log-prior [bs, K], budgets): random, quantised (many exact ties: equal
    tokens, equal paths, equal cross-mode scores, priors that tie modes), identical modes with different
    weights, a mode weighted down to -inf, and -inf log-probs."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for k, d, v in [(2, 3, 4), (3, 2, 5), (4, 3, 3), (2, 4, 3)]:
        lp = torch.randn(2, k, d, v, generator=gen, dtype=torch.float64).log_softmax(-1)
        prior = torch.randn(2, k, generator=gen, dtype=torch.float64).log_softmax(-1)
        out.append((lp, prior))
        quantised = -torch.randint(0, 6, (2, k, d, v), generator=gen).double() / 4
        out.append((quantised, -torch.randint(0, 3, (2, k), generator=gen).double() / 4))
    same = torch.randn(1, 1, 3, 4, generator=gen, dtype=torch.float64).log_softmax(-1).expand(1, 3, 3, 4).clone()
    out.append((same, torch.tensor([[-1.0, -0.5, -0.5]], dtype=torch.float64)))
    masked = torch.randn(1, 3, 3, 4, generator=gen, dtype=torch.float64).log_softmax(-1)
    masked[torch.rand(masked.shape, generator=gen) < 0.3] = float("-inf")
    out.append((masked, torch.tensor([[0.0, float("-inf"), -2.0]], dtype=torch.float64)))
    return [(lp.to(dtype), prior.to(dtype)) for lp, prior in out]


def budgets(logprobs: torch.Tensor) -> list[int]:
    _, _, depth, vocab = logprobs.shape
    total = sum(vocab**d for d in range(1, depth + 1))
    return sorted({1, 2, 5, 11, total // 2, total, total + 3})


def test_weighted_tree_is_exact_against_enumeration() -> None:
    for dtype in (torch.float64, torch.float32):
        for lp, prior in cases(dtype):
            for budget in budgets(lp):
                tree = build_mixture_tree(weigh_modes(lp, prior), budget)
                from_candidates = build_mixture_tree(weigh_modes(top_candidates(lp, budget), prior), budget)
                for b in range(lp.shape[0]):
                    check_weighted_tree(item(tree, b), lp[b], prior[b], budget)
                    check_weighted_tree(item(from_candidates, b), lp[b], prior[b], budget)


def test_without_weights_the_tree_is_the_unweighted_one_bit_for_bit() -> None:
    lp, _ = cases()[0]
    assert weigh_modes(lp, None) is lp
    candidates = top_candidates(lp, 6)
    assert weigh_modes(candidates, None) is candidates
    # Uniform weights of 0 change no bit of any score either.
    zero = weigh_modes(lp, torch.zeros(lp.shape[:2], dtype=lp.dtype))
    want, got = build_mixture_tree(lp, 9), build_mixture_tree(zero, 9)
    for name, value in vars(want).items():
        assert torch.equal(getattr(got, name), value), name


def test_weights_shift_depth_one_only_and_keep_the_candidates() -> None:
    gen = torch.Generator().manual_seed(4)
    lp = torch.randn(2, 3, 4, 7, generator=gen).log_softmax(-1)
    prior = torch.randn(2, 3, generator=gen).log_softmax(-1)
    weighted = weigh_modes(lp, prior)
    assert weighted.dtype == torch.float32
    assert torch.equal(weighted[:, :, 1:], lp[:, :, 1:])
    assert torch.equal(weighted[:, :, 0], lp[:, :, 0] + prior[:, :, None])
    candidates = weigh_modes(top_candidates(lp, 5), prior)
    assert isinstance(candidates, DraftCandidates) and candidates.vocab == 7
    assert torch.equal(candidates.tokens, top_candidates(lp, 5).tokens)
    assert torch.equal(candidates.logprobs, top_candidates(weighted, 5).logprobs)
    bf16 = weigh_modes(lp.bfloat16(), prior)  # a bf16 drafter's scores are summed in float32
    assert bf16.dtype == torch.float32 and torch.equal(bf16[:, :, 1:], lp.bfloat16()[:, :, 1:].float())


def test_a_heavier_mode_takes_a_small_budget() -> None:
    # Two certain modes (two chains of 3): unweighted, a budget of 3 splits between them; weighted
    # .8 / .2, the heavier mode's whole chain comes first.
    chains = torch.tensor([[[0, 1, 2], [3, 4, 0]]])
    lp = torch.nn.functional.one_hot(chains, 5).double().log()
    split = build_mixture_tree(lp, 3)
    assert sorted(split.depths[0].tolist()) == [1, 1, 2]
    heavy = build_mixture_tree(weigh_modes(lp, torch.tensor([[0.2, 0.8]], dtype=torch.float64).log()), 3)
    assert heavy.tokens[0].tolist() == [3, 4, 0] and heavy.modes[0].tolist() == [1, 1, 1]
    assert torch.equal(heavy.scores[0], torch.full((3,), 0.8, dtype=torch.float64).log())


def triton_trees(selected: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """In the interpreter: the Triton tree of weighted log-probs (full, at half the prefixes) and of
    weighted candidates (every prefix, ties and padding at its end) against the reference, and bit for
    bit against the torch tree."""
    for lp, prior in selected:
        every = budgets(lp)[-2]
        for budget, given in ((every // 2, weigh_modes(lp, prior)),
                              (every + 3, weigh_modes(top_candidates(lp, every + 3), prior))):
            got, want = build_mixture_tree(given, budget, backend="triton"), build_mixture_tree(given, budget)
            for name, value in vars(want).items():
                assert torch.equal(getattr(got, name), value), (name, budget)
            for b in range(lp.shape[0]):
                check_weighted_tree(item(got, b), lp[b], prior[b], budget)


CASES = {  # cases()' random log-probs, and its quantised, identical-mode and -inf ones
    "case_random": lambda: triton_trees(cases(torch.float32)[0:8:2]),
    "case_ties_and_minus_inf": lambda: triton_trees(cases(torch.float32)[1:8:2] + cases(torch.float32)[8:]),
}


def test_triton_weighted_tree_in_the_interpreter() -> None:
    run_cases(__file__, CASES, timeout=900)


if __name__ == "__main__":
    main(CASES)
