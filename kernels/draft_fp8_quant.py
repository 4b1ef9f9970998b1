"""Triton `quantize_rows`: the per-row e4m3 quantization of `mfd_sglang.fp8.quantize_rows` in one kernel,
bit-identical to it (values and scales), for FP8Linear's activations on CUDA.

The torch reference takes five passes over an activation (min/max, a float32 copy, the multiply, the clamp,
the cast); on the drafter's [rows, K] inputs they cost about what FP8's GEMM saves. Here one program per row
reads the row twice (its largest magnitude, then the values; the second read mostly from L2) and writes the
e4m3 values and the float32 scale. Same arithmetic, in the same order and rounding: scale =
max(max |x|, 1e-10) * (1 / 448) (float32), 1 / scale with IEEE division (`div_rn`: Triton's `/` is
approximate on NVIDIA GPUs), x * (1 / scale) in float32, clamped to +-448, rounded to e4m3's nearest value with ties to
even (from the float32 bits, `_e4m3_code`), as torch's cast rounds.
Fixed shapes, no host sync: it can be captured in a CUDA graph. CUDA tensors, or CPU ones with
TRITON_INTERPRET=1 set before triton is imported (the tests).
"""

import torch
import triton
import triton.language as tl

from mfd_sglang.kernels.params import FP8, FP8_MAX, SCALE_FLOOR

_BLOCK = 1024  # columns per step of a row's two loops


@triton.jit
def _e4m3_code(v):
    """The e4m3 code (int32, 0..255) of float32 v with |v| <= 448, rounded to nearest even, from v's bits:
    the interpreter's own float8 cast does not round to even (the tests run there), the hardware's does."""
    bits = v.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    # normal (|v| >= 2^-6): keep 3 of 23 mantissa bits, ties to even; a carry moves into the exponent;
    # e4m3's exponent bias is 7, float32's 127
    normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal: |v| / 2^-9 to the nearest integer, ties to even (float32 addition of 2^23 rounds so); 8 is
    # the smallest normal's code
    subnormal = ((magnitude.to(tl.float32, bitcast=True) * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(magnitude < 0x3C800000, subnormal, normal)  # 0x3C800000: 2^-6
    return code | ((bits >> 24) & 0x80)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_x, stride_q, FP8_MAX: tl.constexpr,
                          INV_FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = x_ptr + row * stride_x, q_ptr + row * stride_q
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        largest = tl.maximum(largest, tl.abs(tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(largest, axis=0), FLOOR) * INV_FP8_MAX
    inverse = tl.math.div_rn(1.0, scale)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(x * inverse, -FP8_MAX), FP8_MAX)
        tl.store(q_row + cols, _e4m3_code(q).to(tl.uint8), mask=cols < K)


def quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`mfd_sglang.fp8.quantize_rows` of a 2-D x [M, K] (unit stride along K): (e4m3 [M, K], float32 [M, 1])."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"quantize_rows_triton takes a [rows, K] tensor with unit column stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    rows, k = x.shape
    values = torch.empty(rows, k, dtype=FP8, device=x.device)
    scales = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    if rows:
        _quantize_rows_kernel[(rows,)](x, values.view(torch.uint8), scales, k, x.stride(0), values.stride(0), FP8_MAX=FP8_MAX,
                                       INV_FP8_MAX=1.0 / FP8_MAX,
                                       FLOOR=SCALE_FLOOR, BLOCK=min(_BLOCK, triton.next_power_of_2(k)))
    return values, scales
