"""Drafting without [bs, K, D, V]: the top candidates scored in vocabulary chunks equal the top of the
full log_softmax, and the tree built from them equals the tree built from the full distributions."""

from __future__ import annotations

import pytest
import torch

from mfd_sglang.drafter import vocab_candidates
from mfd_sglang.tree import build_mixture_tree, top_candidates
from references import HIDDEN, VOCAB, inputs, make_drafter

FIELDS = ("tokens", "parents", "depths", "modes", "valid")


def full_top(hidden: torch.Tensor, weight: torch.Tensor, count: int):
    """The independent reference: log_softmax over every row, then a stable ranking."""
    return top_candidates(torch.log_softmax((hidden @ weight.T).float(), dim=-1), count)


@pytest.mark.parametrize("chunk_size", [1, 7, 64, VOCAB, 3 * VOCAB])
@pytest.mark.parametrize("count", [1, 5, VOCAB, VOCAB + 9])
def test_chunked_candidates_equal_the_top_of_the_full_log_softmax(chunk_size, count):
    gen = torch.Generator().manual_seed(chunk_size * 100 + count)
    hidden, weight = torch.randn(2, 3, 4, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    got, want = vocab_candidates(hidden, weight, count, chunk_size), full_top(hidden, weight, count)
    assert got.vocab == want.vocab == VOCAB and got.tokens.shape == want.tokens.shape
    assert got.tokens.shape[-1] == min(count, VOCAB)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 16])
def test_equal_logits_rank_by_token_id_across_chunks(chunk_size):
    # Small integers: every logit is exact, so equal rows give equal logits in any chunking.
    gen = torch.Generator().manual_seed(1)
    weight = torch.randint(-3, 4, (VOCAB, HIDDEN), generator=gen).float()
    weight[[9, 40, 2, 17, 33]] = 3.0  # five equal rows, spread over several chunks, that
    hidden = torch.full((2, HIDDEN), 3.0)  # score 9 * HIDDEN: no row in [-3, 3] scores more
    got = vocab_candidates(hidden, weight, 8, chunk_size)
    assert got.tokens[:, :5].tolist() == [[2, 9, 17, 33, 40]] * 2
    assert torch.equal(got.tokens, full_top(hidden, weight, 8).tokens)


def test_bfloat16_hidden_states_rank_like_the_full_path():
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 5, HIDDEN, generator=gen).bfloat16()
    weight = torch.randn(VOCAB, HIDDEN, generator=gen).bfloat16()
    got, want = vocab_candidates(hidden, weight, 12, 8), full_top(hidden, weight, 12)
    assert torch.equal(got.tokens, want.tokens)
    torch.testing.assert_close(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("draft_vocab", [None, torch.arange(3, VOCAB, 2)])
@pytest.mark.parametrize("single_mode", [False, True])
def test_tree_from_block_candidates_equals_the_tree_from_full_logprobs(draft_vocab, single_mode):
    drafter = make_drafter(num_modes=4)
    if draft_vocab is not None:
        drafter.draft_vocab = draft_vocab
    features, ctx_pos, _, _ = inputs(3, 7)
    context = drafter.context_kv(features, ctx_pos)
    gen = torch.Generator().manual_seed(5)
    embed, lm_head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen)
    roots, starts = torch.tensor([1, 8, 30]), torch.full((3,), 7)
    full = drafter.block_logprobs(roots, starts, context, embed, lm_head, single_mode=single_mode)
    for budget in (1, 6, 25, 200):
        candidates = drafter.block_candidates(roots, starts, context, embed, drafter.head_weight(lm_head), budget,
                                              single_mode=single_mode, chunk_size=5)
        assert candidates.logprobs.shape == (*full.shape[:-1], min(budget, full.shape[-1]))
        want, got = build_mixture_tree(full, budget), build_mixture_tree(candidates, budget)
        for name in FIELDS:
            assert torch.equal(getattr(got, name), getattr(want, name)), (budget, name)
        torch.testing.assert_close(got.scores, want.scores, rtol=0, atol=1e-5)


def test_too_few_candidates_for_the_budget_are_refused():
    candidates = top_candidates(torch.randn(1, 2, 3, VOCAB).log_softmax(-1), 4)
    with pytest.raises(ValueError, match="C >= min"):
        build_mixture_tree(candidates, 5)
