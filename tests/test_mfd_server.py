"""MFD and MFD_D in real SGLang servers on CPU (`python -m mfd_sglang.cpu.launch_server`, fp32, the
make-tiny pair): token ids equal plain greedy decoding of the target (which test_cpu_server holds
equal to the plain server) on /generate, /v1/completions and /v1/chat/completions at budgets 1, 8
and 32; MFD_D across its switch under concurrency; a seeded T > 0 request on both MFD_D paths (the
T > 0 law: test_sampling_server); acceptance per round against the reference engine; an abort
mid-decode; every refused request feature over HTTP; launch-time errors. Every server runs with
SGLang's strict idle KV-leak check, which kills the scheduler on a leak, and each is polled until
idle, then checked for health and leak warnings, when its tests are done."""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from conftest import reference_drafter, target_greedy
from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.hf import SpeculativeGenerator
from mfd_sglang.patches.request_checks import unsupported_request_features
from mfd_sglang.server_process import launch_command, stream_then_abort
from references import TOP_K_ALL, reference_sample, served_summary, verify_summary
from servers import (admitted_together, assert_healthy_without_leaks, chat_ids, chat_template_ids, completion_ids,
                     free_port, generate_ids, held_rid, hub_cache_with, log_tail, plugin_env, served_without_leaks,
                     start_server)

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 16
HELD_AT = 8  # output tokens at which the aborted request's decoding is held until the abort lands
HUB_TARGET, HUB_DRAFTER = "mfd-test/tiny-target", "mfd-test/tiny-drafter"  # the tiny pair in a local HF cache

# (algorithm, tree budget B, drafter: "mfd" (K = 4) or "dflash" (K = 1), MFD_D switch threshold,
# overlap scheduling: SGLang's default, as on a GPU; two servers run the synchronous V2 path instead,
# KV page size: 1, or pages of 4 / 16 tokens, across which verify windows and accepted paths fall)
SERVERS = [
    ("MFD", 8, "mfd", None, True, 1),
    ("MFD", 32, "mfd", None, True, 4),
    ("MFD", 8, "dflash", None, False, 1),  # a plain DFlash drafter: K = 1, i.e. DDTree
    ("MFD_D", 1, "mfd", 1, False, 1),  # budget 1; threshold 1: the single-mode path in every round
    ("MFD_D", 32, "mfd", 1, True, 16),
]


@pytest.fixture(scope="module", params=SERVERS,
                ids=lambda p: f"{p[0]}-B{p[1]}-{p[2]}-{'overlap' if p[4] else 'sync'}-page{p[5]}")
def server(request, tiny_pair, tiny_dflash_drafter, tmp_path_factory):
    algorithm, budget, drafter, threshold, overlap, page_size = request.param
    path = tiny_pair / "drafter" if drafter == "mfd" else tiny_dflash_drafter
    srv = start_server(tmp_path_factory, tiny_pair, path, algorithm, budget, threshold=threshold,
                       extra_args=("--page-size", str(page_size), *(() if overlap else ("--disable-overlap-schedule",))))
    srv.overlap, srv.page_size = overlap, page_size
    # What the reference engine needs to run the same rounds: with one request in flight MFD_D takes
    # its single-mode path when the threshold is 1.
    srv.spec = SimpleNamespace(budget=budget, drafter=path, single_mode=algorithm == "MFD_D" and threshold == 1)
    yield from served_without_leaks(srv)


