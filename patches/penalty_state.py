"""Keep the penalty state reachable in MFD's forward (SGLang 0.5.23).

Wraps ``sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.copy_for_forward`` (AROUND). The
scheduler runs every forward with a copy of the batch's SamplingBatchInfo whose
``penalizer_orchestrator`` is None (``Scheduler._forward_isolation``); the copy carries the penalties
pre-summed over the batch (``acc_additive_penalties`` / ``acc_scaling_penalties``), one row per
request. MFD needs more: each tree node is penalised as if its own path had been output
(`mfd_sglang.serving.penalties`), which takes the per-request penalty values and the counts, and
the worker adds every committed token to the counts (SGLang's speculative paths add one per round).
So for MFD / MFD_D the copy also holds the orchestrator, as ``mfd_penalizer_orchestrator``; it is the
scheduler's own object, filtered and merged by SGLang with the batch. Other algorithms see the
original copy. Re-check ``copy_for_forward`` and ``_forward_isolation`` on SGLang upgrades.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
COPY_FOR_FORWARD = "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo.copy_for_forward"
ATTRIBUTE = "mfd_penalizer_orchestrator"


def copy_for_forward_around(original, sampling_info, *args, **kwargs):
    """AROUND hook: the original copy, holding the orchestrator when the server runs MFD."""
    from mfd_sglang.patches.request_checks import running_mfd

    copy = original(sampling_info, *args, **kwargs)
    if running_mfd():
        setattr(copy, ATTRIBUTE, sampling_info.penalizer_orchestrator)
    return copy


def penalizer_orchestrator(sampling_info):
    """The batch's penalizer orchestrator: its own, or on a forward copy the one this hook kept."""
    return getattr(sampling_info, ATTRIBUTE, None) or sampling_info.penalizer_orchestrator


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(COPY_FOR_FORWARD, copy_for_forward_around, "around")
