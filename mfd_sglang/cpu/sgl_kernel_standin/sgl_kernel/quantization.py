"""``sgl_kernel.quantization`` stand-in: the GGUF kernels ``layers/quantization/gguf.py`` imports
when it loads on CUDA, called only for GGUF-quantized checkpoints."""

from ._unavailable import unavailable

_USE = "GGUF quantized weights"

ggml_dequantize = unavailable("quantization.ggml_dequantize", _USE)
ggml_moe_a8 = unavailable("quantization.ggml_moe_a8", _USE)
ggml_mul_mat_a8 = unavailable("quantization.ggml_mul_mat_a8", _USE)
ggml_mul_mat_vec_a8 = unavailable("quantization.ggml_mul_mat_vec_a8", _USE)
