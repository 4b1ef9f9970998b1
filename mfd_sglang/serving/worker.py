"""MFDWorkerV2: MFD / MFD_D as an SGLang 0.5.23 spec-V2 worker.

Prefill: the target runs the prompt (capturing the hidden states of the drafter's target layers,
SGLang's DFlash-family capture) and the drafter's context K/V of every prompt token goes into the
`DraftContextPool` at the token's KV slot.

Each decode round, with no host sync on a device:
  draft   the drafter fills a block `[last token, MASK...]` for its K modes in one forward over the
          committed context (MFD_D: the single-mode path while >= threshold requests run) and keeps
          each position's B best tokens, scoring the vocabulary in chunks (`DraftCandidates`);
  tree    `build_mixture_tree` keeps the B best prefixes over all modes (Triton kernel on CUDA) and
          `tree_to_verify_layout` lays them out for SGLang's verify; on CUDA draft + tree + layout
          replay as one CUDA graph per batch-size bucket and mode path;
  verify  the root and the B nodes go through SGLang's tree-verify forward
          (`eagle_prepare_for_verify`: FULL_MASK custom mask, TARGET_VERIFY, full vocabulary; a
          replay of the target's tree-verify CUDA graph, `mfd_sglang.serving.verify_graph`);
  accept  each node's logits get what the plain server would apply after the node's path
          (penalties, min_new_tokens, logit_bias: `penalties`; the grammar's mask: SGLang's tree
          traversal), then `verify_tree_greedy` / `verify_tree_sampling` (one target sample per
          node: lossless at any temperature, SGLang's top-k / top-p / min-p law, per-request
          seeds) pick the longest agreed path and the bonus token; logprobs come from those rows;
  commit  SGLang's `move_accept_tokens_to_target_kvcache` moves the path's target KV to the front
          of the verify window and the drafter context K/V of the committed tokens is written.
The result goes back in SGLang's `GenerationBatchResult` with one row of N = B + 1 output tokens
per request (accepted draft tokens, then the bonus).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import deque

import torch

from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.distributed import get_tp_group
from sglang.srt.layers.logprob_processor import compute_spec_logprobs
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.eagle_info import EagleVerifyInput
from sglang.srt.speculative.eagle_utils import eagle_prepare_for_verify
from sglang.srt.speculative.spec_utils import (GrammarTree, build_grammar_vocab_mask,
                                                commit_mamba_states_after_verify,
                                                move_accept_tokens_to_target_kvcache)
from sglang.srt.utils import async_h2d

from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.cuda_graph import BatchGraphs, default_buckets
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.tree import DraftCandidates, DraftTree, build_mixture_tree, empty_tree
from mfd_sglang.tree_layout import VerifyLayout, full_custom_mask, tree_to_verify_layout
from mfd_sglang.verify import (Sampling, TreeVerifyResult, random_seeds, sample_from_logits, sub_budget_accept_lens,
                               verify_tree_greedy, verify_tree_sampling)

from .algorithms import check_tree_verify_attention
from .budget import Arm, BudgetChooser, RoundClock
from .calibration import calibrate_round_costs
from .commit import commit_round, committed_window_path
from .draft_context_pool import DeferredContextWrites, DraftContextPool
from .memory import memory_plan, verify_graph_plan
from .options import budget_from_num_draft_tokens, draft_quantization, read_options
from .penalties import (OutputPenalties, adjust_tree_logits, count_resumed_output, cumulate, output_penalties,
                        path_token_counts)
from .sampling_mask import sampling_mask_output
from .target_checks import check_target_runner
from .verify_graph import MFDVerifyCudaGraphRunner, VerifyGraphsByWidth

logger = logging.getLogger(__name__)

# Plain-decoding rows whose drafter context waits for one batched write (`DeferredContextWrites`).
DEFERRED_CONTEXT_ROWS = 256


def reserved_lens(batch) -> torch.Tensor:
    """Host-side upper bounds [bs] of the committed lengths, known without a device sync: the KV
    lengths reserved by the draft input's prepare_for_decode (else the host copy of seq_lens)."""
    reserved = batch.spec_info.nxt_kv_lens_cpu
    return reserved if reserved is not None else batch.seq_lens_cpu


