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
def test_joined_products_equal_each_projection_alone(attention_bias):
    """context_kv's one product per K and V over all layers and a layer's one product for gate and up (joined
    per call, and read in place after join_projections) equal each layer's own projections on random inputs;
    joined in place, the weights are views of one tensor (a weight changed is seen, nothing copied per call),
    gradients reach every weight when not joined, and FP8 linears take each projection alone."""
    from mfd_sglang.drafter import Rope, joined

    drafter = make_drafter(seed=3, attention_bias=attention_bias)
    features, ctx_pos, block, block_pos = inputs(2, 7)
    layer = drafter.layers[1]
    x = torch.randn(2, 5, HIDDEN, generator=torch.Generator().manual_seed(4))

    def mlp_alone(layer, x):
        return layer.down_proj(torch.nn.functional.silu(layer.gate_proj(x)) * layer.up_proj(x))

    with torch.no_grad():
        ctx = drafter.project_context(features)
        rope = Rope.at(ctx_pos, drafter.cfg, ctx.dtype)
        own = [layer.keys_values(ctx, rope) for layer in drafter.layers]
        mlp_own = mlp_alone(layer, x)
        torch.testing.assert_close(layer.mlp(x), mlp_own)
        per_call = drafter.context_kv(features, ctx_pos)
        drafted = drafter(block, block_pos, per_call)
        in_place = drafter.join_projections().context_kv(features, ctx_pos)
        assert torch.equal(drafter(block, block_pos, in_place), drafted)  # the same products, joined or not
        weights = [layer.k_proj.weight for layer in drafter.layers]
        assert joined(weights).data_ptr() == weights[0].data_ptr()  # a view: nothing concatenated per call
        assert joined([layer.gate_proj.weight, layer.up_proj.weight]).data_ptr() == layer.gate_proj.weight.data_ptr()
        torch.testing.assert_close(layer.mlp(x), mlp_own)
    for got in (per_call, in_place):
        for (k, v), got_k, got_v in zip(own, got.keys, got.values):
            torch.testing.assert_close(got_k, k, atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(got_v, v, atol=1e-6, rtol=1e-5)
    with torch.no_grad():
        drafter.layers[1].v_proj.weight.mul_(2)  # a view of the joined tensor: the next product reads it
        torch.testing.assert_close(drafter.context_kv(features, ctx_pos).values[1],
                                   drafter.layers[1].keys_values(ctx, rope)[1], atol=1e-6, rtol=1e-5)
        assert not torch.allclose(drafter.context_kv(features, ctx_pos).values[1], in_place.values[1])
    trained = make_drafter(seed=3, attention_bias=attention_bias).train()
    trained(block, block_pos, trained.context_kv(features, ctx_pos)).sum().backward()
    for name in ("k_proj", "v_proj", "gate_proj", "up_proj"):
        assert all(getattr(layer, name).weight.grad.abs().sum() > 0 for layer in trained.layers), name
    fp8 = make_drafter(seed=3, attention_bias=attention_bias).quantize_linears_fp8().join_projections()
    storages = {layer.k_norm.untyped_storage().data_ptr() for layer in fp8.layers}
    assert len(storages) == len(fp8.layers)  # not joined
    with torch.no_grad():
        fp8_context = fp8.context_kv(features, ctx_pos)
        torch.testing.assert_close(fp8_context.keys[1], fp8.layers[1].keys_values(fp8.project_context(features),
                                                                                   rope)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rope_equals_transformers_half_rotation_bit_for_bit(dtype):
    """apply_rope over rope_cos_sin's tables (one roll, the sign folded into sin) equals transformers' Qwen3
    rope (x * cos + rotate_half(x) * sin over cos / sin of the angles twice) exactly, at long positions."""
    from transformers.models.qwen3.modeling_qwen3 import rotate_half

    from mfd_sglang.drafter import apply_rope, rope_cos_sin

    gen = torch.Generator().manual_seed(5)
    positions = torch.randint(0, 40960, (3, 17), generator=gen)
    x = torch.randn(3, 17, 4, 128, generator=gen).to(dtype)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos().to(dtype)[:, :, None], angles.sin().to(dtype)[:, :, None]
    ours_cos, ours_sin = rope_cos_sin(positions, 128, 1e6, dtype)
    assert torch.equal(apply_rope(x, ours_cos[:, :, None], ours_sin[:, :, None]), x * cos + rotate_half(x) * sin)