@pytest.fixture(scope="module")
def mfd_d_server(tiny_pair, tmp_path_factory):
    """MFD_D, B = 8, default switch threshold (3), room for 6 running requests, INFO log (switches).
    Hidden states and custom logit processors are enabled so that requests asking for them get past
    SGLang's own checks and reach MFD's. Target and drafter are given as Hugging Face hub ids, found offline
    in the HF cache (HF_HUB_CACHE, HF_HUB_OFFLINE=1) as a user's downloaded models would be. The start-up
    warm-up runs (`--mfd-warmup on`: on CUDA it is the default), so the exactness tests below run after it. Its
    tests send
    their concurrent requests under `admitted_together`: they share their first batch on any machine."""
    cache = tmp_path_factory.mktemp("hf_hub")
    hub_cache_with(cache, HUB_TARGET, tiny_pair / "target")
    snapshot = hub_cache_with(cache, HUB_DRAFTER, tiny_pair / "drafter")
    srv = start_server(tmp_path_factory, tiny_pair, HUB_DRAFTER, "MFD_D", 8, max_running=6, log_level="info",
                       extra_args=("--enable-return-hidden-states", "--enable-custom-logit-processor",
                                   "--mfd-warmup", "on"),
                       extra_env={"HF_HUB_CACHE": str(cache), **plugin_env("hold_admission", "hold_decode")},
                       target=HUB_TARGET)
    srv.drafter_snapshot = snapshot
    yield from served_without_leaks(srv)


def test_hub_id_drafter_is_served_from_its_snapshot(mfd_d_server):
    """The worker in the scheduler process loaded the drafter hub id's cached snapshot; the launch checked
    its fit on the target hub id's config (the exactness tests below hold this server to the target's own
    decoding)."""
    log = mfd_d_server.log()
    assert f"MFD: drafter {HUB_DRAFTER} is {mfd_d_server.drafter_snapshot}" in log, log_tail(mfd_d_server.log_path)
    assert f"MFD_D worker: drafter {mfd_d_server.drafter_snapshot} (" in log, log_tail(mfd_d_server.log_path)


def test_the_warm_up_runs_every_playable_round_before_the_server_is_ready(mfd_d_server):
    """`--mfd-warmup on`: before SGLang reports the server ready, the worker ran a placeholder round at every batch
    size 1-6 for each arm it can play (MFD_D at B = 8: the K-mode path below 3 requests, the single-mode path from 3:
    6 rounds), with the verify forward at the draft buckets; the requests of the tests after it are exact."""
    log = mfd_d_server.log()
    warmed = re.search(r"MFD: start-up warm-up in [\d.]+ s: (\d+) placeholder rounds at batch sizes 1-(\d+) "
                       r"\(the verify forward at \[([\d, ]+)\]\)", log)
    assert warmed, log_tail(mfd_d_server.log_path)
    assert warmed.groups() == ("6", "6", "1, 2, 4, 6"), warmed.group(0)
    assert warmed.start() < log.index("The server is fired up and ready to roll!"), log_tail(mfd_d_server.log_path)


# --- exactness ------------------------------------------------------------------------------------
def test_server_runs_as_launched(server):
    """The scheduler runs what the exactness tests below claim: overlap on unless disabled, and the
    page size asked for."""
    info = requests.get(server.base_url + "/server_info", timeout=60).json()
    assert info["disable_overlap_schedule"] is (not server.overlap), info["disable_overlap_schedule"]
    assert info["page_size"] == server.page_size


def test_server_info_reports_the_accept_length_from_the_first_rounds(server, hf_target, tiny_prompts):
    """After the warmup and one 8-token request (fewer decode batches than SGLang's decode-log interval, 40,
    before which SGLang alone leaves `avg_spec_accept_length` out: patches/accept_length_info.py), every
    scheduler's state in /server_info carries the mean tokens per verify round so far: above 1 (the pair
    accepts drafts) and at most the longest path a round emits (min(B, block - 1) accepted drafts + the
    bonus token). Runs before this module's other generations, on each server."""
    _, tok = hf_target
    generate_ids(server, tok(tiny_prompts[0], add_special_tokens=False)["input_ids"], 8)
    longest = min(server.spec.budget, load_drafter(server.spec.drafter).config.block_size - 1) + 1
    states = requests.get(server.base_url + "/server_info", timeout=60).json()["internal_states"]
    lengths = [state.get("avg_spec_accept_length") for state in states]
    assert states and all(length is not None and 1 < length <= longest for length in lengths), (lengths, longest)


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


