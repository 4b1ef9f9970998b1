"""T > 0 in real SGLang servers on CPU (fp32, the make-tiny pair): an MFD server samples by the plain
server's law and a request's sampling_seed fixes its output.

- Law: the first three tokens of many requests at temperature 2 with top-k, top-p and min-p, from an
  MFD server (one sampling_seed per request: a fixed outcome) and from a plain server, against the
  exact joint law that SGLang's own sampler function (`tests/references.py: sglang_law`) gives on the
  HF target's logits; chi-square at 0.001. The plain server's run shows the reference is its law.
  The setting keeps more tokens than top-k, renormalise, then top-p would.
- Seeds: a seeded request gives the same tokens alone and among concurrent requests, and they are
  plain autoregressive sampling with that seed's coins (`reference_sample`); other seeds give other
  tokens; unseeded requests in one batch do not share a stream. `request_sampling`'s seeds, checked
  on stand-in batches.
"""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import pytest
import torch

from references import SPREAD_LAW, TOP_K_ALL, assert_follows, reference_sample, request_law, sglang_law
from servers import admitted_together, generate_ids, plugin_env, served_without_leaks, start_server

PROMPT = "hello , what next ?"
# temperature, top_k, top_p, min_p: at most of this prompt's first three steps top-k 3 and top-p .55
# keep two or three tokens where top-k, renormalise, top-p keeps one; min-p .08 drops some.
LAW = (2.0, 3, 0.55, 0.08)
RUNS = 300  # requests per server


@pytest.fixture(scope="module")
def mfd_server(tiny_pair, tmp_path_factory):
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD", 8, max_running=8,
                       extra_env=plugin_env("hold_admission"))  # batched cases: `servers.admitted_together`
    yield from served_without_leaks(srv)


def exact_joint_law(model, ids: list[int], settings: tuple, length: int) -> dict[tuple, float]:
    """P(first `length` tokens) under SGLang's plain law on the HF target, enumerated over its support."""
    law: dict[tuple, float] = {}

    def extend(prefix: list[int], p: float) -> None:
        if len(prefix) == length:
            law[tuple(prefix)] = p
            return
        with torch.inference_mode():
            logits = model(torch.tensor([ids + prefix])).logits[0, -1:]
        step = sglang_law(logits, *settings)[0]
        for token in step.nonzero()[:, 0].tolist():
            extend(prefix + [token], p * step[token].item())

    extend([], 1.0)
    return law


def sample_many(server, ids: list[int], settings: tuple, seeds: list[int | None], max_new_tokens: int):
    """(output ids, meta_info) of one request per seed (None: no sampling_seed), 8 at a time."""
    def one(seed):
        extra = {} if seed is None else {"sampling_seed": seed}
        return generate_ids(server, ids, max_new_tokens, **request_law(settings), **extra)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, seeds))


def tally(outputs) -> dict[tuple, int]:
    counts: dict[tuple, int] = {}
    for got, _ in outputs:
        counts[tuple(got)] = counts.get(tuple(got), 0) + 1
    return counts


# --- the law -----------------------------------------------------------------------------------------
def test_plain_server_samples_the_reference_law(plain_server, hf_target):
    model, tok = hf_target
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    outputs = sample_many(plain_server, ids, LAW, [None] * RUNS, 3)
    assert_follows(tally(outputs), exact_joint_law(model, ids, LAW, 3), "plain server")


def test_mfd_server_samples_the_plain_law(mfd_server, hf_target):
    model, tok = hf_target
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    outputs = sample_many(mfd_server, ids, LAW, list(range(RUNS)), 3)
    assert_follows(tally(outputs), exact_joint_law(model, ids, LAW, 3), "MFD server")
    # Tokens 2 and 3 came from verify rounds; in some requests both from one round (a draft accepted).
    one_round = sum(meta["spec_verify_ct"] == 1 for _, meta in outputs)
    assert one_round >= RUNS // 10, f"only {one_round} of {RUNS} requests accepted a draft token"


# --- seeds -------------------------------------------------------------------------------------------
def test_a_seed_fixes_the_output_alone_and_in_a_batch(mfd_server, hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in (PROMPT, tiny_prompts[5])]
    n = 12
    cases = [(i, seed) for i in range(2) for seed in (1, 2)]
    alone = {case: generate_ids(mfd_server, prompts[case[0]], n, **request_law(SPREAD_LAW),
                                sampling_seed=case[1])[0] for case in cases}
    for (i, seed), got in alone.items():
        assert got == reference_sample(model, prompts[i], n, SPREAD_LAW, seed), (i, seed)
    assert alone[(0, 1)] != alone[(0, 2)] or alone[(1, 1)] != alone[(1, 2)], "two seeds, one output"

    # Again, all at once and among unseeded requests: same tokens.
    def run(job):
        i, seed = job
        extra = {} if seed is None else {"sampling_seed": seed}
        return generate_ids(mfd_server, prompts[i], n, **request_law(SPREAD_LAW), **extra)[0]

    jobs = cases + [(0, None), (1, None), (0, None)]
    with admitted_together(mfd_server, len(jobs)), concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        batched = dict(zip(jobs, pool.map(run, jobs)))
    for case in cases:
        assert batched[case] == alone[case], case


def test_unseeded_requests_in_one_batch_draw_apart(mfd_server, hf_target):
    """Eight identical unseeded requests at once: all different. At temperature 2 independent
    24-token draws practically never agree (no two of 200 reference draws share even their first 8
    tokens); requests sharing a stream agree."""
    _, tok = hf_target
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    with admitted_together(mfd_server, 8):
        outputs = sample_many(mfd_server, ids, (2.0, TOP_K_ALL, 1.0, 0.0), [None] * 8, 24)
    assert len({tuple(got) for got, _ in outputs}) == 8


def test_request_sampling_seeds():
    """Per-request seeds in a stand-in batch: sampling_seed where given, fresh random ones elsewhere
    (each round), SGLang's own under deterministic inference; a seeded batch drops the top-k bound."""
    from mfd_sglang.serving.accept import request_sampling

    def batch(seeds: list, top_ks: list[int], sglang_seeds=None):
        info = SimpleNamespace(temperatures=torch.ones(len(seeds), 1), top_ks=torch.tensor(top_ks),
                               top_ps=torch.ones(len(seeds)), min_ps=torch.zeros(len(seeds)),
                               sampling_seed=sglang_seeds, max_top_k=max(top_ks))
        reqs = [SimpleNamespace(sampling_params=SimpleNamespace(sampling_seed=s)) for s in seeds]
        return SimpleNamespace(sampling_info=info, reqs=reqs)

    unseeded = batch([None, None], [4, 6])
    first, second = request_sampling(unseeded), request_sampling(unseeded)
    assert first.max_top_k == 6 and first.seeds[0] != first.seeds[1]
    assert not torch.equal(first.seeds, second.seeds)  # a fresh stream every round
    mixed = request_sampling(batch([None, 7, -(2**63)], [4, 6, 5]))
    assert mixed.seeds[1:].tolist() == [7, -(2**63)] and mixed.max_top_k is None
    assert request_sampling(batch([None, 7], [4, 6], torch.tensor([42, 7]))).seeds.tolist() == [42, 7]
