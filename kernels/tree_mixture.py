"""Triton `build_mixture_tree`: the same contract as, and bit-identical output to, the pure-torch
reference in `mfd_sglang.tree` (same node order, tokens, parents, depths, scores, modes, valid).

Fixed shapes and no host sync, so it can be captured in a CUDA graph. Three launches:

  1. `_vocab_topk_kernel`, one program per (request, mode, depth): the min(B, V) best tokens over
     the vocabulary (B = budget), in tiles merged into a running top-B (bitonic networks).
  2. `_beam_kernel`, one program per (request, mode): per depth, the best B of the B beam slots x
     min(B, V) tokens, written as the reference's beam entries (score, token, parent flat index).
     Only the ~B ln B pairs that can rank are merged (both lists are sorted: see the kernel).
  3. `_merge_select_kernel`, one program per request: per depth, each entry's canonical entry (the
     lowest flat index with the same (canonical parent, token) key), its best score over modes and
     the lowest mode reaching it, from one sort of the depth's M entries by (key, index): runs of
     equal keys, numbered by a prefix sum, their best by atomic max (not all pairs); then the global
     top-`budget` and the DraftTree fields.

The depths are a chain (a depth's beam extends the one before, its keys name the canonical parents),
so the work of a depth is spread over the threads of one program: at the Qwen3-4B serving shapes (bs 1,
K = 8, B = 64) ~40k and ~60k instructions per warp scheduler, ~0.05 ms by the GPU cost ledger's issue-bound
model (`mfd_sglang.gpu_cost`; a model until a GPU measures it).

Exact ordering: every ranking sorts a distinct int64 key (`rank_keys`), the float score mapped to
an int32 whose signed order is the float order (high half), and (2^31 - 1 - index) (low half). A
descending top-k over these keys is the reference's stable descending sort: higher score first,
ties to the lower index (token id, beam flat index, mode, or global index (depth - 1) * M + j).
Scores are summed in float32 in the same order as the reference, so they are bitwise equal. NaN
inputs are unsupported.
"""

import math

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.params import pow2
from mfd_sglang.kernels.bitonic import merge_top, top_k_rows
from mfd_sglang.kernels.common import require_cuda
from mfd_sglang.kernels.rank_keys import MIN_KEY, key_index, key_score, rank_key
from mfd_sglang.handoffs import DraftCandidates, DraftTree

_TILE = 4096  # elements per ranking tile: bounds the register footprint of one top-k


