"""Capture the target's decode CUDA graphs as tree verifies for MFD / MFD_D (SGLang 0.5.23).

Wraps ``sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls`` (AROUND),
the hook point SGLang provides for specialized decode graph runners (its UNO tree mode overrides it
the same way). For a model runner serving MFD or MFD_D the hook returns
``mfd_sglang.serving.verify_graph.MFDVerifyCudaGraphRunner``; every other runner gets SGLang's own
class. Without it the stock runner captures MFD's verify graphs with a mask-less DFlash verify input
(MFD is DFlash-family for SGLang's hidden-state capture), and a replayed tree verify would attend
causally: wrong tokens, no error. Re-check ``get_spec_info`` / ``can_run_graph`` of
``DecodeCudaGraphRunner`` and this method on SGLang upgrades.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
DECODE_GRAPH_RUNNER_CLS = "sglang.srt.model_executor.model_runner.ModelRunner._decode_cuda_graph_runner_cls"


def decode_graph_runner_cls_around(original, model_runner, *args, **kwargs):
    """AROUND hook: MFD's tree-verify runner for MFD / MFD_D target runners, else the original."""
    from mfd_sglang.serving.launch.algorithms import is_mfd

    if is_mfd(model_runner.spec_algorithm) and not model_runner.is_draft_worker:
        from mfd_sglang.serving.verify_graph import MFDVerifyCudaGraphRunner

        return MFDVerifyCudaGraphRunner
    return original(model_runner, *args, **kwargs)


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(DECODE_GRAPH_RUNNER_CLS, decode_graph_runner_cls_around, "around")
