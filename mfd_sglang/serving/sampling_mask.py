"""`return_sampling_mask` under MFD: the support of the plain server's sampling law at every emitted token.

SGLang's sampler returns, for each token of a request that asks for it, the token ids its sampler could
have drawn (the support of top-k / top-p / min-p after temperature) with the log-probability of the
token drawn ("selected") or of every supported token ("support"), renormalised over the support. MFD
draws each emitted token from exactly that law at its tree node (`mfd_sglang.acceptance.plain_law`, on the
node's logits after penalties, logit bias and grammar), so the support of that law at the node's row is
the answer. Greedy requests (top_k 1) get their token alone, with log-probability 0, as in SGLang.

Returned as SGLang's `SamplingMaskOutput`: rows [n, width, cap] for a verify round (width = the verify
window, `num_accept_tokens` the committed tokens of each request, SGLang keeps that prefix), rows [n, cap]
for the prefill's token; n = the requests that asked (`sampling_mask_batch_indices`), cap =
`--sampling-mask-max-tokens` (a larger support is OVERFLOW: SGLang aborts that request with a 400).
"""

from __future__ import annotations

import torch
from sglang.srt.layers.logits_processor import SamplingMaskOutput, SamplingMaskStatus
from sglang.srt.runtime_context import get_exec

from mfd_sglang.acceptance import plain_law


def sampling_mask_output(sampling_info, logits: torch.Tensor, tokens: torch.Tensor,
                         num_accept_tokens: torch.Tensor | None) -> SamplingMaskOutput | None:
    """logits [bs, width, V]: the adjusted rows the emitted tokens [bs, width] were drawn from (width 1
    and num_accept_tokens None for the prefill's token). None when no request asked."""
    rows = sampling_info.sampling_mask_batch_indices
    if rows is None:
        return None
    logits, tokens = logits.index_select(0, rows), tokens.index_select(0, rows).clamp(min=0)

    def per_request(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1).index_select(0, rows)[:, None]

    weights = plain_law(logits, per_request(sampling_info.temperatures).float(), per_request(sampling_info.top_ks),
                        per_request(sampling_info.top_ps).float(), per_request(sampling_info.min_ps).float())
    cap = min(get_exec().features.sampling_mask_max_tokens, weights.shape[-1])
    mass = weights.sum(dim=-1)
    selected = weights.gather(-1, tokens[..., None]).squeeze(-1)
    selected_logprobs = torch.log(selected / mass)
    packed, token_ids = weights.topk(cap, dim=-1)
    lengths = (weights > 0).sum(dim=-1, dtype=torch.int32)
    statuses = torch.where(~(selected > 0) | ~torch.isfinite(selected_logprobs), int(SamplingMaskStatus.INVALID),
                           torch.where(lengths > cap, int(SamplingMaskStatus.OVERFLOW), int(SamplingMaskStatus.OK)))
    support_rows = sampling_info.sampling_support_logprobs_capture_indices
    support_logprobs = None
    if support_rows is not None:
        support_logprobs = torch.log(packed.index_select(0, support_rows) / mass.index_select(0, support_rows)[..., None])
    squeeze = num_accept_tokens is None  # the prefill's token: one row per request

    def shaped(x: torch.Tensor | None) -> torch.Tensor | None:
        return x.squeeze(1) if squeeze and x is not None else x

    return SamplingMaskOutput(
        token_ids=shaped(token_ids.to(torch.int32)), lengths=shaped(lengths.clamp(max=cap)),
        selected_logprobs=shaped(selected_logprobs.float()), support_logprobs=shaped(support_logprobs),
        statuses=shaped(statuses.to(torch.int32)),
        num_accept_tokens=None if squeeze else num_accept_tokens.index_select(0, rows).to(torch.int32))
