"""Reference engine: MFD speculative generation on a plain Transformers causal LM target.

One round, in named stages (each timed, each a method you can call alone):
  draft   the drafter fills a block per mode from the target's context features -> log-probs [K, D, V]
  tree    build_mixture_tree keeps the `budget` best prefixes over all modes (or the DFlash chain)
  verify  the target scores [last verified token, tree...] in one forward with the tree mask
  commit  the accepted path's target KV is moved into place, its context features appended to the
          drafter's cache; the target's token after the path (the bonus) becomes the next root.

Batch 1. Output is exactly the target's own decoding: greedy at T = 0; at T > 0 every emitted token is
a genuine target sample (one sample per tree node, see verify.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .checkpoint import check_fits_target, load_drafter
from .drafter import DraftContext, MFDDrafter, context_features
from .tree import DraftTree, build_chain, build_mixture_tree
from .tree_layout import tree_ancestor_mask
from .verify import TreeVerifyResult, sample_from_logits, verify_tree_greedy, verify_tree_sampling

STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


@dataclass
class RoundStats:
    """What one verify round did (for tau, tests and diagnostics)."""

    emitted: int  # tokens this round added to the output (accepted + bonus, after EOS/max cuts)
    accepted: int  # draft tokens the target agreed with
    accepted_modes: list[int]  # best mode of each accepted node
    accepted_sibling_ranks: list[int]  # 0 = the first (best) child of its parent


@dataclass
class GenerationOutput:
    token_ids: list[int]
    rounds: list[RoundStats]
    stage_seconds: dict[str, float]
    prefill_seconds: float
    finish_reason: str  # "eos" | "length"

    @property
    def tau(self) -> float:
        """Mean tokens per verify round (accepted + bonus)."""
        return sum(r.emitted for r in self.rounds) / max(len(self.rounds), 1)


@dataclass
class _State:
    cache: DynamicCache  # target KV for every committed token except the root
    context: DraftContext  # drafter keys/values for the same tokens
    seq_len: int  # tokens in the target KV
    root: int  # last emitted token: not yet in any cache
    generator: torch.Generator | None
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    # SDPA accepts the custom 4D tree mask as it is.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


class SpeculativeGenerator:
    def __init__(self, target, drafter: MFDDrafter, *, budget: int = 16, tree: str = "mixture",
                 single_mode: bool = False):
        if tree not in ("mixture", "chain"):
            raise ValueError(f"tree must be 'mixture' or 'chain', got {tree!r}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1 (tree nodes, root excluded), got {budget}")
        self.target, self.drafter = target, drafter
        self.budget, self.tree_kind, self.single_mode = budget, tree, single_mode
        self.device = next(target.parameters()).device
        self.embed_weight = target.get_input_embeddings().weight
        self.lm_head_weight = target.get_output_embeddings().weight
        self.layer_ids = drafter.cfg.target_layer_ids

    @classmethod
    def from_paths(cls, target_path: str | Path, drafter_path: str | Path, *, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", **kwargs) -> "SpeculativeGenerator":
        ckpt = load_drafter(drafter_path)
        check_fits_target(ckpt, target_path)
        target = load_target(target_path, dtype=dtype, device=device)
        drafter = MFDDrafter.from_checkpoint(ckpt, dtype=dtype).to(device)
        return cls(target, drafter, **kwargs)

    # --- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, input_ids: list[int], params: SamplingParams) -> _State:
        ids = torch.tensor([input_ids], device=self.device)
        cache = DynamicCache(config=self.target.config)
        out = self.target(ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        first = self._pick(out.logits[:, -1], params, generator)
        positions = torch.arange(len(input_ids), device=self.device)[None]
        context = self.drafter.context_kv(context_features(out.hidden_states, self.layer_ids), positions)
        return _State(cache, context, len(input_ids), int(first[0]), generator)

    def _pick(self, logits: torch.Tensor, params: SamplingParams, generator) -> torch.Tensor:
        if params.greedy:
            return logits.argmax(-1)
        bs = logits.shape[0]
        return sample_from_logits(
            logits.float(), torch.full((bs,), params.temperature, device=logits.device),
            torch.full((bs,), params.top_k, device=logits.device), torch.full((bs,), params.top_p, device=logits.device),
            generator,
        )

    # --- the four stages ------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, state: _State) -> torch.Tensor:
        """Drafter log-probs [1, K, D, Vd] for the block after the root."""
        block = self.drafter.cfg.block_size
        tokens = torch.full((1, block), self.drafter.cfg.mask_token_id, device=self.device)
        tokens[0, 0] = state.root
        positions = state.seq_len + torch.arange(block, device=self.device)[None]
        hidden = self.drafter(self.embed_weight[tokens], positions, state.context, single_mode=self.single_mode)
        return self.drafter.logprobs(hidden, self.lm_head_weight)

    @torch.inference_mode()
    def build_tree(self, logprobs: torch.Tensor) -> DraftTree:
        if self.tree_kind == "chain":
            tree = build_chain(logprobs)
        else:
            tree = build_mixture_tree(logprobs, self.budget)
        tree.tokens = self.drafter.to_target_ids(tree.tokens)
        return tree

    @torch.inference_mode()
    def verify(self, state: _State, tree: DraftTree, params: SamplingParams):
        """One target forward over [root, tree nodes]; returns the walk's result and the forward output."""
        root = torch.tensor([[state.root]], device=self.device)
        input_ids = torch.cat([root, tree.tokens], dim=1)
        depths = torch.cat([torch.zeros_like(root), tree.depths], dim=1)
        positions = state.seq_len + depths
        tree_mask = tree_ancestor_mask(tree)  # [1, N, N] ancestor-or-self, root included
        prefix = torch.ones(1, tree_mask.shape[1], state.seq_len, dtype=torch.bool, device=self.device)
        visible = torch.cat([prefix, tree_mask], dim=2)[:, None]
        dtype = self.embed_weight.dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill(~visible, torch.finfo(dtype).min)
        out = self.target(input_ids, position_ids=positions, attention_mask=mask, past_key_values=state.cache,
                          use_cache=True, output_hidden_states=True)
        logits = out.logits.float()
        if params.greedy:
            result = verify_tree_greedy(tree, logits)
        else:
            bs = logits.shape[0]
            result = verify_tree_sampling(
                tree, logits, torch.full((bs,), params.temperature, device=self.device),
                torch.full((bs,), params.top_k, device=self.device), torch.full((bs,), params.top_p, device=self.device),
                generator=state.generator,
            )
        return result, out

    @torch.inference_mode()
    def commit(self, state: _State, result: TreeVerifyResult, out, keep_tokens: int) -> None:
        """Keep the root and the first `keep_tokens - 1` accepted nodes in both caches; advance the root."""
        local = result.accepted_local_indices[0]
        kept = torch.cat([torch.zeros(1, dtype=torch.long, device=self.device), local[local >= 0]])[:keep_tokens]
        for layer in state.cache.layers:
            layer.keys = torch.cat([layer.keys[:, :, : state.seq_len], layer.keys[:, :, state.seq_len + kept]], dim=2)
            layer.values = torch.cat([layer.values[:, :, : state.seq_len], layer.values[:, :, state.seq_len + kept]], dim=2)
        features = context_features(out.hidden_states, self.layer_ids)[:, kept]
        positions = state.seq_len + torch.arange(len(kept), device=self.device)[None]
        state.context = state.context.append(self.drafter.context_kv(features, positions))
        state.seq_len += len(kept)

    # --- the loop -------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int, *, params: SamplingParams | None = None,
                 eos_token_ids: Iterable[int] = ()) -> GenerationOutput:
        params = params or SamplingParams()
        eos = set(eos_token_ids)
        start = time.perf_counter()
        state = self.prefill(list(input_ids), params)
        prefill_seconds = time.perf_counter() - start
        output, rounds = [state.root], []
        finish = "eos" if state.root in eos else "length"
        while len(output) < max_new_tokens and state.root not in eos:
            logprobs = self._timed(state, "draft", self.draft, state)
            tree = self._timed(state, "tree", self.build_tree, logprobs)
            result, out = self._timed(state, "verify", self.verify, state, tree, params)
            emitted = [t for t in result.accepted_tokens[0].tolist() if t >= 0]
            emitted = emitted[: max_new_tokens - len(output)]
            hit = next((i for i, t in enumerate(emitted) if t in eos), None)
            if hit is not None:
                emitted, finish = emitted[: hit + 1], "eos"
            # The root and the accepted nodes before the last emitted token go into the caches.
            self._timed(state, "commit", self.commit, state, result, out, len(emitted))
            state.root = emitted[-1]
            output += emitted
            rounds.append(self._round_stats(tree, result, len(emitted)))
        return GenerationOutput(output, rounds, dict(state.stage_seconds), prefill_seconds, finish)

    def _timed(self, state: _State, stage: str, fn, *args):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        value = fn(*args)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        state.stage_seconds[stage] += time.perf_counter() - start
        return value

    @staticmethod
    def _round_stats(tree: DraftTree, result: TreeVerifyResult, emitted: int) -> RoundStats:
        local = result.accepted_local_indices[0]
        nodes = (local[local >= 0] - 1).tolist()
        parents = tree.parents[0]
        order = torch.arange(parents.shape[0], device=parents.device)
        earlier_siblings = ((parents[None, :] == parents[:, None]) & (order[None, :] < order[:, None])).sum(1)
        return RoundStats(
            emitted=emitted,
            accepted=int(result.accept_lens[0]) - 1,
            accepted_modes=tree.modes[0, nodes].tolist(),
            accepted_sibling_ranks=earlier_siblings[nodes].tolist(),
        )
