"""Drafter training on target-generated sequences (the DFlash recipe, with K modes).

A training example is an anchor position a in a sequence the target produced: the block is
`[token a, MASK x D]` at positions a..a+D, it sees the target's context features strictly before
a, is bidirectional inside, and never sees other blocks. Two losses over the D drafted positions:

- "decay" (DFlash): cross-entropy weighted by exp(-(d-1)/7) (early positions matter most);
- "dpace" (D-PACE, alpha = 0.5): cross-entropy at position k weighted by the DETACHED suffix sum
  w_k = sum_{j >= k} prod_{i <= j} ((1 - alpha) q_i + alpha), q_i = the drafter's probability of the
  label at position i; it approximates the expected accepted length of the chain.

With K modes each example is scored under every mode and the loss goes mostly to the mode that
already fits it best (winner-take-all, so modes specialise) with a small share for every mode (so
none dies). The best mode is the one with the lowest weighted loss ("decay", what make-tiny uses)
or the largest coverage sum_d prod_{i <= d} q_{k,i} ("dpace": the expected chain acceptance). MFD_D's
default path (`default_mode_embed`) can be trained alongside on every example with plain loss.

The mode gate (`mode_prior`, when the drafter has one) learns that best mode as its label:
cross-entropy of `MFDDrafter.mode_log_prior` on the anchor states, which are detached, and the
body's gradient clipping leaves the gate out, so the gate never changes what the modes learn (the
same run without a gate trains the same body). Alongside the body its labels come from modes that
are still forming and its steps are the body's small ones: measured in `make-multimodal`, such a gate
weighs the futures .32/.37/.17/.14 where its own final labels say .41/.30/.17/.13. So `gate_steps`
more steps follow the body's: the body frozen (bit for bit), only the gate trained on the finished
modes' winners at its own `gate_lr` (cosine from it). With `steps` 0 and `init_from` an MFD drafter of
the same K, that phase alone gates a trained drafter after the fact.

Labels past the end of a sequence, or outside the drafter's draft vocabulary, are ignored (no loss);
for D-PACE a label past the end stops the chain, a label outside the draft vocabulary has q = 0.

`train(TrainConfig)` is the whole pipeline behind `python -m mfd_sglang train`: data from
`train_data`, one target forward per training sequence for the context features, AdamW with
warmup + cosine and grad clip 1.0, resumable checkpoints, our checkpoint format.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafter import DraftContext, MFDDrafter

POSITION_DECAY = 7.0
WINNER_SHARE = 0.9
DPACE_ALPHA = 0.5
LOSSES = ("dpace", "decay")
STATE_DIR = "train_state"  # inside --out: resumable state, log, the run's settings
GRAD_CLIP = 1.0
GATE_LR = 1e-2  # measured on make-multimodal: the gate's pi settles in ~300 steps (the body's 1e-3: not in 1000)


def position_weights(num_positions: int, device=None) -> torch.Tensor:
    return torch.exp(-torch.arange(num_positions, device=device, dtype=torch.float32) / POSITION_DECAY)


def dpace_weights(q: torch.Tensor, alpha: float = DPACE_ALPHA, in_seq: torch.Tensor | None = None) -> torch.Tensor:
    """D-PACE weights [..., D] for label probabilities q [..., D] (detached).

    w_k = sum_{j >= k} prod_{i <= j} g_i with g_i = (1 - alpha) q_i + alpha; positions past the end of
    the sequence (in_seq False) have g = 0, so they and everything after them add nothing.
    """
    g = (1 - alpha) * q.detach() + alpha
    if in_seq is not None:
        g = torch.where(in_seq, g, torch.zeros_like(g))
    prefix = torch.cumprod(g, dim=-1)
    return prefix.flip(-1).cumsum(-1).flip(-1)


def chain_coverage(q: torch.Tensor) -> torch.Tensor:
    """Expected chain acceptance sum_d prod_{i <= d} q_i over the last dimension (q = 0 where ignored)."""
    return torch.cumprod(q, dim=-1).sum(-1)


def mode_weights(score: torch.Tensor, share: float = WINNER_SHARE, *, higher_is_better: bool = True) -> torch.Tensor:
    """Per-example mode weights [n, K]: `share` to the best mode, (1 - share) / K to every mode (floor)."""
    num_modes = score.shape[-1]
    best = score.detach().argmax(-1) if higher_is_better else score.detach().argmin(-1)
    winner = torch.nn.functional.one_hot(best, num_modes).float()
    return share * winner + (1 - share) / num_modes


def anchor_blocks(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """Block inputs, positions and labels for anchors [bs, A] in sequences tokens [bs, S].

    Returns block tokens [bs*A, T], positions [bs*A, T], labels [bs*A, T-1], and the sequence row of
    each example [bs*A].
    """
    bs, num_anchors = anchors.shape
    offsets = torch.arange(block_size, device=tokens.device)
    positions = (anchors[..., None] + offsets).reshape(bs * num_anchors, block_size)
    rows = torch.arange(bs, device=tokens.device).repeat_interleave(num_anchors)
    labels = tokens[rows[:, None], positions[:, 1:]]
    block = torch.full_like(positions, mask_token_id)
    block[:, 0] = tokens[rows, positions[:, 0]]
    return block, positions, labels, rows


@dataclass
class LossOutput:
    loss: torch.Tensor  # the scalar to minimise
    mode_loss: torch.Tensor  # the K-mode part (detached)
    default_loss: torch.Tensor | None  # the default-path part (detached), when trained
    wins: torch.Tensor | None  # [K] examples won by each mode (K > 1)
    accuracy: torch.Tensor  # [D] top-1 agreement of the best mode per position (valid labels)
    cross_entropy: torch.Tensor  # mean nll of the valid labels under the best mode (a plain progress measure)
    gate_loss: torch.Tensor | None = None  # the mode gate's cross-entropy on the best mode (detached), if any
    gate_accuracy: torch.Tensor | None = None  # share of examples whose gate's top mode is the best mode


def _per_position(drafter: MFDDrafter, hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor):
    """nll [n, K, D] of the labels (labels already in draft-vocabulary ids) and the argmax [n, K, D]."""
    logprobs = drafter.logprobs(hidden, lm_head_weight)
    nll = -logprobs.gather(-1, labels[:, None, :, None].expand(-1, hidden.shape[1], -1, 1))[..., 0]
    return nll, logprobs.detach().argmax(-1)


def block_loss(drafter: MFDDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
               tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, *,
               lengths: torch.Tensor | None = None, loss: str = "decay", alpha: float = DPACE_ALPHA,
               winner_share: float = WINNER_SHARE, default_path: bool = False) -> LossOutput:
    """The block loss for sequences tokens [bs, S'] (S' >= S) with target context features [bs, S, n*H].

    anchors [bs, A]: every anchor needs anchor + block_size <= S' (pad `tokens` on the right) and
    anchor < length. `lengths` [bs]: valid tokens per row (labels at or past it are ignored); None =
    all of S'. `default_path`: also train the drafter's `default_mode_embed` (plain loss, every example).
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    cfg = drafter.cfg
    block, positions, labels, rows = anchor_blocks(tokens, anchors, cfg.block_size, cfg.mask_token_id)
    seq_len = features.shape[1]
    seq_positions = torch.arange(seq_len, device=tokens.device)[None].expand(tokens.shape[0], -1)
    full = drafter.context_kv(features, seq_positions)
    # Each example sees the context strictly before its anchor.
    context = DraftContext(
        keys=[k[rows] for k in full.keys],
        values=[v[rows] for v in full.values],
        positions=seq_positions[rows],
        valid=seq_positions[rows] < positions[:, :1],
    )
    in_seq = None if lengths is None else positions[:, 1:] < lengths[rows][:, None]  # [n, D]
    valid = in_seq
    if drafter.draft_vocab is not None:
        labels = drafter.to_draft_ids(labels)
        in_vocab = labels >= 0
        valid = in_vocab if valid is None else valid & in_vocab
        labels = labels.clamp(min=0)
    embeds = embed_weight[block]

    def label_probs(nll: torch.Tensor) -> torch.Tensor:
        """The drafter's (detached) probability of each label [n, K, D], 0 where the label is ignored."""
        q = torch.exp(-nll.detach())
        return q if valid is None else q.masked_fill(~valid[:, None], 0.0)

    def weighted(nll: torch.Tensor) -> torch.Tensor:
        """Per-example, per-mode loss [n, K] from nll [n, K, D]."""
        if valid is not None:
            nll = nll.masked_fill(~valid[:, None], 0.0)
        if loss == "decay":
            return (nll * position_weights(nll.shape[-1], tokens.device)).sum(-1)
        w = dpace_weights(label_probs(nll), alpha, None if in_seq is None else in_seq[:, None])
        return (nll * w).sum(-1)

    hidden, anchor = drafter(embeds, positions, context, with_anchor=True)  # [n, K, D, H], [n, K, H]
    nll, argmax = _per_position(drafter, hidden, lm_head_weight, labels)
    per_mode = weighted(nll)
    num_modes = per_mode.shape[1]
    wins = None
    if num_modes == 1:
        mode_loss = per_mode.mean()
        best = torch.zeros(per_mode.shape[0], dtype=torch.long, device=tokens.device)
    else:
        if loss == "decay":
            weights = mode_weights(per_mode, winner_share, higher_is_better=False)
        else:
            weights = mode_weights(chain_coverage(label_probs(nll)), winner_share)
        best = weights.argmax(-1)
        wins = torch.bincount(best, minlength=num_modes)
        mode_loss = (weights * per_mode).sum(-1).mean()
    total = mode_loss
    gate_loss = gate_accuracy = None
    log_prior = drafter.mode_log_prior(anchor.detach())
    if log_prior is not None:
        gate_loss = torch.nn.functional.nll_loss(log_prior, best)
        gate_accuracy = (log_prior.detach().argmax(-1) == best).float().mean()
        total = total + gate_loss
        gate_loss = gate_loss.detach()
    default_loss = None
    if default_path:
        d_hidden = drafter(embeds, positions, context, single_mode=True)
        d_nll, _ = _per_position(drafter, d_hidden, lm_head_weight, labels)
        default_loss = weighted(d_nll).mean()
        total = total + default_loss
    examples = torch.arange(argmax.shape[0], device=tokens.device)
    hit = (argmax[examples, best] == labels).float()
    best_nll = nll.detach()[examples, best]
    if valid is not None:
        accuracy = (hit * valid).sum(0) / valid.sum(0).clamp(min=1)
        cross_entropy = (best_nll * valid).sum() / valid.sum().clamp(min=1)
    else:
        accuracy, cross_entropy = hit.mean(0), best_nll.mean()
    return LossOutput(total, mode_loss.detach(), None if default_loss is None else default_loss.detach(), wins,
                      accuracy.detach(), cross_entropy, gate_loss, gate_accuracy)


