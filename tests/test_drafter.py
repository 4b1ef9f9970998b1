"""The drafter: K modes in one pass equal K separate passes; padding and context visibility are right."""

from __future__ import annotations

import pytest
import torch

from mfd_sglang.drafter import MFDDrafter
from references import BLOCK, HIDDEN, VOCAB, inputs, make_drafter


def test_k_modes_in_one_pass_equal_separate_single_mode_passes():
    drafter = make_drafter(num_modes=3)
    features, ctx_pos, block, block_pos = inputs(2, 9)
    with torch.no_grad():
        context = drafter.context_kv(features, ctx_pos)
        together = drafter(block, block_pos, context)
        assert together.shape == (2, 3, BLOCK - 1, HIDDEN)
        for mode in range(3):
            alone = make_drafter(num_modes=3, default_mode=mode)
            alone.load_state_dict(drafter.state_dict())
            single = alone(block, block_pos, alone.context_kv(features, ctx_pos), single_mode=True)
            torch.testing.assert_close(together[:, mode : mode + 1], single, atol=1e-5, rtol=1e-5)
    # Different modes really draft differently.
    assert not torch.allclose(together[:, 0], together[:, 1], atol=1e-3)


def test_batched_padded_contexts_equal_unbatched():
    drafter = make_drafter()
    features, ctx_pos, block, _ = inputs(2, 12)
    lengths = [12, 7]
    with torch.no_grad():
        valid = torch.arange(12)[None] < torch.tensor(lengths)[:, None]
        block_pos = torch.tensor(lengths)[:, None] + torch.arange(BLOCK)[None]
        batched = drafter(block, block_pos, drafter.context_kv(features, ctx_pos, valid))
        for b, n in enumerate(lengths):
            alone = drafter(block[b : b + 1], block_pos[b : b + 1],
                            drafter.context_kv(features[b : b + 1, :n], ctx_pos[b : b + 1, :n]))
            torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-5, rtol=1e-5)


def test_block_sees_valid_context_only():
    drafter = make_drafter()
    features, ctx_pos, block, block_pos = inputs(1, 8)
    valid = torch.arange(8)[None] < 5
    with torch.no_grad():
        base = drafter(block, block_pos, drafter.context_kv(features, ctx_pos, valid))
        changed_hidden = features.clone()
        changed_hidden[:, 6] += 5.0
        same = drafter(block, block_pos, drafter.context_kv(changed_hidden, ctx_pos, valid))
        changed_visible = features.clone()
        changed_visible[:, 2] += 5.0
        differs = drafter(block, block_pos, drafter.context_kv(changed_visible, ctx_pos, valid))
    torch.testing.assert_close(base, same)
    assert not torch.allclose(base, differs, atol=1e-3)


def outputs_before_after_moving_the_last_block_slot(drafter: MFDDrafter, ctx_len: int):
    features, ctx_pos, block, block_pos = inputs(1, ctx_len)
    with torch.no_grad():
        context = drafter.context_kv(features, ctx_pos)
        later = block.clone()
        later[:, -1] += 3.0
        return drafter(block, block_pos, context), drafter(later, block_pos, context)


def test_attention_inside_the_block_is_bidirectional():
    """A later block position influences an earlier one (DFlash blocks are not causal)."""
    base, moved = outputs_before_after_moving_the_last_block_slot(make_drafter(), ctx_len=4)
    assert not torch.allclose(base[:, :, 0], moved[:, :, 0], atol=1e-4)


def test_sliding_layers_are_causal_within_their_window():
    drafter = make_drafter(layer_types=("sliding_attention", "sliding_attention"), sliding_window=3)
    base, moved = outputs_before_after_moving_the_last_block_slot(drafter, ctx_len=6)
    features, ctx_pos, block, block_pos = inputs(1, 6)
    with torch.no_grad():
        far = features.clone()
        far[:, 0] += 5.0  # 6+ positions before every block slot: outside a window of 3 after two layers
        unseen = drafter(block, block_pos, drafter.context_kv(far, ctx_pos))
    torch.testing.assert_close(base[:, :, : BLOCK - 2], moved[:, :, : BLOCK - 2])
    torch.testing.assert_close(base, unseen)


