"""Exact mixture draft tree for Multi-Future Drafting.

The drafter gives, per mode k and depth d = 1..D, log-probabilities over the vocabulary. A prefix
u = (u_1..u_d) scores s(u) = max_k sum_{i<=d} logprobs[k, i-1, u_i]. `build_mixture_tree` returns
the `budget` distinct prefixes (any depth 1..D) with the highest s, ties broken toward ancestors, so
the set is prefix-closed. With one mode this is DDTree; `build_chain` is the DFlash single chain.

Everything is fixed-shape and host-sync free (it must run inside CUDA graphs) and batched over a
leading bs dim; an unbatched input gives an unbatched tree.

Conventions of `DraftTree`:
  * nodes are in rank order (best score first, padding last), so parents precede children;
  * `parents` holds the node index of the parent, -1 for a child of the root;
  * `depths` are 1-based; `scores` are path log-probs under the node's best mode (float32, or
    float64 for float64 input), `modes` that mode (lowest index on ties);
  * N == budget always. When fewer prefixes than `budget` exist, or the rest score -inf (prefixes
    scored -inf are never included), the tail is padding: valid False, token 0, parent -1,
    depth 1, score -inf, mode 0.
"""

from dataclasses import dataclass, fields

import torch
from torch import Tensor


@dataclass
class DraftTree:
    """A draft tree of N nodes; every tensor is [N] or, batched, [bs, N]."""

    tokens: Tensor  # int64
    parents: Tensor  # int64, node index of the parent, -1 for a child of the root
    depths: Tensor  # int64, 1-based
    scores: Tensor  # best-mode log-prob of the node's whole path, float32 (float64 for float64 in)
    modes: Tensor  # int64, the mode achieving `scores`
    valid: Tensor  # bool, False only for padding


def build_mixture_tree(logprobs: Tensor, budget: int, *, backend: str = "torch") -> DraftTree:
    """The `budget` best distinct prefixes of a K-mode drafter, exactly.

    logprobs: [K, D, V] or [bs, K, D, V] per-mode, per-depth log-probabilities.
    backend: "torch" (this module), or "triton" (`mfd_sglang.kernels.mixture_tree`: bit-identical
    output, float32/float16/bfloat16 input only; needs a CUDA tensor, or TRITON_INTERPRET=1 set
    before triton is imported for CPU tensors, else ValueError).
    """
    if backend not in ("torch", "triton"):
        raise ValueError(
            f"tree backend {backend!r} is not available: only 'torch' and 'triton' are available"
        )
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if logprobs.dim() == 3:
        return _without_batch(build_mixture_tree(logprobs[None], budget, backend=backend))
    if logprobs.dim() != 4:
        raise ValueError(f"logprobs must be [K, D, V] or [bs, K, D, V], not {logprobs.shape}")
    if backend == "triton":
        # Imported here: the torch backend must not need triton.
        from mfd_sglang.kernels.mixture_tree import build_mixture_tree_triton

        return build_mixture_tree_triton(logprobs, budget)
    _, num_modes, _, vocab = logprobs.shape
    scores, tokens, parents = _per_mode_beams(logprobs, budget)
    scores, modes, parents = _dedupe_prefixes(scores, tokens, parents, num_modes, vocab)
    return _select_top_budget(scores, modes, parents, tokens, budget)


def build_chain(logprobs: Tensor, *, mode: int = 0) -> DraftTree:
    """The DFlash chain: the argmax token of `mode` at every depth, node i the child of node i-1.

    logprobs: [K, D, V] or [bs, K, D, V]. N == D, all nodes valid.
    """
    if logprobs.dim() == 3:
        return _without_batch(build_chain(logprobs[None], mode=mode))
    bs, _, depth, _ = logprobs.shape
    best, tokens = logprobs[:, mode].max(dim=-1)
    steps = torch.arange(depth, device=logprobs.device).expand(bs, depth)
    return DraftTree(
        tokens=tokens,
        parents=steps - 1,
        depths=steps + 1,
        scores=best.to(torch.promote_types(best.dtype, torch.float32)).cumsum(dim=-1),
        modes=torch.full_like(tokens, mode),
        valid=torch.ones_like(tokens, dtype=torch.bool),
    )


