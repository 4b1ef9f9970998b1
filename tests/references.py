"""References and inputs that several test modules hold the code to.

- `sglang_law`: SGLang's plain sampling law, from SGLang's own sampler function (not MFD's `plain_law`).
- `reference_sample`: plain autoregressive sampling of an HF model with a seed's coins, what a seeded
  request must give whatever the tree, the drafter or the batch.
- `SPREAD_LAW` / `spread_samples`: a sampling law with real spread on the tiny target, and the reference
  samples of seeds under it, checked to differ from greedy decoding and from each other (a seeded check on a
  law that keeps one token would pass on a server that ran it greedily or ignored the seed).
- `reference_rounds`: the reference engine's greedy rounds when round i drafts arm i, what a server's
  traced rounds (`servers.round_traces`) are held to; `verify_summary`: SGLang's per-request round counts
  of a reference generation.
- `assert_follows`: a chi-square goodness-of-fit test (significance 0.001), the one every sampled
  distribution in the suite is held to.
- `make_drafter` / `inputs`: a small random MFD drafter and its context / block inputs.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from mfd_sglang.acceptance import Sampling, sample_from_logits
from mfd_sglang.checkpoint import parse_drafter_config
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.hf import GenerationOutput, SamplingParams, SpeculativeGenerator, plain_greedy

TOP_K_ALL = 1 << 30  # SGLang's top_k for "no top-k"
# temperature, top_k, top_p, min_p: a law with real spread on the tiny target, whose T = 1 top-p 0.9 law
# keeps one token at most steps (a seeded check there cannot tell sampling from greedy decoding).
SPREAD_LAW = (1.5, TOP_K_ALL, 0.95, 0.02)


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


def request_law(settings: tuple) -> dict:
    """A request's sampling_params for settings (temperature, top_k, top_p, min_p)."""
    temperature, top_k, top_p, min_p = settings
    return {"temperature": temperature, "top_k": -1 if top_k == TOP_K_ALL else top_k, "top_p": top_p,
            "min_p": min_p}


def spread_samples(model, input_ids: list[int], max_new_tokens: int, seeds: list[int],
                   settings: tuple = SPREAD_LAW) -> list[list[int]]:
    """`reference_sample` of each seed, checked to be a sampled check's worth: every seed's output differs
    from greedy decoding, and no two seeds give the same output."""
    samples = [reference_sample(model, input_ids, max_new_tokens, settings, seed) for seed in seeds]
    greedy = plain_greedy(model, input_ids, max_new_tokens)
    assert all(sample != greedy for sample in samples), f"a seed samples the greedy output under {settings}"
    assert len({tuple(sample) for sample in samples}) == len(seeds), f"two seeds, one output under {settings}"
    return samples


# --- rounds ------------------------------------------------------------------------------------------
def reference_rounds(target, drafter: MFDDrafter, input_ids: list[int], max_new_tokens: int,
                     arms: list[tuple]) -> tuple[list[int], list[int]]:
    """(output ids, accepted draft tokens per round) of the reference engine's greedy decoding of input_ids
    when round i drafts arms[i] = (single_mode, budget, modes) as the serving worker's `Arm` names it
    (budget 0: a plain-decoding round, the root alone; modes: the gate's best `modes`, None: every mode).
    Accepted tokens are counted before the max_new_tokens cut, as SGLang counts them; rounds after the
    output is complete are not run."""
    engines: dict[tuple, SpeculativeGenerator] = {}

    def engine(single_mode: bool, budget: int, modes: int | None) -> SpeculativeGenerator:
        key = (bool(single_mode), max(budget, 1), modes)  # a plain round: a one-node tree, its root alone kept
        if key not in engines:
            engines[key] = SpeculativeGenerator(target, drafter, budget=key[1], single_mode=key[0], num_modes=modes)
        return engines[key]

    state = engine(False, 1, None).prefill([list(input_ids)], SamplingParams())
    out, accepted = [int(state.roots[0])], []
    for single_mode, budget, modes in arms:
        if len(out) >= max_new_tokens:
            break
        run = engine(single_mode, budget, modes)
        result, forward = run.verify(state, run.build_tree(run.draft(state)))
        accepted.append(0 if budget == 0 else int(result.accept_lens[0]) - 1)
        emitted = result.accepted_tokens[0, : accepted[-1] + 1].tolist()[: max_new_tokens - len(out)]
        out += emitted
        run.commit(state, result, forward, torch.tensor([len(emitted)], device=state.roots.device))
        state.roots = torch.tensor([out[-1]], device=state.roots.device)
    return out, accepted


def assert_rounds_as_reference(traced: list, target, drafter: MFDDrafter, input_ids: list[int],
                               max_new_tokens: int) -> list[int]:
    """A greedy request's rounds as a server ran them (`servers.round_traces`: the arm drafted and the draft
    tokens accepted, each round) are the reference engine's for the same arms: the same accepted count
    every round, and its output the target's greedy decoding. Under overlap scheduling the scheduler may
    run one round more after the request's last token (its tokens are dropped): not held. Returns the
    accepted counts."""
    arms = [r.arm for r in traced]
    out, accepted = reference_rounds(target, drafter, input_ids, max_new_tokens, arms)
    assert out == plain_greedy(target, input_ids, max_new_tokens)
    served = [r.accepted for r in traced]
    assert served[: len(accepted)] == accepted and len(served) - len(accepted) <= 1, list(zip(arms, served, accepted))
    return accepted


def assert_served_as_reference_rounds(served: list, traces: dict, target, drafter: MFDDrafter, *,
                                      ignored_arm: tuple | None) -> list[tuple[list[tuple], list[int]]]:
    """Each greedy request a server served (`servers.Served`) ran its traced rounds as the reference engine
    runs them for the same arms (`assert_rounds_as_reference`); with `ignored_arm`, drafting that arm every
    round instead accepts otherwise on at least one request, so a worker that drafted it whatever the
    chosen arm would fail. Returns (arms, accepted counts) per request."""
    runs, ignored_differs = [], 0
    for request in served:
        traced = traces[request.meta["id"]]
        accepted = assert_rounds_as_reference(traced, target, drafter, request.input_ids, request.max_new_tokens)
        runs.append(([r.arm for r in traced][: len(accepted)], accepted))
        if ignored_arm is not None:
            _, ignored = reference_rounds(target, drafter, request.input_ids, request.max_new_tokens,
                                          [ignored_arm] * len(traced))
            ignored_differs += ignored != accepted
    assert ignored_arm is None or ignored_differs, f"drafting {ignored_arm} every round accepts the same: no proof"
    return runs


def verify_summary(reference: GenerationOutput) -> tuple[int, list[int], int]:
    """What SGLang's meta_info reports of a request generated as `reference` (spec_verify_ct,
    spec_correct_drafts_histogram, completion_tokens): rounds, rounds per count of accepted draft tokens
    (before the max_new_tokens cut), and the prefill's token (no round) + what the rounds emitted."""
    histogram = [0] * (max(r.accepted for r in reference.rounds) + 1)
    for r in reference.rounds:
        histogram[r.accepted] += 1
    return len(reference.rounds), histogram, 1 + sum(r.emitted for r in reference.rounds)


def served_summary(meta: dict) -> tuple[int, list[int], int]:
    """The same counts from a server's meta_info."""
    return meta["spec_verify_ct"], meta["spec_correct_drafts_histogram"], meta["completion_tokens"]


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
