"""``sgl_kernel.utils`` stand-in (``layers/attention/triton_backend.py`` imports
``is_arch_support_pdl`` on CUDA)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def is_arch_support_pdl() -> bool:
    """Whether the current CUDA device supports programmatic dependent launch (compute capability
    9.0+, Hopper and later), as the kernel package answers it; the Triton attention backend then
    launches its decode kernels with PDL. False without CUDA."""
    if not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(torch.cuda.current_device())[0] >= 9
