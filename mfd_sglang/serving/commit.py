"""The commit stage of a speculative round, shared by the SGLang worker (`MFDWorkerV2.commit_verified`)
and the round-cost harness (`mfd_sglang/round_cost.py`), so the code that is measured is the code
that serves.

After the verify forward over each request's window `[root, B tree nodes]` the round commits the root
and the accepted path: their target K/V move to the front of the window (the caller's KV store does
the move: SGLang's `move_accept_tokens_to_target_kvcache` in the server, the static cache in the
benchmark; the server also commits a hybrid target's recurrent state after the path) and the drafter
context K/V of the same tokens is written at the front slots of the window.
Torch only (no sglang import): the benchmark runs where SGLang is not installed.
"""

from __future__ import annotations

from typing import Callable

import torch

from mfd_sglang.acceptance import TreeVerifyResult
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.tree_layout import with_root

from mfd_sglang.serving.draft_context_pool import DeferredContextWrites, DraftContextPool


def committed_window_path(accepted: torch.Tensor, width: int) -> torch.Tensor:
    """[bs, width] window indices of the committed tokens in order: the root (0), then the accepted
    nodes by depth (the verify's accepted window indices accepted [bs, >= width - 1]), then -1 past each
    request's accepted path."""
    return with_root(0, accepted[:, : width - 1])


def commit_rows(accepted: torch.Tensor, window_hidden: torch.Tensor, seq_lens: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(path [bs, W], rows [bs * W, F], positions [bs * W]) of a commit of width W: the committed window
    indices (`committed_window_path`), the target's features window_hidden [bs, N, F] at them (the root's
    past the path) and their positions seq_lens[r] + j (int64), from the verify's accepted window indices
    accepted [bs, >= W - 1] (-1 past the path). The torch path of `kernels/commit_rows.py`."""
    path = committed_window_path(accepted, width)
    rows = path.clamp(min=0)[:, :, None].expand(-1, -1, window_hidden.shape[-1])
    positions = seq_lens[:, None].long() + torch.arange(width, device=seq_lens.device)
    return path, window_hidden.gather(1, rows).flatten(0, 1), positions.flatten()


def commit_round(result: TreeVerifyResult, window_hidden: torch.Tensor, seq_lens: torch.Tensor,
                 window_slots: torch.Tensor, context_pool: DraftContextPool | DeferredContextWrites,
                 drafter: MFDDrafter, commit_target: Callable[[torch.Tensor], None]) -> None:
    """Commit one round of bs requests with verify windows of N tokens (root first).

    window_hidden [bs, N, F]: the target's drafter features of every window token; seq_lens [bs]:
    committed tokens before the round (the root sits at position seq_lens); window_slots [bs, N]: the
    KV slots the verify wrote; commit_target(path): commits the target's side of the window indices
    path [bs, W] (-1: none): their K/V to the window's first W slots and, for a hybrid target, the
    recurrent state after the last of them; context_pool takes the drafter context (written, or held
    for a later batched write). Fixed shapes, no host sync.
    """
    width = min(drafter.cfg.block_size, window_slots.shape[1])  # root + the longest possible path
    # Rows past a request's accepted length land in slots it has reserved but not committed;
    # the round that commits those positions overwrites them.
    if drafter.backend == "triton":  # the same in one launch
        from mfd_sglang.kernels import commit_rows as fused

        path, hidden, positions = fused.commit_rows(result.accepted_local_indices, window_hidden, seq_lens, width)
    else:
        path, hidden, positions = commit_rows(result.accepted_local_indices, window_hidden, seq_lens, width)
    commit_target(path)
    context_pool.write(drafter, hidden, positions, window_slots[:, :width].flatten())