def drafter_loss(drafter: MFDDrafter, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 tokens: torch.Tensor, features: torch.Tensor, anchors: torch.Tensor, **kwargs) -> torch.Tensor:
    """Mean per-example loss for sequences tokens [bs, S] with target context features [bs, S, n*H]
    (see `block_loss` for the options; the defaults are make-tiny's: decay loss, no default path)."""
    return block_loss(drafter, embed_weight, lm_head_weight, tokens, features, anchors, **kwargs).loss


def sample_anchors(generator: torch.Generator, bs: int, num_anchors: int, seq_len: int, block_size: int,
                   min_context: int = 1) -> torch.Tensor:
    """Random anchors [bs, A] with a full block inside the sequence and at least `min_context` context tokens."""
    high = seq_len - block_size + 1
    return torch.randint(min_context, high, (bs, num_anchors), generator=generator)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_step(optimizer: torch.optim.Optimizer, loss: torch.Tensor, lr: float,
                   clip_params=None, clip: float = GRAD_CLIP) -> None:
    """Set the learning rate, back-propagate, clip the gradient norm (if `clip_params`), step."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad()
    loss.backward()
    if clip_params is not None:
        torch.nn.utils.clip_grad_norm_(clip_params, clip)
    optimizer.step()


# --- the training pipeline ----------------------------------------------------------------------

@dataclass
class TrainConfig:
    """One training run (the `train` subcommand's options; see cli.py for their help)."""

    target: str
    out: str
    data: str
    num_modes: int = 1
    init_from: str | None = None
    steps: int = 1000
    batch_size: int = 2
    anchors: int = 32
    block_size: int | None = None  # None: the init drafter's, else 16
    layers: int | None = None  # None: the init drafter's, else 1
    lr: float | None = None  # None: 6e-4 from scratch, 1e-4 from --init-from
    warmup: float = 0.04
    seed: int = 0
    dtype: str = "float32"
    draft_vocab_size: int | None = None
    save_every: int = 100
    loss: str = "dpace"
    alpha: float = DPACE_ALPHA
    winner_share: float = WINNER_SHARE
    max_seq_len: int = 512
    mode_gate: bool = False  # also train the mode gate (K > 1): the tree's per-request mode weights
    gate_steps: int = 0  # then this many gate-only steps, the body frozen (needs mode_gate)
    gate_lr: float | None = None  # the gate-only steps' peak learning rate (cosine, no warm-up); None: GATE_LR
    device: str = "cpu"  # where the target and the drafter run ("cuda", "cuda:1", ...)
    # Settings that may change between a run and its --resume without changing what is computed.
    RESUMABLE_CHANGES = ("out", "data", "save_every")
    # Added later: left out of the fingerprint without gate-only steps, so runs saved before them resume.
    GATE_PHASE = ("gate_steps", "gate_lr")
    # Added later: left out of the fingerprint on the CPU, so runs saved before it resume.
    DEVICE = ("device",)


@dataclass
class TrainResult:
    out: Path
    step: int  # steps done in total (resumed runs count the earlier ones)
    losses: list[float] = field(default_factory=list)  # this call's steps
    mode_usage: list[float] | None = None  # this call's share of examples won by each mode (K > 1)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_sequences(path: str | Path, max_seq_len: int) -> list[tuple[list[int], int]]:
    """(prompt + response ids truncated to max_seq_len, prompt length) for every usable record."""
    from .train_data import read_records

    out = []
    for r in read_records(path):
        ids = (list(r["input_ids"]) + list(r["response_ids"]))[:max_seq_len]
        prompt_len = len(r["input_ids"])
        if prompt_len >= 1 and len(ids) >= prompt_len + 1:  # at least one response token to predict
            out.append((ids, prompt_len))
    if not out:
        raise ValueError(f"{path}: no usable training records (each needs a prompt and a response token "
                         f"within --max-seq-len {max_seq_len})")
    return out


def build_draft_vocab(sequences: list[tuple[list[int], int]], size: int) -> torch.Tensor:
    """The `size` most frequent RESPONSE token ids (ties: lower id first), sorted ascending."""
    counts: dict[int, int] = {}
    for ids, prompt_len in sequences:
        for t in ids[prompt_len:]:
            counts[t] = counts.get(t, 0) + 1
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    return torch.tensor(sorted(ranked), dtype=torch.long)


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """`count` layers spread from 1 to depth-3 (DFlash: [1, 9, 17, 25, 33] of 36); all of them when shallow."""
    count = min(count, num_target_layers)
    lo, hi = 1, num_target_layers - 3
    if hi - lo + 1 < count:
        lo, hi = 0, num_target_layers - 1
    if count == 1:
        return [hi]
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})


