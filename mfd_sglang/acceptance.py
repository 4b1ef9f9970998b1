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

Sampling follows SGLang's plain sampler (`sglang.srt.layers.sampler`, the pytorch backend): softmax
of logits / temperature; top-k and top-p applied jointly to the sorted, un-renormalised
probabilities; then min-p against the largest probability. The draw at a node uses one uniform coin
fixed by (the request's seed, the position of the node's token). Nodes at one depth share that
coin, and only one of them can be on the accepted path, so the emitted tokens are exactly those of
plain autoregressive sampling with these coins: a function of the seed and the request alone, the
same for any tree, drafter, batch or run.

Everything is fixed-shape and host-sync free.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from mfd_sglang.handoffs import DraftTree, TreeVerifyResult
from mfd_sglang.tree_layout import local_parents, runs_triton, tree_ancestor_mask, with_root


@dataclass
class Sampling:
    """Per-request sampling settings, each [bs], as SGLang's SamplingBatchInfo holds them."""

    temperature: Tensor  # float, > 0
    top_k: Tensor  # int; <= 0 or >= V: off (SGLang's "off" is 1 << 30); 1: greedy
    top_p: Tensor  # float in (0, 1]; 1: off
    min_p: Tensor  # float in [0, 1]; 0: off
    seeds: Tensor  # int64: the request's random stream (see `stream_coins`, `random_seeds`)
    # A host-side bound on every top_k (SGLang's SamplingBatchInfo.max_top_k): with it only the
    # max_top_k most likely tokens are sorted. None when some request has no top-k, or when a request
    # has a seed of its own: topk may order tied probabilities otherwise than the full (stable) sort,
    # and the bound is batch-wide, so a seeded request's tokens would depend on the rest of the batch
    # (SGLang keeps the full sort for seeded sampling for the same reason).
    max_top_k: int | None = None


def verify_tree_greedy(tree: DraftTree, target_logits: Tensor, backend: str = "torch") -> TreeVerifyResult:
    """Accept the longest tree path that the target's argmax agrees with (backend: `accept_path`'s)."""
    return accept_path(tree, target_logits.argmax(dim=-1), backend)


def verify_tree_sampling(tree: DraftTree, target_logits: Tensor, sampling: Sampling,
                         root_positions: Tensor, backend: str = "torch") -> TreeVerifyResult:
    """Accept the tree path that one target sample per node agrees with.

    root_positions [bs]: the position of each request's root token. Node i's token sits at
    root_positions + its depth; the draw after it (the token its children are matched against)
    uses that position's coin. backend: `accept_path`'s.
    """
    depths = with_root(0, tree.depths)
    target_tokens = sample_from_logits(target_logits, sampling, root_positions[:, None] + depths)
    return accept_path(tree, target_tokens, backend)


def sub_budget_accept_lens(result: TreeVerifyResult, budgets: Tensor) -> Tensor:
    """[bs, len(budgets)]: the tokens each request would have committed this round (accepted draft
    tokens + the bonus) had its tree held only its first b nodes, for each b in budgets [n] (0: plain
    decoding, one token). Exact, for greedy and sampled verification alike: the first b nodes of a
    `DraftTree` form a tree (rank order, parents first); a node's target token depends only on its path
    (its logits, the coin of its position); so that tree's accepted path is the longest prefix of this
    one inside it. The path's local indices increase with depth, so that prefix is its nodes <= b."""
    path = result.accepted_local_indices[:, :, None]
    return 1 + ((path >= 1) & (path <= budgets)).sum(dim=1)


def sample_from_logits(logits: Tensor, sampling: Sampling, positions: Tensor) -> Tensor:
    """One token per row of logits [bs, ..., V] under SGLang's plain law (`plain_law`), drawn by
    inversion with the coin of (the request's seed, positions [bs, ...]): positions[...] is the
    position of the token the row's distribution follows. Returns int64 [bs, ...]."""
    extra = positions.dim() - 1

    def per_request(x: Tensor) -> Tensor:
        return x.reshape(x.shape + (1,) * extra)

    top_k = per_request(sampling.top_k)
    weights = plain_law(logits, per_request(sampling.temperature), top_k, per_request(sampling.top_p),
                        per_request(sampling.min_p), sampling.max_top_k)
    # Inversion over the weights in token-id order.
    cdf = weights.cumsum(dim=-1)
    # coin in (0, 1) keeps the target in (0, total]: the first column whose cdf reaches it has a
    # positive weight and exists.
    target = stream_coins(per_request(sampling.seeds), positions) * cdf[..., -1]
    tokens = (cdf < target[..., None]).sum(dim=-1)
    # Greedy requests (top_k 1) take the argmax itself, as SGLang's greedy path does (a sort may
    # order exactly tied logits differently).
    return torch.where(top_k == 1, logits.argmax(dim=-1), tokens)


