"""tree_to_verify_layout and full_custom_mask against a plain construction with Python loops."""

import pytest
import torch

from mfd_sglang.tree import DraftTree, build_mixture_tree
from mfd_sglang.tree_layout import full_custom_mask, tree_ancestor_mask, tree_to_verify_layout


def plain_layout(tree: DraftTree, root_tokens: list[int], seq_lens: list[int]) -> dict:
    """The layout written out node by node, straight from its definition."""
    bs, budget = tree.tokens.shape
    n = budget + 1
    out = {name: [] for name in ("draft_token", "positions", "next_token", "next_sibling", "mask")}
    custom_mask = []
    for b in range(bs):
        valid = [False] + tree.valid[b].tolist()
        node_tokens = tree.tokens[b].tolist()
        tokens = [root_tokens[b]] + [t if v else 0 for t, v in zip(node_tokens, valid[1:])]
        depths = [0] + [d if v else 1 for d, v in zip(tree.depths[b].tolist(), valid[1:])]
        parent = [-1] + [p + 1 if v else 0 for p, v in zip(tree.parents[b].tolist(), valid[1:])]
        children = [[j for j in range(1, n) if valid[j] and parent[j] == i] for i in range(n)]
        next_token = [kids[0] if kids else -1 for kids in children]
        next_sibling = [-1] * n
        for kids in children:
            for this, following in zip(kids, kids[1:]):
                next_sibling[this] = following
        mask = [[False] * n for _ in range(n)]
        for i in range(n):
            j = i
            while j >= 0:
                mask[i][j] = True
                j = parent[j]
            custom_mask += [True] * seq_lens[b] + mask[i]
        out["draft_token"] += tokens
        out["positions"] += [seq_lens[b] + d for d in depths]
        out["next_token"].append(next_token)
        out["next_sibling"].append(next_sibling)
        out["mask"].append(mask)
    out["custom_mask"] = custom_mask
    return out


def reachable_nodes(next_token: list[int], next_sibling: list[int]) -> set[int]:
    """Local nodes met walking first-child / next-sibling links from the root."""
    seen, stack = set(), [next_token[0]]
    while stack:
        node = stack.pop()
        if node >= 0:
            seen.add(node)
            stack += [next_token[node], next_sibling[node]]
    return seen


@pytest.mark.parametrize("seed", range(6))
def test_layout_matches_plain_construction(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    bs, num_modes, vocab = 3, 1 + seed % 3, 3 + seed % 3
    # Odd seeds ask for more nodes than the (at most 30) prefixes, so the trees end in padding.
    depth, budget = (2, 40) if seed % 2 else (2 + seed % 3, 12)
    logprobs = torch.randn(bs, num_modes, depth, vocab, generator=generator).log_softmax(-1)
    tree = build_mixture_tree(logprobs, budget)
    root_tokens = torch.randint(vocab, (bs,), generator=generator)
    seq_lens = torch.randint(0, 9, (bs,), generator=generator)
    layout = tree_to_verify_layout(tree, root_tokens, seq_lens)
    expected = plain_layout(tree, root_tokens.tolist(), seq_lens.tolist())
    n = budget + 1
    assert layout.draft_token.flatten().tolist() == expected["draft_token"]
    assert layout.positions.flatten().tolist() == expected["positions"]
    assert layout.retrive_index.tolist() == [[b * n + i for i in range(n)] for b in range(bs)]
    assert layout.retrive_next_token.tolist() == expected["next_token"]
    assert layout.retrive_next_sibling.tolist() == expected["next_sibling"]
    assert layout.ancestor_mask.tolist() == expected["mask"]
    assert torch.equal(tree_ancestor_mask(tree), layout.ancestor_mask)
    total_len = n * int(seq_lens.sum()) + bs * n * n
    for known_len in (None, total_len):
        custom_mask = full_custom_mask(layout.ancestor_mask, seq_lens, known_len)
        assert custom_mask.tolist() == expected["custom_mask"]
    for b in range(bs):
        valid_local = {i + 1 for i, v in enumerate(tree.valid[b].tolist()) if v}
        reached = reachable_nodes(expected["next_token"][b], expected["next_sibling"][b])
        assert reached == valid_local
    if seed % 2:
        assert not tree.valid.all()


def test_unbatched_tree_is_rejected() -> None:
    tree = build_mixture_tree(torch.randn(1, 2, 3).log_softmax(-1), 4)
    with pytest.raises(ValueError, match="batched"):
        tree_to_verify_layout(tree, torch.tensor(0), torch.tensor(5))
