"""Ops SGLang calls from ``sgl_kernel`` on CUDA for a dense model (pure torch; any device).

On CUDA, SGLang binds these names when its modules load (``layers/layernorm.py``,
``layers/activation.py``, ``layers/sampler.py``, ``model_executor/runner_backend_utils/
weak_ref_tensor.py``) and calls them from ``forward_cuda`` (norms, gated activations), the
FlashInfer sampling backend (renorm) and the breakable CUDA-graph capture (``weak_ref_tensor``).
With ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` the norms and activations take SGLang's own
``forward_native`` instead, but a server without it, or a caller that imports the function
directly, still reaches these, so each one keeps the kernel's semantics:

- norms and activations compute in fp32 and round once to the input's dtype, as the kernels do;
- ``fused_add_rmsnorm`` / ``gemma_fused_add_rmsnorm`` return None and update BOTH arguments in
  place: ``residual <- input + residual``, ``input <- norm(input + residual)``, the norm taken of
  the fp32 sum (not of the rounded residual);
- ``rmsnorm`` / ``gemma_rmsnorm`` / ``*_and_mul`` return a new tensor, or fill and return ``out``;
- ``top_k_renorm_prob`` / ``top_p_renorm_prob`` threshold at a pivot probability and keep every
  probability >= the pivot (ties at the pivot survive), then renormalise the kept mass to 1.

Nothing here reads device values on the host, so every op can be captured in a CUDA graph (the
renorm ops too when their per-row top_k / top_p tensor is already on the probabilities' device).
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from . import _trace

# --------------------------------------------------------------------------------------------
# RMSNorm (layers/layernorm.py: RMSNorm / GemmaRMSNorm.forward_cuda)
# --------------------------------------------------------------------------------------------


def _rms_normalized(x32: torch.Tensor, weight: torch.Tensor, eps: float, weight_offset: float) -> torch.Tensor:
    """fp32 x / sqrt(mean(x^2) + eps) * (weight + weight_offset) over the last dimension
    (weight_offset 1.0 is Gemma's convention: its checkpoints store weight - 1)."""
    inv_rms = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32 * inv_rms * (weight.float() + weight_offset)


def _into(result: torch.Tensor, out: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernels' `out=` convention: fill and return out when given, else a new tensor."""
    if out is None:
        return result
    if out.shape != result.shape:
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {tuple(result.shape)}")
    out.copy_(result)
    return out


@_trace
def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
            enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """out = input / rms(input) * weight, in fp32, rounded to input's dtype (enable_pdl: a launch
    option of the CUDA kernel, ignored)."""
    return _into(_rms_normalized(input.float(), weight, eps, 0.0).to(input.dtype), out)


@_trace
def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: Optional[bool] = None) -> None:
    """In place: residual <- input + residual; input <- rmsnorm(input + residual) * weight."""
    _add_then_normalize(input, residual, weight, eps, 0.0)


@_trace
def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
                  enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """out = input / rms(input) * (1 + weight) (Gemma's norm), in fp32, rounded to input's dtype."""
    return _into(_rms_normalized(input.float(), weight, eps, 1.0).to(input.dtype), out)


@_trace
def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: Optional[bool] = None) -> None:
    """In place: residual <- input + residual; input <- gemma_rmsnorm(input + residual)."""
    _add_then_normalize(input, residual, weight, eps, 1.0)


def _add_then_normalize(input, residual, weight, eps: float, weight_offset: float) -> None:
    """The fused kernels normalise the float32 sum, not the sum rounded to the residual's dtype."""
    total = input.float() + residual.float()
    residual.copy_(total)
    input.copy_(_rms_normalized(total, weight, eps, weight_offset))


# --------------------------------------------------------------------------------------------
# Gated activations (layers/activation.py: SiluAndMul / GeluAndMul.forward_cuda)
# --------------------------------------------------------------------------------------------


