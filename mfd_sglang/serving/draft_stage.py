"""The draft + tree stage of a round inside SGLang 0.5.23: the drafter, its context pool and its graphs.

`DraftStage.tree(roots, seq_lens, req_pool_indices, max_len, arm)` drafts the block `[root, MASK...]`
of every request for the arm's path (K modes, each request's K' best modes under the mode gate, or
MFD_D's single mode), keeps each position's B best
tokens (`MFDDrafter.block_candidates`: no [bs, K, D, V] tensor), builds the mixture tree of B nodes
(`build_mixture_tree`) and lays it out for SGLang's tree verify (`tree_to_verify_layout`). Budget 0 is plain
decoding: no draft, the root alone.

Every step runs on the stage's `backend` (`mfd_sglang.backend`: resolved once per worker from
--mfd-kernels and the device), which the drafter holds too (`MFDDrafter.join_projections`): "triton" (the
fused lm_head + top-B, `kernels/draft_vocab.py`; the tree kernel; the layout walk; the mode attention;
the drafter's fused steps) or "torch" (the references: vocabulary in chunks, and so on).

The drafter reads the committed context from `DraftContextPool` at the target's KV slots: in place
(`paged`, the mode attention), or for drafters with sliding-window layers copied into a padded
`DraftContext` (`gather`). On CUDA the in-place path has fixed shapes and replays as one CUDA graph per
batch-size bucket and arm (`capture_graphs`).

The drafter borrows the target's embeddings and head (rows past the vocabulary are padding); with a draft
vocabulary its rows of the head are copied once (`MFDDrafter.head_weight`). Under tensor parallelism both
are vocabulary shards; the drafter runs whole on every rank and needs every row, so they are gathered
once at start (one full copy per rank, counted in the memory plan) rather than a per-shard top-B and an
all-gather every round. Every rank then drafts the same tree from the same all-reduced hidden states
with the same deterministic kernels (SGLang's DFLASH draft relies on the same): no broadcast needed.
Under attention data parallelism the embeddings and (with --enable-dp-lm-head) the head are sharded over
the attention-TP group, the ranks that run one batch, and are gathered there (`full_rows`).
"""

from __future__ import annotations

import logging
import time

import torch

from mfd_sglang.checkpoint import DrafterCheckpoint
from mfd_sglang.cuda_graph import BatchGraphs
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.tree import DraftCandidates, DraftTree, build_mixture_tree, empty_tree
from mfd_sglang.tree_layout import VerifyLayout, tree_to_verify_layout

from mfd_sglang.serving.budget.playable import Playable
from mfd_sglang.serving.budget.rule import Arm
from mfd_sglang.serving.draft_context_pool import DraftContextPool

logger = logging.getLogger(__name__)


