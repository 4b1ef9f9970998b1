"""Triton mode attention: the same contract and numbers (within float tolerance) as the torch
reference `mfd_sglang.mode_attention.mode_attention(..., backend="torch")`.

One program per (request, kv head, tile of BLOCK_M query rows), where the rows of a kv head are
(block row, group head) pairs: the K modes' rows of a request share each context tile they read,
so the paged context is streamed once per row tile rather than once per mode and query head. The
context loop runs over the request's own length (online softmax); the block part is one tile of all
K x T block keys with a same-mode mask. No host sync; fixed launch shapes for a given batch.
fp32 inputs are multiplied in IEEE fp32 (`input_precision="ieee"`): Triton's default for an fp32
`tl.dot` on NVIDIA GPUs is TF32, which would part the fp32 path from its reference.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.common import require_cuda


@triton.jit
def _attend_tile(q, k, v, visible, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """Online-softmax update of (running max, running sum, accumulator) with one key/value tile."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc


@triton.jit
def _mode_attention_kernel(
    Q, BK, BV, PK, PV, REQ_TO_TOKEN, REQ_IDX, CTX_LENS, OUT, scale,
    sq_b, sq_h, sq_r, sb_b, sb_h, sb_r, sp_s, sp_h, s_rt, so_b, so_h, so_r,
    ROWS: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    valid_m = row < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    valid_d = offs_d < HEAD_DIM

    q = tl.load(Q + b * sq_b + head[:, None] * sq_h + row[:, None] * sq_r + offs_d[None, :],
                mask=valid_m[:, None] & valid_d[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile adds nothing
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    ctx_len = tl.load(CTX_LENS + b)
    req = tl.load(REQ_IDX + b).to(tl.int64)
    for start in range(0, ctx_len, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        valid_n = offs_n < ctx_len
        slots = tl.load(REQ_TO_TOKEN + req * s_rt + offs_n, mask=valid_n, other=0).to(tl.int64)
        kv_off = slots[:, None] * sp_s + kv_head * sp_h + offs_d[None, :]
        kv_mask = valid_n[:, None] & valid_d[None, :]
        k = tl.load(PK + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(PV + kv_off, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, valid_n[None, :], m_i, l_i, acc, scale, PRECISION)

    offs_r = tl.arange(0, BLOCK_R)
    valid_r = offs_r < ROWS
    blk_off = b * sb_b + kv_head * sb_h + offs_r[:, None] * sb_r + offs_d[None, :]
    blk_mask = valid_r[:, None] & valid_d[None, :]
    k = tl.load(BK + blk_off, mask=blk_mask, other=0.0)
    v = tl.load(BV + blk_off, mask=blk_mask, other=0.0)
    same_mode = (row[:, None] // BLOCK_T) == (offs_r[None, :] // BLOCK_T)
    m_i, l_i, acc = _attend_tile(q, k, v, same_mode & valid_r[None, :], m_i, l_i, acc, scale, PRECISION)

    out = acc / l_i[:, None]
    tl.store(OUT + b * so_b + head[:, None] * so_h + row[:, None] * so_r + offs_d[None, :],
             out.to(OUT.dtype.element_ty), mask=valid_m[:, None] & valid_d[None, :])


def _same_strides(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v as they are when they share strides with a unit-stride last dim, else contiguous copies."""
    if k.stride() == v.stride() and k.stride(-1) == 1:
        return k, v
    return k.contiguous(), v.contiguous()


def mode_attention_triton(q, block_k, block_v, pool_k, pool_v, req_to_token, req_pool_indices, context_lens,
                          *, num_modes: int, block_m: int = 64, block_n: int = 32) -> torch.Tensor:
    require_cuda(q, "the Triton mode attention", "; use backend='torch' on CPU")
    bs, num_heads, rows, head_dim = q.shape
    num_kv_heads = block_k.shape[1]
    if num_heads % num_kv_heads or rows % num_modes:
        raise ValueError(f"heads {num_heads} / kv heads {num_kv_heads} and rows {rows} / modes {num_modes} "
                         "must divide evenly")
    group = num_heads // num_kv_heads
    # The kernel takes any batch / head / row strides (one set for k and v) and needs unit-stride head dims:
    # the drafter's q / k / v are [bs, K*T, heads, hd] tensors seen as [bs, heads, K*T, hd], read in place,
    # and the output takes q's layout, so the drafter's o_proj reads it back without a copy.
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_k, block_v = _same_strides(block_k, block_v)
    pool_k, pool_v = _same_strides(pool_k, pool_v)
    out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_r = max(16, triton.next_power_of_2(rows))
    grid = (bs, num_kv_heads, triton.cdiv(rows * group, block_m))
    _mode_attention_kernel[grid](
        q, block_k, block_v, pool_k, pool_v, req_to_token, req_pool_indices, context_lens, out,
        head_dim ** -0.5,
        q.stride(0), q.stride(1), q.stride(2), block_k.stride(0), block_k.stride(1), block_k.stride(2),
        pool_k.stride(0), pool_k.stride(1), req_to_token.stride(0), out.stride(0), out.stride(1), out.stride(2),
        ROWS=rows, BLOCK_T=rows // num_modes, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    return out
