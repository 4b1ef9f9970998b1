"""References and inputs that several test modules hold the code to.

- `sglang_law`: SGLang's plain sampling law, from SGLang's own sampler function (not MFD's `plain_law`).
- `reference_sample`: plain autoregressive sampling of an HF model with a seed's coins, what a seeded
  request must give whatever the tree, the drafter or the batch.
- `assert_follows`: a chi-square goodness-of-fit test (significance 0.001), the one every sampled
  distribution in the suite is held to.
- `make_drafter` / `inputs`: a small random MFD drafter and its context / block inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from mfd_sglang.checkpoint import parse_drafter_config
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.verify import Sampling, sample_from_logits

TOP_K_ALL = 1 << 30  # SGLang's top_k for "no top-k"


# --- sampling ---------------------------------------------------------------------------------------
def sglang_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float,
               max_top_k: int | None = None) -> torch.Tensor:
    """The distribution [rows, V] (token order) of SGLang's plain sampler, from its own code: the
    pytorch backend's `top_k_top_p_min_p_sampling_from_probs_torch` after what `Sampler.forward`
    does first (logits / temperature, softmax). Its filtered weights, normalised."""
    from sglang.srt.layers.sampler import top_k_top_p_min_p_sampling_from_probs_torch

    rows = logits.shape[0]
    probs = torch.softmax(logits.float() / torch.full((rows, 1), temperature), dim=-1)
    _, kept, ids, _ = top_k_top_p_min_p_sampling_from_probs_torch(
        probs, torch.full((rows,), top_k, dtype=torch.int32), torch.full((rows,), top_p),
        torch.full((rows,), min_p), True, None, torch.zeros(rows, dtype=torch.long),
        return_filtered_probs=True, max_top_k=max_top_k)
    weights = torch.zeros_like(probs).scatter_(-1, ids.long(), kept)
    return weights / weights.sum(-1, keepdim=True)


def reference_sample(model, input_ids: list[int], max_new_tokens: int, settings: tuple, seed: int) -> list[int]:
    """Plain autoregressive sampling of an HF model with `sample_from_logits` and the coins of `seed`
    (settings: temperature, top_k, top_p, min_p): what a seeded request must give, whatever the
    tree, the drafter or the batch."""
    out: list[int] = []
    row = Sampling(*(torch.tensor([v]) for v in settings), torch.tensor([seed]))
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            logits = model(torch.tensor([input_ids + out])).logits[0, -1:]
            # The draw after the token at position len - 1 uses that position's coin.
            out.append(int(sample_from_logits(logits, row, torch.tensor([len(input_ids) + len(out) - 1]))[0]))
    return out


def chi_square_critical(df: int, z: float = 3.09) -> float:
    """Upper quantile of chi-square(df) (Wilson-Hilferty; z = 3.09: significance 0.001)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(counts: dict, expected: dict, what: str = "") -> None:
    """Counts of outcomes follow the probabilities `expected` (outcome -> p): nothing outside its
    support, and a chi-square test at significance 0.001 with cells of expected count < 5 pooled."""
    total = sum(counts.values())
    outside = {k: c for k, c in counts.items() if expected.get(k, 0.0) == 0.0}
    assert not outside, f"{what}: drawn outside the law's support: {outside}"
    small = [k for k, p in expected.items() if p * total < 5]
    cells = [(expected[k] * total, counts.get(k, 0)) for k in expected if k not in small]
    if small:
        cells.append((sum(expected[k] for k in small) * total, sum(counts.get(k, 0) for k in small)))
    assert len(cells) >= 2, f"{what}: a single cell tests nothing"
    chi2 = sum((o - e) ** 2 / e for e, o in cells)
    critical = chi_square_critical(len(cells) - 1)
    assert chi2 < critical, f"{what}: chi-square {chi2:.1f} >= {critical:.1f}: {counts} vs {expected}"


# --- a small random drafter ---------------------------------------------------------------------------
HIDDEN, N_CTX, BLOCK, VOCAB = 32, 2, 6, 50


def make_drafter(num_modes: int = 3, default_mode: int = 0, seed: int = 0, **cfg_changes) -> MFDDrafter:
    raw = {
        "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "intermediate_size": 64, "vocab_size": VOCAB, "block_size": BLOCK,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [0, 1]},
        "mfd_config": {"num_modes": num_modes, "default_mode": default_mode},
    }
    cfg = replace(parse_drafter_config(raw), **cfg_changes)
    torch.manual_seed(seed)
    drafter = MFDDrafter(cfg, context_features=N_CTX * HIDDEN)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() == 2 else 0.1) + (1.0 if p.dim() == 1 else 0.0))
    return drafter.eval()


def inputs(bs: int, ctx_len: int, seed: int = 1):
    """(context features [bs, ctx_len, N_CTX * HIDDEN], their positions, block embeddings [bs, BLOCK,
    HIDDEN], their positions) for `make_drafter`'s drafters."""
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(bs, ctx_len, N_CTX * HIDDEN, generator=gen)
    ctx_pos = torch.arange(ctx_len)[None].expand(bs, -1)
    block_embeds = torch.randn(bs, BLOCK, HIDDEN, generator=gen)
    block_pos = ctx_len + torch.arange(BLOCK)[None].expand(bs, -1)
    return features, ctx_pos, block_embeds, block_pos
