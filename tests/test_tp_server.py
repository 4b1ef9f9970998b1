"""Tensor parallelism on real SGLang CPU servers (`--tp-size 2`: two scheduler processes, one core
each, gloo collectives; the make-tiny pair in fp32). Plain decoding, MFD and MFD_D at TP 2 emit the
target's greedy tokens for concurrent requests; sampled (T = 1) requests run to their length on MFD
and MFD_D, and greedy requests that follow are still exact, which they would not be if the two ranks'
trees or accepted paths had parted (their KV caches would differ and the all-reduced logits with
them), and nothing hangs. Every server ends idle, healthy and leak-free."""

from __future__ import annotations

import concurrent.futures

import pytest
import requests

from conftest import target_greedy
from servers import generate_ids, log_tail
from test_mfd_server import served_without_leaks, start_server

MAX_NEW = 24
TP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}  # a core per rank


@pytest.fixture(scope="module", params=[("plain", None), ("MFD", 8), ("MFD_D", 8)], ids=lambda p: p[0])
def tp_server(request, tiny_pair, tmp_path_factory):
    algorithm, budget = request.param
    algorithm = None if algorithm == "plain" else algorithm
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter" if algorithm else None, algorithm, budget,
                       threshold=2 if algorithm == "MFD_D" else None, extra_args=("--tp-size", "2"), extra_env=TP_ENV)
    srv.algorithm = algorithm
    yield from served_without_leaks(srv)


def prompt_ids(tok, tiny_prompts) -> list[list[int]]:
    return [tok(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts[:4]]


def test_tp2_serves_concurrent_requests_exactly(tp_server, hf_target, tiny_prompts):
    model, tok = hf_target
    info = requests.get(tp_server.base_url + "/server_info", timeout=60).json()
    assert info["tp_size"] == 2
    prompts = prompt_ids(tok, tiny_prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate_ids(tp_server, ids, MAX_NEW), prompts))
    for ids, (got, meta) in zip(prompts, outs):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(tp_server.log_path)
    if tp_server.algorithm is not None:
        assert sum(meta["spec_verify_ct"] for _, meta in outs) < len(prompts) * MAX_NEW  # it speculated


def test_tp2_sampled_requests_keep_the_ranks_together(tp_server, hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = prompt_ids(tok, tiny_prompts)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        sampled = list(pool.map(lambda ids: generate_ids(tp_server, ids, MAX_NEW, temperature=1.0, top_p=0.9), prompts))
    assert all(meta["completion_tokens"] == MAX_NEW for _, meta in sampled)
    got, _ = generate_ids(tp_server, prompts[0], MAX_NEW)
    assert got == target_greedy(model, prompts[0], MAX_NEW), log_tail(tp_server.log_path)
