"""The typed hand-offs between the stages of a speculative round, in the order a round passes them on:

    draft  --DraftCandidates-->  tree  --DraftTree-->  verify layout  --VerifyLayout-->  verify input (target)
    target logits + DraftTree  -->  accept  --TreeVerifyResult-->  commit, outputs

Each stage's torch reference and Triton kernel take and return these (`mfd_sglang.tree`,
`mfd_sglang.tree_layout`, `mfd_sglang.acceptance`, `mfd_sglang.kernels`); they live here, below both, so that a
kernel never imports the module that dispatches to it.
"""

from dataclasses import dataclass

from torch import Tensor


@dataclass
class DraftCandidates:
    """Per (mode, depth) the C best tokens of the drafter and their log-probabilities, best first,
    equal log-probabilities in token-id order (what `top_candidates` takes from full log-probs).
    Mode weights added after the ranking (`weigh_modes`) shift a whole (mode, depth 1) row: its order
    stays, and two values its rounding makes equal keep their earlier order.

    logprobs [bs, K, D, C] float32 (float64 for float64 input); tokens [bs, K, D, C] int64 ids in
    [0, vocab); vocab: the size of the vocabulary they were ranked over. A tree of budget B reads
    the first min(B, vocab) candidates, so C >= min(B, vocab) is required.
    """

    logprobs: Tensor
    tokens: Tensor
    vocab: int


@dataclass
class DraftTree:
    """A draft tree of N nodes; every tensor is [N] or, batched, [bs, N]."""

    tokens: Tensor  # int64
    parents: Tensor  # int64, node index of the parent, -1 for a child of the root
    depths: Tensor  # int64, 1-based
    scores: Tensor  # best-mode (weighted) log-prob of the node's path, float32 (float64 for float64 in)
    modes: Tensor  # int64, the mode achieving `scores`
    valid: Tensor  # bool, False only for padding


@dataclass
class VerifyLayout:
    """Inputs of SGLang's tree verify for bs requests of N = budget + 1 nodes each (every field is
    per request, so a batch's layout is the rows of its requests; SGLang takes draft_token and
    positions flattened)."""

    draft_token: Tensor  # [bs, N] int64, the root token then the node tokens
    positions: Tensor  # [bs, N] int64, seq_len + depth (root depth 0)
    retrive_index: Tensor  # [bs, N] int64, b * N + local index
    retrive_next_token: Tensor  # [bs, N] int64, local index of the first child, -1 if none
    retrive_next_sibling: Tensor  # [bs, N] int64, local index of the next sibling, -1 if none
    ancestor_mask: Tensor  # [bs, N, N] bool, [b, i, j]: local j is an ancestor of, or is, local i


@dataclass
class TreeVerifyResult:
    """Outcome per request. A path holds at most budget draft tokens, so the fixed width of the
    per-token tensors is budget + 1 columns (draft tokens plus the bonus)."""

    accept_lens: Tensor  # [bs] int64, accepted draft tokens + 1 (the bonus)
    # [bs, budget + 1] int64: the accepted draft tokens in depth order, the bonus, then -1s.
    accepted_tokens: Tensor
    # [bs, budget + 1] int64: local indices of the accepted tree nodes in depth order (column d
    # holds the node at depth d + 1; the root is never listed), then -1s.
    accepted_local_indices: Tensor
    bonus_tokens: Tensor  # [bs] int64, the target's token after the last accepted node
