"""Tensor parallelism on real SGLang CPU servers (`--tp-size 2`: two scheduler processes, one core
each, gloo collectives; the make-tiny pair in fp32). Plain decoding, MFD and MFD_D at TP 2 emit the
target's greedy tokens for concurrent requests; on MFD and MFD_D every request's rounds, on each rank
(the round-trace test plugin), are the single-rank reference engine's for the arms drafted, and the
accept length is stated; seeded requests on a law with spread (among an unseeded one, alone and batched)
emit exactly the single-rank reference's samples, and greedy requests
that follow are still exact, which they would not be if the two ranks' trees or accepted paths had
parted (their KV caches would differ and the all-reduced logits with them), and nothing hangs. The MFD
servers run with a test plugin (`tests/plugins/rank_rng/rank_rng.py`) that gives each rank's torch generator a
seed of its own, so an unseeded request's coins differ across ranks and only the worker's broadcasts of
rank 0's first token and accepted paths keep the ranks together. Every server ends idle, healthy and leak-free."""

from __future__ import annotations

import concurrent.futures
import re

import pytest
import requests

from conftest import reference_drafter, target_greedy
from references import SPREAD_LAW, assert_served_as_reference_rounds, request_law, spread_samples
from servers import (Served, admitted_together, generate_ids, log_tail, plugin_env, round_traces, served_without_leaks,
                     start_server)

MAX_NEW = 24
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}  # a core per rank


@pytest.fixture(scope="module", params=[("plain", None), ("MFD", 8), ("MFD_D", 8)], ids=lambda p: p[0])
def tp_server(request, tiny_pair, tmp_path_factory):
    algorithm, budget = request.param
    algorithm = None if algorithm == "plain" else algorithm
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter" if algorithm else None, algorithm, budget,
                       threshold=2 if algorithm == "MFD_D" else None, log_level="info", max_running=8,
                       extra_args=("--tp-size", "2", *(("--mfd-warmup", "on") if algorithm == "MFD_D" else ())),
                       extra_env={**TP_ENV, **plugin_env("hold_admission", *(("rank_rng", "round_trace") if algorithm else ()))})
    srv.algorithm = algorithm
    yield from served_without_leaks(srv)


def prompt_ids(tok, tiny_prompts) -> list[list[int]]:
    return [tok(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts[:4]]


def test_every_rank_warms_up_before_the_server_is_ready(tp_server):
    """MFD_D at TP 2 with `--mfd-warmup on` (the default on CUDA): both ranks run the start-up warm-up's rounds (the
    verify forwards' collectives in step), before SGLang reports ready; the tests here run after it."""
    if tp_server.algorithm != "MFD_D":
        pytest.skip("the warm-up runs on the MFD_D server")
    log = tp_server.log()
    ranks = re.findall(r"TP(\d)\] MFD: start-up warm-up in [\d.]+ s: (\d+) placeholder rounds", log)
    assert sorted(rank for rank, _ in ranks) == ["0", "1"] and len({rounds for _, rounds in ranks}) == 1, \
        log_tail(tp_server.log_path)
    assert log.rindex("MFD: start-up warm-up") < log.index("The server is fired up and ready to roll!")


def test_tp2_serves_concurrent_requests_exactly(tp_server, reference_target, tiny_pair, hf_target, tiny_prompts):
    model, tok = hf_target
    info = requests.get(tp_server.base_url + "/server_info", timeout=60).json()
    assert info["tp_size"] == 2
    prompts = prompt_ids(tok, tiny_prompts)
    with admitted_together(tp_server, len(prompts)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate_ids(tp_server, ids, MAX_NEW), prompts))
    for ids, (got, meta) in zip(prompts, outs):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(tp_server.log_path)
    if tp_server.algorithm is None:
        return
    served = [Served(ids, MAX_NEW, meta) for ids, (_, meta) in zip(prompts, outs)]
    drafter = reference_drafter(tiny_pair / "drafter")
    for rank in (0, 1):
        assert_served_as_reference_rounds(served, round_traces(tp_server, tp_rank=rank), reference_target, drafter,
                                          ignored_arm=None)
    accept = len(prompts) * MAX_NEW / sum(meta["spec_verify_ct"] for _, meta in outs)
    print(f"{tp_server.algorithm} at TP 2: accept length {accept:.2f}, each rank's rounds the reference's")


def test_tp2_seeded_sampling_equals_the_single_rank_reference(tp_server, hf_target, tiny_prompts):
    """A law with spread (`SPREAD_LAW`) at TP 2, four requests at once (MFD_D: its single-mode path), three
    with a seed and one without, then the first prompt alone with another seed (MFD_D: the K-mode path):
    each seeded output is plain sampling of the single-rank HF target with its seed's coins
    (`reference_sample`, as the TP 1 tests hold it), unlike greedy decoding and the other seed's, and a
    greedy request after them is still exact. Then an unseeded request at T = 4, whose
    coins differ across ranks (the rank_rng plugin), and greedy decoding of its prompt and output: exact
    only if every rank took rank 0's first token and accepted paths (without either broadcast the ranks
    part: the server dies or hangs). Plain SGLang samples with its own seeded sampler, not MFD's coins:
    not compared here."""
    if tp_server.algorithm is None:
        pytest.skip("plain SGLang's seeded sampler is not MFD's coin stream: no single-rank reference here")
    reseeded = set(re.findall(r"rank_rng: TP rank (\d) reseeded torch with (\d+)", tp_server.log_path.read_text()))
    assert {rank for rank, _ in reseeded} == {"0", "1"} and len({seed for _, seed in reseeded}) == 2, reseeded
    model, tok = hf_target
    prompts = prompt_ids(tok, tiny_prompts)
    seeds = [11, 12, 13, None]
    law = request_law(SPREAD_LAW)
    with admitted_together(tp_server, len(prompts)), concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        sampled = list(pool.map(lambda i: generate_ids(tp_server, prompts[i], MAX_NEW, **law,
                                                       **({} if seeds[i] is None else {"sampling_seed": seeds[i]})),
                                range(len(prompts))))
    alone, _ = generate_ids(tp_server, prompts[0], MAX_NEW, **law, sampling_seed=14)
    first_prompt = spread_samples(model, prompts[0], MAX_NEW, [11, 14])  # two seeds on one prompt
    assert [sampled[0][0], alone] == first_prompt, log_tail(tp_server.log_path)
    for i in (1, 2):
        assert sampled[i][0] == spread_samples(model, prompts[i], MAX_NEW, [seeds[i]])[0], (i, log_tail(tp_server.log_path))
    assert all(meta["completion_tokens"] == MAX_NEW for _, meta in sampled)
    got, _ = generate_ids(tp_server, prompts[0], MAX_NEW)
    assert got == target_greedy(model, prompts[0], MAX_NEW), log_tail(tp_server.log_path)
    # Unseeded and hot (the tiny target is too sure of itself at T = 1 for coins to matter): each rank draws
    # its own coins (tests/plugins/rank_rng/rank_rng.py). Greedy on the prompt and what came back is exact only if
    # every rank committed rank 0's tokens: else the ranks' KV and radix caches hold different continuations.
    hot, _ = generate_ids(tp_server, prompts[1], MAX_NEW, temperature=4.0)
    continued = prompts[1] + hot
    got, _ = generate_ids(tp_server, continued, MAX_NEW)
    assert got == target_greedy(model, continued, MAX_NEW), log_tail(tp_server.log_path)
