"""Triton: the drafter's block input in one launch, where the torch path (`MFDDrafter.block_hidden` then
`forward`'s first steps) launches eight (the token block's fill and root, the positions' arange, add and
repeat, the embedding gather, the mode add, the first layer's RMSNorm).

For requests r, modes m < K' and block slots t < T (row m * T + t of a request's K' * T rows):
  x[r, m*T + t]         = embed[root_r if t == 0 else mask_id] + modes[r or 0, m]  (rounded to the dtype)
  normed[r, m*T + t]    = RMSNorm(x[r, m*T + t]) * norm_weight                    (float32 statistics)
  positions[r, m*T + t] = starts[r] + t                                           (int64)
The sum is torch's (one rounding of the float32 sum of two values of the dtype); the norm is torch's up to
float32 rounding (`kernels/residual_mlp.store_rms_norm`, the residual norm's own). No host sync (CUDA-graph safe).
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.common import require_cuda
from mfd_sglang.kernels.draft_residual_mlp import store_rms_norm


@triton.jit
def _block_input_kernel(roots_ptr, starts_ptr, embed_ptr, modes_ptr, norm_ptr, x_ptr, normed_ptr, positions_ptr,
                        mask_id, H, T, rows, stride_embed, stride_modes_r, eps, BLOCK: tl.constexpr):
    req = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)  # m * T + t
    slot = row % T
    token = tl.where(slot == 0, tl.load(roots_ptr + req).to(tl.int64), mask_id)
    col = tl.arange(0, BLOCK)
    keep = col < H
    embed = tl.load(embed_ptr + token * stride_embed + col, mask=keep, other=0.0).to(tl.float32)
    mode = tl.load(modes_ptr + req * stride_modes_r + (row // T) * H + col, mask=keep, other=0.0).to(tl.float32)
    out = (req * rows + row) * H
    x = (embed + mode).to(x_ptr.dtype.element_ty)
    tl.store(x_ptr + out + col, x, mask=keep)
    store_rms_norm(normed_ptr + out, x.to(tl.float32), norm_ptr, col, keep, H, eps)
    tl.store(positions_ptr + req * rows + row, tl.load(starts_ptr + req).to(tl.int64) + slot)


def block_input(roots: torch.Tensor, starts: torch.Tensor, embed: torch.Tensor, modes: torch.Tensor, mask_id: int,
                norm_weight: torch.Tensor, eps: float, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [bs, K'*T, H] in embed's dtype, its RMSNorm [bs, K'*T, H], positions [bs, K'*T] int64) of the blocks
    `[root, mask_id x (T - 1)]` (T = block) at positions starts.. of requests roots [bs] (token ids), starts [bs]
    (integers), each row its mode's vector added: modes [bs or 1, K', H] in embed's dtype; embed [V, H],
    norm_weight [H]. One launch."""
    require_cuda(roots, "the Triton block input")
    bs, (num, k, hidden) = roots.shape[0], modes.shape
    if roots.dim() != 1 or starts.shape != roots.shape or num not in (1, bs) or embed.shape[1] != hidden \
            or modes.dtype != embed.dtype or embed.stride(1) != 1 or norm_weight.shape != (hidden,) or block < 1:
        raise ValueError(f"block input: roots {tuple(roots.shape)}, starts {tuple(starts.shape)}, embed "
                         f"{tuple(embed.shape)} {embed.dtype}, modes {tuple(modes.shape)} {modes.dtype}, norm weight "
                         f"{tuple(norm_weight.shape)}, block {block} do not match")
    roots, starts, modes = roots.contiguous(), starts.contiguous(), modes.contiguous()
    rows = k * block
    x = embed.new_empty(bs, rows, hidden)
    normed = torch.empty_like(x)
    positions = torch.empty(bs, rows, dtype=torch.int64, device=roots.device)
    if bs:
        width = triton.next_power_of_2(hidden)
        _block_input_kernel[(bs, rows)](
            roots, starts, embed, modes, norm_weight, x, normed, positions, mask_id, hidden, block, rows,
            embed.stride(0), modes.stride(0) if num > 1 else 0, eps, BLOCK=width,
            num_warps=min(max(width // 512, 1), 16))
    return x, normed, positions