def plain_law(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, min_p: Tensor,
              max_top_k: int | None = None) -> Tensor:
    """The weights [..., V] (token-id order, un-normalised: the probability where kept, else 0) of
    SGLang's plain sampler, `top_k_top_p_min_p_sampling_from_probs_torch` after softmax(logits /
    temperature): rank < top_k and mass before the token <= top_p, both on the sorted
    un-renormalised probabilities; then probability >= min_p * the largest. The settings broadcast
    against logits.shape[:-1]."""
    probs = torch.softmax(logits.float() / temperature[..., None], dim=-1)
    vocab = probs.shape[-1]
    if max_top_k is not None and max_top_k < vocab:
        # Top-k drops every rank >= top_k <= max_top_k, so these columns hold all that can survive.
        sorted_probs, ids = probs.topk(max_top_k, dim=-1)
    else:  # stable: tied probabilities in token-id order on every device, not as a sort happens to leave them
        sorted_probs, ids = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(sorted_probs.shape[-1], device=probs.device)
    top_k = torch.where(top_k > 0, top_k, vocab)
    # SGLang's mass before a token: the inclusive cumsum minus the token (the same float rounding).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (ranks < top_k[..., None]) & (mass_before <= top_p[..., None])
    keep &= sorted_probs >= sorted_probs[..., :1] * min_p[..., None]  # rank 0 is always kept
    return torch.zeros_like(probs).scatter_(-1, ids, sorted_probs * keep)


def stream_coins(seeds: Tensor, positions: Tensor) -> Tensor:
    """A uniform coin in (0, 1) for each (seed, position) pair (they broadcast): a hash, so the
    same pair gives the same coin on any device, in any batch, in any run, and a request's coins
    are its own. float32 multiples of 2**-24, odd ones: 0 and 1 never occur."""
    seeds, positions = torch.broadcast_tensors(seeds.long(), positions.long())
    h = _mix32((positions & 0xFFFFFFFF) ^ 0x9E3779B9)
    h = _mix32(h ^ (seeds & 0xFFFFFFFF))
    h = _mix32(h ^ ((seeds >> 32) & 0xFFFFFFFF))
    return ((h >> 9) * 2 + 1).float() * 2.0**-24


def random_seeds(n: int, device, generator: torch.Generator | None = None) -> Tensor:
    """n fresh seeds [n] int64 for requests that gave none (drawn on the device: no host sync)."""
    return torch.randint(0, 2**62, (n,), device=device, generator=generator)


def _mix32(h: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finaliser (a bijection with full avalanche) on int64 values < 2**32."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _mul32(a: Tensor, c: int) -> Tensor:
    """a * c mod 2**32 for a < 2**32 without overflowing int64: c in 16-bit halves."""
    return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def accept_path(tree: DraftTree, target_tokens: Tensor, backend: str = "torch") -> TreeVerifyResult:
    """Walk a batched tree given the target's token at every local node ([bs, N]): its argmax, its
    sample, or (the evaluation's replay) the token a known continuation has after that node's depth.
    backend: "torch", or "triton" (one launch, bit-identical; `tree_layout.runs_triton`)."""
    if runs_triton(backend, tree.tokens):
        from mfd_sglang.kernels.accept_path import accept_path_triton

        return accept_path_triton(tree, target_tokens)
    bs, budget = tree.tokens.shape
    parents = local_parents(tree)
    matched = (tree.tokens == target_tokens.gather(1, parents[:, 1:])) & tree.valid
    matched = with_root(True, matched)
    accepted = ~(tree_ancestor_mask(tree) & ~matched[:, None, :]).any(dim=-1)
    depths = with_root(0, tree.depths)
    # The root (depth 0) is always accepted, so the deepest accepted node exists.
    last = torch.where(accepted, depths, -1).argmax(dim=-1, keepdim=True)
    accept_lens = depths.gather(1, last) + 1
    bonus_tokens = target_tokens.gather(1, last)
    nodes = torch.arange(1, budget + 1, device=tree.tokens.device)
    no_node = torch.full((bs, budget + 1), -1, dtype=torch.long, device=tree.tokens.device)
    accepted_nodes = torch.where(accepted[:, 1:], nodes, -1)
    path = no_node.scatter_reduce(1, tree.depths - 1, accepted_nodes, "amax")
    path_tokens = with_root(0, tree.tokens).gather(1, path.clamp(min=0))  # by local index
    accepted_tokens = torch.where(path >= 0, path_tokens, -1)
    accepted_tokens.scatter_(1, accept_lens - 1, bonus_tokens)
    return TreeVerifyResult(
        accept_lens=accept_lens.squeeze(1),
        accepted_tokens=accepted_tokens,
        accepted_local_indices=path,
        bonus_tokens=bonus_tokens.squeeze(1),
    )