def _act_and_mul(act: Callable[[torch.Tensor], torch.Tensor], input: torch.Tensor,
                 out: Optional[torch.Tensor]) -> torch.Tensor:
    """act(gate) * up for input = [..., gate | up], in fp32, rounded to input's dtype."""
    d = input.shape[-1] // 2
    x = input.float()
    return _into((act(x[..., :d]) * x[..., d:]).to(input.dtype), out)


@_trace
def silu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _act_and_mul(F.silu, input, out)


@_trace
def gelu_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact (erf) GELU."""
    return _act_and_mul(F.gelu, input, out)


@_trace
def gelu_tanh_and_mul(input: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GELU with the tanh approximation."""
    return _act_and_mul(lambda x: F.gelu(x, approximate="tanh"), input, out)


# --------------------------------------------------------------------------------------------
# Sampling renormalisation (layers/sampler.py, FlashInfer sampling backend)
# --------------------------------------------------------------------------------------------


def _per_row(value: Union[torch.Tensor, int, float], rows: int, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or a per-row tensor as one value per row, on like's device."""
    if isinstance(value, torch.Tensor):
        return value.to(device=like.device, dtype=dtype).reshape(-1).expand(rows)
    return torch.full((rows,), value, device=like.device, dtype=dtype)


def _keep_from_pivot(probs32: torch.Tensor, pivot: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    kept = torch.where(probs32 >= pivot[:, None], probs32, torch.zeros_like(probs32))
    return (kept / kept.sum(dim=-1, keepdim=True)).to(dtype)


@_trace
def top_k_renorm_prob(probs: torch.Tensor, top_k: Union[torch.Tensor, int]) -> torch.Tensor:
    """probs [batch, vocab] restricted to each row's top_k largest (all ties with the k-th largest
    are kept; k is clamped to [1, vocab], so SGLang's TOP_K_ALL keeps everything), renormalised."""
    p = probs.float()
    vocab = p.shape[-1]
    k = _per_row(top_k, p.shape[0], p, torch.int64).clamp(1, vocab)
    descending = torch.sort(p, dim=-1, descending=True).values
    return _keep_from_pivot(p, descending.gather(1, (k - 1)[:, None]).squeeze(1), probs.dtype)


@_trace
def top_p_renorm_prob(probs: torch.Tensor, top_p: Union[torch.Tensor, float]) -> torch.Tensor:
    """probs [batch, vocab] restricted to the nucleus of mass top_p, renormalised: the smallest
    probabilities are dropped while their running total stays below 1 - top_p; the first one kept
    is the pivot and every probability >= the pivot survives (top_p = 1 keeps everything)."""
    p = probs.float()
    vocab = p.shape[-1]
    drop_below = 1.0 - _per_row(top_p, p.shape[0], p, torch.float32)
    ascending = torch.sort(p, dim=-1).values
    dropped = (torch.cumsum(ascending, dim=-1) < drop_below[:, None]).sum(dim=-1).clamp(max=vocab - 1)
    return _keep_from_pivot(p, ascending.gather(1, dropped[:, None]).squeeze(1), probs.dtype)


# --------------------------------------------------------------------------------------------
# CUDA-graph capture (model_executor/runner_backend_utils/weak_ref_tensor.py)
# --------------------------------------------------------------------------------------------


@_trace
def weak_ref_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor over the same memory (same shape, strides, storage offset, dtype, device) that does
    NOT keep that memory alive, as the kernel's `from_blob` without a deleter: SGLang's breakable
    CUDA-graph capture hands these out so its memory pool can reuse intermediates between graph
    segments. The caller guarantees the memory outlives the view.

    The storage comes from torch._C._construct_storage_from_data_pointer (private, but what
    PyTorch's own CUDA-graph trees use to rebuild non-owning tensors over graph-pool memory): it
    wraps an address without a deleter, allocating and copying nothing, so it can run while a CUDA
    graph is being captured."""
    storage = tensor.untyped_storage()
    borrowed = torch._C._construct_storage_from_data_pointer(storage.data_ptr(), tensor.device, storage.nbytes())
    view = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    return view.set_(borrowed, tensor.storage_offset(), tensor.shape, tensor.stride())
