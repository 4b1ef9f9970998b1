"""What MFD returns to SGLang 0.5.23 beside the tokens: the emitted tokens' log-probabilities and sampling
masks, read from the logits each token was drawn from (after penalties, logit bias and grammar; see
`accept`), in the fields and shapes SGLang's speculative workers fill.

- the prefill's first token: one row per request (`first_token_outputs`);
- a verify round: the rows of the committed tokens in order, the root's (the round's first token) then
  each accepted node's, `width` (the launch window B + 1) per request, SGLang keeping each request's
  accepted prefix (`round_outputs`).
"""

from __future__ import annotations

import copy

import torch

from sglang.srt.layers.logprob_processor import compute_spec_logprobs

from mfd_sglang.acceptance import TreeVerifyResult

from mfd_sglang.serving.commit import committed_window_path
from mfd_sglang.serving.sampling_mask import sampling_mask_output


def attach_logprobs(batch, logits_output, logits: torch.Tensor, tokens: torch.Tensor, width: int) -> None:
    """The emitted tokens' logprobs (and top / requested-id logprobs) into logits_output, as SGLang's
    speculative workers return them: `compute_spec_logprobs` over logits [bs * width, V], the row of
    each emitted token tokens [bs, width] (width 1: the prefill's first token, one value per request)."""
    rows = copy.copy(logits_output)
    rows.next_token_logits = logits
    compute_spec_logprobs(batch, rows, tokens.reshape(-1), chain_stride=width)
    logits_output.next_token_logprobs = rows.next_token_logprobs.reshape(-1) if width == 1 else rows.next_token_logprobs
    for name in ("next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                 "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx"):
        setattr(logits_output, name, getattr(rows, name))


def first_token_outputs(batch, logits_output, logits: torch.Tensor, tokens: torch.Tensor) -> None:
    """The prefill's token tokens [bs], drawn from logits [bs, V]: its logprobs and sampling mask."""
    if batch.return_logprob:
        attach_logprobs(batch, logits_output, logits, tokens, width=1)
    logits_output.sampling_mask_output = sampling_mask_output(batch.sampling_info, logits[:, None], tokens[:, None],
                                                              num_accept_tokens=None)


def round_outputs(batch, logits_output, node_logits: torch.Tensor, result: TreeVerifyResult, width: int) -> None:
    """A verify round's emitted tokens (result, padded to `width`), drawn from node_logits [bs, N, V]:
    their logprobs and sampling masks, when a request asked for either."""
    if not batch.return_logprob and batch.sampling_info.sampling_mask_batch_indices is None:
        return
    path = committed_window_path(result.accepted_local_indices, width).clamp(min=0)
    rows = node_logits.gather(1, path[:, :, None].expand(-1, -1, node_logits.shape[-1]))
    if batch.return_logprob:
        attach_logprobs(batch, logits_output, rows.flatten(0, 1), result.accepted_tokens.clamp(min=0), width=width)
    logits_output.sampling_mask_output = sampling_mask_output(batch.sampling_info, rows, result.accepted_tokens,
                                                              num_accept_tokens=result.accept_lens)
