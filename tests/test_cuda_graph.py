"""Fixed-shape replays (`mfd_sglang.cuda_graph`): a padded bucket gives what the function gives on
the unpadded batch; on CPU the same static buffers run eagerly, on CUDA as graphs (skipped here)."""

from __future__ import annotations

import pytest
import torch

from mfd_sglang.cuda_graph import BatchGraphs, capture, default_buckets
from mfd_sglang.tree import DraftTree, build_mixture_tree

K, D, V, BUDGET = 3, 4, 11, 9


def tree_of_rows(table: torch.Tensor, seeds: torch.Tensor, *, key) -> DraftTree:
    """A row-independent function with a dataclass output: a mixture tree per row from logprobs
    looked up by seed (key scales them, standing in for a second mode path)."""
    logprobs = torch.log_softmax(table[seeds] * (2.0 if key else 1.0), dim=-1)
    return build_mixture_tree(logprobs, BUDGET)


def same_trees(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "scores",
                                                                    "modes", "valid"))


def graphs_for(table: torch.Tensor, use_graph: bool) -> BatchGraphs:
    device = table.device
    return BatchGraphs(lambda seeds, *, key: tree_of_rows(table, seeds, key=key),
                       lambda bs: [torch.zeros(bs, dtype=torch.int64, device=device)],
                       default_buckets(12), use_graph=use_graph)


def check_padded_batches_match(device: str, use_graph: bool) -> None:
    table = torch.randn(40, K, D, V, generator=torch.Generator().manual_seed(0)).to(device)
    graphs = graphs_for(table, use_graph)
    graphs.capture_all(keys=(False, True))
    gen = torch.Generator().manual_seed(1)
    # Sizes that hit buckets exactly and ones padded up to the next bucket, both keys, repeated
    # so that stale rows of a previous, larger batch would show.
    for bs, key in [(12, False), (3, False), (1, True), (5, True), (8, False), (2, False), (12, True), (7, False)]:
        seeds = torch.randint(0, 40, (bs,), generator=gen).to(device)
        replayed = graphs(seeds, key=key)
        assert replayed.tokens.shape == (bs, BUDGET)
        assert same_trees(replayed, tree_of_rows(table, seeds, key=key)), (bs, key)


def test_buckets():
    assert default_buckets(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert default_buckets(12) == [1, 2, 4, 8, 12]
    assert default_buckets(1) == [1]
    graphs = graphs_for(torch.zeros(2, K, D, V), use_graph=False)
    assert [graphs.bucket(b) for b in (1, 3, 5, 9, 12)] == [1, 4, 8, 12, 12]
    with pytest.raises(ValueError, match="a batch of 13 exceeds the largest bucket 12"):
        graphs.bucket(13)


def test_eager_capture_replays_from_the_static_inputs():
    x = torch.arange(4.0)
    replay, out = capture(lambda t: t * 2, x, use_graph=False)
    x.copy_(torch.tensor([5.0, 6.0, 7.0, 8.0]))
    assert replay() is out and out.tolist() == [10.0, 12.0, 14.0, 16.0]


def test_padded_batches_match_unpadded_on_cpu():
    check_padded_batches_match("cpu", use_graph=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_padded_batches_match_unpadded_as_cuda_graphs():
    check_padded_batches_match("cuda", use_graph=True)
