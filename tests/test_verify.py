"""Tree verification against a plain walk (greedy) and, sampling, against SGLang's plain sampler:
its law (from its own function), the distribution of the tree's draws (chi-square), seeded streams."""

import pytest
import torch

from mfd_sglang.acceptance import (Sampling, plain_law, random_seeds, sample_from_logits, stream_coins,
                                   sub_budget_accept_lens, verify_tree_greedy, verify_tree_sampling)
from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.tree import DraftTree, build_mixture_tree
from references import TOP_K_ALL, assert_follows, sglang_law


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


def path_logits(tree: DraftTree, vocab: int) -> torch.Tensor:
    """Target logits [bs, N + 1, vocab] that depend only on each local node's path (the root's: on the
    request), as a real target's do: the same node in any tree gets the same row."""
    bs, budget = tree.tokens.shape
    out = torch.empty(bs, budget + 1, vocab)
    for b in range(bs):
        paths = [(b,)]
        for i in range(budget):
            paths.append(paths[tree.parents[b, i].item() + 1] + (tree.tokens[b, i].item(),))
        for j, path in enumerate(paths):
            out[b, j] = 3 * torch.randn(vocab, generator=torch.Generator().manual_seed(hash(path) % 2**31))
    return out


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_sub_budget_accept_lens_equal_verifying_the_smaller_tree(sampled) -> None:
    """What each smaller budget would have accepted, read off one round, equals building the tree of
    that budget and verifying it against the same target (greedy, and sampled with the same seeds)."""
    generator = torch.Generator().manual_seed(3)
    budgets = torch.tensor([0, 1, 2, 3, 5, 8, 13, 21])
    accepted = []
    for seed in range(12):
        bs, num_modes, depth, vocab = 3, 1 + seed % 4, 2 + seed % 4, 3 + seed % 3
        logprobs = torch.randn(bs, num_modes, depth, vocab, generator=generator).log_softmax(-1)
        settings = sampling(bs, 1.0, 0, 1.0, 0.0) if sampled else None
        positions = torch.randint(0, 1000, (bs,), generator=generator)

        def verify(budget: int):
            tree = build_mixture_tree(logprobs, budget)
            logits = path_logits(tree, vocab)
            return (verify_tree_sampling(tree, logits, settings, positions) if sampled
                    else verify_tree_greedy(tree, logits))

        lens = sub_budget_accept_lens(verify(21), budgets)
        expected = [torch.ones(bs, dtype=torch.long)] + [verify(int(b)).accept_lens for b in budgets[1:]]
        assert torch.equal(lens, torch.stack(expected, dim=1)), seed
        accepted += lens[:, -1].tolist()
    assert max(accepted) >= 3  # deep paths were accepted: the prefix rule was exercised


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


# --- sampling: SGLang's plain law, lossless tree walk, seeded streams ------------------------------
def sampling(bs: int, temperature: float, top_k: int, top_p: float, min_p: float,
             seeds: torch.Tensor | None = None, max_top_k: int | None = None) -> Sampling:
    return Sampling(torch.full((bs,), temperature), torch.full((bs,), top_k), torch.full((bs,), top_p),
                    torch.full((bs,), min_p), torch.arange(bs) if seeds is None else seeds, max_top_k)


def law_dict(probs: torch.Tensor) -> dict[int, float]:
    return {t: p for t, p in enumerate(probs.tolist()) if p > 0}


def tally(tokens: torch.Tensor) -> dict[int, int]:
    values, counts = tokens.unique(return_counts=True)
    return dict(zip(values.tolist(), counts.tolist()))


