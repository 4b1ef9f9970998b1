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
  CUDA at compute capability 8.9 or more, both widths multiples of 16 (what `torch._scaled_mm` takes):
      `torch._scaled_mm` on the FP8 tensor cores, row-wise scales, bf16 out; other output dtypes get a float32
      product with unit scales, scaled after;
  elsewhere (CPU; on CUDA, odd widths or a GPU below 8.9): the reference, the e4m3 values as float32 (exact),
      their matmul, then the scales (`reference_mm`).
Activations on the "triton" backend (`mfd_sglang.backend`; the drafter's) are quantized by one Triton kernel
(`mfd_sglang.kernels.draft_fp8_quant`), bit-identical to `quantize_rows` (held to it by tests/test_fp8.py under the Triton interpreter and by the GPU check's
`fp8_draft` rows on the device); so both paths quantize identically and only the matmul's accumulation differs.
Where it runs (`fp8_drafting_supported`): a CUDA GPU of compute capability 8.9 or more (Ada, Hopper and newer)
and every other device (the reference). Below 8.9 (an A100 is 8.0) the GPU has no FP8 tensor cores and no e4m3
conversion instructions, which `torch._scaled_mm` and the Triton quantizer need: the launch does not draft in FP8
there (`options.draft_quantization`), and an FP8Linear run there anyway takes the torch quantizer and the
reference.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from mfd_sglang.backend import check_backend
from mfd_sglang.kernels.params import FP8, FP8_MAX, SCALE_FLOOR


# The first compute capability with FP8 tensor cores and e4m3 conversions: Ada (8.9); Hopper is 9.0.
FP8_COMPUTE_CAPABILITY = (8, 9)


@functools.cache  # a GPU's capability never changes, and every eager FP8Linear call asks
def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) compute capability of the CUDA GPU `device` (with its index); None where this process sees
    no CUDA GPU (arguments resolved on a machine without one, which cannot serve them anyway)."""
    return torch.cuda.get_device_capability(device) if torch.cuda.is_available() else None


def fp8_drafting_supported(device: torch.device | str) -> bool:
    """Whether FP8 drafting runs on `device` (a CUDA one with its index, e.g. "cuda:0"): on a CUDA GPU, when its
    compute capability is at least FP8_COMPUTE_CAPABILITY (or this process sees no GPU: nothing to judge); on
    any other device, yes (the reference path, e4m3 values multiplied as float32)."""
    device = torch.device(device)
    if device.type != "cuda":
        return True
    capability = cuda_capability(device)
    return capability is None or capability >= FP8_COMPUTE_CAPABILITY


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (e4m3 values [..., K], float32 scales [..., 1]): one scale per row, x ~ values * scale."""
    low, high = x.aminmax(dim=-1, keepdim=True)
    scale = torch.maximum(-low, high).float().clamp(min=SCALE_FLOOR) * (1.0 / FP8_MAX)
    return (x.float() * scale.reciprocal()).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def quantize_activations(rows: torch.Tensor, backend: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of [M, K] on `backend` (`mfd_sglang.backend`): "triton" is one fused kernel (five torch
    passes cost about what FP8's GEMM saves), "torch" the torch code. The kernel's e4m3 conversions need
    `fp8_drafting_supported`: on a GPU without them "triton" runs the torch code."""
    if check_backend(backend) == "triton" and fp8_drafting_supported(rows.device):
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
    """`reference_mm` on the FP8 tensor cores (`FP8Linear.takes_scaled_mm`: K and N multiples of 16)."""
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

    def takes_scaled_mm(self, device: torch.device) -> bool:
        """Whether an input on `device` takes `torch._scaled_mm`: a CUDA GPU with FP8 tensor cores
        (`fp8_drafting_supported`; torch refuses it below) and both widths multiples of 16 (what it takes)."""
        return (device.type == "cuda" and self.in_features % 16 == 0 and self.out_features % 16 == 0
                and fp8_drafting_supported(device))

    @property
    def on_tensor_cores(self) -> bool:
        """Whether the layer's products run on the FP8 tensor cores: `takes_scaled_mm` on its weight's device."""
        return self.takes_scaled_mm(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        q_x, x_scale = quantize_activations(rows, self.backend)
        mm = scaled_mm if self.on_tensor_cores else reference_mm
        out = mm(q_x, x_scale, self.weight, self.weight_scale, x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel weights"
