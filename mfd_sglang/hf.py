"""Reference engine: MFD speculative generation on a plain Transformers causal LM target.

One round, in named stages (each timed, each a method you can call alone):
  draft   the drafter fills a block per mode from the target's context features -> log-probs [K, D, V]
          (a drafter with a mode gate folds its mode weights into depth 1: `MFDDrafter.block_logprobs`)
  tree    build_mixture_tree keeps the `budget` best prefixes over all modes (or the DFlash chain)
  verify  the target scores [last verified token, tree...] in one forward with the tree mask
  commit  the accepted path's target KV is moved into place, its context features appended to the
          drafter's cache; the target's token after the path (the bonus) becomes the next root.

Batched: requests of different lengths share one forward per stage; each row keeps its own length
in right-padded caches and sees only its own valid entries through the attention mask. Output is
exactly the target's own decoding of each request: greedy at T = 0; at T > 0 every emitted token
is a genuine target sample (one sample per tree node, see acceptance.py).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from .acceptance import (Sampling, TreeVerifyResult, random_seeds, sample_from_logits, verify_tree_greedy,
                         verify_tree_sampling)
from .checkpoint import check_fits_target, load_drafter
from .drafter import DraftContext, MFDDrafter, context_features
from .timing import timed
from .tree import DraftTree, build_chain, build_mixture_tree
from .tree_layout import tree_ancestor_mask

STAGES = ("draft", "tree", "verify", "commit")


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # row b of a batch uses seed + b (a server request would pass it as sampling_seed)
    min_p: float = 0.0

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
    """A batch in flight. Row b's committed tokens (all but its root) sit at cache slots [0, lengths[b])."""

    cache: DynamicCache  # target KV, right-padded [bs, heads, L, head_dim]
    context: DraftContext  # drafter keys/values of the committed tokens (holes are masked)
    lengths: torch.Tensor  # [bs] committed tokens in the target KV
    roots: torch.Tensor  # [bs] last emitted token of each row: not yet in any cache
    sampling: Sampling | None  # None: greedy
    stage_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))


def load_target(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    # SDPA accepts the custom 4D masks (padding, tree) as they are.
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    return model.to(device).eval()


def plain_greedy(model, input_ids: list[int], max_new_tokens: int, eos: Iterable[int] = (),
                 frequency_penalty: float = 0.0) -> list[int]:
    """Plain autoregressive greedy decoding with a KV cache, stopping after an `eos` token (each step's
    logits less frequency_penalty x the count of each token output so far): the ground truth every
    speculative path is held to."""
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([list(input_ids)], device=device)
    stop = set(eos)
    out: list[int] = []
    counts = torch.zeros(model.config.vocab_size, device=device)
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            logits = model(ids, past_key_values=cache, use_cache=True).logits[0, -1]
            if frequency_penalty:
                logits = logits - frequency_penalty * counts
            token = int(logits.argmax())
            counts[token] += 1
            out.append(token)
            if token in stop:
                break
            ids = torch.tensor([[token]], device=device)
    return out


def batch_sampling(bs: int, params: SamplingParams, device) -> Sampling:
    """The `Sampling` of bs rows under params: one stream per row, seed + row, else fresh random seeds
    (torch's global generator)."""
    rows = torch.arange(bs, device=device)
    seeds = random_seeds(bs, device) if params.seed is None else params.seed + rows
    return Sampling(torch.full((bs,), params.temperature, device=device),
                    torch.full((bs,), params.top_k, device=device),
                    torch.full((bs,), params.top_p, device=device),
                    torch.full((bs,), params.min_p, device=device), seeds)


def eos_token_ids(tokenizer, config) -> set[int]:
    """The tokenizer's EOS plus every EOS id in the model config (which may list several)."""
    ids = config.eos_token_id
    ids = [] if ids is None else list(ids) if isinstance(ids, (list, tuple)) else [ids]
    return {tokenizer.eos_token_id, *ids} - {None}


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool [bs, q, k] -> the additive [bs, 1, q, k] mask Transformers takes as it is."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill(
        ~visible, torch.finfo(dtype).min
    )[:, None]


