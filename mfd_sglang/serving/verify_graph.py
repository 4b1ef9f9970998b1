"""The target's tree-verify CUDA graph for MFD / MFD_D (SGLang 0.5.23).

SGLang's `DecodeCudaGraphRunner.get_spec_info` captures DFlash-family verify graphs with a
`DFlashVerifyInput` and, on FlashInfer / FA3 / Triton / TRT-LLM, no custom mask: DFlash verifies a
chain, which the backends' causal path expresses. MFD verifies a tree, so its graphs must be
captured like EAGLE's: an `EagleVerifyInput` carrying the runner's custom-mask buffer (FULL_MASK
layout), with the target's hidden states captured in full for the drafter. At replay the worker's
own `EagleVerifyInput` brings the round's tree mask, which the attention backend packs into the
captured buffer (FlashInfer: `cuda_graph_custom_mask`; Triton: its custom-mask buffer), and
positions / KV slots are copied into the runner's static buffers; a batch smaller than a captured
size is padded by the runner (EAGLE's `generate_attn_arg_prefill` pads the mask to match).

Installed by `mfd_sglang.patches.tree_verify_graph_runner` through `ModelRunner._decode_cuda_graph_runner_cls`.

Where the budget varies (the automatic budget, the default schedule on CUDA) a round verifies a window of
b + 1 tokens for its budget b (1 for plain decoding), and a graph replays only the width it was captured
with: `VerifyGraphsByWidth` captures one runner per width a round may verify (`verify_graphs_by_width`),
each over an attention backend of its own (a backend's graph buffers and per-batch-size metadata belong
to the width it was captured for), and a round activates its width's pair on the target's model runner.
SGLang 0.5.23's EAGLE adaptive steps keep per-step-count runtime states the same way
(`EAGLEWorkerV2.build_adaptive_runtime_state` / `apply_runtime_state`).
"""

from __future__ import annotations

import logging
import time

import torch

from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.runtime_context import get_context, get_spec
from sglang.srt.speculative.eagle_info import EagleVerifyInput

from mfd_sglang.serving.verify import tree_verify_input

logger = logging.getLogger(__name__)


class MFDVerifyCudaGraphRunner(DecodeCudaGraphRunner):
    """DecodeCudaGraphRunner whose graphs verify a tree of `speculative_num_draft_tokens` nodes
    (root + B) per request under the custom tree mask."""

    def get_spec_info(self, num_tokens: int):
        # The tree mask is read from the runner's buffer; the round's input brings the rest at replay.
        return tree_verify_input(self.buffers.custom_mask, self.captured_req_width)

    def can_run_graph(self, forward_batch) -> bool:
        # Only MFD's tree verify was captured; anything else (there is nothing else today) runs eagerly.
        return isinstance(forward_batch.spec_info, EagleVerifyInput) and super().can_run_graph(forward_batch)


def capture_verify_width(model_runner, width: int, runner_cls=MFDVerifyCudaGraphRunner):
    """(attention backend, graph runner) of the target's tree verify at `width` tokens per request:
    a new backend (new workspace) and its runner, both built while SGLang's resolved
    speculative_num_draft_tokens reads `width` (backends size their graph state from it)."""
    launch_width = get_spec().speculative_num_draft_tokens
    workspace_flag = model_runner.init_new_workspace
    get_context().override("mfd.verify_width_capture", speculative_num_draft_tokens=width)
    try:
        backend = model_runner._get_attention_backend(init_new_workspace=True)
        # What SGLang's build_attention_backends records on the launch backend for model dispatch.
        backend.prefill_attention_backend_str = model_runner.prefill_attention_backend_str
        backend.decode_attention_backend_str = model_runner.decode_attention_backend_str
        runner = runner_cls(model_runner, attn_backend=backend, speculative_num_steps=1,
                            speculative_num_draft_tokens=width)
    finally:
        model_runner.init_new_workspace = workspace_flag
        get_context().override("mfd.verify_width_restore", speculative_num_draft_tokens=launch_width)
    return backend, runner


def device_held_bytes() -> int:
    """This process's device memory held by torch (workspaces, graph state and graph pools are torch
    allocations), not the device's free memory, which other processes move. The allocator's cached free
    blocks are released first: new graphs could otherwise take them, and the growth would read as nothing."""
    if not torch.cuda.is_available():
        return 0
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


class VerifyGraphsByWidth:
    """The target's tree-verify graphs at every window width in `widths`: the launch width's are
    SGLang's own (captured at start-up), the others captured here. `activate(width)` points the model
    runner's attention backend and decode graph runner at that width's pair; they stay active until
    another width is activated (prefills run on whichever backend is active, as under EAGLE's
    adaptive steps: every one is a complete backend)."""

    def __init__(self, model_runner, widths, capture=capture_verify_width, varying: str = "automatic budget"):
        # varying: what varies the budget, for the error message
        self.model_runner = model_runner
        self.active = int(get_spec().speculative_num_draft_tokens)
        self.states = {self.active: (model_runner.attn_backend, model_runner.decode_cuda_graph_runner)}
        held_before, start = device_held_bytes(), time.perf_counter()
        for width in sorted(set(widths) - {self.active}):
            try:
                self.states[width] = capture(model_runner, width)
            except torch.cuda.OutOfMemoryError as exc:
                raise RuntimeError(
                    f"MFD {varying}: out of device memory capturing the tree-verify graphs of a {width}-token "
                    f"window (after windows {sorted(self.states)}); lower --mem-fraction-static or "
                    "--cuda-graph-max-bs, or serve a fixed budget (--speculative-num-draft-tokens N, without "
                    "--mfd-auto-budget)") from exc
        # The launch plan counted these (`memory.VerifyGraphPlan`); the GPU check holds it to this figure.
        logger.info("MFD: tree-verify CUDA graphs captured for windows of %s tokens per request in %.1f s (the "
                    "extra widths took %.0f MiB of device memory)", sorted(self.states), time.perf_counter() - start,
                    (device_held_bytes() - held_before) / 2**20)

    def activate(self, width: int) -> None:
        if width != self.active:
            self.model_runner.attn_backend, self.model_runner.decode_cuda_graph_runner = self.states[width]
            self.active = width


def verify_graphs_by_width(model_runner, budgets, varying: str) -> VerifyGraphsByWidth | None:
    """The target's tree-verify graphs at the windows of `budgets` (b + 1 tokens each), when its decode
    graphs are MFD's tree-verify graphs (a GPU with CUDA graphs on); else None. varying: what varies the
    budget ("automatic budget", "default budget schedule")."""
    if not isinstance(model_runner.decode_cuda_graph_runner, MFDVerifyCudaGraphRunner):
        return None
    return VerifyGraphsByWidth(model_runner, [b + 1 for b in budgets], varying=varying)
