"""Scaling out on real SGLang CPU servers and SGLang's own argument resolution.

- Data-parallel replicas (`--dp-size 2`: SGLang's DataParallelController, one scheduler per replica,
  one core each through `SGLANG_CPU_OMP_THREADS_BIND`, round-robin): every replica starts its own MFD /
  MFD_D worker, and concurrent greedy requests, spread evenly over both replicas, emit the target's
  greedy tokens, each request's rounds the reference engine's for the arms it drafted (the round-trace
  test plugin) and each replica's accept length stated; seeded requests on a law with spread emit, on
  either replica, exactly the samples a single MFD server is held to (`reference_sample`: plain sampling
  of the HF target with the seed's coins), unlike greedy decoding and another seed's; every replica ends
  idle and leak-free. Nothing in the worker knows about replicas.
- Attention data parallelism (`--tp-size 2 --attn-dp-size 2 --enable-dp-lm-head`: one TP group whose
  two ranks each attend for their own requests, dispatched round-robin) passes the same checks: every
  rank starts its worker, concurrent and one-at-a-time requests (the other rank then runs idle
  prefill and verify forwards in step) are exact, greedy and seeded. Without --enable-dp-lm-head it is
  refused at launch in every spelling SGLang accepts (after SGLang's resolution rewrote
  `--dp-size N --enable-dp-attention` into `attn_dp_size=N, dp_size=1`), as are SGLang's DP prefill
  coordination and the automatic budget with it, and PD disaggregation with it on either server;
  replicas, alone and over TP groups, and PD servers pass the same resolution.
"""

from __future__ import annotations

import collections
import concurrent.futures
import re

import pytest
import requests

from conftest import reference_drafter, target_greedy
from references import SPREAD_LAW, assert_served_as_reference_rounds, request_law, spread_samples
from servers import (Served, admitted_together, generate_ids, log_tail, plugin_env, resolve, resolve_cases,
                     round_traces, served_without_leaks, start_server)

MAX_NEW = 16
DP_ENV = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}  # a core per replica


# --- SGLang's argument resolution (`servers.resolve`) ------------------------------------------------
def test_attention_dp_without_dp_lm_head_is_refused_and_replicas_and_pd_pass(tiny_pair):
    old, new, alias, replicas, replicated_tp, prefill, decode, pd_tp = resolve(
        tiny_pair, ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], ["--tp-size", "2", "--attn-dp-size", "2"],
        ["--tp-size", "2", "--attention-data-parallel-size", "2"], ["--dp-size", "2"], ["--tp-size", "2", "--dp-size", "2"],
        ["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"],
        ["--disaggregation-mode", "decode", "--tp-size", "2"])
    for refused in (old, new, alias):
        assert "--attn-dp-size 2 (attention data parallelism" in refused.get("error", ""), refused
        assert "needs --enable-dp-lm-head" in refused["error"], refused
    assert replicas == {"dp_size": 2, "attn_dp_size": 1, "mfd_options": {}}
    assert replicated_tp == {"dp_size": 2, "attn_dp_size": 1, "mfd_options": {}}
    assert prefill == decode == pd_tp == {"dp_size": 1, "attn_dp_size": 1, "mfd_options": {}}  # PD: tests/test_pd_disaggregation.py


def test_pd_under_attention_dp_is_refused_on_either_server(tiny_pair):
    prefill, decode = resolve(tiny_pair, *(["--disaggregation-mode", mode, "--tp-size", "2", "--attn-dp-size", "2",
                                            "--enable-dp-lm-head"] for mode in ("prefill", "decode")))
    for mode, refused in (("prefill", prefill), ("decode", decode)):
        assert (f"--disaggregation-mode {mode} with --attn-dp-size 2: PD disaggregation under attention data "
                "parallelism is not supported") in refused.get("error", ""), refused


def test_attention_dp_with_dp_lm_head_passes_in_either_spelling_and_its_limits_are_refused(tiny_pair):
    attention_dp = ["--tp-size", "2", "--attn-dp-size", "2", "--enable-dp-lm-head"]
    new, old, coordinated, auto = resolve_cases(tiny_pair, [
        (attention_dp, {}), (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--enable-dp-lm-head"], {}),
        (attention_dp, {"SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION": "1"}),
        (attention_dp, {"MFD_SGLANG_AUTO_BUDGET": "1"})])
    assert new == old == {"dp_size": 1, "attn_dp_size": 2, "mfd_options": {}}
    assert "with SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION set" in coordinated.get("error", ""), coordinated
    assert "MFD_SGLANG_AUTO_BUDGET=1 with --tp-size 2" in auto.get("error", ""), auto


# --- data-parallel replicas -------------------------------------------------------------------------
LAYOUTS = {  # (--dp-size, --attn-dp-size) as /server_info reports them: the launch arguments
    (2, 1): ("--dp-size", "2"),
    (1, 2): ("--tp-size", "2", "--attn-dp-size", "2", "--enable-dp-lm-head"),
}


@pytest.fixture(scope="module", params=[("MFD", (2, 1)), ("MFD_D", (2, 1)), ("MFD_D", (1, 2))],
                ids=["MFD-replicas", "MFD_D-replicas", "MFD_D-attention_dp"])
def dp_server(request, tiny_pair, tmp_path_factory):
    """Two replicas, or two attention-DP ranks (one TP group of two ranks, each attending for its own
    requests; the MLP runs over both ranks' tokens, so a rank without requests runs idle forwards while
    the other serves), of MFD or MFD_D (switching to the single-mode path at 2 running requests, so a
    rank runs both paths below)."""
    algorithm, layout = request.param
    warmup = ("--mfd-warmup", "on") if layout == (1, 2) else ()  # the default on CUDA
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", algorithm, 8, log_level="info",
                       max_running=8 if warmup else None,  # the warm-up's rounds: 1-8 requests
                       threshold=2 if algorithm == "MFD_D" else None, extra_args=(*LAYOUTS[layout], *warmup),
                       extra_env={**DP_ENV, **plugin_env("round_trace", "hold_admission")})
    srv.algorithm, srv.layout = algorithm, layout
    yield from served_without_leaks(srv)


