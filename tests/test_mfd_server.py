"""MFD and MFD_D in real SGLang servers on CPU (`python -m mfd_sglang.cpu.launch_server`, fp32, the
make-tiny pair): token ids equal plain greedy decoding of the target (which test_cpu_server holds
equal to the plain server) on /generate, /v1/completions and /v1/chat/completions at budgets 1, 8
and 32; MFD_D across its switch under concurrency; T > 0; abort; acceptance metadata; per-request
and launch-time errors. Every server runs with SGLang's strict idle KV-leak check, which kills the
scheduler on a leak, and each is checked for health and leak warnings when its tests are done."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import time
from pathlib import Path

import pytest
import requests
import torch

from conftest import target_greedy
from mfd_sglang.server_process import launch_command
from servers import (ServerProcess, chat_ids, chat_template_ids, completion_ids, free_port, generate_ids,
                     log_tail)

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 16

# (algorithm, tree budget B, drafter: "mfd" (K = 4) or "dflash" (K = 1), MFD_D switch threshold)
SERVERS = [
    ("MFD", 1, "mfd", None),
    ("MFD", 8, "mfd", None),
    ("MFD", 32, "mfd", None),
    ("MFD", 8, "dflash", None),  # a plain DFlash drafter: K = 1, i.e. DDTree
    ("MFD_D", 1, "mfd", 1),  # threshold 1: the single-mode path in every round
    ("MFD_D", 32, "mfd", 1),
]


def start_server(tmp_path_factory, tiny_pair, drafter: Path, algorithm: str, budget: int, *,
                 threshold: int | None = None, max_running: int = 4, log_level: str = "warning") -> ServerProcess:
    port = free_port()
    log = tmp_path_factory.mktemp("mfd_server") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
    env.setdefault("OMP_NUM_THREADS", "2")
    env.pop("MFD_SGLANG_SWITCH_THRESHOLD", None)
    if threshold is not None:
        env["MFD_SGLANG_SWITCH_THRESHOLD"] = str(threshold)
    cmd = launch_command(tiny_pair / "target", port=port, algorithm=algorithm, drafter=drafter, budget=budget,
                         dtype="float32", extra_args=[
                             "--max-total-tokens", "4096", "--context-length", "1024",
                             "--max-running-requests", str(max_running), "--log-level", log_level])
    return ServerProcess(cmd, log, port=port, env=env, cwd=REPO, startup_timeout=600).start()


def assert_healthy_without_leaks(server: ServerProcess) -> None:
    time.sleep(2.0)  # let the scheduler go idle and run its leak check
    assert requests.get(server.base_url + "/health", timeout=60).status_code == 200, log_tail(server.log_path)
    assert "memory leak" not in server.log(), log_tail(server.log_path)


@pytest.fixture(scope="module", params=SERVERS, ids=lambda p: f"{p[0]}-B{p[1]}-{p[2]}")
def server(request, tiny_pair, tiny_dflash_drafter, tmp_path_factory):
    algorithm, budget, drafter, threshold = request.param
    path = tiny_pair / "drafter" if drafter == "mfd" else tiny_dflash_drafter
    srv = start_server(tmp_path_factory, tiny_pair, path, algorithm, budget, threshold=threshold)
    yield srv
    try:
        assert_healthy_without_leaks(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def mfd_d_server(tiny_pair, tmp_path_factory):
    """MFD_D, B = 8, default switch threshold (3), room for 6 running requests, INFO log (switches)."""
    srv = start_server(tmp_path_factory, tiny_pair, tiny_pair / "drafter", "MFD_D", 8, max_running=6,
                       log_level="info")
    yield srv
    srv.stop()


# --- exactness ------------------------------------------------------------------------------------
def test_generate_equals_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    for text in tiny_prompts[:3]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        got, meta = generate_ids(server, ids, MAX_NEW)
        assert got == target_greedy(model, ids, MAX_NEW), f"prompt {text!r}\n{log_tail(server.log_path)}"


def test_completions_equal_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[-1], add_special_tokens=False)["input_ids"]
    assert completion_ids(server, ids, MAX_NEW) == target_greedy(model, ids, MAX_NEW)


def test_chat_completions_equal_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    messages = [{"role": "user", "content": tiny_prompts[1]}]
    ids = chat_template_ids(tok, messages)
    prompt_ids, got = chat_ids(server, messages, MAX_NEW)
    assert prompt_ids == ids
    assert got == target_greedy(model, ids, MAX_NEW)


def test_meta_info_reports_acceptance(server, hf_target, tiny_prompts):
    _, tok = hf_target
    ids = tok(tiny_prompts[0], add_special_tokens=False)["input_ids"]
    got, meta = generate_ids(server, ids, 32)
    rounds, tau = meta["spec_verify_ct"], meta["spec_accept_length"]
    # One token comes from the prefill; every other token from a verify round.
    assert 1 <= rounds <= len(got)
    assert tau == pytest.approx(meta["completion_tokens"] / rounds)
    assert tau > 1.2, f"the tiny drafter should be accepted: tau {tau}"


# --- MFD_D: concurrency across the switch, T > 0, abort, per-request errors ------------------------
def test_mfd_d_concurrent_requests_cross_the_switch_and_stay_exact(mfd_d_server, hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in tiny_prompts[:6]]
    lengths = [8, 48, 20, 64, 12, 36]  # finishing at different times: 6 -> 1 running requests

    def run(i):
        return generate_ids(mfd_d_server, prompts[i], lengths[i])[0]

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(run, range(6)))
    for ids, n, got in zip(prompts, lengths, outputs):
        assert got == target_greedy(model, ids, n)
    log = mfd_d_server.log()
    assert "switching to the single-mode path" in log, log_tail(mfd_d_server.log_path)
    after_single = log[log.index("switching to the single-mode path"):]
    assert "switching to the 4-mode path" in after_single, log_tail(mfd_d_server.log_path)
    assert_healthy_without_leaks(mfd_d_server)


def test_sampling_finishes_within_top_k_support(mfd_d_server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    top_k, n = 3, 24
    for seed in (1, 2):
        got, meta = generate_ids(mfd_d_server, ids, n, temperature=1.0, top_k=top_k, sampling_seed=seed)
        assert len(got) == n and meta["finish_reason"]["type"] == "length"
        with torch.inference_mode():
            logits = model(torch.tensor([ids + got])).logits[0, len(ids) - 1 : -1]
        allowed = logits.topk(top_k, dim=-1).indices
        for i, token in enumerate(got):
            assert token in allowed[i].tolist(), f"token {i} ({token}) is outside the target's top-{top_k}"


def test_abort_of_a_streaming_request_leaves_the_server_healthy(mfd_d_server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[3], add_special_tokens=False)["input_ids"]
    payload = {"input_ids": ids, "stream": True,
               "sampling_params": {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}}
    with requests.post(mfd_d_server.base_url + "/generate", json=payload, stream=True, timeout=300) as r:
        chunks = 0
        for line in r.iter_lines():
            chunks += bool(line)
            if chunks >= 3:
                break  # closing the connection aborts the request
    assert chunks >= 3
    got, _ = generate_ids(mfd_d_server, ids, MAX_NEW)
    assert got == target_greedy(model, ids, MAX_NEW)
    assert_healthy_without_leaks(mfd_d_server)


@pytest.mark.parametrize("params, feature", [
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"min_p": 0.1}, "min_p"),
    ({"regex": "[a-z ]+"}, "constrained decoding"),
])
def test_unsupported_request_features_are_refused_by_name(mfd_d_server, params, feature):
    payload = {"text": "one two", "sampling_params": {"max_new_tokens": 4, **params}}
    r = requests.post(mfd_d_server.base_url + "/generate", json=payload, timeout=120)
    assert r.status_code == 400, r.text
    assert feature in r.text and "MFD" in r.text
    assert requests.get(mfd_d_server.base_url + "/health", timeout=60).status_code == 200


def test_returned_logprobs_are_refused(mfd_d_server):
    r = requests.post(mfd_d_server.base_url + "/generate", timeout=120, json={
        "text": "one two", "return_logprob": True, "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 400 and "return_logprob" in r.text, r.text


# --- launch-time errors -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["missing drafter", "wrong target", "budget", "page size", "attention backend"])
def test_bad_launch_fails_early_with_a_clear_message(case, tiny_pair, tmp_path):
    drafter = str(tiny_pair / "drafter")
    extra, expected = [], ""
    if case == "missing drafter":
        drafter, expected = str(tmp_path / "no-such-drafter"), "no such directory"
    elif case == "wrong target":
        drafter, expected = str(REPO / "drafters" / "smollm2-135m" / "mfd"), "hidden_size: found 576, expected 64"
    elif case == "budget":
        extra, expected = ["--speculative-num-draft-tokens", "1"], "tree budget of 0"
    elif case == "page size":
        extra, expected = ["--page-size", "2"], "--page-size 2"
    elif case == "attention backend":  # no TARGET_VERIFY tree mask there
        extra, expected = ["--attention-backend", "torch_native"], "MFD on CPU needs --attention-backend mfd_cpu"
    cmd = launch_command(tiny_pair / "target", port=free_port(), algorithm="MFD", drafter=drafter, dtype="float32",
                         extra_args=extra)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
