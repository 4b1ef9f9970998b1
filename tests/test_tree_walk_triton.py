"""The Triton tree walks (`kernels.verify_layout`, `kernels.accept_path`) and the verify's custom
mask (`kernels.verify_mask`) against their torch references, bit for bit, on mixture trees of random drafters
(padding, ties, budgets 0 to 100, depth 15).

On CPU the kernels run under the Triton interpreter, in a subprocess with TRITON_INTERPRET=1 (read when
triton decorates a kernel); the CUDA test runs in-process.
"""

import dataclasses
import os

import pytest
import torch

from interpreted import main, run_cases
from mfd_sglang.acceptance import accept_path
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.tree import build_mixture_tree, empty_tree
from mfd_sglang.tree_layout import full_custom_mask, local_parents, tree_to_verify_layout


def random_tree(seed: int, bs: int, num_modes: int, depth: int, vocab: int, budget: int, *, spread=3.0,
                quantised=False, device="cpu"):
    generator = torch.Generator().manual_seed(seed)
    logprobs = (spread * torch.randn(bs, num_modes, depth, vocab, generator=generator)).log_softmax(-1)
    if quantised:  # equal log-probabilities: ties between tokens, paths and modes
        logprobs = (logprobs * 2).round() / 2
    return build_mixture_tree(logprobs.to(device), budget)


def target_tokens(tree, seed: int, vocab: int):
    """[bs, N] target tokens with long accepted paths: the path of request 0's deepest node, and of a random
    node in the others, is what the target says, broken at one random row in odd requests; the other rows
    random tokens (matches off the path too)."""
    generator = torch.Generator().manual_seed(seed)
    bs, budget = tree.tokens.shape
    device = tree.tokens.device
    target = torch.randint(0, vocab, (bs, budget + 1), generator=generator).to(device)
    if budget == 0:
        return target
    parents = local_parents(tree).cpu()
    tokens = tree.tokens.cpu()
    depths = torch.where(tree.valid, tree.depths, 0).cpu()
    for b in range(bs):
        node = int(torch.randint(1, budget + 1, (1,), generator=generator)) if b else int(depths[b].argmax()) + 1
        path = []
        while node > 0:
            target[b, parents[b, node]] = tokens[b, node - 1]
            node = int(parents[b, node])
            path.append(node)
        if b % 2:  # one row of the path disagrees (a token outside the vocabulary): nodes past it match, unaccepted
            target[b, path[int(torch.randint(0, len(path), (1,), generator=generator))]] = vocab
    return target


def assert_same(want, have, where: str) -> None:
    for field in dataclasses.fields(want):
        a, b = getattr(want, field.name), getattr(have, field.name)
        assert a.dtype == b.dtype and a.shape == b.shape and a.device == b.device, f"{field.name}: {where}"
        assert torch.equal(a, b), f"{field.name} differs: {where}\n{a}\n{b}"


def assert_same_walks(tree, vocab: int, seed: int, where: str, sync_check: bool = False) -> int:
    """Layout, custom mask (exactly sized, and in a larger buffer) and accepted path of both backends agree;
    returns the longest accept length seen."""
    bs = tree.tokens.shape[0]
    device = tree.tokens.device
    generator = torch.Generator().manual_seed(seed)
    roots = torch.randint(0, vocab, (bs,), generator=generator, dtype=torch.int32).to(device)
    seq_lens = torch.randint(0, 500, (bs,), generator=generator).to(device)
    target = target_tokens(tree, seed, vocab)
    with host_syncs_raise(device if sync_check else "cpu"):
        layout = tree_to_verify_layout(tree, roots, seq_lens, backend="triton")
        result = accept_path(tree, target, backend="triton")
    assert_same(tree_to_verify_layout(tree, roots, seq_lens, backend="torch"), layout, f"layout {where}")
    nodes = tree.tokens.shape[1] + 1
    exact = nodes * int(seq_lens.sum()) + bs * nodes * nodes
    for total_len in (exact, exact + 37):
        want = full_custom_mask(layout.ancestor_mask, seq_lens, total_len, backend="torch")
        with host_syncs_raise(device if sync_check else "cpu"):
            have = full_custom_mask(layout.ancestor_mask, seq_lens, total_len, backend="triton")
        assert torch.equal(want, have), f"custom mask of {total_len} cells differs: {where}"
    expected = accept_path(tree, target, backend="torch")
    assert_same(expected, result, f"accept {where}")
    return int(expected.accept_lens.max())


# (bs, K, D, V, budget): trees with padding (fewer prefixes than the budget), budget 1, deep chains; a batch past
# the custom mask's 128 lengths summed a step.
SHAPES = [(1, 1, 1, 3, 1), (2, 1, 3, 3, 50), (2, 2, 4, 2, 40), (3, 2, 5, 4, 6), (2, 8, 3, 10, 12),
          (1, 2, 15, 5, 20), (3, 8, 15, 50, 64), (2, 4, 6, 30, 100), (130, 1, 2, 3, 2)]


def case_random_trees(device="cpu", sync_check=False):
    longest = 0
    for seed, (bs, k, d, v, budget) in enumerate(SHAPES):
        for quantised in (False, True):
            tree = random_tree(seed, bs, k, d, v, budget, quantised=quantised, device=device)
            longest = max(longest, assert_same_walks(tree, v, seed, f"{(bs, k, d, v, budget)} q {quantised}",
                                                     sync_check))
    assert longest >= 8  # the targets follow deep paths: the walks are checked past the first depths


def case_edge_trees(device="cpu", sync_check=False):
    # No node (a round at budget 0): the root alone.
    assert_same_walks(empty_tree(3, device), 7, 0, "empty", sync_check)
    # Certain drafters: chains, then padding.
    tokens = torch.tensor([[3, 1, 4, 1], [1, 0, 2, 1]])
    certain = torch.nn.functional.one_hot(tokens, 5).float().log()[None].expand(2, -1, -1, -1)
    assert_same_walks(build_mixture_tree(certain.to(device), 10), 5, 1, "certain", sync_check)
    # A target that agrees with nothing, and one made of the tree's own tokens (each row its node's token).
    tree = random_tree(2, 2, 4, 5, 6, 30, device=device)
    for target in (torch.full((2, 31), 6), torch.cat([tree.tokens.cpu()[:, :1], tree.tokens.cpu()], 1)):
        want = accept_path(tree, target.to(device), backend="torch")
        assert_same(want, accept_path(tree, target.to(device), backend="triton"), "fixed target")


CASES = {fn.__name__: fn for fn in (case_random_trees, case_edge_trees)}


def test_interpreter_matches_torch() -> None:
    run_cases(__file__, CASES)


def test_cpu_without_interpreter_raises() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1 is set: the CPU path is allowed")
    tree = random_tree(0, 1, 2, 3, 4, 5)
    with pytest.raises(ValueError, match="CUDA tensors or TRITON_INTERPRET=1"):
        accept_path(tree, torch.zeros(1, 6, dtype=torch.int64), backend="triton")
    with pytest.raises(ValueError, match="backend 'cuda' is not one of 'torch', 'triton'"):
        tree_to_verify_layout(tree, torch.zeros(1), torch.zeros(1), backend="cuda")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="interpreter mode is on")
def test_cuda_matches_torch_without_sync() -> None:
    for case in CASES.values():
        case(device="cuda", sync_check=True)


if __name__ == "__main__":
    main(CASES)
