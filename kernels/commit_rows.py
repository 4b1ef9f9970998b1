"""Triton: the commit's inputs in one launch, where the torch path (`serving/commit.py`'s `commit_round`) launches
six (the root column's fill and join, the clamp, the gather of the target's features, the positions' arange and
add).

For requests r and path slots j < W (W = the commit's width, root first):
  path[r, j]          = 0 if j == 0 else accepted[r, j - 1]       (window indices; -1 past the accepted path)
  rows[r * W + j]     = window_hidden[r, max(path[r, j], 0)]       (the target's drafter features, copied)
  positions[r * W + j] = seq_lens[r] + j                           (int64)
Copies only: bit-equal to the torch path. No host sync (CUDA-graph safe).
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.common import require_cuda

_BLOCK_F = 1024  # feature columns a step copies


@triton.jit
def _commit_rows_kernel(accepted_ptr, hidden_ptr, seq_lens_ptr, path_ptr, rows_ptr, positions_ptr, width, F,
                        stride_accepted, stride_hidden_r, stride_hidden_n, BLOCK: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1)
    node = tl.load(accepted_ptr + req * stride_accepted + slot - 1, mask=slot > 0, other=0).to(tl.int64)
    out = req * width + slot
    tl.store(path_ptr + out, node)
    tl.store(positions_ptr + out, tl.load(seq_lens_ptr + req).to(tl.int64) + slot)
    source = hidden_ptr + req * stride_hidden_r + tl.maximum(node, 0) * stride_hidden_n
    for start in range(0, F, BLOCK):
        col = start + tl.arange(0, BLOCK)
        keep = col < F
        tl.store(rows_ptr + out * F + col, tl.load(source + col, mask=keep), mask=keep)


def commit_rows(accepted: torch.Tensor, window_hidden: torch.Tensor, seq_lens: torch.Tensor,
                width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(path [bs, W] int64, rows [bs * W, F], positions [bs * W] int64) of a commit of width W: accepted [bs, >= W - 1]
    window indices (-1 past the path), window_hidden [bs, N, F] (unit-stride features), seq_lens [bs]. One launch."""
    require_cuda(window_hidden, "the Triton commit rows")
    bs, _, features = window_hidden.shape
    if accepted.dim() != 2 or accepted.shape[0] != bs or accepted.shape[1] < width - 1 or width < 1 \
            or seq_lens.shape != (bs,) or window_hidden.stride(2) != 1:
        raise ValueError(f"commit rows: accepted {tuple(accepted.shape)}, window_hidden {tuple(window_hidden.shape)} "
                         f"(strides {window_hidden.stride()}), seq_lens {tuple(seq_lens.shape)}, width {width} "
                         f"do not match")
    accepted = accepted if accepted.stride(-1) == 1 else accepted.contiguous()
    seq_lens = seq_lens.contiguous()
    path = torch.empty(bs, width, dtype=torch.int64, device=window_hidden.device)
    rows = window_hidden.new_empty(bs * width, features)
    positions = torch.empty(bs * width, dtype=torch.int64, device=window_hidden.device)
    if bs:
        _commit_rows_kernel[(bs, width)](accepted, window_hidden, seq_lens, path, rows, positions, width, features,
                                         accepted.stride(0), window_hidden.stride(0), window_hidden.stride(1),
                                         BLOCK=min(_BLOCK_F, triton.next_power_of_2(features)))
    return path, rows, positions
