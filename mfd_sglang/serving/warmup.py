"""The start-up warm-up: before the server reports ready, launch every kernel specialisation a decode round can
launch, so that no request waits for a compile (a Triton compile takes 0.4-1.2 s and blocks the decode loop).

A Triton kernel compiles once per specialisation key: its constexprs, its scalar arguments' types, which integer
arguments are 1 or divisible by 16, its pointers' dtypes and alignment. A round's draft + tree + layout replays a
CUDA graph per batch-size bucket and arm where the draft stage captures them (their capture compiled them); the
rest of a round runs eagerly and specialises on what the round brings:
  per arm (window)   the verify's custom mask, the accept walk, the commit's rows and its drafter context write;
  per batch size     SGLang's own kernels around the verify and the commit take next_power_of_2 of the batch (or of
                     batch x window) as a constexpr: `assign_extend_cache_locs_uniform` (the verify window's KV
                     slots), `assign_extend_cache_locs` and `fill_accept_out_cache_loc` (the accepted path's KV
                     move, `move_accept_tokens_to_target_kvcache`); an eager draft's vocabulary kernels (their
                     split of the vocabulary follows the batch's rows);
  per round          nothing: values that change every round (lengths, sums of lengths) are not specialised on
                     (`do_not_specialize` in MFD's kernels).
So `warm_up` runs a placeholder round (every request in request slot 0, its window in KV slot 0: SGLang's
padding slot, which no request owns; `budget.calibration` relies on the same) at every batch size from 1 to
--max-running-requests for every arm it can play (`budget.playable`): the draft (its graph's replay, or eagerly:
`--disable-cuda-graph`, `--mfd-kernels torch`, drafters with sliding-window layers, whose draft kernels take
launch shapes from the batch), the custom mask, the verify window's KV slots, the accept walk, the padding of
the result and the commit (the KV move of the accepted path included); at each batch-size bucket also the
target's verify forward over the window (its graph, or eagerly; not under attention DP, where a forward gathers
every DP rank's tokens and the verify graphs' capture compiled it). Every rank warms up (each compiles for itself;
under tensor parallelism the ranks run the same rounds, collectives included).
A hybrid target's recurrent-state commit is left out (it would write request slot 0's state); its kernels
compile on the first round. Rounds go on changing what is not specialised on: lengths and their sums
(`do_not_specialize` in MFD's kernels).

tests/test_warmup.py drives these stages over a serving sweep after the warm-up and counts the specialisation keys
the sweep adds (none).
"""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_uniform_func

from mfd_sglang.acceptance import accept_path
from mfd_sglang.tree import DraftTree

from mfd_sglang.serving.accept import pad_result
from mfd_sglang.serving.budget.calibration import CONTEXT_LEN
from mfd_sglang.serving.verify import VerifiedTree, layout_verify_input

logger = logging.getLogger(__name__)

WARMUP_RID = "mfd-warmup"  # the placeholder requests' id (the drafter context's deferred writes name it)


def eager_stages(worker, tree: DraftTree, layout, seq_lens: torch.Tensor, lens_sum: int, verify=None) -> None:
    """The round's stages after its draft, as `MFDWorkerV2.forward_decode` runs them, for placeholder requests
    (request slot 0, KV slot 0) of committed lengths seq_lens (lens_sum: a host-side bound of their sum, as a
    round's reserved lengths give it): the custom mask of the verify input, the verify window's KV slots
    (SGLang's `eagle_prepare_for_verify`), the verify forward when `verify` runs it, the accept walk over the
    root's tokens, the result widened to the launch window, the commit."""
    bs, width = layout.draft_token.shape
    device = seq_lens.device
    layout_verify_input(layout, seq_lens, lens_sum, worker.drafting.drafter.num_draft_positions, worker.backend)
    slots = torch.zeros(bs, dtype=torch.int64, device=device)
    assign_extend_cache_locs_uniform_func(req_pool_indices=slots,
                                          req_to_token=worker.model_runner.req_to_token_pool.req_to_token,
                                          start_offset=seq_lens, batch_size=bs, draft_token_num=width, device=device)
    if verify is not None:
        verify(layout, seq_lens, lens_sum)
    result = pad_result(accept_path(tree, layout.draft_token, worker.backend), worker.speculative_num_draft_tokens)
    hidden = torch.zeros(bs * width, worker.drafting.drafter.fc.in_features, dtype=worker.drafting.embed_weight.dtype,
                         device=device)
    batch = SimpleNamespace(spec_info=SimpleNamespace(draft_token_num=width), seq_lens=seq_lens,
                            reqs=[SimpleNamespace(rid=WARMUP_RID)] * bs,
                            out_cache_loc=torch.zeros(bs * width, dtype=torch.int64, device=device))
    output = SimpleNamespace(logits_output=SimpleNamespace(hidden_states=hidden))
    worker.commit_verified(VerifiedTree(batch, None, output), result, seq_lens, recurrent=False)


def warmup_runs(choice: str, device) -> bool:
    """Whether a server warms up for --mfd-warmup `choice`: auto where kernels compile (CUDA; a CPU runs torch, or
    Triton's interpreter, which compiles nothing), on / off as said."""
    return choice == "on" or (choice == "auto" and str(device).startswith("cuda"))


def warm_up(worker) -> int:
    """Every specialisation a round can launch (module docstring), before the first request; returns the rounds
    run. The verify forwards run on the window's graphs (`MFDWorkerV2.activate_window`,
    `MFDWorkerV2.placeholder_verify`)."""
    playable, device = worker.playable, worker.device
    row_len = worker.model_runner.req_to_token_pool.req_to_token.shape[1]
    context_len = max(min(CONTEXT_LEN, row_len - max(playable.budgets()) - 1), 1)

    def verify(layout, seq_lens: torch.Tensor, lens_sum: int) -> None:
        worker.activate_window(layout.draft_token.shape[1])
        worker.placeholder_verify(layout, seq_lens, lens_sum)()

    start, rounds = time.perf_counter(), 0

    def placeholders(bs: int):
        return (torch.zeros(bs, dtype=torch.int64, device=device),
                torch.full((bs,), context_len, dtype=torch.int64, device=device))

    with torch.inference_mode():
        for bs in range(1, playable.max_requests + 1):
            roots, seq_lens = placeholders(bs)
            for arm in playable.arms(bs):
                tree, layout = worker.drafting.tree(roots, seq_lens, torch.zeros_like(roots), context_len, arm)
                eager_stages(worker, tree, layout, seq_lens, bs * context_len,
                             verify if bs in playable.buckets and not worker.attention_dp else None)
                rounds += 1
        worker.drafting.context_pool.flush()
    if torch.cuda.is_available() and str(device).startswith("cuda"):  # the time includes the compiles
        torch.cuda.synchronize(device)
    logger.info("MFD: start-up warm-up in %.1f s: %d placeholder rounds at batch sizes 1-%d (the verify forward at "
                "%s) for %s", time.perf_counter() - start, rounds, playable.max_requests, list(playable.buckets),
                playable.describe())
    return rounds