class SpeculativeGenerator:
    def __init__(self, target, drafter: MFDDrafter, *, budget: int = 16, tree: str = "mixture",
                 single_mode: bool = False, num_modes: int | None = None):
        """num_modes: draft only each request's num_modes modes of highest gate weight each round
        (`MFDDrafter.gate_modes`; a drafter with a mode gate); the tree's `modes` then index each request's
        chosen modes, best first. None, or the drafter's K: every mode."""
        if tree not in ("mixture", "chain"):
            raise ValueError(f"tree must be 'mixture' or 'chain', got {tree!r}")
        if budget < 1:
            raise ValueError(f"budget must be >= 1 (tree nodes, root excluded), got {budget}")
        if num_modes is not None and (single_mode or drafter.mode_prior is None
                                      or not 1 <= num_modes <= drafter.mode_embed.shape[0]):
            raise ValueError(f"num_modes={num_modes}: it chooses 1..K of the K = {drafter.mode_embed.shape[0]} modes "
                             "by the mode gate, so it needs the K-mode path of a drafter with a mode gate")
        self.target, self.drafter = target, drafter
        self.budget, self.tree_kind, self.single_mode = budget, tree, single_mode
        self.num_modes = None if num_modes == drafter.mode_embed.shape[0] else num_modes
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed_weight = target.get_input_embeddings().weight
        self.lm_head_weight = target.get_output_embeddings().weight
        self.layer_ids = drafter.cfg.target_layer_ids

    @classmethod
    def from_paths(cls, target_path: str | Path, drafter_path: str | Path, *, dtype: torch.dtype = torch.float32,
                   device: str = "cpu", **kwargs) -> "SpeculativeGenerator":
        ckpt = load_drafter(drafter_path)
        check_fits_target(ckpt, target_path)
        target = load_target(target_path, dtype=dtype, device=device)
        drafter = MFDDrafter.from_checkpoint(ckpt, dtype=dtype).to(device).join_projections()
        return cls(target, drafter, **kwargs)

    # --- prefill --------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], params: SamplingParams) -> _State:
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int(lengths.max())
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for row, prompt in enumerate(prompts):
            ids[row, : len(prompt)] = torch.tensor(prompt, device=self.device)
        slots = torch.arange(width, device=self.device)
        valid = slots[None] < lengths[:, None]
        causal = slots[None, :, None] >= slots[None, None, :]
        cache = DynamicCache(config=self.target.config)
        out = self.target(ids, position_ids=slots[None].expand(len(prompts), -1),
                          attention_mask=additive_mask(causal & valid[:, None, :], self.dtype),
                          past_key_values=cache, use_cache=True, output_hidden_states=True)
        sampling = None if params.greedy else batch_sampling(len(prompts), params, self.device)
        last_logits = out.logits[torch.arange(len(prompts)), lengths - 1]
        if sampling is None:
            roots = last_logits.argmax(-1)
        else:  # the token after the last prompt token (position lengths - 1)
            roots = sample_from_logits(last_logits.float(), sampling, lengths - 1)
        features = context_features(out.hidden_states, self.layer_ids)
        context = self.drafter.context_kv(features, slots[None].expand(len(prompts), -1), valid)
        return _State(cache, context, lengths, roots, sampling)

    # --- the four stages ------------------------------------------------------------------------
    @torch.inference_mode()
    def draft(self, state: _State) -> torch.Tensor:
        """Drafter log-probs [bs, K, D, Vd] for the block after each root (mode weights folded in)."""
        return self.draft_blocks(state.roots, state.lengths, state.context, single_mode=self.single_mode)

    @torch.inference_mode()
    def draft_blocks(self, roots: torch.Tensor, lengths: torch.Tensor, context: DraftContext, *,
                     single_mode: bool = False) -> torch.Tensor:
        """Log-probs [bs, K, D, Vd] of blocks `[root, MASK...]` at positions lengths.. over the given context,
        as the tree reads them (`MFDDrafter.block_logprobs`: a mode gate's weights folded in)."""
        modes = (None if self.num_modes is None or single_mode
                 else self.drafter.gate_modes(roots, lengths, context, self.embed_weight, self.num_modes))
        return self.drafter.block_logprobs(roots, lengths, context, self.embed_weight, self.lm_head_weight,
                                           single_mode=single_mode, modes=modes)

    @torch.inference_mode()
    def build_tree(self, logprobs: torch.Tensor) -> DraftTree:
        if self.tree_kind == "chain":
            tree = build_chain(logprobs)
        else:
            tree = build_mixture_tree(logprobs, self.budget)
        tree.tokens = self.drafter.to_target_ids(tree.tokens)
        return tree

    @torch.inference_mode()
    def verify(self, state: _State, tree: DraftTree):
        """One target forward over [root, tree nodes] per row; returns the walk's result and the forward output.
        The sampling settings and seeds are the state's, fixed at prefill."""
        input_ids = torch.cat([state.roots[:, None], tree.tokens], dim=1)
        depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
        cache_width = state.cache.get_seq_length()
        prefix = torch.arange(cache_width, device=self.device)[None] < state.lengths[:, None]
        tree_mask = tree_ancestor_mask(tree)  # [bs, N, N] ancestor-or-self, root included
        visible = torch.cat([prefix[:, None, :].expand(-1, tree_mask.shape[1], -1), tree_mask], dim=2)
        out = self.target(input_ids, position_ids=state.lengths[:, None] + depths,
                          attention_mask=additive_mask(visible, self.dtype), past_key_values=state.cache,
                          use_cache=True, output_hidden_states=True)
        logits = out.logits.float()
        if state.sampling is None:
            result = verify_tree_greedy(tree, logits)
        else:
            result = verify_tree_sampling(tree, logits, state.sampling, state.lengths)
        return result, out

    @torch.inference_mode()
    def commit(self, state: _State, result: TreeVerifyResult, out, keep: torch.Tensor) -> None:
        """Per row, move the root and the first keep[b] - 1 accepted nodes into both caches.

        keep [bs]: tokens emitted this round (0 for a finished row). Row b's entries land at slots
        [lengths[b], lengths[b] + keep[b]); whatever lies beyond a row's length is masked out.
        """
        bs, width = keep.shape[0], int(keep.max())
        root = torch.zeros(bs, 1, dtype=torch.long, device=self.device)
        local = torch.cat([root, result.accepted_local_indices], dim=1)[:, : max(width, 1)]
        columns = torch.arange(local.shape[1], device=self.device)[None]
        kept = columns < keep[:, None]
        local = torch.where(kept, local, 0)
        old_width = state.cache.get_seq_length() - out.logits.shape[1]  # before the verify appended its N
        new_lengths = state.lengths + keep
        slots = torch.arange(int(new_lengths.max()), device=self.device)[None]
        offset = (slots - state.lengths[:, None]).clamp(0, local.shape[1] - 1)
        source = torch.where(slots < state.lengths[:, None], slots, old_width + local.gather(1, offset))
        source = torch.where(slots < new_lengths[:, None], source, 0)
        index = source[:, None, :, None]
        for layer in state.cache.layers:
            layer.keys = layer.keys.gather(2, index.expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3]))
            layer.values = layer.values.gather(2, index.expand(-1, layer.values.shape[1], -1, layer.values.shape[3]))
        features = context_features(out.hidden_states, self.layer_ids)
        features = features.gather(1, local[:, :, None].expand(-1, -1, features.shape[-1]))
        positions = state.lengths[:, None] + columns
        state.context = state.context.append(self.drafter.context_kv(features, positions, kept))
        state.lengths = new_lengths

    # --- the loop -------------------------------------------------------------------------------
    def generate(self, input_ids: list[int], max_new_tokens: int, *, params: SamplingParams | None = None,
                 eos_token_ids: Iterable[int] = ()) -> GenerationOutput:
        return self.generate_batch([list(input_ids)], max_new_tokens, params=params, eos_token_ids=eos_token_ids)[0]

    def generate_batch(self, prompts: list[list[int]], max_new_tokens: int, *, params: SamplingParams | None = None,
                       eos_token_ids: Iterable[int] = (), on_round=None) -> list[GenerationOutput]:
        """Generate for every prompt. `on_round(row, length, logprobs, tree, result)`, if given, sees each
        active row's round before commit (length: the row's committed tokens, logprobs/tree/result: the
        batched stage outputs), for evaluation."""
        params = params or SamplingParams()
        eos = set(eos_token_ids)
        start = time.perf_counter()
        state = self.prefill([list(p) for p in prompts], params)
        prefill_seconds = time.perf_counter() - start
        outputs = [[t] for t in state.roots.tolist()]
        rounds: list[list[RoundStats]] = [[] for _ in prompts]
        done = [out[0] in eos or max_new_tokens <= 1 for out in outputs]
        while not all(done):
            logprobs = self._timed(state, "draft", self.draft, state)
            tree = self._timed(state, "tree", self.build_tree, logprobs)
            result, out = self._timed(state, "verify", self.verify, state, tree)
            keep = []
            for row, tokens in enumerate(result.accepted_tokens.tolist()):
                if done[row]:
                    keep.append(0)
                    continue
                if on_round is not None:
                    on_round(row, int(state.lengths[row]), logprobs, tree, result)
                emitted = [t for t in tokens if t >= 0][: max_new_tokens - len(outputs[row])]
                hit = next((i for i, t in enumerate(emitted) if t in eos), None)
                emitted = emitted if hit is None else emitted[: hit + 1]
                outputs[row] += emitted
                rounds[row].append(self._round_stats(tree, result, row, len(emitted)))
                done[row] = hit is not None or len(outputs[row]) >= max_new_tokens
                keep.append(len(emitted))
            # The root and the accepted nodes before the last emitted token go into the caches.
            self._timed(state, "commit", self.commit, state, result, out, torch.tensor(keep, device=self.device))
            state.roots = torch.tensor([o[-1] for o in outputs], device=self.device)
        return [
            GenerationOutput(out, stats, dict(state.stage_seconds), prefill_seconds,
                             "eos" if out[-1] in eos else "length")
            for out, stats in zip(outputs, rounds)
        ]

    @torch.inference_mode()
    def autoregressive(self, input_ids: list[int], max_new_tokens: int, eos_token_ids: Iterable[int] = ()) -> list[int]:
        """Plain greedy decoding of the target with a KV cache: the baseline speculation must equal."""
        return plain_greedy(self.target, input_ids, max_new_tokens, eos_token_ids)

    def _timed(self, state: _State, stage: str, fn, *args):
        value, seconds = timed(lambda: fn(*args), self.device)
        state.stage_seconds[stage] += seconds
        return value

    @staticmethod
    def _round_stats(tree: DraftTree, result: TreeVerifyResult, row: int, emitted: int) -> RoundStats:
        local = result.accepted_local_indices[row]
        nodes = (local[local >= 0] - 1).tolist()
        parents = tree.parents[row]
        order = torch.arange(parents.shape[0], device=parents.device)
        earlier_siblings = ((parents[None, :] == parents[:, None]) & (order[None, :] < order[:, None])).sum(1)
        return RoundStats(
            emitted=emitted,
            accepted=int(result.accept_lens[row]) - 1,
            accepted_modes=tree.modes[row, nodes].tolist(),
            accepted_sibling_ranks=earlier_siblings[nodes].tolist(),
        )
