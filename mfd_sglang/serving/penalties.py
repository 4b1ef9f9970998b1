"""Penalties, min_new_tokens and logit_bias at every tree node, exactly as the plain server applies them.

Contract. The plain server (SGLang 0.5.23, `sampling_batch_info.apply_logits_bias`) adjusts the
target's logits for a request's next token from the tokens the request has output so far: the
frequency penalty subtracts penalty x count of each output token, the presence penalty subtracts
the penalty from every token that was output, the repetition penalty scales those tokens' logits
(x penalty when negative, / penalty otherwise), min_new_tokens adds -inf to the request's stop
tokens while fewer than that many tokens are out; then the request's logit_bias is added. Additive
terms come before the scaling one, as in SGLang's overlap path (its non-overlap path applies its
penalizers in set order, which only matters when a request combines the repetition penalty with an
additive one).

Tree row i is the target's distribution after local node i's path (root = 0, committed already), so
`adjust_tree_logits` gives it the adjustment the plain server would apply had it output that path:
the committed outputs (`OutputPenalties`, SGLang's penalizer tensors) plus the tokens of node i's
path below the root, and the output length plus node i's depth. `cumulate` adds a round's committed
tokens to those tensors in place, so they count every output token (SGLang's own speculative paths
count one token per round). Everything is fixed-shape and host-sync free.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class OutputPenalties:
    """A batch's penalty state over its committed output tokens; a field is None when no request of the
    batch uses it. The [bs, V] sums are SGLang's own penalizer tensors (updated in place)."""

    frequency: Tensor | None = None  # [bs, 1] float: each request's frequency penalty
    frequency_sum: Tensor | None = None  # [bs, V] float: penalty x count of the token in the output
    presence: Tensor | None = None  # [bs, 1] float
    presence_sum: Tensor | None = None  # [bs, V] float: the penalty where the token was output, else 0
    repetition: Tensor | None = None  # [bs, 1] float
    repetition_scale: Tensor | None = None  # [bs, V] float: the penalty where the token was output, else 1
    min_new_tokens: Tensor | None = None  # [bs, 1] int
    output_len: Tensor | None = None  # [bs, 1] int: tokens output so far
    stop_penalty: Tensor | None = None  # [bs, V] float: -inf at the request's stop tokens, else 0
    logit_bias: Tensor | None = None  # [bs, V] float

    @property
    def counts_paths(self) -> bool:
        """Whether a node's adjustment depends on the tokens of its path (not only on its depth)."""
        return any(t is not None for t in (self.frequency, self.presence, self.repetition))


def output_penalties(sampling_info) -> OutputPenalties | None:
    """The penalty state of an SGLang SamplingBatchInfo, or of the forward copy the scheduler hands the
    worker (None when the batch uses none). Reads the penalizers of SGLang 0.5.23's `penaltylib` by
    their attribute names."""
    from sglang.srt.sampling import penaltylib

    from mfd_sglang.patches.penalty_state import penalizer_orchestrator

    state = OutputPenalties(logit_bias=sampling_info.logit_bias)
    orchestrator = penalizer_orchestrator(sampling_info)
    if orchestrator is not None and orchestrator.is_required:
        penalizers = orchestrator.penalizers
        frequency = penalizers.get(penaltylib.BatchedFrequencyPenalizer)
        if frequency is not None and frequency.is_prepared():
            state.frequency, state.frequency_sum = frequency.frequency_penalties, frequency.cumulated_frequency_penalties
        presence = penalizers.get(penaltylib.BatchedPresencePenalizer)
        if presence is not None and presence.is_prepared():
            state.presence, state.presence_sum = presence.presence_penalties, presence.cumulated_presence_penalties
        repetition = penalizers.get(penaltylib.BatchedRepetitionPenalizer)
        if repetition is not None and repetition.is_prepared():
            state.repetition = repetition.repetition_penalties
            state.repetition_scale = repetition.cumulated_repetition_penalties
        min_new = penalizers.get(penaltylib.BatchedMinNewTokensPenalizer)
        if min_new is not None and min_new.is_prepared():
            state.min_new_tokens, state.output_len = min_new.min_new_tokens, min_new.len_output_tokens
            state.stop_penalty = min_new.stop_token_penalties
    if all(value is None for value in vars(state).values()):
        return None
    return state