def mask_token_for(tokenizer) -> int:
    """The token whose (target) embedding fills the block's MASK slots: the tokenizer's mask token,
    else `<|mask|>`, else its unk / pad / eos token."""
    if tokenizer.mask_token_id is not None:
        return tokenizer.mask_token_id
    vocab = tokenizer.get_vocab()
    if "<|mask|>" in vocab:
        return vocab["<|mask|>"]
    for t in (tokenizer.unk_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id):
        if t is not None:
            return t
    raise ValueError("the tokenizer has no mask, unk, pad or eos token to use as the drafter's MASK")


def new_drafter_config(target_config, tokenizer, *, layers: int, block_size: int, num_context_layers: int = 5) -> dict:
    """A DFlash drafter config for this target: its width and heads, `layers` layers."""
    tc = target_config
    heads = tc.num_attention_heads
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(tc, "num_key_value_heads", None) or heads,
        "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        "vocab_size": tc.vocab_size,
        "rms_norm_eps": float(getattr(tc, "rms_norm_eps", 1e-6)),
        "rope_theta": float(_rope_theta(tc)),
        "max_position_embeddings": tc.max_position_embeddings,
        "attention_bias": False,
        "torch_dtype": "float32",
        "block_size": block_size,
        "num_target_layers": tc.num_hidden_layers,
        "dflash_config": {"mask_token_id": mask_token_for(tokenizer),
                          "target_layer_ids": default_target_layer_ids(tc.num_hidden_layers, num_context_layers)},
    }


