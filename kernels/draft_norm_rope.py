"""Triton per-head RMSNorm + rope, in place: the drafter's queries and keys (`DrafterLayer.forward`) and its
context keys (`MFDDrafter.context_kv`) in one launch, where the torch path (`drafter.rms_norm`, then
`drafter.apply_rope`: multiply, roll, multiply, add) launches five per tensor.

For every head row x [D] of q and k: y = x / sqrt(mean(x^2) + eps) * weight, then y * cos + roll(y, D/2) *
sin, the tables made in the kernel as `drafter.rope_cos_sin` makes them (angles = float32 position x
inverse frequency, the same product; cos twice, sin with its first half negated), all in float32 and
rounded once to x's dtype. The torch path rounds the tables, the norm and each product to the dtype, so the
two agree to the dtype's rounding, as two GEMMs do: a drafter's numbers steer which tokens it proposes,
never what the server emits.

Why not SGLang's: its RMSNorm and rope layers are sgl_kernel CUDA ops (no CPU trace, no interpreter) that
normalise and rotate in separate launches, and its `fused_kv_materialize` writes K/V into a paged pool
rather than in place.

One program per (row, tensor), over its heads 8 at a time. Fixed shapes, no host sync.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.common import require_cuda


@triton.jit
def _norm_rope_heads(x_ptr, row_stride, head_stride, w_ptr, heads_per_weight, positions_ptr, inv_freq_ptr, row,
                     heads, eps, D, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    col = tl.arange(0, BLOCK_D)[None, :]
    rolled = (col + D // 2) % D
    half = D // 2
    angle = tl.load(positions_ptr + row).to(tl.float32) * tl.load(inv_freq_ptr + col % half, mask=col < D, other=0.0)
    cos = tl.cos(angle)
    sin = tl.where(col < half, -tl.sin(angle), tl.sin(angle))
    for first in range(0, heads, BLOCK_H):  # BLOCK_H heads at a time: their [BLOCK_H, D] tiles fit in registers
        head = first + tl.arange(0, BLOCK_H)[:, None]
        keep = (head < heads) & (col < D)
        at = x_ptr + row * row_stride + head * head_stride
        x = tl.load(at + col, mask=keep, other=0.0).to(tl.float32)
        x_rolled = tl.load(at + rolled, mask=keep, other=0.0).to(tl.float32)
        inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]
        weight_row = w_ptr + (head // heads_per_weight) * D
        y = x * inv_rms * tl.load(weight_row + col, mask=keep, other=0.0).to(tl.float32)
        y_rolled = x_rolled * inv_rms * tl.load(weight_row + rolled, mask=keep, other=0.0).to(tl.float32)
        tl.store(at + col, (y * cos + y_rolled * sin).to(x_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _norm_rope_kernel(
    q_ptr, q_row_stride, q_head_stride, q_weight_ptr, q_heads,
    k_ptr, k_row_stride, k_head_stride, k_weight_ptr, k_heads, k_heads_per_weight,
    positions_ptr, inv_freq_ptr, eps, D,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _norm_rope_heads(k_ptr, k_row_stride, k_head_stride, k_weight_ptr, k_heads_per_weight, positions_ptr,
                         inv_freq_ptr, row, k_heads, eps, D, BLOCK_H, BLOCK_D)
    else:
        _norm_rope_heads(q_ptr, q_row_stride, q_head_stride, q_weight_ptr, q_heads, positions_ptr, inv_freq_ptr,
                         row, q_heads, eps, D, BLOCK_H, BLOCK_D)


def _rows_heads(x: torch.Tensor, name: str) -> torch.Tensor:
    """x [..., H, D] as a view [rows, H, D] (written in place: never a copy) with a unit-stride head dim."""
    if x.dim() < 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [..., heads, head_dim] with a unit-stride head dim, got {tuple(x.shape)}")
    return x.view(-1, *x.shape[-2:])  # raises where only a copy could flatten it


def norm_rope_(q: torch.Tensor | None, q_weight: torch.Tensor | None, k: torch.Tensor, k_weight: torch.Tensor,
               positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> None:
    """In place: q [..., Hq, D] normed by q_weight [D] and k [..., Hk, D] by k_weight [G, D] (head h by row
    h // (Hk / G): a stack of layers' k-norms over their heads), then both rotated to their positions [...]
    (one per leading index) with inverse frequencies inv_freq [D / 2] float32 (`drafter.rope_inv_freq`). q
    may be None (keys alone). One launch."""
    k_rows = _rows_heads(k, "k")
    rows, k_heads, dim = k_rows.shape
    require_cuda(k, "the Triton norm + rope")
    k_weight = k_weight.reshape(-1, dim)
    if k_heads % k_weight.shape[0]:
        raise ValueError(f"{k_heads} key heads do not split over {k_weight.shape[0]} norm weights")
    positions = positions.reshape(-1)
    if positions.shape[0] != rows or inv_freq.shape != (dim // 2,) or inv_freq.dtype != torch.float32:
        raise ValueError(f"{positions.shape[0]} positions and inverse frequencies {tuple(inv_freq.shape)} "
                         f"{inv_freq.dtype} do not fit {rows} rows of head_dim {dim} (float32 [{dim // 2}])")
    q_rows = k_rows if q is None else _rows_heads(q, "q")
    if q_rows.shape[0] != rows or q_rows.shape[2] != dim:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} differ in rows or head_dim")
    q_weight = k_weight if q is None else q_weight
    grid = (rows, 1 if q is None else 2)
    if rows == 0:
        return
    _norm_rope_kernel[grid](
        q_rows, q_rows.stride(0), q_rows.stride(1), q_weight, q_rows.shape[1],
        k_rows, k_rows.stride(0), k_rows.stride(1), k_weight, k_heads, k_heads // k_weight.shape[0],
        positions, inv_freq, eps, dim, BLOCK_H=8, BLOCK_D=triton.next_power_of_2(dim), num_warps=4)