def path_token_counts(tokens: Tensor, ancestors: Tensor, vocab: int) -> Tensor:
    """[bs, N, V] float: how often each token occurs on local node i's path below the root.

    tokens [bs, N]: local node tokens (root first); ancestors [bs, N, N] bool: [b, i, j] when local
    node j is node i or an ancestor of it (`tree_layout.tree_ancestor_mask`)."""
    bs, num_nodes = tokens.shape
    below_root = ancestors.clone()
    below_root[:, :, 0] = False
    counts = torch.zeros(bs, num_nodes, vocab, dtype=torch.float32, device=tokens.device)
    index = tokens.clamp(0, vocab - 1)[:, None, :].expand(bs, num_nodes, num_nodes)
    return counts.scatter_add_(2, index, below_root.float())


def adjust_tree_logits(logits: Tensor, state: OutputPenalties, depths: Tensor,
                       path_counts: Tensor | None = None) -> Tensor:
    """Apply the plain server's adjustment to every row of logits [bs, N, V] (float32, in place; also
    returned). depths [bs, N]: tokens of row i's path below the root (0 for the root); path_counts
    [bs, N, V] (`path_token_counts`), or None when no row has path tokens (the prefill's row)."""
    frequency_sum, presence_sum, repetition_scale = (None if t is None else t[:, None, :] for t in (
        state.frequency_sum, state.presence_sum, state.repetition_scale))
    if path_counts is not None:
        seen = path_counts > 0
        if state.frequency is not None:
            frequency_sum = frequency_sum + state.frequency[:, :, None] * path_counts
        if state.presence is not None:
            presence_sum = torch.where(seen, state.presence[:, :, None], presence_sum)
        if state.repetition is not None:
            repetition_scale = torch.where(seen, state.repetition[:, :, None], repetition_scale)
    if frequency_sum is not None:
        logits -= frequency_sum
    if presence_sum is not None:
        logits -= presence_sum
    if state.min_new_tokens is not None:
        short = (state.output_len + depths) < state.min_new_tokens  # [bs, N]
        logits += torch.where(short[:, :, None], state.stop_penalty[:, None, :], 0.0)
    if repetition_scale is not None:
        logits.copy_(torch.where(logits < 0, logits * repetition_scale, logits / repetition_scale))
    if state.logit_bias is not None:
        logits += state.logit_bias[:, None, :]
    return logits


def count_resumed_output(state: OutputPenalties, reqs, device) -> None:
    """Count the output each request already has when it is prefilled again, after SGLang retracted it
    to free KV slots. SGLang 0.5.23's penalizers start from zero for every new batch and never read
    req.output_ids, so its plain server forgets those counts (penalised output changes when the KV pool
    runs full); MFD counts them, as the plain law without retraction does."""
    outputs = [list(req.output_ids) for req in reqs]
    if not any(outputs):
        return
    width = max(len(o) for o in outputs)
    from sglang.srt.utils import async_h2d  # sglang only where a server runs: the unit tests stay light

    tokens = async_h2d([o + [-1] * (width - len(o)) for o in outputs], dtype=torch.int64, device=device)
    cumulate(state, tokens, async_h2d([len(o) for o in outputs], dtype=torch.int64, device=device))


def cumulate(state: OutputPenalties, tokens: Tensor, lengths: Tensor) -> None:
    """Count the first lengths[b] of tokens [bs, W] (a round's committed output, -1 past it) as
    output, in place in the state's tensors (SGLang's penalizers)."""
    if state.output_len is not None:
        state.output_len += lengths[:, None].to(state.output_len.dtype)
    if not state.counts_paths:
        return
    valid = torch.arange(tokens.shape[1], device=tokens.device)[None, :] < lengths[:, None]
    vocab = next(t.shape[1] for t in (state.frequency_sum, state.presence_sum, state.repetition_scale) if t is not None)
    counts = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens.clamp(0, vocab - 1), valid.float())
    if state.frequency is not None:
        state.frequency_sum += state.frequency * counts
    if state.presence is not None:
        state.presence_sum.copy_(torch.where(counts > 0, state.presence, state.presence_sum))
    if state.repetition is not None:
        state.repetition_scale.copy_(torch.where(counts > 0, state.repetition, state.repetition_scale))