def test_concurrent_requests_and_a_prefix_hit_equal_greedy(server, hf_target, tiny_prompts):
    """Four requests at once over a shared 40-token prefix (pages of 4 / 16 split it mid-page), then the
    first again: its prefix comes from the radix cache (page-aligned with pages) and the output is the
    same greedy continuation."""
    model, tok = hf_target
    base = tok(" ".join(tiny_prompts), add_special_tokens=False)["input_ids"]
    prefix = (base * (40 // len(base) + 1))[:40]
    prompts = [prefix + tok(text, add_special_tokens=False)["input_ids"] for text in tiny_prompts[:4]]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate_ids(server, ids, MAX_NEW), prompts))
    for ids, (got, _) in zip(prompts, outs):
        assert got == target_greedy(model, ids, MAX_NEW), log_tail(server.log_path)
    again, meta = generate_ids(server, prompts[0], MAX_NEW)
    assert meta["cached_tokens"] >= 40 - server.page_size, meta
    assert again == outs[0][0]


def test_rounds_accept_what_the_reference_engine_accepts(server, reference_target, hf_target, tiny_prompts):
    """Per prompt, the server's verify rounds accept what the reference engine's rounds accept on the
    same prompt, budget, drafter and mode path (fp32, greedy): as many rounds (spec_verify_ct), the same
    count of rounds per number of accepted draft tokens (spec_correct_drafts_histogram; SGLang counts
    a round's accepted drafts before the max_new_tokens cut, as RoundStats.accepted does), and
    completion_tokens = the prefill's token (no round; the engine's first root) + the tokens the rounds
    emitted. (spec_accept_length is completion_tokens / spec_verify_ct by SGLang's own definition.)"""
    _, tok = hf_target
    engine = SpeculativeGenerator(reference_target, reference_drafter(server.spec.drafter), budget=server.spec.budget,
                                  single_mode=server.spec.single_mode)
    accepted_drafts = 0
    for text in tiny_prompts[:2]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        reference = engine.generate(ids, 32)
        got, meta = generate_ids(server, ids, 32)
        assert got == reference.token_ids
        assert served_summary(meta) == verify_summary(reference), f"prompt {text!r}"
        accepted_drafts += sum(r.accepted for r in reference.rounds)
    assert accepted_drafts > 0  # the comparison covers rounds that accepted draft tokens


# --- MFD_D: concurrency across the switch, T > 0, abort, per-request errors ------------------------
def test_mfd_d_concurrent_requests_cross_the_switch_and_stay_exact(mfd_d_server, hf_target, tiny_prompts):
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in tiny_prompts[:6]]
    lengths = [8, 48, 20, 64, 12, 36]  # finishing at different times: 6 -> 1 running requests

    def run(i):
        return generate_ids(mfd_d_server, prompts[i], lengths[i])[0]

    with admitted_together(mfd_d_server, 6), concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(run, range(6)))
    for ids, n, got in zip(prompts, lengths, outputs):
        assert got == target_greedy(model, ids, n)
    log = mfd_d_server.log()
    assert "switching to the single-mode path" in log, log_tail(mfd_d_server.log_path)
    after_single = log[log.index("switching to the single-mode path"):]
    assert "switching to the 4-mode path" in after_single, log_tail(mfd_d_server.log_path)
    assert_healthy_without_leaks(mfd_d_server)