def _per_mode_beams(logprobs: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per mode and depth, the `width` best prefixes of that mode at that depth.

    A mode's score is a sum of per-depth terms independent of the parent, so its top-`width` at
    depth d extend its top-`width` at depth d-1 by one of depth d's top-`width` tokens.
    Entries at a depth are indexed flat as j = k * width + slot. Returns scores, tokens and parents
    (flat index of the parent entry at depth d-1), each [bs, D, K * width]; slots that hold no
    prefix score -inf.
    """
    bs, num_modes, depth, vocab = logprobs.shape
    top_logprobs, top_tokens = _top_ranked(logprobs, min(width, vocab))
    # Sum in at least float32: a bf16 drafter's path scores would lose their ordering.
    top_logprobs = top_logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    num_top = top_logprobs.shape[-1]
    mode_offsets = torch.arange(num_modes, device=logprobs.device)[:, None] * width
    # Depth 0 is the root alone: slot 0 scores 0, the other slots hold nothing.
    beam = top_logprobs.new_full((bs, num_modes, width), float("-inf"))
    beam[..., 0] = 0.0
    scores, tokens, parents = [], [], []
    for d in range(depth):
        candidates = beam[..., :, None] + top_logprobs[:, :, d, None, :]
        beam, flat = _top_ranked(candidates.flatten(-2), width)
        scores.append(beam.flatten(1))
        tokens.append(top_tokens[:, :, d].gather(-1, flat % num_top).flatten(1))
        parents.append((flat // num_top + mode_offsets).flatten(1))
    return torch.stack(scores, 1), torch.stack(tokens, 1), torch.stack(parents, 1)


def _top_ranked(values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The `count` largest of the last dim, best first; exactly equal values in index order.

    torch.topk picks and orders equal values arbitrarily (and differently per device); a stable
    sort makes ties deterministic (lower token id / lower flat index first), as the Triton
    backend ranks them.
    """
    ranked, order = values.sort(dim=-1, descending=True, stable=True)
    return ranked[..., :count], order[..., :count]


def _dedupe_prefixes(
    scores: Tensor, tokens: Tensor, parents: Tensor, num_modes: int, vocab: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Merge the modes' beam entries ([bs, D, M] from `_per_mode_beams`) per distinct prefix.

    A prefix's canonical entry is the lowest flat index holding it; it gets the max score over the
    modes that have it and the lowest mode achieving that max, every other entry scores -inf.
    Returns scores, modes and canonical parents (flat index at depth d-1, -1 at depth 1).
    """
    bs, depth, num_entries = scores.shape
    width = num_entries // num_modes
    entry_modes = torch.arange(num_modes, device=scores.device).repeat_interleave(width)
    entry_modes = entry_modes.expand(bs, -1)
    no_mode = torch.full_like(entry_modes, num_modes)
    no_score = torch.full_like(scores[:, 0], float("-inf"))
    parent = torch.full_like(tokens[:, 0], -1)  # the root
    merged_scores, merged_modes, canonical_parents = [], [], []
    for d in range(depth):
        canonical = _first_equal_index(parent * vocab + tokens[:, d])
        best = no_score.scatter_reduce(1, canonical, scores[:, d], "amax")
        reaches_best = scores[:, d] == best.gather(1, canonical)
        modes_at_best = torch.where(reaches_best, entry_modes, no_mode)
        merged_scores.append(best)
        merged_modes.append(no_mode.scatter_reduce(1, canonical, modes_at_best, "amin"))
        canonical_parents.append(parent)
        if d + 1 < depth:
            parent = canonical.gather(1, parents[:, d + 1])
    return (
        torch.stack(merged_scores, 1),
        torch.stack(merged_modes, 1),
        torch.stack(canonical_parents, 1),
    )


def _first_equal_index(keys: Tensor) -> Tensor:
    """For each position of keys [bs, M], the lowest position holding the same key."""
    order = keys.sort(dim=-1, stable=True).indices
    sorted_keys = keys.gather(-1, order)
    positions = torch.arange(keys.shape[-1], device=keys.device).expand_as(keys)
    starts_run = torch.ones_like(keys, dtype=torch.bool)
    starts_run[:, 1:] = sorted_keys[:, 1:] != sorted_keys[:, :-1]
    run_start = torch.where(starts_run, positions, 0).cummax(dim=-1).values
    # A stable sort keeps equal keys in position order, so a run's start is its lowest position.
    return torch.empty_like(order).scatter_(-1, order, order.gather(-1, run_start))


def _select_top_budget(
    scores: Tensor, modes: Tensor, canonical_parents: Tensor, tokens: Tensor, budget: int
) -> DraftTree:
    """The `budget` best entries of [bs, D, M] tensors as a DraftTree in rank order."""
    bs, _, num_entries = scores.shape
    # Global index g = (depth - 1) * M + j, so a stable descending sort breaks score ties toward
    # smaller depth (ancestors first), then lower flat index.
    chosen = scores.flatten(1).sort(dim=-1, descending=True, stable=True).indices[:, :budget]
    node_scores = scores.flatten(1).gather(1, chosen)
    valid = node_scores > float("-inf")
    depths = chosen // num_entries + 1
    parent_entry = (depths - 2) * num_entries + canonical_parents.flatten(1).gather(1, chosen)
    node_of_entry = torch.full_like(scores.flatten(1), -1, dtype=torch.long)
    node_of_entry.scatter_(1, chosen, torch.arange(budget, device=scores.device).expand(bs, -1))
    parents = node_of_entry.gather(1, parent_entry.clamp(min=0))
    return DraftTree(
        tokens=torch.where(valid, tokens.flatten(1).gather(1, chosen), 0),
        parents=torch.where(valid & (depths > 1), parents, -1),
        depths=torch.where(valid, depths, 1),
        scores=node_scores,
        modes=torch.where(valid, modes.flatten(1).gather(1, chosen), 0),
        valid=valid,
    )


def _without_batch(tree: DraftTree) -> DraftTree:
    return DraftTree(**{f.name: getattr(tree, f.name)[0] for f in fields(tree)})
