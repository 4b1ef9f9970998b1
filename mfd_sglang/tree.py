"""Exact mixture draft tree for Multi-Future Drafting.

The drafter gives, per mode k and depth d = 1..D, log-probabilities over the vocabulary. A prefix
u = (u_1..u_d) scores s(u) = max_k sum_{i<=d} logprobs[k, i-1, u_i], summed in depth order in the
input's float type (at least float32). `build_mixture_tree` returns the `budget` distinct prefixes
(any depth 1..D) with the highest s; equal scores go to the smaller depth first (ancestors, so the set
is prefix-closed), and among equal scores at one depth the order is the builders' own (deterministic,
the same for the torch and Triton backends). With one mode this is DDTree; `build_chain` is the
DFlash single chain.

Mode weights. A drafter with a mode gate weighs mode k by pi_k per request: s(u) = max_k [log pi_k +
sum_{i<=d} logprobs[k, i-1, u_i]]. Every prefix of mode k holds its depth-1 token, so `weigh_modes`
folds log pi_k into mode k's depth-1 log-probabilities and the builders stay as they are: the tree
of `weigh_modes(logprobs, log_prior)` is the weighted rule exactly, its `scores` are the weighted
scores, summed as (log pi_k + logprobs[k, 0, u_1]) + logprobs[k, 1, u_2] + ..., its `modes` the
(lowest) mode reaching them. Without weights (no gate) the log-probabilities are used as they are:
the unweighted rule, bit for bit.

Everything is fixed-shape and host-sync free (it must run inside CUDA graphs) and batched over a
leading bs dim; an unbatched input gives an unbatched tree.

The tree only ever reads, per (mode, depth), the min(budget, V) best tokens and their
log-probabilities. `DraftCandidates` holds exactly those; `build_mixture_tree` takes them in place
of the full [.., V] log-probabilities (the serving path computes them from the drafter's hidden
states in vocabulary chunks, `MFDDrafter.block_candidates`, so no [bs, K, D, V] tensor exists).

Conventions of `DraftTree`:
  * nodes are in rank order (best score first, padding last), so parents precede children;
  * `parents` holds the node index of the parent, -1 for a child of the root;
  * `depths` are 1-based; `scores` are path log-probs under the node's best mode, log pi_k included
    when the input is weighted (float32, or float64 for float64 input), `modes` that mode (lowest
    index on ties);
  * N == budget always. When fewer prefixes than `budget` exist, or the rest score -inf (prefixes
    scored -inf are never included), the tail is padding: valid False, token 0, parent -1,
    depth 1, score -inf, mode 0.
"""

from dataclasses import fields

import torch
from torch import Tensor

from mfd_sglang.backend import check_backend
from mfd_sglang.handoffs import DraftCandidates, DraftTree


def top_candidates(logprobs: Tensor, count: int) -> DraftCandidates:
    """The `count` best tokens of full log-probabilities [bs, K, D, V] (ties to the lower id)."""
    top_logprobs, top_tokens = _top_ranked(logprobs, min(count, logprobs.shape[-1]))
    # Sum in at least float32: a bf16 drafter's path scores would lose their ordering.
    top_logprobs = top_logprobs.to(torch.promote_types(logprobs.dtype, torch.float32))
    return DraftCandidates(top_logprobs, top_tokens, logprobs.shape[-1])


def weigh_modes(logprobs: Tensor | DraftCandidates, log_prior: Tensor | None) -> Tensor | DraftCandidates:
    """Log-probabilities [.., K, D, V] (or their DraftCandidates) with log_prior [.., K] added to every
    depth-1 entry of its mode, in at least float32: the tree of the result weighs mode k by pi_k (see
    the module docstring). log_prior None: `logprobs` itself (the unweighted rule)."""
    if log_prior is None:
        return logprobs
    if isinstance(logprobs, DraftCandidates):
        return DraftCandidates(weigh_modes(logprobs.logprobs, log_prior), logprobs.tokens, logprobs.vocab)
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    first = logprobs[..., :1, :].to(dtype) + log_prior.to(dtype)[..., None, None]
    return torch.cat([first, logprobs[..., 1:, :].to(dtype)], dim=-2)