def _rope_theta(tc) -> float:
    theta = getattr(tc, "rope_theta", None)
    if theta is None:
        params = getattr(tc, "rope_parameters", None) or {}
        theta = params.get("rope_theta", 10000.0)
    return theta


def _with_modes(raw: dict, num_modes: int, draft_vocab_size: int | None, mode_gate: bool) -> dict:
    raw = json.loads(json.dumps(raw))
    mfd = {"num_modes": num_modes, "default_mode": "embed" if num_modes > 1 else 0}
    if draft_vocab_size is not None:
        mfd["draft_vocab_size"] = draft_vocab_size
    if mode_gate:
        mfd["mode_prior"] = "gate"
    raw["mfd_config"] = mfd
    raw["torch_dtype"] = "float32"
    return raw


def init_drafter(cfg: TrainConfig, target, tokenizer, sequences, generator: torch.Generator):
    """(drafter, raw config): from --init-from (its weights copied; K modes around its default path)
    or from scratch (normal(0, 0.02) matrices, unit norms)."""
    from ..checkpoint import load_drafter, parse_drafter_config

    embed = target.get_input_embeddings().weight.detach().float()
    base = None
    if cfg.init_from:
        ckpt = load_drafter(cfg.init_from)
        base = MFDDrafter.from_checkpoint(ckpt).float()
        raw = json.loads((Path(cfg.init_from) / "config.json").read_text())
        raw.pop("mfd_config", None)
        for name, wanted, have in (("block_size", cfg.block_size, ckpt.config.block_size),
                                   ("layers", cfg.layers, ckpt.config.num_hidden_layers)):
            if wanted is not None and wanted != have:
                raise ValueError(f"--{name.replace('_', '-')} {wanted} differs from the --init-from drafter's {have}")
    else:
        raw = new_drafter_config(target.config, tokenizer, layers=cfg.layers or 1, block_size=cfg.block_size or 16)
    draft_vocab = None
    if cfg.draft_vocab_size:
        draft_vocab = build_draft_vocab(sequences, cfg.draft_vocab_size)
    elif base is not None and base.draft_vocab is not None:
        draft_vocab = base.draft_vocab.clone()
    raw = _with_modes(raw, cfg.num_modes, None if draft_vocab is None else int(draft_vocab.numel()), cfg.mode_gate)
    dcfg = parse_drafter_config(raw)
    n_ctx = len(dcfg.target_layer_ids) * target.config.hidden_size
    drafter = MFDDrafter(dcfg, context_features=n_ctx)
    if draft_vocab is not None:
        drafter.draft_vocab = draft_vocab
    # Mode embeddings: small random vectors, std 0.02 x the RMS of the (target) embeddings they are added to.
    mode_std = 0.02 * float(embed.pow(2).mean().sqrt())
    with torch.no_grad():
        if base is None:
            for name, p in drafter.named_parameters():
                if p.dim() == 2 and name != "mode_embed":
                    p.normal_(0.0, 0.02, generator=generator)
            centre = torch.zeros(dcfg.hidden_size)
        else:
            skip = {"mode_embed", "default_mode_embed", "draft_vocab"}
            own = drafter.state_dict()
            for name, tensor in base.state_dict().items():
                if name not in skip and name in own:  # the base's gate only when this run trains one
                    own[name].copy_(tensor)
            centre = base.mode_vectors(single_mode=True)[0].detach().float()
        if dcfg.num_modes > 1:
            if base is not None and base.carries_mode_embed and base.cfg.num_modes == dcfg.num_modes:
                drafter.mode_embed.copy_(base.mode_embed)
            else:
                noise = torch.randn(drafter.mode_embed.shape, generator=generator) * mode_std
                drafter.mode_embed.copy_(centre[None] + noise)
        if drafter.default_mode_embed is not None:
            drafter.default_mode_embed.copy_(centre)
        if drafter.mode_prior is not None and not (base is not None and base.mode_prior is not None
                                                   and base.cfg.num_modes == dcfg.num_modes):
            # A zero gate starts at uniform weights: today's tree, until it learns otherwise.
            drafter.mode_prior.weight.zero_()
            drafter.mode_prior.bias.zero_()
    return drafter, raw


