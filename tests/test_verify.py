"""Tree verification against a plain walk (greedy) and the target's distribution (sampling)."""

import contextlib
import math

import pytest
import torch

from mfd_sglang.tree import DraftTree, build_mixture_tree
from mfd_sglang.verify import sample_from_logits, verify_tree_greedy, verify_tree_sampling

# Total variation allowed between an empirical and an exact distribution over <= 6 tokens.
TV_TOLERANCE = 0.02


def plain_walk(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Accepted local indices and bonus token of one request, following the target node by node."""
    tokens, parents, valid = tree.tokens.tolist(), tree.parents.tolist(), tree.valid.tolist()
    path, node = [], 0
    while True:
        children = [
            i + 1
            for i in range(len(tokens))
            if valid[i] and parents[i] + 1 == node and tokens[i] == target_tokens[node]
        ]
        if not children:
            return path, target_tokens[node]
        node = children[0]
        path.append(node)


def check_against_plain_walk(tree: DraftTree, target_tokens: torch.Tensor, result) -> None:
    bs, budget = tree.tokens.shape
    for b in range(bs):
        item = DraftTree(**{name: value[b] for name, value in vars(tree).items()})
        path, bonus = plain_walk(item, target_tokens[b].tolist())
        padding = [-1] * (budget - len(path))
        assert result.accept_lens[b] == len(path) + 1
        assert result.bonus_tokens[b] == bonus
        assert result.accepted_local_indices[b].tolist() == path + [-1] + padding
        draft = [item.tokens[i - 1].item() for i in path]
        assert result.accepted_tokens[b].tolist() == draft + [bonus] + padding


def test_greedy_matches_plain_walk() -> None:
    generator = torch.Generator().manual_seed(0)
    accept_lens = []
    for seed in range(40):
        bs, num_modes, depth, vocab = 4, 1 + seed % 3, 1 + seed % 4, 3 + seed % 2
        budget = 1 + 3 * seed % 17  # some trees end in padding
        logprobs = torch.randn(bs, num_modes, depth, vocab, generator=generator).log_softmax(-1)
        tree = build_mixture_tree(logprobs, budget)
        target_logits = torch.randn(bs, budget + 1, vocab, generator=generator)
        result = verify_tree_greedy(tree, target_logits)
        check_against_plain_walk(tree, target_logits.argmax(-1), result)
        accept_lens += result.accept_lens.tolist()
    assert min(accept_lens) == 1 and max(accept_lens) >= 4


def hand_tree(bs: int) -> DraftTree:
    """root -> {5, 3, 0: padding}; 5 -> 7; 3 -> 1 -> 2. Local indices: node i is i + 1."""
    tree = DraftTree(
        tokens=torch.tensor([5, 3, 7, 1, 2, 0]),
        parents=torch.tensor([-1, -1, 0, 1, 3, -1]),
        depths=torch.tensor([1, 1, 2, 2, 3, 1]),
        scores=torch.tensor([-1.0, -1.5, -2.0, -2.5, -3.0, float("-inf")]),
        modes=torch.zeros(6, dtype=torch.long),
        valid=torch.tensor([True, True, True, True, True, False]),
    )
    return DraftTree(**{name: value.expand(bs, -1) for name, value in vars(tree).items()})


def test_greedy_crafted_paths() -> None:
    # Target token per local node (root, 5, 3, 7, 1, 2, padding) for four requests.
    target_tokens = torch.tensor(
        [
            [6, 0, 0, 0, 0, 0, 0],  # nothing accepted
            [3, 0, 1, 0, 2, 4, 0],  # full depth through the second child of the root
            [5, 7, 0, 6, 0, 0, 0],  # through the first child, bonus after 7
            [0, 0, 0, 0, 0, 0, 0],  # the padding node's token 0 is never accepted
        ]
    )
    target_logits = 10.0 * torch.nn.functional.one_hot(target_tokens, 8).float()
    tree = hand_tree(4)
    result = verify_tree_greedy(tree, target_logits)
    assert result.accept_lens.tolist() == [1, 4, 3, 1]
    assert result.bonus_tokens.tolist() == [6, 4, 6, 0]
    assert result.accepted_tokens[:, :4].tolist() == [
        [6, -1, -1, -1],
        [3, 1, 2, 4],
        [5, 7, 6, -1],
        [0, -1, -1, -1],
    ]
    assert result.accepted_local_indices[:, :3].tolist() == [
        [-1, -1, -1],
        [2, 4, 5],
        [1, 3, -1],
        [-1, -1, -1],
    ]
    check_against_plain_walk(tree, target_tokens, result)


def filtered_distribution(logits: list[float], temperature: float, top_k: int, top_p: float):
    """softmax(logits / temperature) after top-k, then top-p, written out plainly."""
    vocab = len(logits)
    order = sorted(range(vocab), key=lambda t: -logits[t])
    if 0 < top_k < vocab:
        order = order[:top_k]
    weights = {t: math.exp((logits[t] - logits[order[0]]) / temperature) for t in order}
    probs = {t: w / sum(weights.values()) for t, w in weights.items()}
    kept, mass = [], 0.0
    for t in order:
        if top_p < 1.0 and mass >= top_p:
            break
        kept.append(t)
        mass += probs[t]
    return [probs[t] / mass if t in kept else 0.0 for t in range(vocab)]


def empirical_distribution(tokens: torch.Tensor, vocab: int) -> list[float]:
    return (torch.bincount(tokens, minlength=vocab).double() / len(tokens)).tolist()


def total_variation(p: list[float], q: list[float]) -> float:
    return 0.5 * sum(abs(a - b) for a, b in zip(p, q))


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (3, 1.0), (0, 0.75), (4, 0.8)])
def test_sampling_is_lossless(top_k: int, top_p: float) -> None:
    """First token ~ the target's filtered root distribution; second token given the first
    (when that is a tree node) ~ the target's filtered distribution at that node."""
    vocab, num_draws, temperature = 6, 100_000, 0.7
    tree = DraftTree(  # root -> {2, 4, 0}; 2 -> {1, 5}; 4 -> 3
        tokens=torch.tensor([2, 4, 0, 1, 5, 3]),
        parents=torch.tensor([-1, -1, -1, 0, 0, 1]),
        depths=torch.tensor([1, 1, 1, 2, 2, 2]),
        scores=torch.tensor([-1.0, -1.2, -1.4, -2.0, -2.2, -2.4]),
        modes=torch.zeros(6, dtype=torch.long),
        valid=torch.ones(6, dtype=torch.bool),
    )
    logits = torch.randn(7, vocab, generator=torch.Generator().manual_seed(1))
    batched = DraftTree(**{name: v.expand(num_draws, -1) for name, v in vars(tree).items()})
    result = verify_tree_sampling(
        batched,
        logits.expand(num_draws, -1, -1),
        torch.full((num_draws,), temperature),
        torch.full((num_draws,), top_k),
        torch.full((num_draws,), top_p),
        generator=torch.Generator().manual_seed(2),
    )
    expected = [filtered_distribution(row, temperature, top_k, top_p) for row in logits.tolist()]
    first, second = result.accepted_tokens[:, 0], result.accepted_tokens[:, 1]
    assert total_variation(empirical_distribution(first, vocab), expected[0]) < TV_TOLERANCE
    root_children = {2: 1, 4: 2, 0: 3}  # token -> local index
    checked = 0
    for token in range(vocab):
        drew = first == token
        if token not in root_children:
            assert (second[drew] == -1).all() and (result.accept_lens[drew] == 1).all()
        elif drew.sum() >= 10_000:
            empirical = empirical_distribution(second[drew], vocab)
            assert total_variation(empirical, expected[root_children[token]]) < TV_TOLERANCE
            checked += 1
    assert checked >= 1
    if top_k:
        support = logits[0].topk(top_k).indices.tolist()
        assert set(first.tolist()) <= set(support)


def test_sample_from_logits_filters() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 50, generator=generator)
    temperature = torch.full((2, 3), 1.3)
    keep_all = torch.ones(2, 3)

    def draw(top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        return sample_from_logits(
            logits.expand(400, -1, -1, -1),
            temperature,
            top_k,
            top_p,
            generator=torch.Generator().manual_seed(4),
        )

    unfiltered = draw(torch.zeros(2, 3, dtype=torch.long), keep_all)
    assert unfiltered.shape == (400, 2, 3) and unfiltered.dtype == torch.long
    assert torch.equal(draw(torch.full((2, 3), 50), keep_all), unfiltered)  # top_k >= V is off
    top_k = torch.tensor([[1, 2, 3], [5, 10, 0]])
    tokens = draw(top_k, keep_all)
    for row in range(2):
        for col in range(3):
            k = top_k[row, col].item() or 50
            support = set(logits[row, col].topk(k).indices.tolist())
            assert set(tokens[:, row, col].tolist()) <= support
    # A tiny top_p keeps only the most likely token.
    assert (draw(torch.zeros(2, 3, dtype=torch.long), keep_all * 1e-6) == logits.argmax(-1)).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_matches_cpu_without_host_sync() -> None:
    from mfd_sglang.tree_layout import tree_to_verify_layout

    generator = torch.Generator().manual_seed(5)
    bs, budget, vocab = 3, 16, 40
    logprobs = torch.randn(bs, 2, 4, vocab, generator=generator).log_softmax(-1)
    target_logits = torch.randn(bs, budget + 1, vocab, generator=generator)
    root_tokens, seq_lens = torch.tensor([1, 2, 3]), torch.tensor([7, 0, 12])
    settings = (torch.full((bs,), 0.7), torch.tensor([0, 5, 50]), torch.tensor([1.0, 0.9, 0.5]))

    def pipeline(device: str):
        # Inputs are moved first: a host-to-device copy itself counts as a sync.
        lp, logits, roots, lens = (
            t.to(device) for t in (logprobs, target_logits, root_tokens, seq_lens)
        )
        sampling = [s.to(device) for s in settings]
        with host_syncs_raise() if device == "cuda" else contextlib.nullcontext():
            tree = build_mixture_tree(lp, budget)
            layout = tree_to_verify_layout(tree, roots, lens)
            greedy = verify_tree_greedy(tree, logits)
            verify_tree_sampling(tree, logits, *sampling)
        return tree, layout, greedy

    for cuda_part, cpu_part in zip(pipeline("cuda"), pipeline("cpu")):
        for name, value in vars(cpu_part).items():
            torch.testing.assert_close(getattr(cuda_part, name).cpu(), value, msg=name)


@contextlib.contextmanager
def host_syncs_raise():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