# (temperature, top_k, top_p, min_p). On CRAFTED_LOGITS' rows 1 and 2 the first, second and fourth
# keep more tokens under SGLang's joint top-k / top-p than under top-k, renormalise, then top-p (MFD's
# rule before); the third has min-p drop tokens that top-p keeps.
LAW_SETTINGS = [
    (1.0, 2, 0.55, 0.0),
    (1.0, 3, 0.7, 0.0),
    (0.8, TOP_K_ALL, 0.95, 0.3),
    (1.3, 3, 0.6, 0.2),
]
# [7, 6]: the root row is the example, [.5, .3, .2] on tokens 0-2 (top-k 2, top-p .55: SGLang
# keeps two tokens, the old rule one); rows 1 and 2 (after tokens 0 and 1) one spread-out
# distribution in two token orders; rows 3-6 are never checked.
_SPREAD = [0.35, 0.25, 0.2, 0.1, 0.06, 0.04]
CRAFTED_LOGITS = torch.tensor([
    [0.5, 0.3, 0.2, 1e-6, 1e-6, 1e-6],
    _SPREAD,
    [_SPREAD[i] for i in (3, 5, 1, 0, 2, 4)],
    *[_SPREAD[::-1]] * 4,
]).log()


def test_the_law_is_sglangs_plain_sampler() -> None:
    """plain_law keeps exactly the weights of SGLang's own function, with and without the
    max_top_k bound, over random rows and every combination of the filters."""
    generator = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.randn(64, 40, generator=generator) * scale for scale in (0.5, 2.0, 5.0)])
    example = torch.tensor([[0.5, 0.3, 0.2]]).log()
    weights = plain_law(example, torch.ones(1), torch.tensor([2]), torch.tensor([0.55]), torch.zeros(1))
    assert (weights > 0).tolist() == [[True, True, False]]  # the example
    for temperature in (0.7, 1.3):
        for top_k in (TOP_K_ALL, 1, 3, 12):
            for top_p in (1.0, 0.9, 0.55, 0.3):
                for min_p in (0.0, 0.05, 0.3):
                    settings = (temperature, top_k, top_p, min_p)
                    expected = sglang_law(logits, *settings)
                    bounds = [None] if top_k == TOP_K_ALL else [None, top_k, 20]
                    for max_top_k in bounds:
                        ours = plain_law(logits, *(torch.full((logits.shape[0],), v) for v in settings),
                                         max_top_k=max_top_k)
                        assert torch.equal(ours > 0, expected > 0), (settings, max_top_k)
                        torch.testing.assert_close(ours / ours.sum(-1, keepdim=True), expected,
                                                   rtol=0, atol=1e-6, msg=str((settings, max_top_k)))


def test_tied_probabilities_keep_the_lower_token_ids() -> None:
    """SGLang leaves the order of equal probabilities to its sort; MFD's is defined (lower token id
    first), so a top-k cut through tied tokens keeps the same ones on any device."""
    logits = torch.randint(0, 4, (200, 30), generator=torch.Generator().manual_seed(4)).float()
    weights = plain_law(logits, torch.ones(200), torch.full((200,), 6), torch.ones(200), torch.zeros(200))
    by_probability_then_id = logits * 100 - torch.arange(30)
    expected = torch.zeros_like(logits).scatter_(-1, by_probability_then_id.topk(6).indices, 1.0)
    assert torch.equal(weights > 0, expected > 0)


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", LAW_SETTINGS)
def test_tree_sampling_draws_from_sglangs_law(temperature, top_k, top_p, min_p) -> None:
    """One request per row (its own seed): the first token follows SGLang's law at the root, the
    second, given a first token that is a tree node, SGLang's law at that node (chi-square)."""
    num_draws = 20_000
    tree = DraftTree(  # root -> {0, 1, 4}; 0 -> {1, 2}; 1 -> 3
        tokens=torch.tensor([0, 1, 4, 1, 2, 3]),
        parents=torch.tensor([-1, -1, -1, 0, 0, 1]),
        depths=torch.tensor([1, 1, 1, 2, 2, 2]),
        scores=torch.tensor([-1.0, -1.2, -1.4, -2.0, -2.2, -2.4]),
        modes=torch.zeros(6, dtype=torch.long),
        valid=torch.ones(6, dtype=torch.bool),
    )
    logits = CRAFTED_LOGITS
    law = sglang_law(logits, temperature, top_k, top_p, min_p)
    batched = DraftTree(**{name: v.expand(num_draws, -1) for name, v in vars(tree).items()})
    result = verify_tree_sampling(batched, logits.expand(num_draws, -1, -1),
                                  sampling(num_draws, temperature, top_k, top_p, min_p),
                                  root_positions=torch.full((num_draws,), 11))
    first, second = result.accepted_tokens[:, 0], result.accepted_tokens[:, 1]
    assert_follows(tally(first), law_dict(law[0]), "first token")
    root_children = {0: 1, 1: 2, 4: 3}  # token -> local index
    checked = 0
    for token in range(logits.shape[1]):
        drew = first == token
        if token not in root_children:
            assert (second[drew] == -1).all() and (result.accept_lens[drew] == 1).all()
        elif drew.sum() >= 2000:
            assert_follows(tally(second[drew]), law_dict(law[root_children[token]]), f"after {token}")
            checked += 1
    assert checked >= 1


