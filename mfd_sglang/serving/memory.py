"""Device memory MFD adds to an SGLang server, per part, so that the server can plan for it.

SGLang 0.5.23 already sizes its KV pool for a DFlash-family drafter's context K/V
(`resolve_dflash_draft_cell_size`: the drafter's kv heads x (head_dim + v_head_dim) x layers per
token, which is exactly what `DraftContextPool` holds per KV slot). What it does not plan for:

  drafter weights   the drafter's own tensors (it borrows the target's embeddings and head; a
                    draft vocabulary copies its rows of the head once; under tensor parallelism
                    every rank holds a gathered full copy of the embeddings, and of the head when
                    it is not tied, beside the target's own vocabulary shards);
  draft working set one draft + tree round at batch bs (what the draft CUDA graph of that batch
                    size keeps in its pool): the largest of the drafter layers' activations, the
                    vocabulary scoring of one chunk (`mfd_sglang.drafter.vocab_candidates`) and the
                    tree's per-mode beams, plus the hidden states and candidates that live across them;
  verify working set the float32 target logits of the B + 1 verified tokens per request that the
                    accept step reads (one [bs * N, V] copy, made when the target returns lower
                    precision), plus the per-node sampling work at T > 0.

`MemoryPlan.extra_bytes(bs)` is their sum at batch bs: an upper bound of what the plugin allocates
outside SGLang's plan, held against measured allocations by `benchmarks/draft_memory.py` and its test.
At launch (`reserve_in_mem_fraction`) it is taken out of SGLang's default `--mem-fraction-static` for
`--max-running-requests`, so the KV pool leaves room for it; a fraction the user set is left alone
and a warning says what MFD needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mfd_sglang.checkpoint import DrafterConfig
from mfd_sglang.drafter import VOCAB_CHUNK

logger = logging.getLogger(__name__)

FLOAT32, INT64 = 4, 8
# Per scored vocabulary entry of a draft row: the matmul output (drafter dtype), its float32 copy,
# float32 temporaries of the normaliser, and the int64 ranking keys of the chunk and of its merge
# with the running best (5 x 8 bytes: bits, shifted key, key, merged keys, top-k scratch).
SCORING_BYTES_PER_ENTRY = FLOAT32 * 2 + INT64 * 4
# Per (mode, beam slot, candidate) of the tree's beams: the float32 path score, its ranking and the
# int64 flat index.
TREE_BYTES_PER_ENTRY = FLOAT32 * 2 + INT64 * 2


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

    def draft_bytes(self, bs: int) -> int:
        """Upper bound of one draft + tree round's allocations at batch bs."""
        block_rows, draft_rows = bs * self.num_modes * self.block, bs * self.num_modes * (self.block - 1)
        count = min(self.budget, self.draft_vocab)
        chunk = min(self.vocab_chunk, self.draft_vocab)
        layer = block_rows * (3 * self.intermediate + self.attention_width + 2 * self.hidden) * self.dtype_bytes
        scoring = draft_rows * chunk * (self.dtype_bytes + SCORING_BYTES_PER_ENTRY)
        tree = bs * self.num_modes * self.budget * count * TREE_BYTES_PER_ENTRY
        resident = 2 * block_rows * self.hidden * self.dtype_bytes + draft_rows * count * (FLOAT32 + 2 * INT64)
        return resident + max(layer, scoring, tree)

    def verify_bytes(self, bs: int) -> int:
        """The accept step's float32 copy of the verify logits [bs * (B + 1), V] and as much again
        for the T > 0 per-node sampling work."""
        return 2 * bs * (self.budget + 1) * self.vocab * FLOAT32

    def extra_bytes(self, bs: int) -> int:
        """Everything MFD allocates outside SGLang's plan with bs requests running."""
        return self.weight_bytes + self.draft_bytes(bs) + self.verify_bytes(bs)

    def describe(self, bs: int) -> str:
        mib = 2**20
        return (f"drafter weights {self.weight_bytes / mib:.0f} MiB, draft + tree at {bs} requests "
                f"{self.draft_bytes(bs) / mib:.0f} MiB, verify logits {self.verify_bytes(bs) / mib:.0f} MiB "
                f"(outside SGLang's plan: {self.extra_bytes(bs) / mib:.0f} MiB); drafter context "
                f"{self.context_bytes_per_token} B per KV slot (inside SGLang's KV plan)")


def memory_plan(cfg: DrafterConfig, weight_elements: int, *, dtype_bytes: int, budget: int, vocab: int,
                num_modes: int | None = None, tp_size: int = 1, tied_embeddings: bool = True) -> MemoryPlan:
    """The plan, per rank, of a drafter (its config and number of weight elements, `checkpoint.weights`
    or the module's parameters) served in a dtype of `dtype_bytes` with tree budget B over a target
    vocabulary of `vocab`, on `tp_size` tensor-parallel ranks."""
    draft_vocab = cfg.draft_vocab_size or vocab
    head_copy = draft_vocab * cfg.hidden_size if cfg.draft_vocab_size else 0
    if tp_size > 1:  # the gathered embeddings (and head) of the worker
        head_copy += vocab * cfg.hidden_size * (1 if tied_embeddings else 2)
    q_width, kv_width = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return MemoryPlan(
        weight_bytes=(weight_elements + head_copy) * dtype_bytes,
        context_bytes_per_token=2 * cfg.num_hidden_layers * kv_width * dtype_bytes,
        hidden=cfg.hidden_size, intermediate=cfg.intermediate_size,
        attention_width=2 * q_width + 2 * kv_width,
        num_modes=num_modes or cfg.num_modes, block=cfg.block_size, budget=budget, vocab=vocab,
        draft_vocab=draft_vocab, dtype_bytes=dtype_bytes)


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


def plan_launch_memory(server_args) -> None:
    """At launch on an accelerator (SGLang's handle_server_args stage): the plan of the drafter at
    --speculative-draft-model-path, reserved through `reserve_in_mem_fraction`."""
    if str(server_args.device) == "cpu":
        return  # CPU servers get an explicit --mem-fraction-static from the CPU launcher
    from sglang.srt.utils.common import get_device_memory_capacity

    from mfd_sglang.checkpoint import _target_text_config, load_drafter

    from .options import budget_from_num_draft_tokens, read_options

    ckpt = load_drafter(server_args.speculative_draft_model_path)
    target = _target_text_config(server_args.model_path)
    weights = sum(t.numel() for t in ckpt.weights.values() if t.is_floating_point())
    plan = memory_plan(ckpt.config, weights, dtype_bytes=4 if str(server_args.dtype) in ("float32", "float") else 2,
                       budget=budget_from_num_draft_tokens(server_args.speculative_num_draft_tokens),
                       vocab=target["vocab_size"],
                       num_modes=read_options().num_modes, tp_size=int(server_args.tp_size or 1),
                       tied_embeddings=bool(target.get("tie_word_embeddings")))
    # The raw input tells whether the user set the fraction (the resolved value is always set).
    raw = getattr(server_args, "_raw_input", None) or {}
    reserve_in_mem_fraction(server_args, plan, get_device_memory_capacity(str(server_args.device)),
                            user_set=raw.get("mem_fraction_static") is not None)
