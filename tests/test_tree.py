"""build_mixture_tree against brute-force enumeration and a best-first search; build_chain."""

import heapq
import itertools
import math
import os

import pytest
import torch

from mfd_sglang.tree import DraftTree, build_chain, build_mixture_tree


Ranking = list[tuple[tuple[int, ...], float, int]]  # (token path, score, mode), best first


def brute_force_top(logprobs: torch.Tensor, budget: int | None) -> Ranking:
    """The top `budget` (None: all) prefixes of [K, D, V] logprobs, ties toward shorter paths."""
    num_modes, depth, vocab = logprobs.shape
    lp = logprobs.tolist()
    ranked = []
    for d in range(1, depth + 1):
        for path in itertools.product(range(vocab), repeat=d):
            per_mode = [sum(lp[k][i][t] for i, t in enumerate(path)) for k in range(num_modes)]
            score = max(per_mode)
            if score > -math.inf:
                ranked.append((path, score, per_mode.index(score)))
    ranked.sort(key=lambda entry: (-entry[1], len(entry[0])))
    return ranked[:budget]


def best_first_top(logprobs: torch.Tensor, budget: int) -> Ranking:
    """The same ranking by best-first search: a child never outscores its parent."""
    num_modes, depth, _ = logprobs.shape
    heap = [(0.0, 0, (), (0.0,) * num_modes)]
    ranked = []
    while heap and len(ranked) < budget + 1:
        neg_score, _, path, per_mode = heapq.heappop(heap)
        ranked.append((path, -neg_score, per_mode.index(-neg_score)))
        if len(path) == depth:
            continue
        children = torch.tensor(per_mode, dtype=logprobs.dtype)[:, None] + logprobs[:, len(path)]
        for token, child in enumerate(children.T.tolist()):
            heapq.heappush(heap, (-max(child), len(path) + 1, path + (token,), tuple(child)))
    return ranked[1:]  # drop the root


def tree_item(tree: DraftTree, item: int) -> DraftTree:
    return DraftTree(**{name: value[item] for name, value in vars(tree).items()})


def tree_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token path of every valid node of an unbatched tree, checking the tree's structure."""
    paths = []
    for i, (token, parent, depth) in enumerate(
        zip(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist())
    ):
        if not tree.valid[i]:
            break
        assert parent < i, "parents precede children"
        if parent >= 0:
            assert tree.valid[parent]
        prefix = paths[parent] if parent >= 0 else ()
        assert depth == len(prefix) + 1
        paths.append(prefix + (token,))
    return paths


def check_tree(tree: DraftTree, expected: Ranking, budget: int) -> None:
    for name in ("tokens", "parents", "depths", "scores", "modes", "valid"):
        assert getattr(tree, name).shape == (budget,), name
    num_valid = len(expected)
    assert tree.valid.tolist() == [True] * num_valid + [False] * (budget - num_valid)
    paths = tree_paths(tree)
    assert len(set(paths)) == len(paths), "no duplicate prefixes"
    assert paths == [path for path, _, _ in expected]
    torch.testing.assert_close(
        tree.scores[:num_valid],
        torch.tensor([score for _, score, _ in expected], dtype=tree.scores.dtype),
    )
    assert tree.modes[:num_valid].tolist() == [mode for _, _, mode in expected]
    padding = slice(num_valid, None)
    assert (tree.tokens[padding] == 0).all() and (tree.parents[padding] == -1).all()
    assert (tree.depths[padding] == 1).all() and (tree.modes[padding] == 0).all()
    assert (tree.scores[padding] == float("-inf")).all()


def small_shapes() -> list[tuple[int, int]]:
    """(D, V) pairs small enough to enumerate every prefix."""
    return [
        (depth, vocab)
        for depth in range(1, 6)
        for vocab in range(2, 6)
        if sum(vocab**d for d in range(1, depth + 1)) <= 400
    ]


def random_logprobs(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64).log_softmax(-1)


@pytest.mark.parametrize("num_modes", [1, 2, 3, 4])
def test_exact_against_brute_force(num_modes: int) -> None:
    generator = torch.Generator().manual_seed(num_modes)
    for depth, vocab in small_shapes():
        logprobs = random_logprobs(generator, 3, num_modes, depth, vocab)
        rankings = [brute_force_top(item, budget=None) for item in logprobs]
        num_prefixes = len(rankings[0])
        # Budgets from 1 to all prefixes (every one for small trees, about 12 for big ones), and
        # beyond, which pads.
        step = 1 + num_prefixes // 12
        for budget in [*range(1, num_prefixes, step), num_prefixes, num_prefixes + 3]:
            batched = build_mixture_tree(logprobs, budget)
            for item, ranking in enumerate(rankings):
                tree = build_mixture_tree(logprobs[item], budget)
                check_tree(tree, ranking[:budget], budget)
                for name, value in vars(tree_item(batched, item)).items():
                    assert torch.equal(value, getattr(tree, name)), name


