"""The gated RMSNorm of hybrid Gated DeltaNet models on CPU (SGLang 0.5.23).

Wraps ``sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward`` (AROUND). Qwen3.5's GDN layers
normalise their output with FLA's gated RMSNorm, ``norm(x) * silu(z)``. Off Intel AMX SGLang runs its
Triton kernel, which on a CPU-only machine asks ``torch.cuda`` for a multiprocessor count (no driver:
start-up fails) and, run by Triton's interpreter, takes about a second per call. For CPU tensors the
hook computes it in torch, in the order of Hugging Face's ``Qwen3_5RMSNormGated`` (float32 norm,
times the weight in the input dtype, times silu(z) in float32), for the configuration SGLang's own CPU
kernel serves (norm before the gate, one group, swish); anything else runs SGLang's code.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
GATED_RMSNORM_FORWARD = "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward"


def gated_rmsnorm_on_cpu_around(original, norm, x, z=None):
    if (x.device.type != "cpu" or z is None or not norm.norm_before_gate or norm.group_size is not None
            or norm.activation != "swish"):
        return original(norm, x, z)
    import torch
    import torch.nn.functional as F

    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return ((norm.weight * normed.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(GATED_RMSNORM_FORWARD, gated_rmsnorm_on_cpu_around, "around")
