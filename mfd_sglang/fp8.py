"""FP8 (e4m3) linear layers: how SGLang 0.5.23's online FP8 runs a bf16 checkpoint's linears on Hopper
(`Fp8LinearMethod` on a GPU with CUTLASS FP8, no FP8 checkpoint), for the drafter's own module.

Scaling, SGLang's Hopper scheme (`Fp8LinearMethod.process_weights_after_loading` quantizes a bf16 weight per
channel with `per_token_group_quant_fp8`, `apply_fp8_linear` its input per token with `sglang_per_token_quant_fp8`):
  weights      per output channel, once at load from the weight in the serving dtype:
               scale[n] = max(max_k |W[n, k]|, 1e-10) * (1 / 448), a float32 multiply. SGLang's kernels divide
               by 448 instead, which can differ in the scale's last bit; the multiply is what torch computes
               for a division by a scalar on CUDA but not on CPU, so written as a multiply the CPU reference
               and the CUDA path get the same scales bit for bit;
  activations  dynamic per token (per input row), every call, the same way (SGLang's per-token kernel has no
               1e-10 floor: an all-zero row gets scale 0 there, 1e-10 / 448 here; its values are zeros in both);
  values       q = e4m3(clamp(x * (1 / scale), -448, 448)), rounded to nearest even (torch's cast), the
               reciprocal multiplied as SGLang's quantization kernels do.
Why this one: it is what `--quantization fp8` / `--speculative-draft-model-quantization fp8` give a bf16
model on Hopper (per-tensor weights are SGLang's path on GPUs without CUTLASS FP8), it is the finer of the
two (one outlier channel or token does not coarsen the others), and both scales fold into the GEMM's
epilogue (`torch._scaled_mm`'s row-wise scaling), so they cost nothing there.

Product: y[m, n] = s_x[m] * s_w[n] * sum_k q_x[m, k] q_w[n, k] (+ bias), accumulated in float32:
  CUDA, both widths multiples of 16 (what `torch._scaled_mm` takes): `torch._scaled_mm` on the FP8 tensor
      cores, row-wise scales, bf16 out; other output dtypes get a float32 product with unit scales, scaled after;
  elsewhere (CPU; odd widths on CUDA): the reference, the e4m3 values as float32 (exact), their matmul, then
      the scales (`reference_mm`).
Activations on the "triton" backend (`mfd_sglang.backend`; the drafter's) are quantized by one Triton kernel
(`mfd_sglang.kernels.draft_fp8_quant`), bit-identical to `quantize_rows` (held to it by tests/test_fp8.py under the Triton interpreter and by the GPU check's
`fp8_draft` rows on the device); so both paths quantize identically and only the matmul's accumulation differs.
"""

from __future__ import annotations

import torch
from torch import nn

from mfd_sglang.backend import check_backend
from mfd_sglang.kernels.params import FP8, FP8_MAX, SCALE_FLOOR


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values [..., K], float32 scales [..., 1]): one scale per row, x ~ values * scale."""
    low, high = x.aminmax(dim=-1, keepdim=True)
    scale = torch.maximum(-low, high).float().clamp(min=SCALE_FLOOR) * (1.0 / FP8_MAX)
    return (x.float() * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(rows: torch.Tensor, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of [M, K] on `backend` (`mfd_sglang.backend`): "triton" is one fused kernel (five torch
    passes cost about what FP8's GEMM saves), "torch" the torch code."""
    if check_backend(backend) == "triton":
        from mfd_sglang.kernels.draft_fp8_quant import quantize_rows_triton  # the CPU path must not need triton

        return quantize_rows_triton(rows if rows.stride(-1) == 1 else rows.contiguous())
    return quantize_rows(rows)


def reference_mm(q_x: torch.Tensor, x_scale: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
                 out_dtype: torch.dtype) -> torch.Tensor:
    """q_x [M, K] and q_w [N, K] (e4m3) with scales [M, 1] and [N] -> [M, N] in out_dtype: the products of e4m3
    values are exact in float32, summed in float32, then scaled."""
    return ((q_x.float() @ q_w.float().T) * x_scale * w_scale).to(out_dtype)


def scaled_mm(q_x: torch.Tensor, x_scale: torch.Tensor, q_w: torch.Tensor, w_scale: torch.Tensor,
              out_dtype: torch.dtype) -> torch.Tensor:
    """`reference_mm` on the FP8 tensor cores (CUDA, K and N multiples of 16)."""
    if out_dtype == torch.bfloat16:  # row-wise scaling takes bf16 output only
        return torch._scaled_mm(q_x, q_w.T, scale_a=x_scale, scale_b=w_scale[None], out_dtype=out_dtype)
    unit = torch.ones((), device=q_x.device)
    out = torch._scaled_mm(q_x, q_w.T, scale_a=unit, scale_b=unit, out_dtype=torch.float32)
    return (out * x_scale * w_scale).to(out_dtype)


class FP8Linear(nn.Module):
    """A linear layer with e4m3 weights [N, K] and per-output-channel float32 scales [N]; inputs are
    quantized per row at every call. The output has the input's dtype; the bias (if any) stays in it.
    Built from a linear already in the serving dtype; a later dtype cast of the module would cast the
    e4m3 weight too, so quantize last."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        values, scales = quantize_rows(weight.detach())
        self.register_buffer("weight", values)
        self.register_buffer("weight_scale", scales.view(-1))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.backend = "torch"  # the activation quantizer's (the drafter's, `MFDDrafter.join_projections`)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "FP8Linear":
        return cls(linear.weight, linear.bias)

    @property
    def on_tensor_cores(self) -> bool:
        """Whether a CUDA input takes `torch._scaled_mm` (both widths multiples of 16)."""
        return self.in_features % 16 == 0 and self.out_features % 16 == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q_x, x_scale = quantize_activations(rows, self.backend)
        mm = scaled_mm if rows.is_cuda and self.on_tensor_cores else reference_mm
        out = mm(q_x, x_scale, self.weight, self.weight_scale, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel weights"
