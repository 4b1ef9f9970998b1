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
- Seeded requests, on a law with spread (their samples differ from greedy decoding and across seeds), emit
  the samples a single MFD server is held to (`reference_sample`), and the single server's own output.
- A request aborted on the decode server mid-stream leaves both servers exact and leak-free.
- A decode server that retracts requests (forced by SGLANG_TEST_RETRACT; a retracted request's KV is
  backed up and restored; SGLang's own log line counts the retracted requests) stays exact, on MFD_D's two
  paths (the round-trace test plugin shows rounds of each), and every request's rounds are the reference
  engine's for the arms it drafted: its drafter context survived the retraction.
"""

from __future__ import annotations

import concurrent.futures
import random
import re

import pytest
import requests

from conftest import reference_drafter, target_greedy
from mfd_sglang.server_process import free_port, stream_then_abort
from references import SPREAD_LAW, assert_served_as_reference_rounds, request_law, spread_samples
from servers import (Served, admitted_together, assert_healthy_without_leaks, generate_ids, held_rid, log_tail,
                     plugin_env, post_json, round_traces, start_server)

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
        # the decode server holds a `held_rid` request's decoding until it is aborted
        for extra, env in ((transfer_args("prefill", bootstrap_port), PD_ENV),
                           (transfer_args("decode"), {**PD_ENV, **plugin_env("hold_decode")}), ((), PD_ENV)):
            servers.append(start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD", BUDGET,
                                        log_level="info", extra_args=extra, extra_env=env))
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
    seeds = {i: [21 + i] + ([99] if i == 0 else []) for i in range(len(prompts))}  # two seeds on the first prompt
    expected = {(i, seed): got for i, its in seeds.items()
                for seed, got in zip(its, spread_samples(model, prompts[i], MAX_NEW, its))}
    jobs = list(expected)
    sample = request_law(SPREAD_LAW)
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        served = list(pool.map(lambda job: pd_generate(prefill, decode, prompts[job[0]], MAX_NEW, **sample,
                                                       sampling_seed=job[1]), jobs))
    for (i, seed), (got, _) in zip(jobs, served):
        assert got == expected[i, seed], log_tail(decode.log_path)
        assert got == generate_ids(single, prompts[i], MAX_NEW, **sample, sampling_seed=seed)[0]


def test_an_abort_on_the_decode_server_leaves_both_servers_exact(pd, prompts, hf_target):
    """Aborted once 8 tokens are out, and the decode server decodes it no further until the abort lands
    (`hold_decode`): the abort lands in flight on any machine."""
    prefill, decode, _ = pd
    model, _ = hf_target
    held_at = 8
    payload = {**pd_payload(prefill, prompts[2], 200), "rid": held_rid(held_at), "stream": True}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(requests.post, prefill.base_url + "/generate", json=payload, timeout=300)
        chunks = stream_then_abort(decode, payload, abort_after=held_at, timeout=300, tokens=True)
        assert first.result().status_code == 200
    assert all(chunk["finish_reason"] is None for chunk in chunks[:-1]), chunks
    assert chunks[-1]["finish_reason"]["type"] == "abort", chunks[-1]
    got, _ = pd_generate(prefill, decode, prompts[2], MAX_NEW)
    assert got == target_greedy(model, prompts[2], MAX_NEW)
    assert_healthy_without_leaks(decode)
    assert_healthy_without_leaks(prefill)


def test_retraction_on_the_decode_server_keeps_exactness(pd, prompts, reference_target, hf_target, tiny_pair,
                                                         tmp_path_factory):
    """A second decode server, MFD_D switching to its single-mode path at 2 running requests, with a
    retraction forced every third forward; its requests' KV is backed up and restored (`cpu_tensor`). Without
    overlap scheduling, so that each request's traced rounds are the rounds its output came from (with
    overlap, a round in flight when its request is retracted is run again).

    Certain on any machine: the server admits no request until all three have arrived (`hold_admission`), so
    they decode together from their first round; each needs at least three rounds (23 tokens after the
    prefill's, at most BUDGET + 1 a round), and of three consecutive forwards one is a retraction forward.
    A fourth request afterwards, alone, drafts MFD_D's K-mode path."""
    prefill, _, _ = pd
    model, _ = hf_target
    decode = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", BUDGET, threshold=2,
                          log_level="info", extra_args=(*transfer_args("decode"), "--disable-overlap-schedule"),
                          extra_env={**PD_ENV, "SGLANG_TEST_RETRACT": "1", **plugin_env("round_trace", "hold_admission")})
    try:
        together, alone = prompts[:3], prompts[3]
        with admitted_together(decode, len(together)), concurrent.futures.ThreadPoolExecutor(len(together)) as pool:
            served = list(pool.map(lambda ids: pd_generate(prefill, decode, ids, MAX_NEW), together))
        retracted = sum(map(int, re.findall(r"Testing retraction\. #retracted_reqs: (\d+)", decode.log())))
        assert retracted > 0, "no request was retracted: the case proves nothing"
        served.append(pd_generate(prefill, decode, alone, MAX_NEW))
        sent = [*together, alone]
        for ids, (got, _) in zip(sent, served):
            assert got == target_greedy(model, ids, MAX_NEW), log_tail(decode.log_path)
        traces = round_traces(decode)
        paths = {r.arm[0] for rounds in traces.values() for r in rounds}
        assert paths == {False, True}, f"MFD_D's paths drafted (single_mode): {paths}"
        assert_served_as_reference_rounds([Served(ids, MAX_NEW, meta) for ids, (_, meta) in zip(sent, served)],
                                          traces, reference_target, reference_drafter(tiny_pair / "drafter"),
                                          ignored_arm=None)
        accept = len(sent) * MAX_NEW / sum(meta["spec_verify_ct"] for _, meta in served)
        print(f"PD decode with {retracted} retraction(s): accept length {accept:.2f}")
        assert_healthy_without_leaks(decode)
    finally:
        decode.stop()