def request_sampling(batch) -> Sampling:
    """The batch's sampling settings (SGLang's plain law: temperature, top-k, top-p, min-p) and one
    seed per request: SGLang's own seeds under --enable-deterministic-inference (42 for requests
    without one), else the request's sampling_seed, else a fresh random seed each round (a stream of
    its own, not reproducible)."""
    info = batch.sampling_info
    device = info.temperatures.device
    seeds, seeded = info.sampling_seed, True
    if seeds is None:
        given = [r.sampling_params.sampling_seed for r in batch.reqs]
        seeds = random_seeds(len(given), device)
        seeded = any(s is not None for s in given)
        if seeded:  # staged in pinned memory: no host sync on a device
            mask = async_h2d([s is not None for s in given], dtype=torch.bool, device=device)
            values = async_h2d([0 if s is None else s for s in given], dtype=torch.int64, device=device)
            seeds = torch.where(mask, values, seeds)
    # Seeded requests get the full sort, whose order does not depend on the batch (Sampling.max_top_k).
    return Sampling(info.temperatures.reshape(-1).float(), info.top_ks.reshape(-1), info.top_ps.reshape(-1).float(),
                    info.min_ps.reshape(-1).float(), seeds, None if seeded else info.max_top_k)


def adjust_node_logits(logits: torch.Tensor, layout: VerifyLayout, penalties: OutputPenalties) -> None:
    """Count each root as output (the prefill's token, or the last round's bonus), then give every
    node's row logits [bs, N, V] the plain server's adjustment after the node's path (in place)."""
    roots = layout.draft_token[:, 0]
    cumulate(penalties, roots[:, None], torch.ones_like(roots))
    depths = layout.ancestor_mask.sum(dim=-1) - 1  # ancestors and the node itself, minus the root
    counts = None
    if penalties.counts_paths:
        counts = path_token_counts(layout.draft_token, layout.ancestor_mask, logits.shape[-1])
    adjust_tree_logits(logits, penalties, depths, counts)


