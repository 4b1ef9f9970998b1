"""Lossless verification of a batched draft tree against the target model.

Local indices follow `tree_layout`: 0 is the root (the last verified token), tree node i is i + 1,
N = budget + 1. Row i of `target_logits` [bs, N, V] is the target's distribution for the token
following local node i.

The target picks one token per local node: its argmax (greedy) or one sample from its filtered
distribution. A tree node is matched when it is valid and its token is the target's token at its
parent; it is accepted when it and all its ancestors are matched. Siblings carry distinct tokens,
so the accepted nodes form one path from the root; the target's token at the path's end is the
bonus. Every emitted token is therefore the target's own choice after the tokens before it, which
makes sampling lossless.

Everything is fixed-shape and host-sync free.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mfd_sglang.tree import DraftTree
from mfd_sglang.tree_layout import local_parents, tree_ancestor_mask


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


def verify_tree_greedy(tree: DraftTree, target_logits: Tensor) -> TreeVerifyResult:
    """Accept the longest tree path that the target's argmax agrees with."""
    return _accept_path(tree, target_logits.argmax(dim=-1))


def verify_tree_sampling(
    tree: DraftTree,
    target_logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    generator: torch.Generator | None = None,
) -> TreeVerifyResult:
    """Accept the tree path that one target sample per node agrees with.

    temperature [bs] (> 0), top_k [bs] (<= 0 or >= V: off), top_p [bs] (1.0: off).
    """
    target_tokens = sample_from_logits(
        target_logits, temperature[:, None], top_k[:, None], top_p[:, None], generator
    )
    return _accept_path(tree, target_tokens)


def sample_from_logits(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    generator: torch.Generator | None = None,
) -> Tensor:
    """One token per row of logits [..., V], drawn from softmax(logits / temperature) restricted
    to the top_k tokens, then to the smallest head of those holding top_p of their mass.

    temperature (> 0), top_k (<= 0 or >= V: off) and top_p (1.0: off) broadcast against the
    leading dims of `logits`. Returns int64 tokens of shape logits.shape[:-1].
    """
    vocab = logits.shape[-1]
    scaled = logits.float() / temperature[..., None]
    sorted_logits, sorted_tokens = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)
    top_k = torch.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
    probs = sorted_logits.masked_fill(ranks >= top_k[..., None], float("-inf")).softmax(dim=-1)
    # Keep the tokens whose preceding mass is below top_p; top_p >= 1 keeps all despite rounding.
    mass_before = probs.cumsum(dim=-1) - probs
    keep = (mass_before < top_p[..., None]) | (top_p[..., None] >= 1)
    probs = probs.masked_fill(~keep, 0.0)
    # Exponential race: argmax(p / E), E ~ Exp(1), samples p (unnormalised) without a host sync.
    race = probs / torch.empty_like(probs).exponential_(generator=generator)
    return sorted_tokens.gather(-1, race.argmax(dim=-1, keepdim=True)).squeeze(-1)


def _accept_path(tree: DraftTree, target_tokens: Tensor) -> TreeVerifyResult:
    """Walk a batched tree given the target's token at every local node ([bs, N])."""
    bs, budget = tree.tokens.shape
    parents = local_parents(tree)
    matched = (tree.tokens == target_tokens.gather(1, parents[:, 1:])) & tree.valid
    matched = torch.cat([torch.ones_like(matched[:, :1]), matched], dim=1)  # the root
    accepted = ~(tree_ancestor_mask(tree) & ~matched[:, None, :]).any(dim=-1)
    depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
    # The root (depth 0) is always accepted, so the deepest accepted node exists.
    last = torch.where(accepted, depths, -1).argmax(dim=-1, keepdim=True)
    accept_lens = depths.gather(1, last) + 1
    bonus_tokens = target_tokens.gather(1, last)
    nodes = torch.arange(1, budget + 1, device=tree.tokens.device)
    no_node = torch.full((bs, budget + 1), -1, dtype=torch.long, device=tree.tokens.device)
    accepted_nodes = torch.where(accepted[:, 1:], nodes, -1)
    path = no_node.scatter_reduce(1, tree.depths - 1, accepted_nodes, "amax")
    path_tokens = tree.tokens.gather(1, (path - 1).clamp(min=0))
    accepted_tokens = torch.where(path >= 0, path_tokens, -1)
    accepted_tokens.scatter_(1, accept_lens - 1, bonus_tokens)
    return TreeVerifyResult(
        accept_lens=accept_lens.squeeze(1),
        accepted_tokens=accepted_tokens,
        accepted_local_indices=path,
        bonus_tokens=bonus_tokens.squeeze(1),
    )
