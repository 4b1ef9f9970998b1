"""The accept stage of a round, and the prefill's first token, by the plain server's law.

Every token MFD emits is drawn from the target's distribution as the plain SGLang 0.5.23 server would
draw it at that point of the request's output:
- the logits of a tree node are adjusted as after the node's path (`penalties`: penalties,
  min_new_tokens, logit_bias; the grammar's mask in the state the path leads to, built by SGLang's
  tree traversal);
- greedy batches take the argmax (`verify_tree_greedy`); otherwise one target sample per node
  (`verify_tree_sampling`: lossless at any temperature, SGLang's top-k / top-p / min-p law) from each
  request's own seeded stream (`request_sampling`), so the output does not depend on the tree;
- the first token after a prompt is drawn from the prefill's adjusted logits by the same law and
  stream (`sample_first_tokens`).
Torch on the batch's device, fixed shapes, no host sync.
"""

from __future__ import annotations

import dataclasses

import torch

from sglang.srt.utils import async_h2d

from mfd_sglang.acceptance import (Sampling, TreeVerifyResult, random_seeds, sample_from_logits, verify_tree_greedy,
                                   verify_tree_sampling)
from mfd_sglang.tree import DraftTree
from mfd_sglang.tree_layout import VerifyLayout

from mfd_sglang.serving.penalties import (OutputPenalties, adjust_tree_logits, count_resumed_output, cumulate,
                                          output_penalties, path_token_counts)


def request_sampling(batch) -> Sampling:
    """The batch's sampling settings (SGLang's plain law: temperature, top-k, top-p, min-p) and one
    seed per request: SGLang's own seeds under --enable-deterministic-inference (42 for requests
    without one), else the request's sampling_seed, else a fresh random seed each round (a stream of
    its own, not reproducible)."""
    info = batch.sampling_info
    device = info.temperatures.device
    seeds, seeded = info.sampling_seed, True
    if seeds is None:
        given = [r.sampling_params.sampling_seed for r in batch.reqs]
        seeds = random_seeds(len(given), device)
        seeded = any(s is not None for s in given)
        if seeded:  # staged in pinned memory: no host sync on a device
            mask = async_h2d([s is not None for s in given], dtype=torch.bool, device=device)
            values = async_h2d([0 if s is None else s for s in given], dtype=torch.int64, device=device)
            seeds = torch.where(mask, values, seeds)
    # Seeded requests get the full sort, whose order does not depend on the batch (Sampling.max_top_k).
    return Sampling(info.temperatures.reshape(-1).float(), info.top_ks.reshape(-1), info.top_ps.reshape(-1).float(),
                    info.min_ps.reshape(-1).float(), seeds, None if seeded else info.max_top_k)


def adjust_node_logits(logits: torch.Tensor, layout: VerifyLayout, penalties: OutputPenalties) -> None:
    """Count each root as output (the prefill's token, or the last round's bonus), then give every
    node's row logits [bs, N, V] the plain server's adjustment after the node's path (in place)."""
    roots = layout.draft_token[:, 0]
    cumulate(penalties, roots[:, None], torch.ones_like(roots))
    depths = layout.ancestor_mask.sum(dim=-1) - 1  # ancestors and the node itself, minus the root
    counts = None
    if penalties.counts_paths:
        counts = path_token_counts(layout.draft_token, layout.ancestor_mask, logits.shape[-1])
    adjust_tree_logits(logits, penalties, depths, counts)


def accept_tree(tree: DraftTree, layout: VerifyLayout, logits: torch.Tensor, batch, seq_lens: torch.Tensor,
                grammar_mask=None, *, backend: str) -> tuple[TreeVerifyResult, torch.Tensor]:
    """The accepted path of each request's tree (root at position seq_lens) from the target's logits
    [bs * N, V] of its nodes, each adjusted as the plain server would after the node's path; also
    returns those adjusted logits [bs, N, V] (float32), which the emitted tokens' outputs read.
    backend: the walk's (`verify.accept_path`)."""
    logits = logits.view(*layout.draft_token.shape, -1).float()
    penalties = output_penalties(batch.sampling_info)
    if penalties is not None:
        adjust_node_logits(logits, layout, penalties)
    if grammar_mask is not None:  # -inf where masked: the order with the finite adjustments does not matter
        grammar_mask.apply(logits.view(-1, logits.shape[-1]))
    if batch.sampling_info.is_all_greedy:
        result = verify_tree_greedy(tree, logits, backend)
    else:  # greedy requests in a mixed batch carry top_k = 1, which makes their sample the argmax
        result = verify_tree_sampling(tree, logits, request_sampling(batch), seq_lens, backend)
    if penalties is not None:  # the accepted draft tokens; the bonus is the next round's root
        cumulate(penalties, result.accepted_tokens, result.accept_lens - 1)
    return result, logits


def sample_first_tokens(batch, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The token after each prompt (at its last token, position seq_len - 1) from the target's logits
    [bs, V], adjusted as the plain server's prefill does (penalties of a retracted request's output so
    far, min_new_tokens, logit_bias; the grammar's mask at its start state), by the same law and seeded
    stream as the verify rounds. Also returns the adjusted logits (float32)."""
    logits = logits.float()
    penalties = output_penalties(batch.sampling_info)
    if penalties is not None:  # the output so far: none, or a retracted request's
        count_resumed_output(penalties, batch.reqs, logits.device)
        adjust_tree_logits(logits[:, None, :], penalties, torch.zeros_like(logits[:, :1], dtype=torch.int64))
    if batch.has_grammar:  # SGLang's own prefill mask
        batch.sampling_info.update_regex_vocab_mask()
        batch.sampling_info.grammar_mask.apply(logits)
        batch.sampling_info.grammar_mask = None
    if batch.sampling_info.is_all_greedy:
        return logits.argmax(dim=-1), logits
    return sample_from_logits(logits, request_sampling(batch), batch.seq_lens - 1), logits


def pad_result(result: TreeVerifyResult, width: int) -> TreeVerifyResult:
    """The result of a round verified with a smaller tree, widened with -1 columns to `width`
    (the launch budget's B + 1, the row width SGLang reads every round)."""
    extra = width - result.accepted_tokens.shape[1]
    if extra == 0:
        return result
    pad = torch.nn.functional.pad
    return dataclasses.replace(result, accepted_tokens=pad(result.accepted_tokens, (0, extra), value=-1),
                               accepted_local_indices=pad(result.accepted_local_indices, (0, extra), value=-1))
