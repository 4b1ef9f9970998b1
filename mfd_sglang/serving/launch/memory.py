"""Device memory MFD adds to an SGLang server, per part, so that the server can plan for it.

SGLang 0.5.23 already sizes its KV pool for a DFlash-family drafter's context K/V
(`resolve_dflash_draft_cell_size`: the drafter's kv heads x (head_dim + v_head_dim) x layers per
token, which is exactly what `DraftContextPool` holds per KV slot). What it does not plan for:

  drafter weights   the drafter's own tensors (it borrows the target's embeddings and head; a
                    draft vocabulary copies its rows of the head once; under tensor parallelism
                    every rank holds a gathered full copy of the embeddings, and of the head when
                    it is not tied (sharded over the attention-TP group under attention DP), beside the target's own vocabulary shards); with
                    --speculative-draft-model-quantization fp8 the attention and MLP linears hold one
                    byte per weight and a float32 scale per output channel (`drafter_weight_bytes`);
  draft working set one draft + tree round at batch bs (what the draft CUDA graph of that batch
                    size keeps in its pool): the largest of the drafter layers' activations, the
                    vocabulary scoring of one chunk (`mfd_sglang.drafter.vocab_candidates`; on CUDA
                    its Triton kernel's scratch, when larger) and the tree's per-mode beams, plus the
                    hidden states and candidates that live across them;
  verify working set the float32 target logits of the B + 1 verified tokens per request that the
                    accept step reads ([bs * N, V]; a copy when the target returns lower precision),
                    plus the per-node sampling work at T > 0 (`SAMPLING_BYTES_PER_ENTRY` per logit);
  draft graphs      on CUDA, what each captured draft graph keeps between replays: its static inputs and
                    its outputs (the tree and its layout; `draft_graph_buffer_bytes`), summed over the graphs;
  verify graphs     where a round's budget varies (the automatic budget, the default schedule on CUDA)
                    with CUDA graphs, the attention backends of its windows other than the launch one
                    (`VerifyGraphPlan`).

`MemoryPlan.extra_bytes(bs)` is their sum at batch bs: an upper bound of what the plugin allocates
outside SGLang's plan. The working sets are those of the largest round the server plays
(`budget.playable.Playable`, `MemoryPlan.rounds`: every arm of every batch-size bucket at the bucket's size,
which is what the draft graphs are captured for; under the default schedule the tree shrinks as the batch
grows, so the largest round is far below bs requests at B). The graphs share one memory pool, which holds
the largest of their working sets; what each keeps between replays is counted per graph. Held
against measured allocations by `benchmarks/draft_memory.py` (the draft) and `benchmarks/verify_memory.py`
(the verify) and their tests. At launch (`launch.plan_launch_memory`, `reserve_in_mem_fraction`) it is taken
out of SGLang's default `--mem-fraction-static` for `--max-running-requests`, so the KV pool leaves room for
it; a fraction the user set is left alone and a warning says what MFD needs.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from mfd_sglang.checkpoint import DrafterConfig
from mfd_sglang.drafter import VOCAB_CHUNK, fp8_linear_shapes
from mfd_sglang.kernels.params import VOCAB_SPLITS, VOCAB_TILE, pow2

logger = logging.getLogger(__name__)

FLOAT32, INT64 = 4, 8
# Per scored vocabulary entry of a draft row: the matmul output (drafter dtype), its float32 copy,
# float32 temporaries of the normaliser, and the int64 ranking keys of the chunk and of its merge
# with the running best (5 x 8 bytes: bits, shifted key, key, merged keys, top-k scratch).
SCORING_BYTES_PER_ENTRY = FLOAT32 * 2 + INT64 * 4
# Per (mode, beam slot, candidate) of the tree's beams: the float32 path score, its ranking and the
# int64 flat index.
TREE_BYTES_PER_ENTRY = FLOAT32 * 2 + INT64 * 2
FP8 = 1


def drafter_weight_bytes(cfg: DrafterConfig, weight_elements: int, dtype_bytes: int,
                         draft_quantization: str | None = None) -> int:
    """Bytes of a drafter's own weights (`weight_elements` of them, all in a dtype of `dtype_bytes`
    unquantized); "fp8": its attention and MLP linears (`fp8_linear_shapes`) at one byte per weight plus
    a float32 scale per output channel, the rest unchanged."""
    if draft_quantization != "fp8":
        return weight_elements * dtype_bytes
    shapes = fp8_linear_shapes(cfg)
    quantized = sum(out * inp for out, inp in shapes)
    return (weight_elements - quantized) * dtype_bytes + quantized * FP8 + sum(out for out, _ in shapes) * FLOAT32
# Per verify logit at T > 0, what `verify.plain_law` holds at once over the fully sorted vocabulary (no
# top-k bound): the softmax, its sorted copy and int64 sort indices, the mass before each token, the kept
# mask (bool), the kept probabilities and the weights they are scattered into.
SAMPLING_BYTES_PER_ENTRY = FLOAT32 * 5 + INT64 + 1
# Per verified node at T > 0: its position, coin, inversion target and token (int64 at most each).
SAMPLING_BYTES_PER_NODE = INT64 * 4


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes: int  # drafter weights in the serving dtype
    context_bytes_per_token: int  # DraftContextPool per KV slot (SGLang plans this one)
    hidden: int
    intermediate: int
    attention_width: int  # (q + k + v + o) projection widths, summed
    num_modes: int
    block: int  # block size T (root + D drafted positions)
    budget: int  # tree nodes B
    vocab: int  # the target's vocabulary (verify logits)
    draft_vocab: int  # the drafter's scored vocabulary
    dtype_bytes: int
    vocab_chunk: int = VOCAB_CHUNK
    verify_graph_bytes: int = 0  # VerifyGraphPlan.total_bytes(), independent of the running batch
    # FP8 drafting: per block row, an FP8 linear's input quantized (a float32 copy and the e4m3 values)
    # and its float32 product (the unit-scale path), at the widest quantized linear; 0 unquantized
    fp8_bytes_per_row: int = 0
    # The rounds the server plays (`budget.playable.Playable.rounds`): (batch size, budget, modes) of every arm
    # of every batch-size bucket, at the bucket's size (a draft graph pads its batch to it); empty: every round
    # drafts `num_modes` modes at `budget`.
    rounds: tuple[tuple[int, int, int], ...] = ()
    # The draft graphs' static inputs and outputs (tree and layout), which stay allocated per captured graph
    # (`draft_graph_bytes`, summed over the captured rounds); 0 without draft CUDA graphs.
    draft_graph_bytes: int = 0

    def draft_bytes(self, bs: int) -> int:
        """Upper bound of one draft + tree round's allocations at batch bs (none at budget 0: no draft)."""
        if self.budget == 0:
            return 0
        block_rows, draft_rows = bs * self.num_modes * self.block, bs * self.num_modes * (self.block - 1)
        count = min(self.budget, self.draft_vocab)
        chunk = min(self.vocab_chunk, self.draft_vocab)
        layer = block_rows * ((3 * self.intermediate + self.attention_width + 2 * self.hidden) * self.dtype_bytes
                              + self.fp8_bytes_per_row)
        # The torch chunk's logits and keys, or the Triton kernel's scratch (its splits' keys, max and sum).
        keys = pow2(count)
        splits = min(VOCAB_SPLITS, -(-self.draft_vocab // VOCAB_TILE))
        scoring = draft_rows * max(chunk * (self.dtype_bytes + SCORING_BYTES_PER_ENTRY),
                                   splits * (INT64 * keys + 2 * FLOAT32))
        tree = bs * self.num_modes * self.budget * count * TREE_BYTES_PER_ENTRY
        resident = 2 * block_rows * self.hidden * self.dtype_bytes + draft_rows * count * (FLOAT32 + 2 * INT64)
        return resident + max(layer, scoring, tree)

    def verify_bytes(self, bs: int) -> int:
        """The float32 verify logits [bs * (B + 1), V] the accept step reads and, at T > 0, the per-node
        sampling work on them: `SAMPLING_BYTES_PER_ENTRY` per logit, `SAMPLING_BYTES_PER_NODE` per node
        and the vocabulary's int64 ranks."""
        nodes = bs * (self.budget + 1)
        return (nodes * self.vocab * (FLOAT32 + SAMPLING_BYTES_PER_ENTRY) + nodes * SAMPLING_BYTES_PER_NODE
                + INT64 * self.vocab)

    def round_plans(self, bs: int) -> list[tuple[int, "MemoryPlan"]]:
        """(n, the plan of a round of n requests at a fixed budget) of every round of at most bs requests the
        server plays: bs's own without `rounds`, else the rounds of the buckets up to the one of bs requests."""
        if not self.rounds:
            return [(bs, self)]
        sizes = sorted({n for n, _, _ in self.rounds})
        bucket = next((n for n in sizes if n >= bs), sizes[-1])
        return [(n, replace(self, budget=budget, num_modes=modes, rounds=(), draft_graph_bytes=0))
                for n, budget, modes in self.rounds if n <= bucket]

    def largest_draft(self, bs: int) -> tuple[int, "MemoryPlan"]:
        """The round (`round_plans`) of the largest draft + tree working set: the draft graphs share one memory
        pool, which keeps the largest graph's working set for the server's life."""
        return max(self.round_plans(bs), key=lambda plan: plan[1].draft_bytes(plan[0]))

    def largest_verify(self, bs: int) -> tuple[int, "MemoryPlan"]:
        """The round of the largest verify working set (it comes on top of the draft graphs' pool)."""
        return max(self.round_plans(bs), key=lambda plan: plan[1].verify_bytes(plan[0]))

    def parts(self, bs: int) -> dict[str, int]:
        """The plan's bytes by part with bs requests running; they sum to `extra_bytes(bs)`."""
        (n_draft, draft), (n_verify, verify) = self.largest_draft(bs), self.largest_verify(bs)
        return {"drafter weights": self.weight_bytes, "draft + tree": draft.draft_bytes(n_draft),
                "verify logits": verify.verify_bytes(n_verify), "draft graphs' buffers": self.draft_graph_bytes,
                "verify graphs of the other windows": self.verify_graph_bytes}

    def extra_bytes(self, bs: int) -> int:
        """Everything MFD allocates outside SGLang's plan with bs requests running."""
        return sum(self.parts(bs).values())

    def describe(self, bs: int) -> str:
        mib = 2**20
        fp8 = " (attention and MLP linears in FP8)" if self.fp8_bytes_per_row else ""
        parts = ", ".join(f"{name} {size / mib:.0f} MiB{fp8 if name == 'drafter weights' else ''}"
                          for name, size in self.parts(bs).items() if size or "graphs" not in name)
        if self.rounds:
            (n_draft, draft), (n_verify, verify) = self.largest_draft(bs), self.largest_verify(bs)
            at = (f"the largest rounds of at most {bs} requests: draft {n_draft} at budget {draft.budget}, "
                  f"verify {n_verify} at budget {verify.budget}")
        else:
            at = f"{bs} requests at budget {self.budget}"
        return (f"{parts} (at {at}; outside SGLang's plan: {self.extra_bytes(bs) / 2**30:.2f} GiB); drafter context "
                f"{self.context_bytes_per_token} B per KV slot (inside SGLang's KV plan)")


def draft_graph_buffer_bytes(bs: int, budget: int) -> int:
    """What one draft graph of bs requests at `budget` keeps allocated between replays (`cuda_graph.BatchGraphs`):
    its static inputs and their pad copies (roots, lengths, request slots: int64) and its outputs, the tree
    (tokens, parents, depths, modes: int64; scores: float32; valid: bool, per node) and its verify layout
    (five int64 fields per window token and the window's ancestor mask, bool)."""
    nodes, window = budget, budget + 1
    return bs * (2 * 3 * INT64 + nodes * (4 * INT64 + FLOAT32 + 1) + window * 5 * INT64 + window * window)


# flashinfer allocates an 8 MiB int workspace on the device in every wrapper's __init__; SGLang's
# FlashInfer backend makes one prefill wrapper per captured batch size (and wrapper kind) for the
# tree verify.
FLASHINFER_WRAPPER_INT_WORKSPACE = 8 * 2**20
# SGLang 0.5.23 raises the FlashInfer workspace to 512 MiB for Qwen2 / Qwen3-family targets, to 2 GiB
# under deterministic inference (`FlashInferAttnBackend.__init__`).
FLASHINFER_QWEN_WORKSPACE, FLASHINFER_DETERMINISTIC_WORKSPACE = 512 * 2**20, 2048 * 2**20
# Per backend and width: index pointers, Triton's lean-decode partials, split counts (< 2 MiB for a
# 132-SM device and 256 requests).
SMALL_GRAPH_STATE = 8 * 2**20


@dataclass(frozen=True)
class VerifyGraphPlan:
    """Device memory of the extra tree-verify windows of a varying budget (`serving/verify_graph.py`):
    for each window width other than the launch one, attention backends of their own and their
    CUDA-graph state, as SGLang 0.5.23 allocates them (the launch width's state SGLang plans itself).
    A graph token is one of (largest captured batch) x width; per backend and width:

      flashinfer  a new float workspace (`init_new_workspace`), the KV indices (int32) and the custom
                  mask (uint8) per graph token and context position (`init_cuda_graph_state`), one
                  prefill wrapper per captured batch size and wrapper kind;
      triton      the KV indices (int64) per graph token and context position, the tree mask (uint8,
                  FULL_MASK: per graph token x (context + width)), the split-KV partial outputs and
                  log-sum-exps (float32 per graph token x head x split x (head_dim + 1)).

    Plus `SMALL_GRAPH_STATE` each. The graphs' activations come from SGLang's graph memory pool, which
    the launch width (the largest) sized first, so they are not counted again."""

    backends: tuple[str, ...]  # the distinct attention backends a verify runs on (hybrid: two)
    capture_bs: tuple[int, ...]
    context_len: int
    heads: int  # query heads per rank
    head_dim: int
    kv_splits: int  # Triton's split-KV count
    workspace_bytes: int  # FlashInfer's float workspace
    wrapper_kinds: int  # FlashInfer's wrappers per batch size (2 with a sliding window)
    widths: tuple[int, ...]

    def width_bytes(self, width: int) -> int:
        tokens = max(self.capture_bs) * width
        total = 0
        for backend in self.backends:
            if backend == "flashinfer":
                total += (self.workspace_bytes + tokens * self.context_len * 5
                          + len(self.capture_bs) * self.wrapper_kinds * FLASHINFER_WRAPPER_INT_WORKSPACE)
            else:
                total += (tokens * self.context_len * INT64 + tokens * (self.context_len + width)
                          + tokens * self.heads * self.kv_splits * (self.head_dim + 1) * FLOAT32)
            total += SMALL_GRAPH_STATE
        return total

    def total_bytes(self) -> int:
        return sum(self.width_bytes(width) for width in self.widths)


def verify_graph_plan(server_args, budget: int, budgets: tuple[int, ...] | None = None) -> VerifyGraphPlan | None:
    """The plan of the extra verify windows for a GPU server whose rounds verify the windows of `budgets`
    (default: the automatic budget's candidates up to the launch budget) (SGLang's resolved arguments and the
    target's ModelConfig); None without CUDA graphs."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.environ import envs
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from mfd_sglang.serving.budget.rule import candidate_budgets

    if server_args.disable_cuda_graph:
        return None
    decode_graphs = server_args.cuda_graph_config.decode
    if decode_graphs.backend == Backend.DISABLED:
        return None
    max_requests = int(server_args.max_running_requests)
    capture_bs = sorted({bs for bs in decode_graphs.bs if bs <= max_requests}
                        | ({max_requests} if max(decode_graphs.bs) > max_requests else set()))
    model = model_config_of(server_args)
    text = model.hf_text_config
    deterministic = bool(server_args.enable_deterministic_inference)
    tile = 256 if deterministic else server_args.triton_attention_split_tile_size
    backends = {server_args.attention_backend, server_args.decode_attention_backend,
                server_args.prefill_attention_backend} - {None}
    return VerifyGraphPlan(
        backends=tuple(sorted(backends)), capture_bs=tuple(capture_bs), context_len=int(model.context_len),
        heads=math.ceil(model.get_max_num_attention_heads() / int(server_args.tp_size or 1)),
        head_dim=int(model.head_dim),
        kv_splits=math.ceil(model.context_len / tile) if tile else int(server_args.triton_attention_num_kv_splits),
        workspace_bytes=(FLASHINFER_DETERMINISTIC_WORKSPACE if deterministic
                         else max(envs.SGLANG_FLASHINFER_WORKSPACE_SIZE.get(), FLASHINFER_QWEN_WORKSPACE)),
        wrapper_kinds=2 if (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True))
        or model.is_encoder_decoder else 1,
        widths=tuple(b + 1 for b in (candidate_budgets(budget) if budgets is None else budgets) if b != budget))


def memory_plan(cfg: DrafterConfig, weight_elements: int, *, dtype_bytes: int, budget: int, vocab: int,
                num_modes: int | None = None, tp_size: int = 1, tied_embeddings: bool = True,
                verify_graph_bytes: int = 0, draft_quantization: str | None = None) -> MemoryPlan:
    """The plan, per rank, of a drafter (its config and number of floating-point weight elements, from
    `checkpoint.weights`) served in a dtype of `dtype_bytes` with tree budget B over a target
    vocabulary of `vocab`, on `tp_size` tensor-parallel ranks; draft_quantization: `options.draft_quantization`."""
    draft_vocab = cfg.draft_vocab_size or vocab
    head_copy = draft_vocab * cfg.hidden_size if cfg.draft_vocab_size else 0
    if tp_size > 1:  # the gathered embeddings (and head) of the worker
        head_copy += vocab * cfg.hidden_size * (1 if tied_embeddings else 2)
    q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes = fp8_linear_shapes(cfg) if draft_quantization == "fp8" else []
    return MemoryPlan(
        weight_bytes=drafter_weight_bytes(cfg, weight_elements, dtype_bytes, draft_quantization)
        + head_copy * dtype_bytes,
        context_bytes_per_token=2 * cfg.num_hidden_layers * kv_width * dtype_bytes,
        hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        attention_width=2 * q_width + 2 * kv_width,
        num_modes=num_modes or cfg.num_modes, block=cfg.block_size, budget=budget, vocab=vocab,
        draft_vocab=draft_vocab, dtype_bytes=dtype_bytes, verify_graph_bytes=verify_graph_bytes,
        fp8_bytes_per_row=max((inp * (FLOAT32 + FP8) + out * FLOAT32 for out, inp in shapes), default=0))


def reserve_in_mem_fraction(server_args, plan: MemoryPlan, gpu_mem_mib: float | None, user_set: bool) -> None:
    """Take the plan's extra memory at --max-running-requests out of SGLang's default
    --mem-fraction-static (SGLang sizes the KV pool from it); warn when the user set the fraction."""
    max_bs = int(server_args.max_running_requests)
    extra_mib = plan.extra_bytes(max_bs) / 2**20
    if not gpu_mem_mib or server_args.mem_fraction_static is None:
        return
    if user_set:
        logger.warning("MFD needs about %.0f MiB outside the KV pool at %d running requests (%s); "
                       "--mem-fraction-static %.3f leaves %.0f MiB of %.0f for it and SGLang's own activations.",
                       extra_mib, max_bs, plan.describe(max_bs), server_args.mem_fraction_static,
                       gpu_mem_mib * (1 - server_args.mem_fraction_static), gpu_mem_mib)
        return
    lowered = round(float(server_args.mem_fraction_static) - extra_mib / gpu_mem_mib, 3)
    if lowered <= 0.05:
        raise ValueError(f"MFD needs about {extra_mib:.0f} MiB outside the KV pool at {max_bs} running "
                         f"requests ({plan.describe(max_bs)}), more than this device's {gpu_mem_mib:.0f} MiB "
                         "allow; lower --max-running-requests or --speculative-num-draft-tokens.")
    logger.info("MFD: --mem-fraction-static %.3f -> %.3f to leave %.0f MiB for %s", server_args.mem_fraction_static,
                lowered, extra_mib, plan.describe(max_bs))
    server_args.mem_fraction_static = lowered


def drafter_memory_plan(server_args, ckpt, *, budget: int, vocab: int, tied_embeddings: bool, dtype_bytes: int,
                        num_modes: int | None, playable, draft_graphs: bool) -> MemoryPlan:
    """The plan of the drafter checkpoint `ckpt` served by `server_args` with tree budget B over a target
    vocabulary of `vocab`, as the launch reserves it and the worker logs it; playable: what each batch-size
    bucket plays (`budget.playable.Playable`), whose rounds size the working sets and, where the budget
    varies, whose windows get tree-verify graphs beside the launch one's; draft_graphs: whether the draft
    stage captures CUDA graphs of its (bucket, arm) pairs (`DraftStage.captures_graphs`)."""
    from mfd_sglang.serving.launch.options import attention_dp_size, draft_quantization

    verify_budgets = playable.budgets()
    graphs = verify_graph_plan(server_args, budget, verify_budgets) if verify_budgets != (budget,) else None
    # The vocabulary is sharded over the ranks that run one batch: the attention-TP group under attention DP.
    vocab_shards = int(server_args.tp_size or 1) // attention_dp_size(server_args)
    weights = sum(t.numel() for t in ckpt.weights.values() if t.is_floating_point())  # as at launch
    plan = memory_plan(ckpt.config, weights, dtype_bytes=dtype_bytes, budget=budget, vocab=vocab,
                       num_modes=num_modes, tp_size=vocab_shards, tied_embeddings=tied_embeddings,
                       verify_graph_bytes=graphs.total_bytes() if graphs else 0,
                       draft_quantization=draft_quantization(server_args))
    return replace(plan, rounds=playable.rounds(plan.num_modes),
                   draft_graph_bytes=sum(draft_graph_buffer_bytes(bs, arm.budget) for bs, arm in playable.pairs())
                   if draft_graphs else 0)
