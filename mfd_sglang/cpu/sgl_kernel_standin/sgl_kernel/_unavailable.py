"""Placeholders for ``sgl_kernel`` names SGLang imports on CUDA when its modules load but never
calls for a dense bf16 / fp32 model (quantized layers, MoE, HiCache): the import succeeds, a call
raises NotImplementedError naming the op."""

from __future__ import annotations

from typing import Callable


def unavailable(name: str, used_for: str) -> Callable:
    """A function that raises NotImplementedError naming sgl_kernel.<name> when called."""

    def placeholder(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} ({used_for}) is not provided by the mfd_sglang pure-torch sgl_kernel "
            "stand-in; serve a dense bf16 / fp32 model, or install the real sglang-kernel wheel"
        )

    placeholder.__name__ = placeholder.__qualname__ = name.rsplit(".", 1)[-1]
    return placeholder


# top-level names (layers/quantization/compressed_tensors/schemes/compressed_tensors_w8a8_int8.py,
# layers/quantization/gguf.py, layers/moe/moe_runner/triton_utils/fused_moe.py)
int8_scaled_mm = unavailable("int8_scaled_mm", "W8A8 int8 quantized linear layers")
moe_sum = unavailable("moe_sum", "MoE expert reduction")
moe_sum_reduce = unavailable("moe_sum_reduce", "MoE expert reduction")