def build_mixture_tree(logprobs: Tensor | DraftCandidates, budget: int, *, backend: str = "torch") -> DraftTree:
    """The `budget` best distinct prefixes of a K-mode drafter, exactly.

    logprobs: [K, D, V] or [bs, K, D, V] per-mode, per-depth log-probabilities, or their
    `DraftCandidates` (batched; the same tree).
    backend: "torch" (this module), or "triton" (`mfd_sglang.kernels.tree_mixture`: bit-identical
    output, float32/float16/bfloat16 input only; needs a CUDA tensor, or TRITON_INTERPRET=1 set
    before triton is imported for CPU tensors, else ValueError).
    """
    check_backend(backend)
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if isinstance(logprobs, DraftCandidates):
        candidates = logprobs
        if candidates.logprobs.dim() != 4 or candidates.logprobs.shape[-1] < min(budget, candidates.vocab):
            raise ValueError(f"candidates must be [bs, K, D, C] with C >= min(budget, vocab) = "
                             f"{min(budget, candidates.vocab)}, not {tuple(candidates.logprobs.shape)}")
    elif logprobs.dim() == 3:
        return _without_batch(build_mixture_tree(logprobs[None], budget, backend=backend))
    elif logprobs.dim() != 4:
        raise ValueError(f"logprobs must be [K, D, V] or [bs, K, D, V], not {logprobs.shape}")
    if backend == "triton":
        # Imported here: the torch backend must not need triton.
        from mfd_sglang.kernels.tree_mixture import build_mixture_tree_triton

        return build_mixture_tree_triton(logprobs, budget)
    if not isinstance(logprobs, DraftCandidates):
        candidates = top_candidates(logprobs, budget)
    num_modes = candidates.logprobs.shape[1]
    scores, tokens, parents = _per_mode_beams(candidates, budget)
    scores, modes, parents = _dedupe_prefixes(scores, tokens, parents, num_modes, candidates.vocab)
    return _select_top_budget(scores, modes, parents, tokens, budget)


def empty_tree(bs: int, device) -> DraftTree:
    """A batch of trees with no node ([bs, 0] fields): verifying one is plain decoding (the root's
    row alone gives the round's one token)."""
    def none(dtype):
        return torch.zeros(bs, 0, dtype=dtype, device=device)

    return DraftTree(tokens=none(torch.int64), parents=none(torch.int64), depths=none(torch.int64),
                     scores=none(torch.float32), modes=none(torch.int64), valid=none(torch.bool))


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


def _per_mode_beams(candidates: DraftCandidates, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per mode and depth, the `width` best prefixes of that mode at that depth.

    A mode's score is a sum of per-depth terms independent of the parent, so its top-`width` at
    depth d extend its top-`width` at depth d-1 by one of depth d's top-`width` tokens.
    Entries at a depth are indexed flat as j = k * width + slot. Returns scores, tokens and parents
    (flat index of the parent entry at depth d-1), each [bs, D, K * width]; slots that hold no
    prefix score -inf.
    """
    num_top = min(width, candidates.vocab)
    top_logprobs, top_tokens = candidates.logprobs[..., :num_top], candidates.tokens[..., :num_top]
    bs, num_modes, depth, _ = top_logprobs.shape
    mode_offsets = torch.arange(num_modes, device=top_logprobs.device)[:, None] * width
    # Depth 0 is the root alone: slot 0 scores 0, the other slots hold nothing.
    beam = top_logprobs.new_full((bs, num_modes, width), float("-inf"))
    beam[..., 0] = 0.0
    scores, tokens, parents = [], [], []
    for d in range(depth):
        extended = beam[..., :, None] + top_logprobs[:, :, d, None, :]
        beam, flat = _top_ranked(extended.flatten(-2), width)
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
