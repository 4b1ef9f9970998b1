"""The verify stage of a round: the target's forward over each request's window [root, tree nodes]
through SGLang 0.5.23's tree-verify path.

`tree_verify_input` is the one place MFD builds SGLang's `EagleVerifyInput` (a top-k 1 input whose
FULL_MASK custom mask carries the tree; hidden states of every verified token captured for the
drafter): from a round's `VerifyLayout`, or, with no layout, the input a tree-verify CUDA graph is
captured with (`verify_graph`), whose buffers bring the rest at replay. An idle attention-DP rank's
input is SGLang's own empty one (`idle_verify`).

`verify_tree` runs one verify: `eagle_prepare_for_verify` (SGLang's own preparation: KV slots of the
window, the mask packed for the attention backend) and the target worker's `forward_batch_generation`
with `is_verify=True` (full-vocabulary logits of every node; on a GPU a replay of the window's
tree-verify graph). The window's width is the layout's; the caller activates that width's graphs first
when it varies (the automatic budget).

Attention DP: the MLP gathers every DP rank's tokens, counted as requests x this rank's window width
(`spec_scale_global_num_tokens`), so every rank verifies the same width, an idle rank included
(`idle_verify`); while any rank is idle every rank verifies eagerly, since a graph replay pads its
count to the captured batch size and the ranks would disagree on the gather's offsets (SGLang's DFLASH
guards the same).
"""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch

from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import eagle_prepare_for_verify

from mfd_sglang.tree_layout import VerifyLayout, full_custom_mask


def reserved_lens(batch) -> torch.Tensor:
    """Host-side upper bounds [bs] of the committed lengths, known without a device sync: the KV
    lengths reserved by the draft input's prepare_for_decode (else the host copy of seq_lens)."""
    reserved = batch.spec_info.nxt_kv_lens_cpu
    return reserved if reserved is not None else batch.seq_lens_cpu


def tree_verify_input(custom_mask: torch.Tensor, num_nodes: int, layout: VerifyLayout | None = None,
                      spec_steps: int = 1) -> EagleVerifyInput:
    """SGLang's tree-verify input of windows of `num_nodes` tokens under `custom_mask`: a round's, with
    its layout's tokens, positions and traversal (spec_steps: the drafter's draft positions), or without
    a layout the capture-time input of a tree-verify graph."""
    tree = (None,) * 5 if layout is None else (layout.draft_token.flatten(), layout.positions.flatten(),
                                               layout.retrive_index, layout.retrive_next_token,
                                               layout.retrive_next_sibling)
    draft_token, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling = tree
    return EagleVerifyInput(
        draft_token=draft_token,
        custom_mask=custom_mask,
        positions=positions,
        retrieve_index=retrieve_index,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        retrieve_cum_len=None,
        spec_steps=spec_steps,
        topk=1,
        draft_token_num=num_nodes,
        capture_hidden_mode=CaptureHiddenMode.FULL,
        seq_lens_sum=None,
        seq_lens_cpu=None,
    )


def layout_verify_input(layout: VerifyLayout, seq_lens: torch.Tensor, lens_sum: int,
                        spec_steps: int, backend: str) -> EagleVerifyInput:
    """The verify input of a round's layout; lens_sum: any host-side upper bound of sum(seq_lens) (it
    sizes the flat mask, whose cells are placed from seq_lens); backend: the mask's (`full_custom_mask`)."""
    bs, num_nodes = layout.draft_token.shape
    custom_mask = full_custom_mask(layout.ancestor_mask, seq_lens, num_nodes * lens_sum + bs * num_nodes * num_nodes,
                                   backend)
    return tree_verify_input(custom_mask, num_nodes, layout, spec_steps)


class VerifiedTree(NamedTuple):
    """What a verify leaves for accept and commit."""

    batch: object  # the decode batch with the verify input as its spec_info (commit reads its window)
    forward_batch: object  # SGLang's ForwardBatch of the verify (kept alive with the result)
    output: object  # the target's GenerationBatchResult: logits of every node, hidden states


def verify_tree(target_worker, batch, layout: VerifyLayout, seq_lens: torch.Tensor, spec_steps: int,
                backend: str) -> VerifiedTree:
    """One target forward over [root, tree nodes] per request through SGLang's tree-verify path (backend: the
    verify mask's, `layout_verify_input`)."""
    verify_input = layout_verify_input(layout, seq_lens, int(reserved_lens(batch).sum()), spec_steps, backend)
    return run_verify(target_worker, batch, verify_input)


def idle_verify(target_worker, batch, num_nodes: int) -> None:
    """The verify forward of an idle attention-DP rank (no request): windows of `num_nodes` tokens, as
    its peers verify, eagerly."""
    run_verify(target_worker, batch, EagleVerifyInput.create_idle_input(
        topk=1, spec_steps=1, num_verify_tokens=num_nodes, device=target_worker.device))


def run_verify(target_worker, batch, verify_input: EagleVerifyInput) -> VerifiedTree:
    """SGLang's preparation of `batch` under `verify_input` and the target's verify forward: eager while this
    rank or, under attention DP, any rank is idle."""
    verify_batch = copy.copy(batch)
    verify_batch.spec_info = verify_input
    # The target's decode graphs are captured as tree verifies (patches: the tree-verify graph runner).
    forward_batch, _ = eagle_prepare_for_verify(verify_input, target_worker.model_runner.req_to_token_pool,
                                                verify_batch, target_worker)
    peer_counts = forward_batch.original_global_num_tokens_cpu  # attention DP: every rank's request count
    if batch.forward_mode.is_idle() or (peer_counts is not None and min(peer_counts) == 0):
        forward_batch.can_run_decode_cuda_graph = False
    output = target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch, is_verify=True)
    return VerifiedTree(verify_batch, forward_batch, output)