def test_identical_modes_are_merged() -> None:
    generator = torch.Generator().manual_seed(7)
    for depth, vocab in [(3, 3), (4, 2), (2, 5)]:
        logprobs = random_logprobs(generator, 3, depth, vocab)
        logprobs[2] = logprobs[0]  # modes 0 and 2 propose exactly the same prefixes
        for budget in (1, 4, 9, 40):
            expected = brute_force_top(logprobs, budget)
            check_tree(build_mixture_tree(logprobs, budget), expected, budget)


def test_minus_inf_prefixes_are_never_included() -> None:
    generator = torch.Generator().manual_seed(3)
    logprobs = random_logprobs(generator, 2, 3, 4)
    logprobs[torch.rand(logprobs.shape, generator=generator) < 0.5] = float("-inf")
    for budget in (1, 5, 20, 90):
        check_tree(build_mixture_tree(logprobs, budget), brute_force_top(logprobs, budget), budget)


def test_certain_drafter_gives_chains_then_padding() -> None:
    # Every prefix on a chain scores exactly 0: only the tie-break toward ancestors orders them.
    logprobs = torch.nn.functional.one_hot(torch.tensor([[3, 1, 4], [1, 0, 2]]), 5).double().log()
    chain = build_mixture_tree(logprobs[:1], 5)
    check_tree(chain, brute_force_top(logprobs[:1], 5), 5)
    assert chain.tokens.tolist() == [3, 1, 4, 0, 0] and chain.parents.tolist() == [-1, 0, 1, -1, -1]
    # Two certain modes: two chains; equal scores at equal depth may come in either order.
    tree = build_mixture_tree(logprobs, 8)
    assert set(tree_paths(tree)) == {path for path, _, _ in brute_force_top(logprobs, 8)}
    assert tree.depths.tolist() == [1, 1, 2, 2, 3, 3, 1, 1] and tree.valid.sum() == 6


def test_large_vocab_against_best_first_search() -> None:
    generator = torch.Generator().manual_seed(11)
    # Peaked distributions, so the tree mixes deep and wide parts.
    logprobs = 4 * torch.randn(2, 3, 5, 300, generator=generator, dtype=torch.float64)
    logprobs = logprobs.log_softmax(-1)
    batched = build_mixture_tree(logprobs, 48)
    for item in range(2):
        tree = tree_item(batched, item)
        check_tree(tree, best_first_top(logprobs[item], 48), 48)
        assert tree.depths.max() > 2 and (tree.depths == 1).sum() > 2


def test_float32_input() -> None:
    logprobs = random_logprobs(torch.Generator().manual_seed(5), 2, 3, 4)
    tree = build_mixture_tree(logprobs.float(), 10)
    assert tree.scores.dtype == torch.float32
    expected = brute_force_top(logprobs, 10)
    assert tree_paths(tree) == [path for path, _, _ in expected]


def test_unavailable_backend_raises() -> None:
    with pytest.raises(ValueError, match="cuda"):
        build_mixture_tree(torch.zeros(1, 2, 3), 2, backend="cuda")


def test_triton_backend_on_cpu_needs_the_interpreter() -> None:
    # The Triton backend itself is held to this reference in tests/test_tree_triton.py.
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the CPU path is allowed")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        build_mixture_tree(torch.zeros(1, 2, 3), 2, backend="triton")


def test_chain() -> None:
    logprobs = random_logprobs(torch.Generator().manual_seed(2), 2, 3, 4, 7)
    chain = build_chain(logprobs, mode=1)
    best, tokens = logprobs[:, 1].max(dim=-1)
    assert torch.equal(chain.tokens, tokens)
    assert chain.parents.tolist() == [[-1, 0, 1, 2]] * 2
    assert chain.depths.tolist() == [[1, 2, 3, 4]] * 2
    torch.testing.assert_close(chain.scores, best.cumsum(-1))
    assert (chain.modes == 1).all() and chain.valid.all()
    single = build_chain(logprobs[1], mode=1)
    assert torch.equal(single.tokens, chain.tokens[1]) and single.parents.tolist() == [-1, 0, 1, 2]
