"""PD disaggregation's Mooncake sender on CPU (SGLang 0.5.23).

Wraps ``CommonKVSender.__init__`` of ``sglang.srt.disaggregation.common.conn`` (AFTER), which
``MooncakeKVSender`` (``sglang.srt.disaggregation.mooncake.conn``) inherits without defining its own. The
Mooncake sender declares ``supports_host_tensor_indices = True``, and the prefill scheduler's
``_send_kv_chunk`` (``sglang/srt/disaggregation/prefill.py``) then copies the page indices into pinned host
memory and records a ``torch.cuda.Event`` for the transfer thread to wait on, which fails on a machine
without CUDA. The hook sets the attribute to False on every new sender when CUDA is unavailable (no other
sender declares it), so the scheduler takes its other branch: the indices are already host tensors and go
to ``send`` as they are.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
SENDER_INIT = "sglang.srt.disaggregation.common.conn.CommonKVSender.__init__"


def host_indices_without_cuda_after(result, self, *args, **kwargs):
    import torch

    if not torch.cuda.is_available():
        self.supports_host_tensor_indices = False
    return result


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(SENDER_INIT, host_indices_without_cuda_after, "after")