@triton.jit
def _vocab_topk_kernel(
    logprobs_ptr, top_lp_ptr, top_tok_ptr, V, NUM_TOP,
    BB: tl.constexpr, TILE_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # (request * K + mode) * D + depth
    row_ptr = logprobs_ptr + row * V
    running = tl.full([BB], MIN_KEY, tl.int64)
    for start in range(0, V, TILE_V):
        tokens = start + tl.arange(0, TILE_V)
        # Clamped unmasked load: avoids a (bf16) `other` constant; lanes past V are dropped below.
        lp = tl.load(row_ptr + tl.minimum(tokens, V - 1)).to(tl.float32)
        keys = tl.where(tokens < V, rank_key(lp, tokens), MIN_KEY)
        running = merge_top(running, keys, TILE_V, BB)
    slot = tl.arange(0, BB)
    keep = slot < NUM_TOP
    token = tl.where(keep, key_index(running), 0)
    # Reload the value rather than decode it, so a -0.0 logprob stays -0.0 like the reference's.
    lp = tl.load(row_ptr + token).to(tl.float32)
    tl.store(top_lp_ptr + row * NUM_TOP + slot, lp, mask=keep)
    tl.store(top_tok_ptr + row * NUM_TOP + slot, token.to(tl.int64), mask=keep)


@triton.jit
def _extend_beam(running, prev_ptr, lp, d, i0, B, NUM_TOP, R: tl.constexpr, C: tl.constexpr, BB: tl.constexpr):
    """Merge into `running` the candidates (slot i, token rank t) of an [R, C] tile, i = i0 + row,
    t = column, that can rank in the top B: (i + 1) * (t + 1) <= B (see `_beam_kernel`)."""
    slot = i0 + tl.arange(0, R)
    t = tl.arange(0, C)
    # Depth 0 is the root alone: slot 0 scores 0, the other slots hold nothing (-inf).
    root = tl.where(slot == 0, 0.0, float("-inf"))
    prev = tl.load(prev_ptr + slot, mask=(slot < B) & (d > 0), other=float("-inf"))
    beam = tl.where(d > 0, prev, root)
    lp_t = tl.load(lp + t, mask=t < NUM_TOP, other=0.0)
    candidate = beam[:, None] + lp_t[None, :]
    ok = (slot[:, None] < B) & (t[None, :] < NUM_TOP) & ((slot[:, None] + 1) * (t[None, :] + 1) <= B)
    keys = tl.where(ok, rank_key(candidate, slot[:, None] * NUM_TOP + t[None, :]), MIN_KEY)
    return merge_top(running, tl.reshape(keys, [R * C]), R * C, BB)


@triton.jit
def _beam_kernel(
    top_lp_ptr, top_tok_ptr, beam_score_ptr, beam_tok_ptr, beam_parent_ptr,
    K, D, B, NUM_TOP,
    BB: tl.constexpr, NTB: tl.constexpr, ROWS_A: tl.constexpr, COLS_B: tl.constexpr,
):
    """Per depth, the B best of the B beam slots x NUM_TOP tokens. Both lists are sorted best first
    (ties to the lower index), so candidate (i, t) ranks below the (i + 1) * (t + 1) - 1 candidates
    (i' <= i, t' <= t): with (i + 1) * (t + 1) > B it cannot make the top B, and only the pairs with
    min(i, t) < sqrt(B) are ranked: slots i < ROWS_A x every token rank, then slots i >= ROWS_A x
    token ranks t < COLS_B (ROWS_A * COLS_B >= B, or COLS_B >= NUM_TOP). At B = 64, 1,024 lanes instead of
    4,096. Where that saves nothing (a vocabulary of a few tokens), ROWS_A = BB and COLS_B = 0: one tile."""
    pid = tl.program_id(0)  # request * K + mode
    request = pid // K
    mode = pid % K
    M = K * B  # entries per depth, flat index j = mode * B + slot
    rank = tl.arange(0, BB)
    for d in range(D):
        row = (pid * D + d).to(tl.int64)
        lp = top_lp_ptr + row * NUM_TOP
        prev_ptr = beam_score_ptr + ((request * D + d - 1) * M + mode * B).to(tl.int64)
        running = tl.full([BB], MIN_KEY, tl.int64)
        running = _extend_beam(running, prev_ptr, lp, d, 0, B, NUM_TOP, ROWS_A, NTB, BB)
        if COLS_B > 0:
            running = _extend_beam(running, prev_ptr, lp, d, ROWS_A, B, NUM_TOP, BB, COLS_B, BB)
        keep = rank < B  # at least B candidates are real (slot 0 x NUM_TOP, and slots x token 0)
        flat = tl.where(keep, key_index(running), 0)
        token = tl.load(top_tok_ptr + row * NUM_TOP + flat % NUM_TOP, mask=keep, other=0)
        out = ((request * D + d) * M + mode * B).to(tl.int64) + rank
        tl.store(beam_score_ptr + out, key_score(running), mask=keep)
        tl.store(beam_tok_ptr + out, token, mask=keep)
        tl.store(beam_parent_ptr + out, (mode * B + flat // NUM_TOP).to(tl.int64), mask=keep)
        tl.debug_barrier()  # the next depth reads this depth's scores (other threads' stores)


@triton.jit
def _merge_select_kernel(
    beam_score_ptr, beam_tok_ptr, beam_parent_ptr,
    scratch_ptr, canon_ptr, merged_score_ptr, merged_mode_ptr, canon_parent_ptr, node_ptr,
    out_tok_ptr, out_parent_ptr, out_depth_ptr, out_score_ptr, out_mode_ptr, out_valid_ptr,
    K, D, B, V, budget,
    MB: tl.constexpr, BB: tl.constexpr, TILE_G: tl.constexpr,
):
    request = tl.program_id(0).to(tl.int64)
    M = K * B
    T = D * M  # global index g = depth0 * M + j, as the reference flattens [D, M]
    req = request * T  # every per-entry buffer is [bs, D, M]
    sorted_at = scratch_ptr + request * 3 * MB  # per request: the sorted entries, then per run its
    canon_at = sorted_at + MB  # canonical entry and its best rank key
    best_at = canon_at + MB
    j = tl.arange(0, MB)
    j_ok = j < M
    p = tl.arange(0, MB)  # a position in the sorted order
    # --- dedupe: merge the modes' entries holding the same prefix, depth by depth ---
    for d in range(D):
        at = req + d * M
        token = tl.load(beam_tok_ptr + at + j, mask=j_ok, other=0)
        parent = tl.load(beam_parent_ptr + at + j, mask=j_ok & (d > 0), other=0)
        # Canonical parent: the canonical id (at depth d-1) of the beam parent; -1 is the root.
        parent_canon = tl.load(canon_ptr + at - M + parent, mask=j_ok & (d > 0), other=-1)
        tl.store(canon_parent_ptr + at + j, parent_canon, mask=j_ok)
        tl.store(node_ptr + at + j, tl.full([MB], -1, tl.int64), mask=j_ok)
        # Sort the entries by (prefix key, j), descending: equal prefixes form runs whose last
        # position holds the lowest j, the canonical entry. Padding (0) sorts after every entry.
        key = (parent_canon + 1) * V + token + 1
        order = tl.where(j_ok, key * MB + j, 0)
        order = tl.reshape(top_k_rows(tl.reshape(order, [1, MB]), 1, MB, MB, 0), [MB])
        tl.store(sorted_at + p, order)
        tl.store(best_at + p, tl.full([MB], MIN_KEY, tl.int64))
        tl.debug_barrier()
        key_p = order // MB
        entry = order % MB
        real = key_p > 0
        before = tl.load(sorted_at + p - 1, mask=p > 0, other=0) // MB
        after = tl.load(sorted_at + p + 1, mask=p + 1 < MB, other=0) // MB
        ends = real & (after != key_p)
        # Runs numbered in sorted order: a run's canonical entry is filed under its number, its best
        # (score, lowest mode at it) gathered there by atomic max (an order-free, exact reduction).
        run = tl.cumsum((real & (before != key_p)).to(tl.int32), 0) - 1
        tl.store(canon_at + tl.cumsum(ends.to(tl.int32), 0) - 1, entry, mask=ends)
        score = tl.load(beam_score_ptr + at + entry, mask=real, other=0.0)
        tl.atomic_max(best_at + run, rank_key(score, entry // B), mask=real)
        tl.debug_barrier()
        canon = tl.load(canon_at + run, mask=real, other=0)
        best = tl.atomic_max(best_at + run, tl.full([MB], MIN_KEY, tl.int64), mask=real)  # read at L2
        tl.store(canon_ptr + at + entry, canon, mask=real)
        # Only the canonical entry keeps the prefix (best score, lowest mode at it); others -inf.
        tl.store(merged_score_ptr + at + entry, tl.where(ends, key_score(best), float("-inf")), mask=real)
        tl.store(merged_mode_ptr + at + entry, tl.where(ends, key_index(best), K).to(tl.int64), mask=real)
        tl.debug_barrier()
    # --- selection: the global top-`budget` by (score desc, g asc) ---
    running = tl.full([BB], MIN_KEY, tl.int64)
    for g0 in range(0, T, TILE_G):
        g = g0 + tl.arange(0, TILE_G)
        score = tl.load(merged_score_ptr + req + g, mask=g < T, other=float("-inf"))
        running = merge_top(running, tl.where(g < T, rank_key(score, g), MIN_KEY), TILE_G, BB)
    rank = tl.arange(0, BB)
    keep = rank < budget  # T >= budget, so these ranks are all real entries
    g = tl.where(keep, key_index(running), 0)
    score = key_score(running)
    valid = score > float("-inf")
    depth = g // M + 1
    tl.store(node_ptr + req + g, rank.to(tl.int64), mask=keep)
    tl.debug_barrier()
    parent_entry = (depth - 2) * M + tl.load(canon_parent_ptr + req + g, mask=keep, other=0)
    parent = tl.load(node_ptr + req + tl.maximum(parent_entry, 0), mask=keep, other=-1)
    token = tl.load(beam_tok_ptr + req + g, mask=keep, other=0)
    mode = tl.load(merged_mode_ptr + req + g, mask=keep, other=0)
    out = request * budget + rank
    tl.store(out_tok_ptr + out, tl.where(valid, token, 0), mask=keep)
    tl.store(out_parent_ptr + out, tl.where(valid & (depth > 1), parent, -1), mask=keep)
    tl.store(out_depth_ptr + out, tl.where(valid, depth, 1).to(tl.int64), mask=keep)
    tl.store(out_score_ptr + out, score, mask=keep)
    tl.store(out_mode_ptr + out, tl.where(valid, mode, 0), mask=keep)
    tl.store(out_valid_ptr + out, valid, mask=keep)


# The selection tiles (entries per depth MB, top BB, tile) that ptxas compiles with local memory, each run at half
# the tile: at a gate's K' = 4 (M = 256) and B = 64, one tile of 4096 gets 80 registers and 8 bytes of spills on
# sm_90a (a register-allocation edge: K = 8's 512 entries, or B = 32, compile without); 2048 gets 76 and none, for
# 2-3 % more issued instructions (two tiles' merges).
_SPILLING_SELECT_TILES = {(256, 64, 4096)}


def _select_tile(entries: int, mb: int, bb: int) -> int:
    """TILE_G of `_merge_select_kernel`: the global selection's tile over the tree's D * M entries, a power of two
    from bb to _TILE, halved at `_SPILLING_SELECT_TILES`. The tile only cuts the entries into chunks for the
    merges of distinct keys: every tile gives the same top-B."""
    tile = max(bb, min(pow2(entries), _TILE))
    return tile // 2 if (mb, bb, tile) in _SPILLING_SELECT_TILES else tile


def build_mixture_tree_triton(logprobs: torch.Tensor | DraftCandidates, budget: int) -> DraftTree:
    """`mfd_sglang.tree.build_mixture_tree` on Triton; logprobs [K, D, V] or [bs, K, D, V] in
    float32, float16 or bfloat16 (scores come out float32), or float32 `DraftCandidates` (the
    vocabulary top-B launch is then skipped)."""
    if isinstance(logprobs, DraftCandidates):
        source = logprobs.logprobs
        bs, num_modes, depth, _ = source.shape
        vocab = logprobs.vocab
    else:
        if logprobs.dim() == 3:
            tree = build_mixture_tree_triton(logprobs[None], budget)
            return DraftTree(**{name: value[0] for name, value in vars(tree).items()})
        if logprobs.dim() != 4:
            raise ValueError(f"logprobs must be [K, D, V] or [bs, K, D, V], not {logprobs.shape}")
        source = logprobs
        bs, num_modes, depth, vocab = logprobs.shape
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if source.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"the Triton tree backend takes float32/16 or bfloat16, not {source.dtype}")
    require_cuda(source, "the Triton tree backend")
    width = budget
    num_top = min(width, vocab)
    num_entries = num_modes * width  # M, entries per depth
    if depth * num_entries >= 2**31 or vocab >= 2**31:
        raise ValueError("too many tree entries for 32-bit indices")
    dev = source.device
    bb, ntb, mb = pow2(width), pow2(num_top), pow2(num_entries)
    i64 = dict(dtype=torch.int64, device=dev)

    if isinstance(logprobs, DraftCandidates):
        top_lp = logprobs.logprobs[..., :num_top].float().reshape(-1, num_top).contiguous()
        top_tok = logprobs.tokens[..., :num_top].reshape(-1, num_top).contiguous()
    else:
        top_lp = torch.empty(bs * num_modes * depth, num_top, dtype=torch.float32, device=dev)
        top_tok = torch.empty(bs * num_modes * depth, num_top, **i64)
        tile_v = max(bb, min(pow2(vocab), 1024))
        _vocab_topk_kernel[(bs * num_modes * depth,)](
            logprobs.contiguous(), top_lp, top_tok, vocab, num_top, BB=bb, TILE_V=tile_v
        )

    entries = (bs, depth, num_entries)
    beam_score = torch.empty(entries, dtype=torch.float32, device=dev)
    beam_tok = torch.empty(entries, **i64)
    beam_parent = torch.empty(entries, **i64)
    cols_b = min(pow2(math.isqrt(width - 1) + 1), ntb)  # cols_b ** 2 >= width, or every token rank
    rows_a = max(cols_b, bb // ntb)  # each tile has >= bb lanes
    if rows_a * ntb + bb * cols_b >= bb * ntb:
        rows_a, cols_b = bb, 0
    _beam_kernel[(bs * num_modes,)](
        top_lp, top_tok, beam_score, beam_tok, beam_parent, num_modes, depth, width, num_top,
        BB=bb, NTB=ntb, ROWS_A=rows_a, COLS_B=cols_b,
    )

    canon, merged_mode, canon_parent, node = (torch.empty(entries, **i64) for _ in range(4))
    scratch = torch.empty(bs, 3, mb, **i64)
    merged_score = torch.empty(entries, dtype=torch.float32, device=dev)
    tokens, parents, depths, modes = (torch.empty(bs, budget, **i64) for _ in range(4))
    scores = torch.empty(bs, budget, dtype=torch.float32, device=dev)
    valid = torch.empty(bs, budget, dtype=torch.bool, device=dev)
    _merge_select_kernel[(bs,)](
        beam_score, beam_tok, beam_parent,
        scratch, canon, merged_score, merged_mode, canon_parent, node,
        tokens, parents, depths, scores, modes, valid,
        num_modes, depth, width, vocab, budget,
        MB=mb, BB=bb, num_warps=8, TILE_G=_select_tile(depth * num_entries, mb, bb),
    )
    return DraftTree(
        tokens=tokens, parents=parents, depths=depths, scores=scores, modes=modes, valid=valid
    )