def attach_logprobs(batch, logits_output, logits: torch.Tensor, tokens: torch.Tensor, width: int) -> None:
    """The emitted tokens' logprobs (and top / requested-id logprobs) into logits_output, as SGLang's
    speculative workers return them: `compute_spec_logprobs` over logits [bs * width, V], the row of
    each emitted token tokens [bs, width] (width 1: the prefill's first token, one value per request)."""
    rows = copy.copy(logits_output)
    rows.next_token_logits = logits
    compute_spec_logprobs(batch, rows, tokens.reshape(-1), chain_stride=width)
    logits_output.next_token_logprobs = rows.next_token_logprobs.reshape(-1) if width == 1 else rows.next_token_logprobs
    for name in ("next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                 "next_token_token_ids_logprobs_val", "next_token_token_ids_logprobs_idx"):
        setattr(logits_output, name, getattr(rows, name))


def pad_result(result: TreeVerifyResult, width: int) -> TreeVerifyResult:
    """The result of a round verified with a smaller tree, widened with -1 columns to `width`
    (the launch budget's B + 1, the row width SGLang reads every round)."""
    extra = width - result.accepted_tokens.shape[1]
    if extra == 0:
        return result
    pad = torch.nn.functional.pad
    return dataclasses.replace(result, accepted_tokens=pad(result.accepted_tokens, (0, extra), value=-1),
                               accepted_local_indices=pad(result.accepted_local_indices, (0, extra), value=-1))


class MFDWorkerV2(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        self.server_args = server_args
        self.gpu_id = gpu_id
        self._target_worker = target_worker
        self._draft_worker = None  # the drafter runs in this worker, not in a second TpModelWorker
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        # A hybrid Gated DeltaNet target keeps a recurrent / conv state per request, committed each round.
        self.recurrent_target = mambaish_config(self.model_runner.model_config) is not None

        spec = get_spec()
        algorithm = self.model_runner.spec_algorithm
        # Names the SGLang infrastructure reads from every spec worker.
        self.speculative_num_draft_tokens = int(spec.speculative_num_draft_tokens)
        self.speculative_num_steps = 1
        self.topk = 1
        self.budget = budget_from_num_draft_tokens(self.speculative_num_draft_tokens)

        options = read_options()
        ckpt = load_drafter(spec.speculative_draft_model_path)
        self.draft_quantization = draft_quantization(server_args)  # "fp8": attention and MLP linears in e4m3
        self.drafter = MFDDrafter.from_checkpoint(ckpt, dtype=self.model_runner.model_config.dtype,
                                                  fp8_linears=self.draft_quantization == "fp8").to(self.device)
        if options.num_modes is not None:
            self.drafter.mode_embed.data = self.drafter.mode_embed.data[: options.num_modes]
        self.switch_threshold = options.switch_threshold if algorithm.name == "MFD_D" else None
        self.single_mode = False  # MFD_D's current path, logged when it switches
        # The automatic budget: per decode batch, (path, budget) from measured acceptance and cost.
        self.budget_chooser = self.round_clock = None
        if options.auto_budget:
            paths = (False, True) if algorithm.name == "MFD_D" else (False,)
            self.budget_chooser = BudgetChooser(self.budget, paths=paths)
            self.round_clock = RoundClock()
            # On the device once: a round measures a prefix of these (`measured_budgets`)
            self.candidate_budgets = torch.tensor(self.budget_chooser.budgets, device=self.device)
            self.switch_threshold = None
            # (arm, committed tokens per request and budget: [bs, budgets], copied to the host without a
            # sync, event) of rounds whose acceptance is not yet recorded
            self.pending_acceptance: deque = deque()
        on_cuda = str(self.device).startswith("cuda")
        self.tree_backend = "triton" if on_cuda else "torch"
        sliding = any(self.drafter.cfg.is_sliding(i) for i in range(self.drafter.cfg.num_hidden_layers))
        self.mode_attention_backend = None if sliding else "triton" if on_cuda else "torch"

        target = self.model_runner.model
        vocab = self.model_runner.model_config.vocab_size
        # The drafter borrows the target's embeddings and head (rows past the vocabulary are padding);
        # with a draft vocabulary its rows are copied once here, not every round.
        self.tp_group = get_tp_group()
        embed, head = target.get_input_embeddings().weight, target.lm_head.weight
        tied = head is embed
        if self.tp_group.world_size > 1:
            # Under tensor parallelism both are vocabulary shards. The drafter runs whole on every rank
            # and needs every row: gathered once here (one full copy per rank, counted in the memory
            # plan) rather than a per-shard top-B and an all-gather in every round.
            embed = self.tp_group.all_gather(embed, dim=0)
            head = embed if tied else self.tp_group.all_gather(head, dim=0)
        self.embed_weight = embed[:vocab]
        self.head_weight = self.drafter.head_weight(head[:vocab])
        weights = sum(t.numel() for t in ckpt.weights.values() if t.is_floating_point())  # as at launch
        # As reserved at launch (`plan_launch_memory`), the automatic budget's verify graphs included.
        graphs = verify_graph_plan(server_args, self.budget) if on_cuda else None
        self.memory_plan = memory_plan(ckpt.config, weights, budget=self.budget, vocab=vocab,
                                       dtype_bytes=self.embed_weight.element_size(),
                                       num_modes=self.drafter.mode_embed.shape[0],
                                       tp_size=self.tp_group.world_size, tied_embeddings=tied,
                                       verify_graph_bytes=graphs.total_bytes() if graphs else 0,
                                       draft_quantization=self.draft_quantization)
        logger.info("MFD memory: %s", self.memory_plan.describe(int(server_args.max_running_requests or 1)))
        self.context_pool: DraftContextPool | None = None
        self.deferred_context: DeferredContextWrites | None = None  # plain-decoding rounds' context (automatic budget)
        self.draft_graphs: BatchGraphs | None = None
        self.verify_graphs: VerifyGraphsByWidth | None = None  # per-budget verify graphs (automatic budget)
        cfg = self.drafter.cfg
        logger.info("%s worker: drafter %s (%d layer(s), K = %d mode(s), block %d, linears %s), tree budget %s, "
                    "single-mode switch at %s running requests, tree backend %s, mode attention %s", algorithm.name,
                    spec.speculative_draft_model_path, cfg.num_hidden_layers, self.drafter.mode_embed.shape[0],
                    cfg.block_size, "fp8 e4m3" if self.draft_quantization == "fp8" else "unquantized",
                    f"auto (at most {self.budget}, from {self.budget_chooser.budgets})"
                    if self.budget_chooser else self.budget,
                    "auto" if self.budget_chooser else self.switch_threshold or "never", self.tree_backend,
                    self.mode_attention_backend or "padded copy (sliding layers)")

    # --- SGLang lifecycle ---------------------------------------------------------------------
    def __getattr__(self, name):
        # Scheduler-facing methods this wrapper does not define belong to the target worker.
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)

    @property
    def draft_worker(self):
        return None

    def init_attention_backends(self):
        # Called once the target's KV pool and attention backend exist: the drafter context pool
        # mirrors its slots, and the backend must apply the tree mask.
        check_tree_verify_attention(self.model_runner.attn_backend)
        check_target_runner(self.model_runner)
        kv_pool = self.model_runner.token_to_kv_pool
        num_slots = kv_pool.size + kv_pool.page_size
        self.context_pool = DraftContextPool(self.drafter, num_slots, device=self.device,
                                             dtype=self.model_runner.model_config.dtype)
        if self.budget_chooser is not None:
            self.deferred_context = DeferredContextWrites(self.context_pool, self.drafter, DEFERRED_CONTEXT_ROWS,
                                                          device=self.device, dtype=self.model_runner.model_config.dtype)

    def init_cuda_graphs(self):
        """The CUDA graphs (`capture_cuda_graphs`), then, under the automatic budget, the start-up cost
        calibration of every arm (on a CPU too, where SGLang calls this as well and nothing is captured)."""
        self.capture_cuda_graphs()
        if self.budget_chooser is not None:
            with torch.inference_mode():
                self.budget_chooser.calibrate(calibrate_round_costs(
                    self, self.budget_chooser.arms, int(self.server_args.max_running_requests)))

    def capture_cuda_graphs(self):
        """Under the automatic budget, the target's tree-verify graphs at every candidate budget's
        window (SGLang captured the launch budget's). Capture draft + tree + layout at every batch-size
        bucket (and both MFD_D paths). Only the paged context (mode attention in Triton) has fixed
        shapes; sliding-window drafters draft eagerly."""
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

        if self.server_args.disable_cuda_graph or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED):
            return
        if self.budget_chooser is not None and isinstance(self.model_runner.decode_cuda_graph_runner,
                                                          MFDVerifyCudaGraphRunner):
            self.verify_graphs = VerifyGraphsByWidth(self.model_runner,
                                                     [budget + 1 for budget in self.budget_chooser.budgets])
        if self.mode_attention_backend != "triton":
            return
        max_bs = int(self.server_args.max_running_requests or 48)

        def example_inputs(bs: int):  # also the pad rows: token 0, empty context, request slot 0
            return [torch.zeros(bs, dtype=torch.int64, device=self.device) for _ in range(3)]

        if self.budget_chooser is not None:
            keys = [arm for arm in self.budget_chooser.arms if arm[1] > 0]
        else:
            keys = [(single, self.budget) for single in ((False, True) if self.switch_threshold is not None else (False,))]
        self.draft_graphs = BatchGraphs(self.draft_paged_tree, example_inputs, default_buckets(max_bs), use_graph=True)
        with torch.inference_mode():
            self.draft_graphs.capture_all(keys=keys)
        logger.info("MFD: draft + tree + layout CUDA graphs captured for batch sizes %s", self.draft_graphs.buckets)

    def clear_cache_pool(self):
        pass

    # --- one forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        if batch.forward_mode.is_idle():
            raise RuntimeError("MFD does not support idle batches (data-parallel attention is rejected at launch).")
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            if self.round_clock is not None:
                self.round_clock.other_forward()
            return self.forward_prefill(batch, on_publish)
        return self.forward_decode(batch, on_publish, grammar_barrier)

    def forward_prefill(self, batch, on_publish):
        # is_verify: SGLang's sampler is skipped; MFD samples the first token itself (sample_first),
        # so one law and one seeded stream cover every token of a request.
        if self.deferred_context is not None:  # held rows before this prefill's writes (slots may be reused)
            self.deferred_context.flush()
        result = self.target_worker.forward_batch_generation(batch, is_verify=True,
                                                             capture_hidden_mode=CaptureHiddenMode.FULL)
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:  # the lengths are known: the scheduler may prepare the next batch
            on_publish(result.new_seq_lens)
        logits = result.logits_output.next_token_logits.float()
        penalties = output_penalties(batch.sampling_info)
        if penalties is not None:  # the output so far: none, or a retracted request's
            count_resumed_output(penalties, batch.reqs, logits.device)
            adjust_tree_logits(logits[:, None, :], penalties, torch.zeros_like(logits[:, :1], dtype=torch.int64))
        if batch.has_grammar:  # the grammars' masks at their start state (SGLang's own prefill mask)
            batch.sampling_info.update_regex_vocab_mask()
            batch.sampling_info.grammar_mask.apply(logits)
            batch.sampling_info.grammar_mask = None
        result.next_token_ids = self.sample_first(batch, logits)
        if batch.return_logprob:
            attach_logprobs(batch, result.logits_output, logits, result.next_token_ids, width=1)
        result.logits_output.sampling_mask_output = sampling_mask_output(
            batch.sampling_info, logits[:, None], result.next_token_ids[:, None], num_accept_tokens=None)
        hidden = result.logits_output.hidden_states
        if hidden is None:
            raise RuntimeError("MFD prefill got no target hidden states: the target model must support "
                               "DFlash layer capture (set_dflash_layers_to_capture).")
        # Host lists staged in pinned memory and a known output size: no host sync (overlap scheduling).
        device, num_tokens = hidden.device, hidden.shape[0]
        extend_lens = async_h2d(batch.extend_lens, dtype=torch.int64, device=device)
        prefix_lens = async_h2d(batch.prefix_lens, dtype=torch.int64, device=device)
        starts = torch.repeat_interleave(prefix_lens - (extend_lens.cumsum(0) - extend_lens), extend_lens,
                                         output_size=num_tokens)
        positions = starts + torch.arange(num_tokens, device=device)
        self.context_pool.write(self.drafter, hidden, positions, batch.out_cache_loc)
        result.logits_output.hidden_states = None  # keep it off the result's CPU copy
        result.next_draft_input = make_draft_input_v2(bonus_tokens=result.next_token_ids,
                                                      new_seq_lens=batch.seq_lens)
        return result

    def forward_decode(self, batch, on_publish, grammar_barrier=None):
        draft_input = batch.spec_info
        seq_lens = batch.seq_lens
        if seq_lens.is_cuda:  # gathered on the schedule stream (overlap): keep it alive on this one
            seq_lens.record_stream(torch.cuda.current_stream(seq_lens.device))
        roots = draft_input.bonus_tokens.reshape(-1).long()
        arm = self.choose_arm(len(batch.reqs))

        tree, layout = self.draft_tree(roots, seq_lens, batch.req_pool_indices, int(reserved_lens(batch).max()), arm)
        # Grammar requests: the tree goes to the host while the verify runs (SGLang's EAGLE path).
        grammar_tree = (GrammarTree.from_device(layout.retrive_next_token, layout.retrive_next_sibling,
                                                layout.draft_token) if batch.has_grammar else None)
        verify_batch, forward_batch, output = self.verify(batch, layout, seq_lens)
        logits = output.logits_output.next_token_logits
        grammar_mask = None
        if grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                                                    device=logits.device, barrier=grammar_barrier)
        result, logits = self.accept(tree, layout, logits, batch, seq_lens, grammar_mask)
        self.from_rank0(*(getattr(result, field.name) for field in dataclasses.fields(result)))
        if self.budget_chooser is not None:
            self.measure_acceptance(arm, result)
        result = pad_result(result, self.speculative_num_draft_tokens)
        accept_lens = result.accept_lens.to(torch.int32)
        new_seq_lens = seq_lens + accept_lens.to(seq_lens.dtype)
        if on_publish is not None:  # the lengths are known: the scheduler may prepare the next batch
            on_publish(new_seq_lens)
        if batch.return_logprob or batch.sampling_info.sampling_mask_batch_indices is not None:
            # The emitted tokens' rows in order: the root's (first token), then each accepted node's.
            path = committed_window_path(result, self.speculative_num_draft_tokens).clamp(min=0)
            rows = logits.gather(1, path[:, :, None].expand(-1, -1, logits.shape[-1]))
            if batch.return_logprob:
                attach_logprobs(batch, output.logits_output, rows.flatten(0, 1), result.accepted_tokens.clamp(min=0),
                                width=self.speculative_num_draft_tokens)
            output.logits_output.sampling_mask_output = sampling_mask_output(
                batch.sampling_info, rows, result.accepted_tokens, num_accept_tokens=result.accept_lens)
        self.commit(verify_batch, result, output.logits_output.hidden_states, seq_lens)
        output.logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=output.logits_output,
            next_token_ids=result.accepted_tokens.clamp(min=0).reshape(-1),
            accept_lens=accept_lens,
            next_draft_input=make_draft_input_v2(bonus_tokens=result.bonus_tokens, new_seq_lens=new_seq_lens),
            can_run_cuda_graph=output.can_run_cuda_graph,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            new_seq_lens=new_seq_lens,
            routed_experts_output=output.routed_experts_output,
            indexer_topk_output=output.indexer_topk_output,
            extra_keep_alive_refs=[forward_batch],
        )

    def from_rank0(self, *tensors: torch.Tensor) -> None:
        """Under tensor parallelism every rank takes rank 0's sampled tokens and accepted path (in place),
        as SGLang's EAGLE / DFLASH workers broadcast theirs: a sampled token draws random numbers, which
        agree across ranks only while every rank's generator has made the same draws. The tree needs no
        broadcast: every rank drafts it from the same all-reduced hidden states with the same
        deterministic kernels (SGLang's DFLASH draft relies on the same)."""
        if self.tp_group.world_size == 1:
            return
        for tensor in tensors:
            if tensor.is_contiguous():
                self.tp_group.broadcast(tensor, src=0)
            else:  # collectives take contiguous buffers
                tensor.copy_(self.tp_group.broadcast(tensor.contiguous(), src=0))

    # --- the round's tree: its drafting path and budget ------------------------------------------
    def choose_arm(self, bs: int) -> Arm:
        """(single-mode path, budget) of this round: the automatic budget's choice, else the launch
        budget on MFD_D's path for bs running requests (single mode from the threshold on)."""
        if self.budget_chooser is not None:
            self.record_finished_acceptance()
            arm = self.budget_chooser.choose(bs)
            timing = self.round_clock.decode_round(bs, arm)
            if timing is not None:
                self.budget_chooser.record_round_time(*timing)
            return arm
        single_mode = self.switch_threshold is not None and bs >= self.switch_threshold
        if single_mode != self.single_mode:
            self.single_mode = single_mode
            logger.info("MFD_D: %d running requests, switching to the %s path", bs,
                        "single-mode" if single_mode else f"{self.drafter.mode_embed.shape[0]}-mode")
        return single_mode, self.budget

    def measure_acceptance(self, arm: Arm, result: TreeVerifyResult) -> None:
        """Start the host copy of what every budget <= the round's would have committed; recorded once
        the copy is done (a later round), so the round never waits for it."""
        budgets = self.candidate_budgets[: len(self.budget_chooser.measured_budgets(arm))]
        committed = sub_budget_accept_lens(result, budgets)
        done = None
        if committed.is_cuda:
            committed = committed.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending_acceptance.append((arm, committed, done))

    def record_finished_acceptance(self) -> None:
        while self.pending_acceptance and (self.pending_acceptance[0][2] is None or self.pending_acceptance[0][2].query()):
            arm, committed, _ = self.pending_acceptance.popleft()
            self.budget_chooser.record_acceptance(arm, committed.tolist())

    # --- the stages of a round ------------------------------------------------------------------
    def draft_tree(self, roots: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int,
                   arm: Arm) -> tuple[DraftTree, VerifyLayout]:
        """draft + tree (and its verify layout) of arm (single-mode path, budget): a CUDA-graph replay
        when captured for this batch size, else eager; the context is read in place (mode attention), or
        for drafters with sliding-window layers copied into a padded DraftContext (max_len: a host-side
        upper bound of seq_lens). Budget 0: no draft, the root alone (plain decoding)."""
        single_mode, budget = arm
        if budget == 0:
            return self.layout(empty_tree(roots.shape[0], roots.device), roots, seq_lens)
        if self.deferred_context is not None:  # the drafter reads every committed token's context
            self.deferred_context.flush()
        if self.draft_graphs is not None and seq_lens.shape[0] <= self.draft_graphs.max_bs:
            return self.draft_graphs(roots, seq_lens, req_pool_indices, key=arm)
        if self.mode_attention_backend is not None:
            return self.draft_paged_tree(roots, seq_lens, req_pool_indices, key=arm)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slots = req_to_token[req_pool_indices.long()][:, :max_len].long()
        context = self.context_pool.gather(slots, seq_lens)
        return self.build_tree(self.draft(roots, seq_lens, context, single_mode, budget), roots, seq_lens, budget)

    def draft(self, roots: torch.Tensor, seq_lens: torch.Tensor, context, single_mode: bool,
              budget: int) -> DraftCandidates:
        """The drafter's `budget` best tokens per (mode, position) of the blocks `[root, MASK...]` at
        positions seq_lens.., with their log-probs: all the tree reads, scored over the vocabulary in
        chunks so that no [bs, K, D, V] tensor is ever made."""
        return self.drafter.block_candidates(roots, seq_lens, context, self.embed_weight, self.head_weight,
                                             budget, single_mode=single_mode)

    def draft_paged_tree(self, roots: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, *,
                         key: Arm) -> tuple[DraftTree, VerifyLayout]:
        """draft + tree + layout over the context read in place: fixed shapes, what the CUDA graphs replay
        (key: the arm, (single-mode path, budget))."""
        single_mode, budget = key
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        context = self.context_pool.paged(req_to_token, req_pool_indices, seq_lens, self.mode_attention_backend)
        return self.build_tree(self.draft(roots, seq_lens, context, single_mode, budget), roots, seq_lens, budget)

    def build_tree(self, candidates: DraftCandidates, roots: torch.Tensor, seq_lens: torch.Tensor,
                   budget: int) -> tuple[DraftTree, VerifyLayout]:
        """The mixture tree (target token ids) and its SGLang verify layout (fixed shapes)."""
        tree = build_mixture_tree(candidates, budget, backend=self.tree_backend)
        tree.tokens = self.drafter.to_target_ids(tree.tokens)
        return self.layout(tree, roots, seq_lens)

    @staticmethod
    def layout(tree: DraftTree, roots: torch.Tensor, seq_lens: torch.Tensor) -> tuple[DraftTree, VerifyLayout]:
        return tree, tree_to_verify_layout(tree, roots, seq_lens)

    def verify_input(self, layout: VerifyLayout, seq_lens: torch.Tensor, lens_sum: int) -> EagleVerifyInput:
        """SGLang's tree-verify input of a layout; lens_sum: any host-side upper bound of sum(seq_lens)
        (it sizes the flat mask, whose cells are placed from seq_lens)."""
        bs, num_nodes = layout.draft_token.shape
        custom_mask = full_custom_mask(layout.ancestor_mask, seq_lens,
                                       num_nodes * lens_sum + bs * num_nodes * num_nodes)
        return EagleVerifyInput(
            draft_token=layout.draft_token.flatten(),
            custom_mask=custom_mask,
            positions=layout.positions.flatten(),
            retrieve_index=layout.retrive_index,
            retrieve_next_token=layout.retrive_next_token,
            retrieve_next_sibling=layout.retrive_next_sibling,
            retrieve_cum_len=None,
            spec_steps=self.drafter.num_draft_positions,
            topk=1,
            draft_token_num=num_nodes,
            capture_hidden_mode=CaptureHiddenMode.FULL,
            seq_lens_sum=None,
            seq_lens_cpu=None,
        )

    def verify(self, batch, layout: VerifyLayout, seq_lens: torch.Tensor):
        """One target forward over [root, tree nodes] per request through SGLang's tree-verify path
        (the launch budget's window, or a smaller one under the automatic budget)."""
        num_nodes = layout.draft_token.shape[1]
        verify_input = self.verify_input(layout, seq_lens, int(reserved_lens(batch).sum()))
        verify_batch = copy.copy(batch)
        verify_batch.spec_info = verify_input
        if self.verify_graphs is not None:  # the graphs (and backend) of this round's window
            self.verify_graphs.activate(num_nodes)
        # The target's decode graphs are captured as tree verifies (patches/verify_graph.py).
        forward_batch, _ = eagle_prepare_for_verify(verify_input, self.model_runner.req_to_token_pool,
                                                    verify_batch, self.target_worker)
        output = self.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch,
                                                             is_verify=True)
        return verify_batch, forward_batch, output

    def sample_first(self, batch, logits: torch.Tensor) -> torch.Tensor:
        """The token after each prompt (at its last token, position seq_len - 1), by the same law and
        seeded stream as the verify rounds."""
        if batch.sampling_info.is_all_greedy:
            return logits.argmax(dim=-1)
        tokens = sample_from_logits(logits.float(), request_sampling(batch), batch.seq_lens - 1)
        self.from_rank0(tokens)
        return tokens

    def accept(self, tree: DraftTree, layout: VerifyLayout, logits: torch.Tensor, batch, seq_lens: torch.Tensor,
               grammar_mask=None) -> tuple[TreeVerifyResult, torch.Tensor]:
        """The accepted path: the target's argmax, or one sample per node (root at position seq_lens),
        each node's logits adjusted as the plain server would after its path (penalties,
        min_new_tokens, logit_bias; the grammar's mask in the state the path leads to). Also returns
        those logits [bs, N, V] (float32)."""
        logits = logits.view(*layout.draft_token.shape, -1).float()
        penalties = output_penalties(batch.sampling_info)
        if penalties is not None:
            adjust_node_logits(logits, layout, penalties)
        if grammar_mask is not None:  # -inf where masked: the order with the finite adjustments does not matter
            grammar_mask.apply(logits.view(-1, logits.shape[-1]))
        if batch.sampling_info.is_all_greedy:
            result = verify_tree_greedy(tree, logits)
        else:  # greedy requests in a mixed batch carry top_k = 1, which makes their sample the argmax
            result = verify_tree_sampling(tree, logits, request_sampling(batch), seq_lens)
        if penalties is not None:  # the accepted draft tokens; the bonus is the next round's root
            cumulate(penalties, result.accepted_tokens, result.accept_lens - 1)
        return result, logits

    def commit(self, verify_batch, result: TreeVerifyResult, target_hidden: torch.Tensor,
               seq_lens: torch.Tensor) -> None:
        """Target KV of the accepted path to the front of the verify window (SGLang's
        `move_accept_tokens_to_target_kvcache`) and, for a hybrid target, the recurrent / conv state
        after its last node into the request's state (SGLang's `commit_mamba_states_after_verify`; the
        verify kept every node's state aside); drafter context K/V of the committed tokens (root +
        accepted nodes) into their slots. The stage itself is `commit_round`, shared with the
        round-cost benchmark."""
        bs = seq_lens.shape[0]
        num_nodes = verify_batch.spec_info.draft_token_num  # the round's window: root + its tree
        allocator = self.model_runner.token_to_kv_pool_allocator

        def commit_target(path: torch.Tensor) -> None:
            # SGLang indexes the batch's flat verify window (request b's node i: b * N + i).
            base = torch.arange(bs, device=path.device)[:, None] * num_nodes
            accept_index = torch.where(path >= 0, base + path, -1)
            if self.recurrent_target:
                commit_mamba_states_after_verify(self.target_worker, verify_batch, result.accept_lens,
                                                 accept_index, num_nodes)
            if num_nodes > 1:  # a plain-decoding round's K/V is already where it belongs
                move_accept_tokens_to_target_kvcache(verify_batch, accept_index, result.accept_lens - 1, allocator)

        context = self.context_pool
        if num_nodes == 1 and self.deferred_context is not None:  # plain decoding: the context can wait
            self.deferred_context.hold_for(tuple(req.rid for req in verify_batch.reqs))
            context = self.deferred_context
        commit_round(result, target_hidden.view(bs, num_nodes, -1), seq_lens,
                     verify_batch.out_cache_loc.view(bs, num_nodes), context, self.drafter, commit_target)
