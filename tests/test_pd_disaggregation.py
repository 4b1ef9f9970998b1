"""PD disaggregation on real SGLang CPU servers, with a real KV transfer.

A prefill server and a decode server, both MFD on the tiny pair (fp32), joined by SGLang's `mooncake_tcp`
backend (PyPI's mooncake-transfer-engine-non-cuda, TCP on loopback: `mfd_sglang.cpu.launch_server` sets
SGLANG_HOST_IP=127.0.0.1). Each request goes to both servers with the same bootstrap fields, as SGLang's
router sends it. The prefill server's MFD worker writes the prompt's drafter context and samples the first
token; the context moves with the target's KV (the drafter context pool is registered as the draft KV
pool); the decode server's first round drafts from it.

- Greedy requests, concurrent, emit the target's greedy tokens, and each verifies in exactly the rounds it
  takes on a single MFD server (no PD): the same accept length, which a decode server without the prompt's
  drafter context does not reach (it drafts from an empty context).
- Seeded T = 1 requests emit the samples a single MFD server is held to (`reference_sample`), and the single
  server's own output.
- A request aborted on the decode server mid-stream leaves both servers exact and leak-free.
- A decode server that retracts requests (forced by SGLANG_TEST_RETRACT; a retracted request's KV is
  backed up and restored) stays exact, on MFD_D's two paths.
"""

from __future__ import annotations

import concurrent.futures
import random
import uuid

import pytest
import requests

from conftest import target_greedy
from mfd_sglang.server_process import free_port, stream_then_abort
from references import TOP_K_ALL, reference_sample
from servers import assert_healthy_without_leaks, generate_ids, log_tail, post_json, start_server

MAX_NEW = 24
BUDGET = 8
PD_ENV = {"OMP_NUM_THREADS": "1"}  # three servers on two cores


def transfer_args(mode: str, bootstrap_port: int | None = None) -> tuple[str, ...]:
    args = ("--disaggregation-mode", mode, "--disaggregation-transfer-backend", "mooncake_tcp")
    return args + (("--disaggregation-bootstrap-port", str(bootstrap_port)) if bootstrap_port else ())


@pytest.fixture(scope="module")
def pd(tiny_pair, tmp_path_factory):
    """(prefill server, decode server, a single MFD server without PD), all MFD at budget 8."""
    bootstrap_port = free_port()
    servers = []
    try:
        for extra in (transfer_args("prefill", bootstrap_port), transfer_args("decode"), ()):
            servers.append(start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD", BUDGET,
                                        log_level="info", extra_args=extra, extra_env=PD_ENV))
        prefill, decode, single = servers
        prefill.bootstrap_port = bootstrap_port
        yield prefill, decode, single
        for server in servers:
            assert_healthy_without_leaks(server)
    finally:
        for server in servers:
            server.stop()


def pd_payload(prefill, input_ids: list[int], max_new_tokens: int, **sampling) -> dict:
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    return {"input_ids": input_ids, "sampling_params": params, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": prefill.bootstrap_port, "bootstrap_room": random.randrange(1 << 62)}


def pd_generate(prefill, decode, input_ids: list[int], max_new_tokens: int, **sampling) -> tuple[list[int], dict]:
    """(output ids, meta_info) of the decode server for one request sent to both servers, as SGLang's router
    sends it; the prefill server answers with the first token only."""
    payload = pd_payload(prefill, input_ids, max_new_tokens, **sampling)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(post_json, prefill, "/generate", payload)
        out = post_json(decode, "/generate", payload)
        assert first.result()["meta_info"]["completion_tokens"] == 1
    assert out["output_ids"][0] == first.result()["output_ids"][0]
    return out["output_ids"], out["meta_info"]


@pytest.fixture(scope="module")
def prompts(hf_target, tiny_prompts) -> list[list[int]]:
    _, tok = hf_target
    return [tok(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts]


def test_greedy_requests_are_exact_and_accept_as_on_a_single_server(pd, prompts, hf_target):
    prefill, decode, single = pd
    model, _ = hf_target
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda ids: pd_generate(prefill, decode, ids, MAX_NEW), prompts))
    for ids, (got, _) in zip(prompts, served):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(decode.log_path)
    # One at a time on both, so that batching cannot change a round: the prompt's drafter context arrived.
    for ids in prompts:
        got, meta = pd_generate(prefill, decode, ids, MAX_NEW)
        alone, alone_meta = generate_ids(single, ids, MAX_NEW)
        assert got == alone
        assert meta["spec_verify_ct"] == alone_meta["spec_verify_ct"], (ids, meta, alone_meta)
    accept = len(prompts) * MAX_NEW / sum(meta["spec_verify_ct"] for _, meta in served)
    assert accept > 3.0, f"accept length {accept:.2f}: too little speculation to prove the tree"
    print(f"PD greedy accept length {accept:.2f}")


def test_seeded_sampling_equals_a_single_mfd_server(pd, prompts, hf_target):
    prefill, decode, single = pd
    model, _ = hf_target
    sample = dict(temperature=1.0, top_p=0.9)
    seeds = list(range(21, 21 + len(prompts)))
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        served = list(pool.map(lambda i: pd_generate(prefill, decode, prompts[i], MAX_NEW, **sample,
                                                     sampling_seed=seeds[i]), range(len(prompts))))
    for ids, seed, (got, _) in zip(prompts, seeds, served):
        assert got == reference_sample(model, ids, MAX_NEW, (1.0, TOP_K_ALL, 0.9, 0.0), seed), log_tail(decode.log_path)
        assert got == generate_ids(single, ids, MAX_NEW, **sample, sampling_seed=seed)[0]


def test_an_abort_on_the_decode_server_leaves_both_servers_exact(pd, prompts, hf_target):
    prefill, decode, _ = pd
    model, _ = hf_target
    payload = {**pd_payload(prefill, prompts[2], 200), "rid": uuid.uuid4().hex, "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(requests.post, prefill.base_url + "/generate", json=payload, timeout=300)
        chunks = stream_then_abort(decode, payload, abort_after=3, timeout=300)
        assert first.result().status_code == 200
    assert chunks[-1]["finish_reason"]["type"] == "abort", chunks[-1]
    got, _ = pd_generate(prefill, decode, prompts[2], MAX_NEW)
    assert got == target_greedy(model, prompts[2], MAX_NEW)
    assert_healthy_without_leaks(decode)
    assert_healthy_without_leaks(prefill)


def test_retraction_on_the_decode_server_keeps_exactness(pd, prompts, hf_target, tiny_pair, tmp_path_factory):
    """A second decode server, MFD_D switching to its single-mode path at 2 running requests, with a
    retraction forced every third forward; its requests' KV is backed up and restored (`cpu_tensor`)."""
    prefill, _, _ = pd
    model, _ = hf_target
    decode = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", BUDGET, threshold=2,
                          log_level="info", extra_args=transfer_args("decode"),
                          extra_env={**PD_ENV, "SGLANG_TEST_RETRACT": "1"})
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            served = list(pool.map(lambda ids: pd_generate(prefill, decode, ids, MAX_NEW), prompts[:3]))
        assert "retract" in decode.log().lower(), "no request was retracted: the case proves nothing"
        for ids, (got, _) in zip(prompts, served):
            assert got == target_greedy(model, ids, MAX_NEW), log_tail(decode.log_path)
        assert_healthy_without_leaks(decode)
    finally:
        decode.stop()