def test_a_seeded_request_samples_alike_on_both_mfd_d_paths(mfd_d_server, hf_target, tiny_prompts):
    """T > 0 (the law itself: test_sampling_server.py): a seeded request's tokens are plain
    autoregressive sampling with its seed's coins, alone (the K-mode path) and among five longer
    requests (the single-mode path): neither the tree nor the batch changes them."""
    model, tok = hf_target
    ids = tok(tiny_prompts[2], add_special_tokens=False)["input_ids"]
    law, n = dict(temperature=1.5, top_p=0.95, min_p=0.02), 20
    expected = reference_sample(model, ids, n, (1.5, TOP_K_ALL, 0.95, 0.02), seed=3)
    assert generate_ids(mfd_d_server, ids, n, **law, sampling_seed=3)[0] == expected
    switches = mfd_d_server.log().count("switching to the single-mode path")

    def run(i):
        extra = {"sampling_seed": 3} if i == 0 else {}
        return generate_ids(mfd_d_server, ids, n if i == 0 else 3 * n, **law, **extra)[0]

    with admitted_together(mfd_d_server, 6), concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(run, range(6)))
    assert outputs[0] == expected
    assert mfd_d_server.log().count("switching to the single-mode path") > switches, log_tail(mfd_d_server.log_path)


def test_abort_mid_decode_ends_the_request_and_frees_its_memory(mfd_d_server, hf_target, tiny_prompts):
    """A streaming request of 600 tokens is aborted by its id once 8 tokens are out (the server decodes it no
    further until the abort lands: `hold_decode`, so the abort lands in flight on any machine): its stream ends
    with finish reason "abort" well short of 600 tokens, the scheduler goes idle with its strict KV-leak check
    passing (target KV and drafter context slots freed), and the next request is still exact."""
    model, tok = hf_target
    ids = tok(tiny_prompts[3], add_special_tokens=False)["input_ids"]
    payload = {"rid": held_rid(HELD_AT), "input_ids": ids, "stream": True,
               "sampling_params": {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}}
    chunks = stream_then_abort(mfd_d_server, payload, abort_after=HELD_AT, timeout=300, tokens=True)
    assert all(chunk["finish_reason"] is None for chunk in chunks[:-1]), chunks  # decoding when aborted
    assert chunks[-1]["finish_reason"]["type"] == "abort", chunks[-1]
    assert HELD_AT <= chunks[-1]["completion_tokens"] < 600, chunks[-1]
    assert_healthy_without_leaks(mfd_d_server)
    got, _ = generate_ids(mfd_d_server, ids, MAX_NEW)
    assert got == target_greedy(model, ids, MAX_NEW)


# Every request feature MFD refuses (mfd_sglang/patches/request_checks.py) as a /generate request asks
# for it: (the name the refusal gives, top-level request fields, sampling params). Remove an entry when
# MFD learns to serve its feature. lora_path is not here: SGLang refuses --enable-lora for MFD at launch
# (test_bad_launch_fails_early_with_a_clear_message) and any lora_path without it, so a request with
# one never reaches MFD's check.
REFUSED_FEATURES = [
    ("return_hidden_states", {"return_hidden_states": True}, {}),
    ("custom_logit_processor", {"custom_logit_processor": "DisallowedTokensLogitsProcessor"}, {}),
]
REFUSED_AT_LAUNCH = {"lora_path"}


class _EveryFeature:
    """A request stand-in on which every check of unsupported_request_features fires: each field reads
    7 (> 0, != 0, != 1, truthy, not None)."""

    def __getattr__(self, name):
        return self if name == "sampling_params" else 7


def test_every_refused_feature_is_tried_over_http():
    """REFUSED_FEATURES names every feature request_checks can refuse, and nothing else."""
    assert set(unsupported_request_features(_EveryFeature())) == (
        {feature for feature, _, _ in REFUSED_FEATURES} | REFUSED_AT_LAUNCH)


@pytest.mark.parametrize("feature, fields, sampling", REFUSED_FEATURES,
                         ids=[next(iter({**f, **p})) for _, f, p in REFUSED_FEATURES])