def _fingerprint(cfg: TrainConfig, sequences) -> dict:
    digest = hashlib.sha256()
    for ids, prompt_len in sequences:
        digest.update(json.dumps([prompt_len, ids]).encode())
    left_out = (TrainConfig.RESUMABLE_CHANGES + (() if cfg.gate_steps else TrainConfig.GATE_PHASE)
                + (TrainConfig.DEVICE if cfg.device == "cpu" else ()))
    settings = {k: v for k, v in asdict(cfg).items() if k not in left_out}
    return {"settings": settings, "data_sha256": digest.hexdigest(), "sequences": len(sequences)}


def _batch(sequences, rows: list[int], block_size: int, pad_id: int):
    """tokens [B, S + block_size] (right-padded), lengths [B], prompt lengths [B], S."""
    width = max(len(sequences[r][0]) for r in rows)
    tokens = torch.full((len(rows), width + block_size), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids = sequences[r][0]
        tokens[i, : len(ids)] = torch.tensor(ids)
    lengths = torch.tensor([len(sequences[r][0]) for r in rows])
    prompt_lengths = torch.tensor([sequences[r][1] for r in rows])
    return tokens, lengths, prompt_lengths, width


def sample_response_anchors(generator: torch.Generator, prompt_lengths: torch.Tensor, lengths: torch.Tensor,
                            num_anchors: int) -> torch.Tensor:
    """Anchors [B, A] uniform in [max(prompt_len - 1, 1), length - 2]: every label a block predicts at
    position 1 is a response token, every block has context, and at least one label."""
    lo = (prompt_lengths - 1).clamp(min=1)
    hi = (lengths - 2).clamp(min=lo)
    u = torch.rand((lengths.shape[0], num_anchors), generator=generator)
    return lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])