def test_one_requests_stream_over_positions_follows_the_law() -> None:
    """A single seed's coins along positions are independent draws: the same distribution drawn
    at 20000 successive positions follows SGLang's law."""
    logits = CRAFTED_LOGITS[1:2].expand(20_000, -1)
    settings = (1.0, 4, 0.95, 0.05)
    tokens = sample_from_logits(logits, sampling(20_000, *settings, seeds=torch.full((20_000,), 1234)),
                                positions=torch.arange(20_000))
    assert_follows(tally(tokens), law_dict(sglang_law(logits[:1], *settings)[0]))


def test_coins_are_uniform_per_seed_and_per_position() -> None:
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 987654321])
    coins = stream_coins(seeds[:, None], torch.arange(5000)[None, :])
    assert ((coins > 0) & (coins < 1)).all()
    assert torch.equal(coins, stream_coins(seeds[:, None], torch.arange(5000)[None, :]))
    across_seeds = stream_coins(torch.arange(5000), torch.tensor(17))
    for sample in (*coins, across_seeds):  # each seed along positions; many seeds at one position
        bins = (sample * 10).long()
        assert_follows(tally(bins), {b: 0.1 for b in range(10)}, "coin deciles")
    # Streams of different seeds differ (no two requests share one).
    assert len({tuple(row.tolist()) for row in coins[:, :8]}) == len(seeds)


