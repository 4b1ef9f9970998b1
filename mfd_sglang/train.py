"""Drafter training on target-generated sequences (the DFlash recipe, with K modes).

A training example is an anchor position a in a sequence the target produced: the block is
`[token a, MASK x D]` at positions a..a+D, it sees the target's context features strictly before
a, is bidirectional inside, and never sees other blocks. The loss is cross-entropy on the D
drafted positions, weighted by exp(-(d-1)/7) (early positions matter most for acceptance).
With K modes each example is scored under every mode and the loss goes mostly to the mode that
already fits it best (winner-take-all, so modes specialise) with a small share for every mode
(so none dies).
"""

from __future__ import annotations

import math

import torch

from .drafter import DraftContext, MFDDrafter

POSITION_DECAY = 7.0
WINNER_SHARE = 0.9


def position_weights(num_positions: int, device=None) -> torch.Tensor:
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / POSITION_DECAY)


def anchor_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block inputs, positions and labels for anchors [bs, A] in sequences tokens [bs, S].

    Returns block tokens [bs*A, T], positions [bs*A, T], labels [bs*A, T-1], and the sequence row of
    each example [bs*A].
    """
    bs, num_anchors = anchors.shape
    offsets = torch.arange(block_size, device=tokens.device)
    positions = (anchors[..., None] + offsets).reshape(bs * num_anchors, block_size)
    rows = torch.arange(bs, device=tokens.device).repeat_interleave(num_anchors)
    labels = tokens[rows[:, None], positions[:, 1:]]
    block = torch.full_like(positions, mask_token_id)
    block[:, 0] = tokens[rows, positions[:, 0]]
    return block, positions, labels, rows


def drafter_loss(drafter: MFDDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Mean per-example loss for sequences tokens [bs, S] with target context features [bs, S, n*H]."""
    cfg = drafter.cfg
    if drafter.draft_vocab is not None:
        raise ValueError("training a drafter with a draft vocabulary is not supported yet; train on the full vocabulary")
    block, positions, labels, rows = anchor_blocks(tokens, anchors, cfg.block_size, cfg.mask_token_id)
    seq_positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
    full = drafter.context_kv(features, seq_positions)
    # Each example sees the context strictly before its anchor.
    context = DraftContext(
        keys=[k[rows] for k in full.keys],
        values=[v[rows] for v in full.values],
        positions=seq_positions[rows],
        valid=seq_positions[rows] < positions[:, :1],
    )
    hidden = drafter(embed_weight[block], positions, context)  # [n, K, D, H]
    logprobs = drafter.logprobs(hidden, lm_head_weight)
    token_nll = -logprobs.gather(-1, labels[:, None, :, None].expand(-1, hidden.shape[1], -1, 1))[..., 0]
    per_mode = (token_nll * position_weights(labels.shape[1], tokens.device)).sum(-1)  # [n, K]
    num_modes = per_mode.shape[1]
    if num_modes == 1:
        return per_mode.mean()
    winner = torch.nn.functional.one_hot(per_mode.detach().argmin(-1), num_modes).float()
    weights = WINNER_SHARE * winner + (1 - WINNER_SHARE) / num_modes
    return (weights * per_mode).sum(-1).mean()


def sample_anchors(generator: torch.Generator, bs: int, num_anchors: int, seq_len: int, block_size: int,
                   min_context: int = 1) -> torch.Tensor:
    """Random anchors [bs, A] with a full block inside the sequence and at least `min_context` context tokens."""
    high = seq_len - block_size + 1
    return torch.randint(min_context, high, (bs, num_anchors), generator=generator)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))