def _save_state(state_dir: Path, payload: dict) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / "state.pt.tmp"
    torch.save(payload, tmp)
    os.replace(tmp, state_dir / "state.pt")


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None,
          log=print) -> TrainResult:
    """Train a drafter; write it to cfg.out (our checkpoint format) and its resumable state to
    cfg.out/train_state/. `stop_after`: end this call after that many total steps (as an interruption)."""
    from transformers import AutoTokenizer

    from ..checkpoint import load_drafter, save_drafter
    from ..drafter import context_features
    from ..hf import load_target

    if cfg.num_modes < 1:
        raise ValueError(f"--num-modes must be >= 1, got {cfg.num_modes}")
    if cfg.mode_gate and cfg.num_modes < 2:
        raise ValueError(f"--mode-gate weighs K >= 2 modes, got --num-modes {cfg.num_modes}")
    if cfg.gate_steps < 0 or (cfg.gate_steps and not cfg.mode_gate):
        raise ValueError(f"--gate-steps {cfg.gate_steps}: needs --mode-gate and a count >= 0")
    if cfg.loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {cfg.loss!r}")
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {cfg.dtype!r}")
    out = Path(cfg.out)
    state_dir = out / STATE_DIR
    state_path = state_dir / "state.pt"
    if state_path.is_file() and not resume:
        raise FileExistsError(f"{state_path} exists: pass --resume to continue that run, or choose a new --out")

    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    dtype = DTYPES[cfg.dtype]
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.target))
    device = torch.device(cfg.device)
    target = load_target(cfg.target, dtype=dtype, device=device)
    target.requires_grad_(False)
    # Frozen: the target's embeddings and lm_head are used as they are and never trained.
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sequences = load_sequences(cfg.data, cfg.max_seq_len)
    drafter, raw = init_drafter(cfg, target, tokenizer, sequences, generator)
    drafter.to(device)  # made on the CPU from the CPU generator: the same start on any device
    block_size = drafter.cfg.block_size
    fingerprint = _fingerprint(cfg, sequences)
    params = [p for p in drafter.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=0.0, weight_decay=0.0)
    # The gate's gradient stays out of the body's clipping norm (see the module docstring).
    gate_params = set() if drafter.mode_prior is None else set(drafter.mode_prior.parameters())
    body_params = [p for p in params if p not in gate_params]
    peak = cfg.lr if cfg.lr is not None else (1e-4 if cfg.init_from else 6e-4)
    warmup = max(1, round(cfg.warmup * cfg.steps))
    default_path = drafter.default_mode_embed is not None

    step = 0
    if resume and state_path.is_file():
        state = torch.load(state_path, weights_only=False, map_location=device)
        if state["fingerprint"] != fingerprint:
            old, new = state["fingerprint"], fingerprint
            diff = {k: (old["settings"].get(k), v) for k, v in new["settings"].items() if old["settings"].get(k) != v}
            if old["data_sha256"] != new["data_sha256"]:
                diff["data"] = (f"{old['sequences']} sequences", f"{new['sequences']} sequences (other contents)")
            raise ValueError(f"--resume: this run differs from the saved one in {diff} (saved, now)")
        if state.get("draft_vocab") is not None:
            drafter.draft_vocab = state["draft_vocab"].to(device)
        drafter.load_state_dict(state["drafter"])
        optimizer.load_state_dict(state["optimizer"])
        generator.set_state(state["generator"].cpu())
        torch.set_rng_state(state["torch_rng"].cpu())
        step = state["step"]
        log(f"[train] resumed at step {step} from {state_path}")
    elif resume:
        log(f"[train] --resume: no state in {state_dir}, starting from step 0")

    (state_dir).mkdir(parents=True, exist_ok=True)
    (state_dir / "settings.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")

    def save(at_step: int, pending_log: list[dict]) -> None:
        save_drafter(out, raw, {name: w.cpu() for name, w in drafter.checkpoint_weights().items()})
        _save_state(state_dir, {
            "step": at_step, "drafter": drafter.state_dict(), "optimizer": optimizer.state_dict(),
            "generator": generator.get_state(), "torch_rng": torch.get_rng_state(),
            "fingerprint": fingerprint, "draft_vocab": drafter.draft_vocab,
        })
        with open(state_dir / "log.jsonl", "a") as fh:
            for line in pending_log:
                fh.write(json.dumps(line) + "\n")
        pending_log.clear()

    total = cfg.steps + cfg.gate_steps
    end = total if stop_after is None else min(total, stop_after)
    losses: list[float] = []
    wins_total = torch.zeros(drafter.cfg.num_modes, dtype=torch.long)
    pending: list[dict] = []
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == torch.bfloat16 else nullcontext()
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=step, disable=not progress, desc="train", unit="step")
    smooth = None
    drafter.train()
    try:
        while step < end:
            gate_only = step >= cfg.steps
            if gate_only:
                for p in body_params:  # no graph and no gradient for the body: AdamW skips it
                    p.requires_grad_(False)
            rows = torch.randint(0, len(sequences), (cfg.batch_size,), generator=generator).tolist()
            tokens, lengths, prompt_lengths, width = _batch(sequences, rows, block_size, pad_id)
            anchors = sample_response_anchors(generator, prompt_lengths, lengths, cfg.anchors)
            tokens, lengths, anchors = tokens.to(device), lengths.to(device), anchors.to(device)
            with torch.no_grad():  # one target forward per training sequence (right padding: causal, no mask)
                hidden_states = target(tokens[:, :width], output_hidden_states=True).hidden_states
                features = context_features(hidden_states, drafter.cfg.target_layer_ids)
            with autocast:
                result = block_loss(drafter, embed, lm_head, tokens, features, anchors, lengths=lengths,
                                    loss=cfg.loss, alpha=cfg.alpha, winner_share=cfg.winner_share,
                                    default_path=default_path and not gate_only)
            if gate_only:
                lr = cosine_lr(step - cfg.steps, cfg.gate_steps, cfg.gate_lr or GATE_LR, 1)
                optimizer_step(optimizer, result.loss, lr)
            else:
                lr = cosine_lr(step, cfg.steps, peak, warmup)
                optimizer_step(optimizer, result.loss, lr, clip_params=body_params)
            step += 1
            value = float(result.loss.detach())
            losses.append(value)
            smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
            line = {"step": step, "loss": value, "cross_entropy": float(result.cross_entropy), "lr": lr, "accuracy": [round(float(a), 4) for a in result.accuracy]}
            postfix = {"loss": f"{smooth:.3f}", "ce": f"{float(result.cross_entropy):.2f}", "lr": f"{lr:.1e}", "acc@1": f"{float(result.accuracy[0]):.2f}"}
            if result.default_loss is not None:
                line["default_loss"] = float(result.default_loss)
            if result.gate_loss is not None:
                line["gate_loss"], line["gate_accuracy"] = float(result.gate_loss), float(result.gate_accuracy)
                postfix["gate@1"] = f"{float(result.gate_accuracy):.2f}"
            if result.wins is not None:
                wins_total += result.wins.cpu()
                line["wins"] = result.wins.tolist()
                usage = wins_total.float() / wins_total.sum()
                postfix["modes"] = "/".join(f"{u:.2f}" for u in usage.tolist())
                postfix["eff"] = f"{float(torch.exp(-(usage * usage.clamp(min=1e-12).log()).sum())):.1f}"
            pending.append(line)
            bar.update(1)
            bar.set_postfix(postfix)
            if step % cfg.save_every == 0 or step == end:
                save(step, pending)
    finally:
        bar.close()
    drafter.eval()
    if not (out / "config.json").is_file():
        save(step, pending)
    load_drafter(out)  # what we wrote must load
    usage = None
    if drafter.cfg.num_modes > 1 and wins_total.sum() > 0:
        usage = (wins_total.float() / wins_total.sum()).tolist()
        log(f"[train] mode usage (share of examples won): {' '.join(f'{u:.2f}' for u in usage)}")
    log(f"[train] step {step}/{total}: wrote {out}")
    return TrainResult(out, step, losses, usage)
