"""Committing a verified recurrent state on CPU (SGLang 0.5.23).

Wraps ``fused_mamba_state_scatter_with_mask`` and ``fused_conv_window_scatter_with_mask`` of
``sglang.kernels.ops.mamba.mamba_state_scatter_triton`` (AROUND). After a speculative verify on a hybrid
Gated DeltaNet target, SGLang copies each request's state after its last accepted step (recurrent
state and convolution window) from the verify's per-step scratch into the request's slot with these
Triton kernels, which refuse non-CUDA tensors. For CPU tensors the hooks do the same copy in torch:
for every request i with step[i] >= 0, ``dst[:, dst_index[i]] = src[:, src_row[i], step[i]]``
(src_row defaults to i); other tensors go to SGLang's kernels.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
MODULE = "sglang.kernels.ops.mamba.mamba_state_scatter_triton"
STATE_SCATTER = f"{MODULE}.fused_mamba_state_scatter_with_mask"
CONV_WINDOW_SCATTER = f"{MODULE}.fused_conv_window_scatter_with_mask"


def scatter_on_cpu_around(original, dst, src, dst_indices_raw, step_indices_raw, src_indices_raw=None):
    if dst.device.type != "cpu":
        return original(dst, src, dst_indices_raw, step_indices_raw, src_indices_raw)
    import torch

    steps = step_indices_raw.long()
    rows = (torch.arange(steps.shape[0]) if src_indices_raw is None else src_indices_raw.long())
    valid = steps >= 0
    dst[:, dst_indices_raw.long()[valid]] = src[:, rows[valid], steps[valid]].to(dst.dtype)


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(STATE_SCATTER, scatter_on_cpu_around, "around")
    register_once(CONV_WINDOW_SCATTER, scatter_on_cpu_around, "around")