def prompt_ids(tok, tiny_prompts) -> list[list[int]]:
    return [tok(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts[:4]]


def test_each_dp_rank_runs_its_own_worker(dp_server):
    info = requests.get(dp_server.base_url + "/server_info", timeout=60).json()
    assert (info["dp_size"], info["attn_dp_size"]) == dp_server.layout
    log = dp_server.log()
    for rank in (0, 1):  # a replica's log prefix is "DP0]", an attention-DP rank's "DP0 TP0]"
        assert re.search(rf"DP{rank}( TP{rank})?\] {dp_server.algorithm} worker: drafter", log), log_tail(dp_server.log_path)


def test_every_attention_dp_rank_warms_up_before_the_server_is_ready(dp_server):
    """Attention DP with `--mfd-warmup on`: each DP rank runs the start-up warm-up's rounds (their drafts and
    eager stages; the verify forward, which gathers every rank's tokens, is left to the graphs' capture) before
    SGLang reports ready, and the requests after it are exact (below)."""
    if dp_server.layout != (1, 2):
        pytest.skip("the warm-up runs on the attention-DP server")
    log = dp_server.log()
    ranks = re.findall(r"DP(\d) TP\d\] MFD: start-up warm-up in [\d.]+ s: (\d+) placeholder rounds", log)
    assert sorted(rank for rank, _ in ranks) == ["0", "1"], log_tail(dp_server.log_path)
    assert log.rindex("MFD: start-up warm-up") < log.index("The server is fired up and ready to roll!")


def test_concurrent_greedy_requests_are_spread_over_both_replicas_and_exact(dp_server, reference_target, tiny_pair,
                                                                           hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = prompt_ids(tok, tiny_prompts) * 2
    with admitted_together(dp_server, len(prompts) // 2, schedulers=2), \
            concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # round-robin: half on each rank
        outs = list(pool.map(lambda ids: generate_ids(dp_server, ids, MAX_NEW), prompts))
    for ids, (got, _) in zip(prompts, outs):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(dp_server.log_path)
    by_rank = collections.defaultdict(list)
    for ids, (_, meta) in zip(prompts, outs):
        by_rank[meta["dp_rank"]].append(Served(ids, MAX_NEW, meta))
    assert sorted(by_rank) == [0, 1] and len(by_rank[0]) == len(by_rank[1])  # round-robin
    traces, drafter = round_traces(dp_server), reference_drafter(tiny_pair / "drafter")
    for rank, served in sorted(by_rank.items()):  # each replica's rounds are the reference engine's
        assert_served_as_reference_rounds(served, traces, reference_target, drafter, ignored_arm=None)
        accept = len(served) * MAX_NEW / sum(request.meta["spec_verify_ct"] for request in served)
        print(f"{dp_server.algorithm} {dp_server.layout} rank {rank}: accept length {accept:.2f}")


def test_seeded_sampling_on_either_replica_equals_the_single_server_law(dp_server, hf_target, tiny_prompts):
    """A law with spread (`SPREAD_LAW`): four requests at once, three seeded and one not (MFD_D: its
    single-mode path), then the first prompt with another seed sent twice in a row, which round-robin gives
    to each replica once (MFD_D: the K-mode path). Each seeded output is plain sampling of the HF target
    with its seed's coins, as on a single MFD server, unlike greedy decoding and the other seed's; a greedy
    request after them is still exact."""
    model, tok = hf_target
    prompts = prompt_ids(tok, tiny_prompts)
    seeds = [11, 12, 13, None]
    law = request_law(SPREAD_LAW)
    with admitted_together(dp_server, len(prompts) // 2, schedulers=2), \
            concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(lambda i: generate_ids(dp_server, prompts[i], MAX_NEW, **law, **(
            {} if seeds[i] is None else {"sampling_seed": seeds[i]})), range(len(prompts))))
    first_prompt = spread_samples(model, prompts[0], MAX_NEW, [11, 14])  # two seeds on one prompt
    for i, (got, meta) in enumerate(batched):
        assert meta["completion_tokens"] == MAX_NEW
        if seeds[i] is not None:
            expected = first_prompt[0] if i == 0 else spread_samples(model, prompts[i], MAX_NEW, [seeds[i]])[0]
            assert got == expected, (seeds[i], log_tail(dp_server.log_path))
    twice = [generate_ids(dp_server, prompts[0], MAX_NEW, **law, sampling_seed=14) for _ in range(2)]
    assert sorted(meta["dp_rank"] for _, meta in twice) == [0, 1]
    assert [got for got, _ in twice] == [first_prompt[1]] * 2, log_tail(dp_server.log_path)
    got, _ = generate_ids(dp_server, prompts[0], MAX_NEW)
    assert got == target_greedy(model, prompts[0], MAX_NEW), log_tail(dp_server.log_path)
