"""MFDWorkerV2: MFD / MFD_D as an SGLang 0.5.23 spec-V2 worker: the round, its stages called in order.

Prefill: the target runs the prompt (capturing the hidden states of the drafter's target layers,
SGLang's DFlash-family capture) and the drafter's context K/V of every prompt token goes into the
`DraftContextPool` at the token's KV slot.

Each decode round, with no host sync on a device:
  arm     the round's drafting path and budget: the launch budget (MFD_D: the single-mode path while
          >= threshold requests run), or the automatic budget's choice (`budget.auto`);
  draft   + tree: the drafter fills a block `[last token, MASK...]` per mode in one forward over the
          committed context and the mixture tree keeps the B best prefixes over all modes, laid out
          for SGLang's verify (`draft_stage`; one CUDA graph per batch-size bucket and arm on CUDA);
  verify  the root and the B nodes through SGLang's tree-verify forward (`verify`; a replay of
          the target's tree-verify CUDA graph, `verify_graph`);
  accept  the longest path the target agrees with and the bonus token, by the plain server's law
          (`accept`); under tensor parallelism every rank takes rank 0's (`from_rank0`);
  commit  the path's target KV to the front of the verify window (and a hybrid target's recurrent
          state), the drafter context K/V of the committed tokens (`commit_verified`, `commit`);
  outputs logprobs and sampling masks of the emitted tokens (`outputs`).
The result goes back in SGLang's `GenerationBatchResult` with one row of N = B + 1 output tokens
per request (accepted draft tokens, then the bonus).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from sglang.srt.arg_groups.model_override_base import resolved_view
from sglang.srt.configs.hybrid_arch import mambaish_config
from sglang.srt.layers.dp_attention import get_dp_tp_group
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.runtime_context import get_spec
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import make_draft_input_v2
from sglang.srt.speculative.spec_utils import (GrammarTree, build_grammar_vocab_mask,
                                                commit_mamba_states_after_verify,
                                                move_accept_tokens_to_target_kvcache)
from sglang.srt.utils import async_h2d

from mfd_sglang.acceptance import TreeVerifyResult
from mfd_sglang.backend import resolve_backend
from mfd_sglang.checkpoint import load_drafter, target_text_config

from mfd_sglang.serving.accept import accept_tree, pad_result, sample_first_tokens
from mfd_sglang.serving.budget.auto import AutoBudget
from mfd_sglang.serving.budget.playable import auto_paths, server_playable
from mfd_sglang.serving.budget.rule import Arm, Path
from mfd_sglang.serving.budget.schedule import budget_schedule
from mfd_sglang.serving.budget.calibration import placeholder_verify_batch
from mfd_sglang.serving.commit import commit_round
from mfd_sglang.serving.draft_stage import DraftStage, draft_graphs_captured
from mfd_sglang.serving.launch.memory import drafter_memory_plan
from mfd_sglang.serving.launch.options import (attention_dp_size, budget_from_num_draft_tokens, draft_quantization,
                                               read_options)
from mfd_sglang.serving.outputs import first_token_outputs, round_outputs
from mfd_sglang.serving.launch.target_checks import check_target_runner, check_tree_verify_attention
from mfd_sglang.serving.verify import VerifiedTree, idle_verify, layout_verify_input, reserved_lens, verify_tree
from mfd_sglang.serving.verify_graph import verify_graphs_by_width
from mfd_sglang.serving.warmup import warm_up, warmup_runs

logger = logging.getLogger(__name__)

# Plain-decoding rows whose drafter context waits for one batched write (`DraftContextPool.deferred_for`).
DEFERRED_CONTEXT_ROWS = 256


class MFDWorkerV2(BaseSpecWorker):
    """SGLang's spec-V2 worker contract: what the 0.5.23 scheduler reads from its spec worker
    (`self.draft_worker` / `self.model_worker` there) is `BaseSpecWorker`'s (graph memory and time, weight
    updates, HiCache's draft plan, ...) or defined here: `forward_batch_generation` (prefill and decode
    rounds), `init_attention_backends` and `init_cuda_graphs` (called once the target's KV pool exists),
    `clear_cache_pool`, `target_worker`, `draft_worker` (None: the drafter runs here, not in a
    TpModelWorker of its own), `model_runner`, `device`, and the spec sizes SGLang reads from every spec
    worker (`speculative_num_draft_tokens`, the verify window N = B + 1; `speculative_num_steps` and
    `topk`, 1). Unlike SGLang's DFLASH and EAGLE V2 workers nothing is forwarded to the target worker
    (`tests/test_worker_contract.py` holds this list to the scheduler's source)."""

    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        # What the launch resolved (SGLang keeps MFD's `resolve_server_args` writes as declarations over the
        # raw record, e.g. max_running_requests 48 when unset); the raw fields are what the user typed.
        server_args = resolved_view(server_args)
        self.server_args = server_args
        self.gpu_id = gpu_id
        self._target_worker = target_worker
        self._draft_worker = None  # BaseSpecWorker.draft_worker: the drafter runs here, not in a TpModelWorker
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        # The ranks that run this rank's batch: the TP group, or the attention-TP group under attention DP.
        self.tp_group = get_dp_tp_group()
        # A hybrid Gated DeltaNet target keeps a recurrent / conv state per request, committed each round.
        self.recurrent_target = mambaish_config(self.model_runner.model_config) is not None
        spec = get_spec()
        algorithm = self.model_runner.spec_algorithm.name
        self.speculative_num_draft_tokens = int(spec.speculative_num_draft_tokens)
        self.speculative_num_steps = 1
        self.topk = 1
        self.budget = budget_from_num_draft_tokens(self.speculative_num_draft_tokens)

        options = self.options = read_options(server_args)
        ckpt = load_drafter(spec.speculative_draft_model_path)
        self.draft_quantization = draft_quantization(server_args)  # "fp8": attention and MLP linears in e4m3
        # Which implementation runs every step of the round, decided once (--mfd-kernels, the device).
        self.backend = resolve_backend(options.kernels, self.device)
        self.drafting = DraftStage.for_target(ckpt, self.model_runner, fp8_linears=self.draft_quantization == "fp8",
                                              num_modes=options.num_modes, backend=self.backend)
        # With a mode gate and --mfd-num-modes K' < K: each request's K' best modes (`Arm.modes`).
        self.gated_modes = (options.num_modes if self.drafting.gated and options.num_modes is not None
                            and options.num_modes < self.drafting.num_modes else None)
        self.auto_budget = (AutoBudget(self.budget, device=self.device, paths=auto_paths(ckpt.config, options, algorithm))
                            if options.auto_budget else None)
        # MFD_D with a fixed budget: the single-mode path from this many running requests on.
        self.switch_threshold = options.switch_threshold if algorithm == "MFD_D" and not options.auto_budget else None
        self.single_mode = False  # MFD_D's current path, logged when it switches
        # On CUDA without --speculative-num-draft-tokens or --mfd-auto-budget: the budget by batch size.
        self.budget_schedule = budget_schedule(server_args, options, ckpt.config,
                                               target_text_config(self.model_runner.model_config.hf_config),
                                               budget=self.budget, algorithm=algorithm)
        self.attention_dp = attention_dp_size(server_args) > 1  # the schedule reads every DP rank's requests
        self.verify_windows = None  # the schedule's tree-verify graphs by window (GPU, CUDA graphs)
        # What each batch-size bucket can play: the draft graphs, the memory plan and the warm-up read it.
        self.playable = server_playable(server_args, options, ckpt.config, budget=self.budget, algorithm=algorithm,
                                        schedule=self.budget_schedule)
        drafting = self.drafting
        self.memory_plan = drafter_memory_plan(
            server_args, ckpt, budget=self.budget, vocab=self.model_runner.model_config.vocab_size,
            tied_embeddings=self.model_runner.model.lm_head.weight is self.model_runner.model.get_input_embeddings().weight,
            dtype_bytes=drafting.embed_weight.element_size(), num_modes=options.num_modes, playable=self.playable,
            draft_graphs=draft_graphs_captured(server_args, options.kernels, ckpt.config))  # as at launch
        logger.info("MFD memory: %s", self.memory_plan.describe(int(server_args.max_running_requests)))
        cfg = drafting.drafter.cfg
        logger.info("%s worker: drafter %s (%d layer(s), K = %d mode(s)%s, block %d, linears %s), tree budget %s, "
                    "single-mode switch at %s running requests, kernels %s (--mfd-kernels %s), drafter context %s",
                    algorithm,
                    spec.speculative_draft_model_path, cfg.num_hidden_layers, drafting.num_modes,
                    f", each request's {self.gated_modes} best by the mode gate" if self.gated_modes else "",
                    cfg.block_size,
                    "fp8 e4m3" if self.draft_quantization == "fp8" else "unquantized",
                    self.auto_budget.describe() if self.auto_budget else
                    self.budget_schedule.describe() if self.budget_schedule else self.budget,
                    "auto" if self.auto_budget else self.switch_threshold or "never", self.backend, options.kernels,
                    "read in place" if drafting.paged else "padded copy (sliding layers)")

    # --- SGLang lifecycle ---------------------------------------------------------------------
    def init_attention_backends(self):
        # Called once the target's KV pool and attention backend exist: the drafter context pool
        # mirrors its slots, and the backend must apply the tree mask.
        check_tree_verify_attention(self.model_runner.attn_backend)
        check_target_runner(self.model_runner)
        kv_pool = self.model_runner.token_to_kv_pool
        self.drafting.init_context_pool(kv_pool.size + kv_pool.page_size, self.model_runner.req_to_token_pool,
                                        device=self.device,
                                        dtype=self.model_runner.model_config.dtype,
                                        deferred_rows=DEFERRED_CONTEXT_ROWS if self.auto_budget or self.budget_schedule
                                        else 0,
                                        page_size=kv_pool.page_size)

    @property
    def primary_draft_kv_pool(self):
        """The drafter context pool as SGLang's KV pool class: under PD disaggregation SGLang registers it as
        the draft KV pool on both servers and moves a request's pages of it with the target's KV (the prompt's
        drafter context, written by the prefill server's MFD worker)."""
        pool = self.drafting.context_pool
        return None if pool is None else pool.sglang_pool

    def init_cuda_graphs(self):
        """CUDA graphs: under the automatic budget the target's tree-verify graphs at every candidate
        window, under the default schedule at each of its budgets' (SGLang captured the launch budget's), and
        draft + tree + layout of every arm each batch-size bucket can play (`budget.playable`); then the
        warm-up (`warmup.warm_up`: every kernel specialisation a round can launch) and the automatic budget's
        start-up calibration (on a CPU too, where SGLang calls this as well and nothing is captured). SGLang
        reports the server ready after this."""
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

        max_bs = int(self.server_args.max_running_requests)
        if not (self.server_args.disable_cuda_graph or check_cuda_graph_backend(Phase.DECODE, Backend.DISABLED)):
            if self.auto_budget is not None:
                self.auto_budget.capture_verify_graphs(self.model_runner)
            elif self.budget_schedule is not None:
                self.verify_windows = verify_graphs_by_width(self.model_runner, self.playable.budgets(),
                                                             "default budget schedule")
            self.drafting.capture_graphs(self.playable)
        if warmup_runs(self.options.warmup, self.device):
            warm_up(self)
        if self.auto_budget is not None:
            self.auto_budget.calibrate(max_bs,
                                       self.model_runner.req_to_token_pool.req_to_token.shape[1],
                                       draft=self.drafting.tree, verify=self.placeholder_verify)

    def placeholder_verify(self, layout, seq_lens: torch.Tensor, lens_sum: int):
        """The verify forward of layout's window for the calibration's placeholder requests."""
        verify_input = layout_verify_input(layout, seq_lens, lens_sum, self.drafting.drafter.num_draft_positions,
                                           self.backend)
        forward_batch = placeholder_verify_batch(self.model_runner, verify_input, seq_lens)
        return lambda: self.target_worker.forward_batch_generation(batch=None, forward_batch=forward_batch,
                                                                   is_verify=True)

    def clear_cache_pool(self):
        pass

    # --- one forward ----------------------------------------------------------------------------
    @torch.inference_mode()
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        # Under attention DP a rank with no request of its own gets an idle batch and still runs the target
        # forward: the MLP's DP gather spans every rank (SGLang never mixes prefill and verify rounds there).
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            if self.auto_budget is not None:
                self.auto_budget.other_forward()
            return self.forward_prefill(batch, on_publish)
        if batch.forward_mode.is_idle():
            return self.forward_idle_verify(batch, on_publish)
        return self.forward_decode(batch, on_publish, grammar_barrier)

    def forward_prefill(self, batch, on_publish):
        # is_verify: SGLang's sampler is skipped; MFD samples the first token itself (sample_first_tokens),
        # so one law and one seeded stream cover every token of a request.
        result = self.target_worker.forward_batch_generation(batch, is_verify=True,
                                                             capture_hidden_mode=CaptureHiddenMode.FULL)
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:  # the lengths are known: the scheduler may prepare the next batch
            on_publish(result.new_seq_lens)
        if batch.forward_mode.is_idle():
            result.next_token_ids = torch.empty((0,), dtype=torch.int64, device=self.device)
            result.next_draft_input = make_draft_input_v2(bonus_tokens=result.next_token_ids,
                                                          new_seq_lens=batch.seq_lens)
            return result
        result.next_token_ids, logits = sample_first_tokens(batch, result.logits_output.next_token_logits)
        if not batch.sampling_info.is_all_greedy:
            self.from_rank0(result.next_token_ids)
        first_token_outputs(batch, result.logits_output, logits, result.next_token_ids)
        self.write_prompt_context(batch, result.logits_output.hidden_states)
        result.logits_output.hidden_states = None  # keep it off the result's CPU copy
        result.next_draft_input = make_draft_input_v2(bonus_tokens=result.next_token_ids,
                                                      new_seq_lens=batch.seq_lens)
        return result

    def write_prompt_context(self, batch, hidden: torch.Tensor | None) -> None:
        """The drafter context K/V of every prompt token this prefill ran, at its KV slot."""
        if hidden is None:
            raise RuntimeError("MFD prefill got no target hidden states: the target model must support "
                               "DFlash layer capture (set_dflash_layers_to_capture).")
        # Host lists staged in pinned memory and a known output size: no host sync (overlap scheduling).
        device, num_tokens = hidden.device, hidden.shape[0]
        extend_lens = async_h2d(batch.extend_lens, dtype=torch.int64, device=device)
        prefix_lens = async_h2d(batch.prefix_lens, dtype=torch.int64, device=device)
        starts = torch.repeat_interleave(prefix_lens - (extend_lens.cumsum(0) - extend_lens), extend_lens,
                                         output_size=num_tokens)
        self.drafting.write_context(hidden, starts + torch.arange(num_tokens, device=device), batch.out_cache_loc)

    def forward_decode(self, batch, on_publish, grammar_barrier=None):
        seq_lens = batch.seq_lens
        if seq_lens.is_cuda:  # gathered on the schedule stream (overlap): keep it alive on this one
            seq_lens.record_stream(torch.cuda.current_stream(seq_lens.device))
        roots = batch.spec_info.bonus_tokens.reshape(-1).long()
        arm = self.choose_arm(len(batch.reqs), self.scheduled_batch_size(batch))
        tree, layout = self.drafting.tree(roots, seq_lens, batch.req_pool_indices, int(reserved_lens(batch).max()), arm)
        # Grammar requests: the tree goes to the host while the verify runs (SGLang's EAGLE path).
        grammar_tree = (GrammarTree.from_device(layout.retrive_next_token, layout.retrive_next_sibling,
                                                layout.draft_token) if batch.has_grammar else None)
        self.activate_window(arm.budget + 1)
        verified = verify_tree(self.target_worker, batch, layout, seq_lens, self.drafting.drafter.num_draft_positions,
                               self.backend)
        logits_output = verified.output.logits_output
        grammar_mask = None
        if grammar_tree is not None:
            grammar_mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=grammar_tree, sampling_info=batch.sampling_info,
                                                    device=logits_output.next_token_logits.device,
                                                    barrier=grammar_barrier)
        result, node_logits = accept_tree(tree, layout, logits_output.next_token_logits, batch, seq_lens, grammar_mask,
                                          backend=self.backend)
        self.from_rank0(*(getattr(result, field.name) for field in dataclasses.fields(result)))
        if self.auto_budget is not None:
            self.auto_budget.after_round(arm, result)
        result = pad_result(result, self.speculative_num_draft_tokens)
        new_seq_lens = seq_lens + result.accept_lens.to(seq_lens.dtype)
        if on_publish is not None:  # the lengths are known: the scheduler may prepare the next batch
            on_publish(new_seq_lens)
        round_outputs(batch, logits_output, node_logits, result, self.speculative_num_draft_tokens)
        self.commit_verified(verified, result, seq_lens)
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=result.accepted_tokens.clamp(min=0).reshape(-1),
            accept_lens=result.accept_lens.to(torch.int32),
            next_draft_input=make_draft_input_v2(bonus_tokens=result.bonus_tokens, new_seq_lens=new_seq_lens),
            can_run_cuda_graph=verified.output.can_run_cuda_graph,
            speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            new_seq_lens=new_seq_lens,
            routed_experts_output=verified.output.routed_experts_output,
            indexer_topk_output=verified.output.indexer_topk_output,
            extra_keep_alive_refs=[verified.forward_batch],
        )

    def forward_idle_verify(self, batch, on_publish):
        """An idle attention-DP rank's decode round: the target's verify forward over no request at the
        window width its peers verify (`idle_verify`; under the default schedule its budget for every DP
        rank's requests, which the peers read too), nothing drafted or accepted."""
        width = (self.speculative_num_draft_tokens if self.budget_schedule is None
                 else self.budget_schedule.budget(self.scheduled_batch_size(batch)) + 1)
        self.activate_window(width)
        idle_verify(self.target_worker, batch, width)
        no_tokens = torch.empty((0,), dtype=torch.int64, device=self.device)
        if on_publish is not None:
            on_publish(no_tokens)
        return GenerationBatchResult(
            logits_output=None, next_token_ids=no_tokens, accept_lens=no_tokens.to(torch.int32),
            next_draft_input=make_draft_input_v2(bonus_tokens=no_tokens, new_seq_lens=no_tokens),
            can_run_cuda_graph=False, speculative_num_draft_tokens=self.speculative_num_draft_tokens,
            new_seq_lens=no_tokens)

    # --- the round's arm --------------------------------------------------------------------------
    def choose_arm(self, bs: int, scheduled_bs: int | None = None) -> Arm:
        """The automatic budget's choice, else MFD_D's path for bs running requests (single mode from the
        threshold on) at the launch budget, or under the default schedule at its budget for scheduled_bs
        requests (`scheduled_batch_size`; bs when not given)."""
        if self.auto_budget is not None:
            return self.auto_budget.choose(bs)
        single_mode = self.switch_threshold is not None and bs >= self.switch_threshold
        if single_mode != self.single_mode:
            self.single_mode = single_mode
            logger.info("MFD_D: %d running requests, switching to the %s path", bs,
                        "single-mode" if single_mode else f"{self.gated_modes or self.drafting.num_modes}-mode")
        path = Path(single_mode, None if single_mode else self.gated_modes)
        if self.budget_schedule is not None:
            return self.budget_schedule.arm(scheduled_bs or bs, path)
        return path.at(self.budget)

    def scheduled_batch_size(self, batch) -> int:
        """The requests the default schedule reads a round's budget at: this rank's, or under attention DP
        every DP rank's together (SGLang's per-rank counts of the round, gathered before it on every rank),
        since the MLP runs them all and every rank must verify one window width."""
        counts = getattr(batch, "global_num_tokens", None)
        return sum(counts) if self.attention_dp and counts else len(batch.reqs)

    def activate_window(self, width: int) -> None:
        """The target's tree-verify graphs (and attention backend) of a window of `width` tokens per request,
        where the budget varies (the automatic budget's, the default schedule's)."""
        if self.auto_budget is not None:
            self.auto_budget.activate_window(width)
        elif self.verify_windows is not None:
            self.verify_windows.activate(width)

    # --- tensor parallelism -----------------------------------------------------------------------
    def from_rank0(self, *tensors: torch.Tensor) -> None:
        """Under tensor parallelism every rank takes rank 0's sampled tokens and accepted path (in place),
        as SGLang's EAGLE / DFLASH workers broadcast theirs: a sampled token draws random numbers, which
        agree across ranks only while every rank's generator has made the same draws. Under attention DP
        only inside the attention-TP group: the other ranks hold other batches. The tree needs no
        broadcast (`draft_stage`)."""
        if self.tp_group.world_size == 1:
            return
        for tensor in tensors:
            if tensor.is_contiguous():
                self.tp_group.broadcast(tensor, src=0)
            else:  # collectives take contiguous buffers
                tensor.copy_(self.tp_group.broadcast(tensor.contiguous(), src=0))

    # --- commit -----------------------------------------------------------------------------------
    def commit_verified(self, verified: VerifiedTree, result: TreeVerifyResult, seq_lens: torch.Tensor, *,
                        recurrent: bool = True) -> None:
        """Target KV of the accepted path to the front of the verify window (SGLang's
        `move_accept_tokens_to_target_kvcache`) and, for a hybrid target, the recurrent / conv state
        after its last node into the request's state (SGLang's `commit_mamba_states_after_verify`; the
        verify kept every node's state aside); drafter context K/V of the committed tokens (root +
        accepted nodes) into their slots, held for a batched write after a plain-decoding round. The
        stage itself is `commit_round`, shared with the round-cost harness (`mfd_sglang.round_cost`).
        recurrent=False leaves a hybrid target's state alone (the warm-up's placeholder rounds)."""
        verify_batch = verified.batch
        bs = seq_lens.shape[0]
        num_nodes = verify_batch.spec_info.draft_token_num  # the round's window: root + its tree
        allocator = self.model_runner.token_to_kv_pool_allocator

        def commit_target(path: torch.Tensor) -> None:
            # SGLang indexes the batch's flat verify window (request b's node i: b * N + i).
            base = torch.arange(bs, device=path.device)[:, None] * num_nodes
            accept_index = torch.where(path >= 0, base + path, -1)
            if self.recurrent_target and recurrent:
                commit_mamba_states_after_verify(self.target_worker, verify_batch, result.accept_lens,
                                                 accept_index, num_nodes)
            if num_nodes > 1:  # a plain-decoding round's K/V is already where it belongs
                move_accept_tokens_to_target_kvcache(verify_batch, accept_index, result.accept_lens - 1, allocator)

        pool = self.drafting.context_pool
        context = pool.deferred_for(tuple(req.rid for req in verify_batch.reqs)) if num_nodes == 1 else pool
        hidden = verified.output.logits_output.hidden_states
        commit_round(result, hidden.view(bs, num_nodes, -1), seq_lens, verify_batch.out_cache_loc.view(bs, num_nodes),
                     context, self.drafting.drafter, commit_target)