def test_seeded_draws_are_the_requests_own() -> None:
    """A request's tokens depend on its seed, its logits and positions only: the same in a batch
    whose other requests have other settings; the tree's first token and, on an accepted node, its
    second are the draws of plain sampling at those positions. Different seeds give different
    tokens; greedy rows (top_k 1) take the argmax."""
    generator = torch.Generator().manual_seed(3)
    # Integer logits: many exact ties, at the top and at the top-k cut.
    logits = torch.randint(0, 4, (8, 7, 30), generator=generator).float()
    roots = torch.arange(8) * 5
    seeds = torch.tensor([5, 5, 6, 7, 8, 9, 10, 11])
    alone = sampling(8, 1.0, 6, 0.9, 0.05, seeds=seeds)
    first = sample_from_logits(logits[:, 0], alone, roots)
    tokens = torch.randint(0, 30, (8, 6), generator=generator)
    # Rows 0-3 accept their first node (local index 1), rows 4-7 the root's other child (local 4).
    tokens[:4, 0], tokens[:4, 3] = first[:4], (first[:4] + 1) % 30
    tokens[4:, 0], tokens[4:, 3] = (first[4:] + 1) % 30, first[4:]
    tree = DraftTree(tokens=tokens, parents=torch.tensor([-1, 0, 1, -1, 3, 4]).expand(8, -1),
                     depths=torch.tensor([1, 2, 3, 1, 2, 3]).expand(8, -1),
                     scores=torch.zeros(8, 6), modes=torch.zeros(8, 6, dtype=torch.long),
                     valid=torch.ones(8, 6, dtype=torch.bool))
    mixed = Sampling(alone.temperature, torch.tensor([6, 6, 6, 6, 1, 6, 6, TOP_K_ALL]), alone.top_p,
                     alone.min_p, seeds)
    result = verify_tree_sampling(tree, logits, alone, roots)
    other = verify_tree_sampling(tree, logits, mixed, roots)
    same = torch.tensor([True, True, True, True, False, True, True, False])
    assert torch.equal(result.accepted_tokens[same], other.accepted_tokens[same])
    assert other.accepted_tokens[4, 0] == logits[4, 0].argmax()  # greedy: the first of the tied maxima
    # Also with the top-k bound, whose topk orders tied maxima its own way.
    greedy_rows = Sampling(alone.temperature, torch.tensor([1, 6] * 4), alone.top_p, alone.min_p, seeds,
                           max_top_k=6)
    greedy = sample_from_logits(logits[:, 0], greedy_rows, roots)
    assert torch.equal(greedy[::2], logits[::2, 0].argmax(-1))
    # The tree's tokens are plain sampling's: root draw at roots, an accepted first node's at roots + 1.
    assert torch.equal(result.accepted_tokens[:, 0], first)
    accepted = 0
    for b in range(8):
        node = result.accepted_local_indices[b, 0].item()
        if node > 0:
            row = Sampling(*(t[b : b + 1] for t in (alone.temperature, alone.top_k, alone.top_p, alone.min_p,
                                                   alone.seeds)))
            draw = sample_from_logits(logits[b : b + 1, node], row, roots[b : b + 1] + 1)
            assert result.accepted_tokens[b, 1] == draw[0]
            accepted += 1
    assert accepted == 8
    # Many seeds on the same logits and positions: not one shared stream.
    many = sample_from_logits(logits[:1, 0].expand(200, -1), sampling(200, 1.0, 6, 0.9, 0.05, max_top_k=6),
                              torch.zeros(200, dtype=torch.long))
    assert len(many.unique()) >= 3


def test_random_seeds_differ() -> None:
    seeds = random_seeds(1000, "cpu")
    assert seeds.dtype == torch.long and len(seeds.unique()) == 1000 and (seeds >= 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_pipeline_matches_cpu_without_host_sync() -> None:
    from mfd_sglang.tree_layout import tree_to_verify_layout

    generator = torch.Generator().manual_seed(5)
    bs, budget, vocab = 3, 16, 40
    logprobs = torch.randn(bs, 2, 4, vocab, generator=generator).log_softmax(-1)
    target_logits = torch.randn(bs, budget + 1, vocab, generator=generator)
    root_tokens, seq_lens = torch.tensor([1, 2, 3]), torch.tensor([7, 0, 12])
    settings = Sampling(torch.full((bs,), 0.7), torch.tensor([0, 5, 50]), torch.tensor([1.0, 0.9, 0.5]),
                        torch.tensor([0.0, 0.1, 0.0]), torch.tensor([1, -2, 2**40]))

    def pipeline(device: str):
        # Inputs are moved first: a host-to-device copy itself counts as a sync.
        lp, logits, roots, lens = (
            t.to(device) for t in (logprobs, target_logits, root_tokens, seq_lens)
        )
        on_device = Sampling(*(getattr(settings, f).to(device) for f in
                               ("temperature", "top_k", "top_p", "min_p", "seeds")))
        with host_syncs_raise(device):
            tree = build_mixture_tree(lp, budget)
            layout = tree_to_verify_layout(tree, roots, lens)
            greedy = verify_tree_greedy(tree, logits)
            # The coins are a hash of (seed, position): the same draws on either device.
            sampled = verify_tree_sampling(tree, logits, on_device, lens)
        return tree, layout, greedy, sampled

    for cuda_part, cpu_part in zip(pipeline("cuda"), pipeline("cpu")):
        for name, value in vars(cpu_part).items():
            torch.testing.assert_close(getattr(cuda_part, name).cpu(), value, msg=name)