@pytest.mark.parametrize("draft_vocab", [None, torch.tensor([1, 4, 7, 20, 33])])
def test_logprobs_over_the_draft_vocabulary_map_back_to_target_ids(draft_vocab):
    drafter = make_drafter()
    if draft_vocab is not None:
        drafter.draft_vocab = draft_vocab
    lm_head = torch.randn(VOCAB, HIDDEN)
    hidden = torch.randn(2, 3, BLOCK - 1, HIDDEN)
    logprobs = drafter.logprobs(hidden, lm_head)
    expected_ids = torch.arange(VOCAB) if draft_vocab is None else draft_vocab
    assert logprobs.shape[-1] == len(expected_ids)
    torch.testing.assert_close(logprobs.exp().sum(-1), torch.ones(2, 3, BLOCK - 1))
    best = logprobs.argmax(-1)
    full_scores = hidden @ lm_head[expected_ids].T
    assert torch.equal(drafter.to_target_ids(best), expected_ids[full_scores.argmax(-1)])


def test_paged_context_read_in_place_equals_the_padded_context():
    from mfd_sglang.serving.draft_context_pool import DraftContextPool

    drafter = make_drafter(num_modes=3)
    lengths = [5, 9]
    features, ctx_pos, block_embeds, _ = inputs(2, max(lengths))
    block_pos = torch.tensor(lengths)[:, None] + torch.arange(BLOCK)
    valid = ctx_pos < torch.tensor(lengths)[:, None]
    dense = drafter.context_kv(features, ctx_pos, valid)

    pool = DraftContextPool(drafter, 40, device="cpu", dtype=torch.float32)
    table = torch.zeros(4, 12, dtype=torch.int32)  # SGLang's req_to_token: rows of slot ids
    rows = torch.tensor([3, 1])
    slots = torch.randperm(39, generator=torch.Generator().manual_seed(2))[:sum(lengths)] + 1
    for b, (row, n) in enumerate(zip(rows, lengths)):
        mine = slots[sum(lengths[:b]): sum(lengths[:b]) + n]
        table[row, :n] = mine.int()
        pool.write(drafter, features[b, :n], torch.arange(n), mine)
    paged = pool.paged(table, rows, torch.tensor(lengths), backend="torch")
    with torch.no_grad():
        torch.testing.assert_close(drafter(block_embeds, block_pos, paged), drafter(block_embeds, block_pos, dense),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("attention_bias", [False, True])
def test_stacked_context_projections_equal_each_layers_own(attention_bias):
    """context_kv's one product per K and V over all layers (stacked per call, and read in place after
    stack_context_projections) equals every layer's own keys_values on random inputs; the in-place stack
    shares the layers' weights (a weight changed is seen), gradients reach every layer's weights, and FP8
    linears take each layer's own path."""
    from mfd_sglang.drafter import Rope

    drafter = make_drafter(seed=3, attention_bias=attention_bias)
    features, ctx_pos, _, _ = inputs(2, 7)
    with torch.no_grad():
        ctx = drafter.project_context(features)
        rope = Rope.at(ctx_pos, drafter.cfg, ctx.dtype)
        own = [layer.keys_values(ctx, rope) for layer in drafter.layers]
        per_call = drafter.context_kv(features, ctx_pos)
        in_place = drafter.stack_context_projections().context_kv(features, ctx_pos)
    assert drafter._stacked_context is not None
    for got in (per_call, in_place):
        for (k, v), got_k, got_v in zip(own, got.keys, got.values):
            torch.testing.assert_close(got_k, k, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got_v, v, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        drafter.layers[1].v_proj.weight.mul_(2)  # a view of the stack: the next product reads it in place
        assert drafter.stacked_context_projections() is drafter._stacked_context
        torch.testing.assert_close(drafter.context_kv(features, ctx_pos).values[1],
                                   drafter.layers[1].keys_values(ctx, rope)[1], atol=1e-6, rtol=1e-5)
        assert not torch.allclose(drafter.context_kv(features, ctx_pos).values[1], in_place.values[1])
    trained = make_drafter(seed=3, attention_bias=attention_bias).train()
    trained.context_kv(features, ctx_pos).keys[1].sum().backward()
    assert trained.layers[1].k_proj.weight.grad.abs().sum() > 0 and trained.layers[1].k_norm.grad.abs().sum() > 0
    assert trained.layers[0].k_proj.weight.grad.abs().sum() == 0  # layer 0's keys are another output
    fp8 = make_drafter(seed=3, attention_bias=attention_bias).quantize_linears_fp8()
    assert fp8.stacked_context_projections() is None and fp8.stack_context_projections()._stacked_context is None