class DraftStage:
    def __init__(self, drafter: MFDDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor, *, backend: str):
        # Its joined products read the weights in place; its own steps run on the stage's backend.
        self.drafter = drafter.join_projections(backend)
        self.backend = backend
        self.embed_weight, self.head_weight = embed_weight, head_weight
        # Sliding-window layers need the padded copy of the context; every other drafter reads it in place.
        self.paged = not any(drafter.cfg.is_sliding(i) for i in range(drafter.cfg.num_hidden_layers))
        self.context_pool: DraftContextPool | None = None  # once the target's KV pool exists
        self.req_to_token_pool = None  # SGLang's (request slot -> KV slot of each position), with it
        self.graphs: BatchGraphs | None = None

    @classmethod
    def for_target(cls, ckpt: DrafterCheckpoint, model_runner, *, fp8_linears: bool,
                   num_modes: int | None, backend: str) -> "DraftStage":
        """The stage of drafter checkpoint `ckpt` on the target of `model_runner` (without a mode gate its
        first `num_modes` modes when set; with one, every mode stays: rounds choose theirs per request,
        `Arm.modes`; fp8_linears: attention and MLP linears in e4m3; backend: `mfd_sglang.backend`'s)."""
        device = model_runner.device
        drafter = MFDDrafter.from_checkpoint(ckpt, dtype=model_runner.model_config.dtype,
                                             fp8_linears=fp8_linears).to(device)
        if num_modes is not None and drafter.mode_prior is None:
            drafter.mode_embed.data = drafter.mode_embed.data[:num_modes]
        target, vocab = model_runner.model, model_runner.model_config.vocab_size
        embed_module = target.get_input_embeddings()
        embed = full_rows(embed_module)
        head = embed if target.lm_head.weight is embed_module.weight else full_rows(target.lm_head)
        return cls(drafter, embed[:vocab], drafter.head_weight(head[:vocab]), backend=backend)

    @property
    def num_modes(self) -> int:
        return self.drafter.mode_embed.shape[0]

    @property
    def gated(self) -> bool:
        """Whether the drafter has a mode gate (`MFDDrafter.gate_modes`: K' < K modes per request)."""
        return self.drafter.mode_prior is not None

    def init_context_pool(self, num_slots: int, req_to_token_pool, *, device, dtype: torch.dtype,
                          deferred_rows: int = 0, page_size: int = 0) -> None:
        """The drafter's context K/V at every one of the target's `num_slots` KV slots, which
        req_to_token_pool maps requests' positions to (deferred_rows, page_size: see `DraftContextPool`). The
        pool is also registered on req_to_token_pool, where the retraction-backup hooks find it
        (`mfd_sglang/patches/retraction_backup.py`)."""
        self.req_to_token_pool = req_to_token_pool
        self.context_pool = DraftContextPool(self.drafter, num_slots, device=device, dtype=dtype,
                                             deferred_rows=deferred_rows, page_size=page_size)
        req_to_token_pool.mfd_context_pool = self.context_pool

    def write_context(self, target_hidden: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Context K/V of tokens with target hidden states [T, F] at positions [T] into slots [T]."""
        self.context_pool.write(self.drafter, target_hidden, positions, slots)

    def capture_graphs(self, playable: Playable) -> None:
        """CUDA graphs of draft + tree + layout of each drafted arm of each batch-size bucket (`playable.pairs()`,
        what the memory plan counts), on the "triton" backend with the in-place context: only that path has
        fixed shapes and no host sync (the torch references size their tensors from the data; drafters with
        sliding-window layers need the padded copy), so the others draft eagerly (`draft_graphs_captured`)."""
        if not (self.paged and self.backend == "triton"):
            return
        device = self.embed_weight.device

        def example_inputs(bs: int):  # also the pad rows: token 0, empty context, request slot 0
            return [torch.zeros(bs, dtype=torch.int64, device=device) for _ in range(3)]

        start = time.perf_counter()
        self.graphs = BatchGraphs(self.paged_tree, example_inputs, playable.buckets, use_graph=True)
        with torch.inference_mode():
            self.graphs.capture_pairs(playable.pairs())
        logger.info("MFD: draft + tree + layout CUDA graphs captured in %.1f s: %d graphs over batch sizes %s (%s)",
                    time.perf_counter() - start, len(playable.pairs()), list(playable.buckets), playable.describe())

    def tree(self, roots: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, max_len: int,
             arm: Arm) -> tuple[DraftTree, VerifyLayout]:
        """draft + tree + layout of arm: a CUDA-graph replay when captured for this batch size, else eager
        (max_len: a host-side upper bound of seq_lens, the padded copy's width)."""
        if arm.budget == 0:
            return self.with_layout(empty_tree(roots.shape[0], roots.device), roots, seq_lens)
        self.context_pool.flush()  # a graph replay reads the pool's tensors directly
        if self.graphs is not None and self.graphs.has(seq_lens.shape[0], arm):
            return self.graphs(roots, seq_lens, req_pool_indices, key=arm)
        if self.paged:
            return self.paged_tree(roots, seq_lens, req_pool_indices, key=arm)
        slots = self.req_to_token_pool.req_to_token[req_pool_indices.long()][:, :max_len].long()
        context = self.context_pool.gather(slots, seq_lens)
        return self.tree_of(self.candidates(roots, seq_lens, context, arm), roots, seq_lens, arm.budget)

    def paged_tree(self, roots: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor, *,
                   key: Arm) -> tuple[DraftTree, VerifyLayout]:
        """draft + tree + layout over the context read in place: fixed shapes, what the CUDA graphs replay
        (key: the arm, as `BatchGraphs` keys its graphs)."""
        candidates = self.paged_candidates(roots, seq_lens, req_pool_indices, key)
        return self.tree_of(candidates, roots, seq_lens, key.budget)

    def paged_candidates(self, roots: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
                         arm: Arm) -> DraftCandidates:
        """`paged_tree`'s draft alone: the candidates over the context read in place."""
        context = self.context_pool.paged(self.req_to_token_pool.req_to_token, req_pool_indices, seq_lens,
                                          self.backend)
        return self.candidates(roots, seq_lens, context, arm)

    def candidates(self, roots: torch.Tensor, seq_lens: torch.Tensor, context, arm: Arm) -> DraftCandidates:
        """The drafter's `arm.budget` best tokens per (mode, position) of the blocks `[root, MASK...]` at
        positions seq_lens.., with their log-probs: all the tree reads. An arm of `modes` modes first
        lets the gate choose each request's (`MFDDrafter.gate_modes`, a root-only pass)."""
        modes = None if arm.modes is None else self.drafter.gate_modes(roots, seq_lens, context,
                                                                       self.embed_weight, arm.modes)
        return self.drafter.block_candidates(roots, seq_lens, context, self.embed_weight, self.head_weight,
                                             arm.budget, single_mode=arm.single_mode, modes=modes,
                                             backend=self.backend)

    def tree_of(self, candidates: DraftCandidates, roots: torch.Tensor, seq_lens: torch.Tensor,
                budget: int) -> tuple[DraftTree, VerifyLayout]:
        """The mixture tree (target token ids) of the candidates and its verify layout (fixed shapes)."""
        tree = build_mixture_tree(candidates, budget, backend=self.backend)
        tree.tokens = self.drafter.to_target_ids(tree.tokens)
        return self.with_layout(tree, roots, seq_lens)

    def with_layout(self, tree: DraftTree, roots: torch.Tensor, seq_lens: torch.Tensor) -> tuple[DraftTree, VerifyLayout]:
        """(tree, its SGLang verify layout under `roots` at positions seq_lens)."""
        return tree, tree_to_verify_layout(tree, roots, seq_lens, self.backend)


def draft_graphs_captured(server_args, kernels: str, cfg) -> bool:
    """Whether a server's draft stage captures CUDA graphs (`DraftStage.capture_graphs`): CUDA graphs on, the
    "triton" backend (--mfd-kernels `kernels` on the server's device) and the context read in place (no
    sliding-window layer in drafter config `cfg`). The launch's memory plan and the worker read it."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from mfd_sglang.backend import resolve_backend

    if resolve_backend(kernels, server_args.device) != "triton" or any(cfg.is_sliding(i)
                                                                        for i in range(cfg.num_hidden_layers)):
        return False
    return not (server_args.disable_cuda_graph or server_args.cuda_graph_config.decode.backend == Backend.DISABLED)


def full_rows(module) -> torch.Tensor:
    """The whole vocabulary's rows of an SGLang embedding or head, gathered on the module's own group when
    it is sharded: the TP group, or the attention-TP group under attention DP (a padded vocabulary's
    padding rows come last: shards are consecutive ranges of it)."""
    if getattr(module, "tp_size", 1) > 1:
        return module.tp_group.all_gather(module.weight, dim=0)
    return module.weight
