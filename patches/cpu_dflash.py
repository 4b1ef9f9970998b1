"""SGLang's own DFLASH speculative algorithm on CPU servers (SGLang 0.5.23).

Three hooks, registered by the CPU launcher (``mfd_sglang.cpu.install``); with them SGLang's DFLASH
worker (``dflash_worker_v2.py``, its drafter ``models/dflash.py``) serves on CPU as it is: its CUDA-only
paths (fused KV materialisation, Triton verify helpers, draft CUDA graphs) are guarded by ``is_cuda()``
or the graph setting and take their torch branches. ``tests/test_dflash_server.py`` holds its greedy
output to plain decoding.

1. ``sglang.srt.arg_groups.speculative_hook._handle_dflash`` (AROUND), DFLASH's launch-time argument
   resolution. It asks whether the platform runs DFLASH; an in-tree platform is answered by the device
   name (cuda / npu / xpu), so every CPU launch stopped with "DFLASH speculative decoding is not
   supported by CpuSRTPlatform on device 'cpu'", and its draft attention backend would fall back to
   flashinfer. For ``device == "cpu"`` the hook first refuses a target attention backend without a
   TARGET_VERIFY forward (DFLASH verifies its block as one), then runs the function with the platform
   answering as an out-of-tree CPU platform would: DFLASH is supported, and so are the draft attention
   backends that run the drafter's non-causal block forward on CPU (``mfd_cpu``, the default, and
   ``triton`` under the Triton interpreter; any other is replaced by ``mfd_cpu`` with SGLang's own
   warning). Everything else it resolves (block size, top-k 1, one step, max running requests) is
   SGLang's.
2. ``sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation`` (AROUND). Every
   decode round calls ``batch.seq_lens.record_stream(current_stream())``; torch has no CPU kernel for
   ``record_stream`` (and ``torch.cpu.Stream`` is not a ``torch.Stream``), so the first decode round
   raised. A CPU has one stream, so there is nothing to record: for a CPU ``seq_lens`` tensor the hook
   makes that call a no-op on that tensor.
3. ``sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs`` (AFTER). It passes
   ``forward_batch.input_embeds.bfloat16()`` to the model, whatever the model's dtype; DFLASH feeds its
   draft block as input embeddings (the target's embeddings of the block tokens), so an fp32 server's
   drafter got bf16 inputs against fp32 weights and raised. When the embeddings come in the runner's
   own dtype (and no ``replace_embeds`` were written into the copy) the hook passes them unchanged (a
   bf16 server is unaffected). This one is not CPU-specific: an fp32 DFLASH forward that SGLang runs
   eagerly on a GPU takes the same path.

Re-check all three on every SGLang upgrade (grep ``is_supported = (``, ``record_stream`` and
``input_embeds.bfloat16()``).
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
HANDLE_DFLASH = "sglang.srt.arg_groups.speculative_hook._handle_dflash"
DFLASH_FORWARD = "sglang.srt.speculative.dflash_worker_v2.DFlashWorkerV2.forward_batch_generation"
EXTEND_FORWARD_KWARGS = "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs"

# Attention backends with a TARGET_VERIFY forward on CPU; the first is the draft default.
CPU_VERIFY_BACKENDS = ("mfd_cpu", "triton")


class CpuSRTPlatformWithDFLASH:
    """The current platform, answering DFLASH's launch-time questions for a CPU server."""

    def __init__(self, platform):
        self._platform = platform

    def __getattr__(self, name):
        return getattr(self._platform, name)

    def is_out_of_tree(self) -> bool:
        return True  # so that _handle_dflash asks the methods below instead of testing the device name

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        return algorithm == "DFLASH"

    def supports_speculative_draft_attention_backend(self, algorithm: str, backend: str) -> bool:
        return algorithm == "DFLASH" and backend in CPU_VERIFY_BACKENDS

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return CPU_VERIFY_BACKENDS[0]


def check_cpu_verify_backends(server_args) -> None:
    """Raise when a target attention backend of a CPU DFLASH launch has no TARGET_VERIFY forward."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of, resolved_view

    for backend in sorted(set(attention_backends_of(resolved_view(server_args))), key=str):
        if backend not in CPU_VERIFY_BACKENDS:
            raise ValueError(
                f"DFLASH on CPU verifies its draft block in one TARGET_VERIFY forward, which attention backend "
                f"{backend!r} does not have: use --attention-backend mfd_cpu (the CPU launcher's default) or "
                f"triton (under TRITON_INTERPRET=1, slow)")


def dflash_on_cpu_around(original, server_args, *args, **kwargs):
    """AROUND hook for ``_handle_dflash``."""
    from sglang.srt.arg_groups import speculative_hook
    from sglang.srt.arg_groups.model_override_base import resolving_view

    if resolving_view(server_args).device != "cpu":
        return original(server_args, *args, **kwargs)
    check_cpu_verify_backends(server_args)
    platform = speculative_hook.current_platform
    speculative_hook.current_platform = CpuSRTPlatformWithDFLASH(platform)
    try:
        return original(server_args, *args, **kwargs)
    finally:
        speculative_hook.current_platform = platform


def _record_no_stream(stream) -> None:
    return None


def seq_lens_without_streams_around(original, self, batch, *args, **kwargs):
    """AROUND hook for ``DFlashWorkerV2.forward_batch_generation``."""
    seq_lens = getattr(batch, "seq_lens", None)
    if seq_lens is not None and seq_lens.device.type == "cpu":
        seq_lens.record_stream = _record_no_stream  # an instance attribute: this tensor only
    return original(self, batch, *args, **kwargs)


def embeds_in_model_dtype_after(kwargs, self, forward_batch, *args, **extra):
    """AFTER hook for ``ModelRunner._extend_forward_kwargs``."""
    embeds = forward_batch.input_embeds
    # (with replace_embeds SGLang has written them into its bf16 copy: left as it is)
    if embeds is not None and embeds.dtype == self.dtype and forward_batch.replace_embeds is None:
        kwargs["input_embeds"] = embeds
    return kwargs


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(HANDLE_DFLASH, dflash_on_cpu_around, "around")
    register_once(DFLASH_FORWARD, seq_lens_without_streams_around, "around")
    register_once(EXTEND_FORWARD_KWARGS, embeds_in_model_dtype_after, "after")