def test_refused_request_features_get_a_400_that_names_them(mfd_d_server, feature, fields, sampling):
    if "custom_logit_processor" in fields:  # a real serialized processor, as a client would send it
        from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

        fields = {"custom_logit_processor": DisallowedTokensLogitsProcessor().to_str()}
    payload = {"text": "one two", **fields, "sampling_params": {"max_new_tokens": 4, **sampling}}
    r = requests.post(mfd_d_server.base_url + "/generate", json=payload, timeout=120)
    assert r.status_code == 400, r.text
    assert f"MFD speculative decoding does not support {feature} in a request" in r.json()["error"]["message"]
    assert requests.get(mfd_d_server.base_url + "/health", timeout=60).status_code == 200


# --- launch-time errors -----------------------------------------------------------------------------
BAD_LAUNCHES = ["missing drafter", "hub id not cached", "wrong target", "wrong hub target", "budget",
                "pipeline parallelism", "attention backend", "lora", "triton kernels without CUDA"]


def bad_launch(case: str, tiny_pair: Path, hf_cache: Path) -> tuple[list[str], str]:
    """(the launch command of `case`, the message it must fail with), HF_HUB_CACHE being hf_cache."""
    drafter, target = str(tiny_pair / "drafter"), tiny_pair / "target"
    extra, expected = [], ""
    if case == "missing drafter":
        drafter, expected = str(hf_cache / "no-such-drafter"), "no such directory"
    elif case == "hub id not cached":  # offline, an empty HF cache
        drafter = "mfd-test/not-cached"
        expected = f"no drafter 'mfd-test/not-cached' (revision main) in the Hugging Face cache ({hf_cache}"
    elif case in ("wrong target", "wrong hub target"):
        drafter, expected = str(REPO / "drafters" / "smollm2-135m" / "mfd"), "hidden_size: found 576, expected 64"
        if case == "wrong hub target":  # the fit read from the hub target's cached config
            target = HUB_TARGET
            hub_cache_with(hf_cache, HUB_TARGET, tiny_pair / "target")
    elif case == "budget":
        extra, expected = ["--speculative-num-draft-tokens", "1"], "tree budget of 0"
    elif case == "pipeline parallelism":
        extra, expected = ["--pp-size", "2"], "--pp-size 2: pipeline parallelism is not supported"
    elif case == "lora":  # SGLang's own refusal: the reason a request's lora_path never reaches MFD
        extra, expected = ["--enable-lora"], "LoRA is only compatible with"
    elif case == "attention backend":  # no TARGET_VERIFY tree mask there
        extra, expected = ["--attention-backend", "torch_native"], "MFD on CPU needs --attention-backend mfd_cpu"
    elif case == "triton kernels without CUDA":  # (the launch's env turns the Triton interpreter off)
        extra, expected = ["--mfd-kernels", "triton"], "--mfd-kernels triton runs MFD's Triton kernels, which need a CUDA"
    return launch_command(target, port=free_port(), algorithm="MFD", drafter=drafter, dtype="float32",
                          extra_args=extra), expected


@pytest.fixture(scope="module")
def bad_launches(tiny_pair, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, str]]:
    """Every bad launch, each with its own empty HF cache, two at a time (each spends its seconds importing
    SGLang on one core; all at once, each one's 300 s would be shared by nine on a busy machine): case ->
    (the finished process, the message expected)."""
    def run(case):
        cache = tmp_path_factory.mktemp("hf_cache")
        cmd, expected = bad_launch(case, tiny_pair, cache)
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(cache))
        if case == "triton kernels without CUDA":  # the CPU launcher turns the interpreter on unless told
            env["TRITON_INTERPRET"] = "0"
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO), expected

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(zip(BAD_LAUNCHES, pool.map(run, BAD_LAUNCHES)))


@pytest.mark.parametrize("case", BAD_LAUNCHES)
def test_bad_launch_fails_early_with_a_clear_message(case, bad_launches):
    proc, expected = bad_launches[case]
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr, (proc.stdout + proc.stderr)[-3000:]
