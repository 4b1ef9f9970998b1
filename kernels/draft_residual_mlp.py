"""Triton steps of a drafter layer between its products, one launch each where the torch path
(`DrafterLayer.forward`, `DrafterLayer.mlp`) launches two: the attention's residual add with the MLP's
RMSNorm, and SwiGLU's SiLU(gate) x up.

Both compute in float32 and round once to the input dtype; the residual sum is rounded first (the stream
the next layer adds to holds it in the dtype, as torch's does) and normed from its rounded value. The torch
path also rounds SiLU(gate) before the product, so the two agree to the dtype's rounding.

Why not SGLang's: its `fused_add_rmsnorm` and `silu_and_mul` are sgl_kernel CUDA ops (no CPU trace, no
interpreter), and the former writes its sum over the residual input in place.
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.common import require_cuda


@triton.jit
def store_rms_norm(out_ptr, x, weight_ptr, col, keep, H, eps):
    """Store RMSNorm(x) * weight of one row x (float32 [BLOCK], lanes col < H kept) in out's dtype."""
    inv_rms = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    weight = tl.load(weight_ptr + col, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + col, (x * inv_rms * weight).to(out_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, normed_ptr, H, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * H
    col = tl.arange(0, BLOCK)
    keep = col < H
    total = tl.load(x_ptr + row + col, mask=keep, other=0.0).to(tl.float32) \
        + tl.load(delta_ptr + row + col, mask=keep, other=0.0).to(tl.float32)
    total = total.to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row + col, total, mask=keep)
    store_rms_norm(normed_ptr + row, total.to(tl.float32), weight_ptr, col, keep, H, eps)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = col < I
    gate = tl.load(gate_up_ptr + row * 2 * I + col, mask=keep, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * I + I + col, mask=keep, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * I + col, (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty), mask=keep)


def _check(x: torch.Tensor) -> None:
    require_cuda(x, "the Triton drafter steps")


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, ...]:
    """(x + delta, rms_norm(x + delta) * weight) for x, delta [..., H], weight [H]. One launch."""
    _check(x)
    x, delta = x.contiguous(), delta.contiguous()
    hidden = x.shape[-1]
    total, normed = torch.empty_like(x), torch.empty_like(x)
    block = triton.next_power_of_2(hidden)
    if x.numel():
        _add_rms_norm_kernel[(x.numel() // hidden,)](x, delta, weight, total, normed, hidden, eps, BLOCK=block,
                                                     num_warps=min(max(block // 512, 1), 16))
    return total, normed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of gate_up [..., 2I] (gate its first half, up its second): [..., I]. One launch."""
    _check(gate_up)
    gate_up = gate_up.contiguous()
    inner = gate_up.shape[-1] // 2
    out = gate_up.new_empty(*gate_up.shape[:-1], inner)
    block = min(triton.next_power_of_2(inner), 1024)
    if out.numel():
        _silu_mul_kernel[(out.numel() // inner, triton.cdiv(inner, block))](gate_up, out, inner, BLOCK=block)
    return out
