"""Tensor parallelism on CPU (SGLang 0.5.23).

Wraps ``sglang.srt.distributed.parallel_state.init_model_parallel_group`` (AROUND). On a CPU machine
0.5.23 still asks for PyNccl in every group it makes (its check covers NPU / XPU / out-of-tree
platforms only), and PyNccl needs a CUDA device, so ``--tp-size 2`` fails at start-up with
"Expected a cuda device". Under the CPU launcher the hook passes ``use_pynccl=False``; the groups then
use torch.distributed's gloo backend, which SGLang's CPU path already selects.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
INIT_MODEL_PARALLEL_GROUP = "sglang.srt.distributed.parallel_state.init_model_parallel_group"


def without_pynccl_around(original, *args, **kwargs):
    kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def install() -> None:
    from mfd_sglang.patches import register_once

    register_once(INIT_MODEL_PARALLEL_GROUP, without_pynccl_around, "around")
