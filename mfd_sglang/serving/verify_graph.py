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

Installed by `mfd_sglang.patches.verify_graph` through `ModelRunner._decode_cuda_graph_runner_cls`.
"""

from __future__ import annotations

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.speculative.eagle_info import EagleVerifyInput


def tree_verify_capture_input(num_draft_tokens: int, custom_mask: torch.Tensor) -> EagleVerifyInput:
    """The spec input a tree-verify graph is captured with: the tree mask read from `custom_mask`
    (the runner's buffer) and the hidden states of every verified token kept."""
    return EagleVerifyInput(
        draft_token=None,
        custom_mask=custom_mask,
        positions=None,
        retrieve_index=None,
        retrieve_next_token=None,
        retrieve_next_sibling=None,
        retrieve_cum_len=None,
        spec_steps=1,
        topk=1,
        draft_token_num=num_draft_tokens,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None,
        seq_lens_cpu=None,
    )


class MFDVerifyCudaGraphRunner(DecodeCudaGraphRunner):
    """DecodeCudaGraphRunner whose graphs verify a tree of `speculative_num_draft_tokens` nodes
    (root + B) per request under the custom tree mask."""

    def get_spec_info(self, num_tokens: int):
        return tree_verify_capture_input(self.captured_req_width, self.buffers.custom_mask)

    def can_run_graph(self, forward_batch) -> bool:
        # Only MFD's tree verify was captured; anything else (there is nothing else today) runs eagerly.
        return isinstance(forward_batch.spec_info, EagleVerifyInput) and super().can_run_graph(forward_batch)
