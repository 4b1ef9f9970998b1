"""A real SGLang server on CPU (`python -m mfd_sglang.cpu.launch_server`, plain decoding, fp32) on
the tiny target: /generate, /v1/completions and /v1/chat/completions must give exactly HF greedy
decoding's token ids, with SGLang's torch_native attention and with the launcher's default, this
plugin's mfd_cpu backend. One server per backend."""

from __future__ import annotations

import os

import pytest
import requests

from conftest import target_greedy
from mfd_sglang.server_process import launch_command
from servers import chat_ids, chat_template_ids, completion_ids, free_port, generate_ids, start

MAX_NEW = 16
USER_MAX_TOTAL_TOKENS = 1536  # given on the command line: must win over the launcher's 8192


@pytest.fixture(scope="module", params=["torch_native", "launcher default"])
def server(request, tiny_pair, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("cpu_server") / "server.log"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env["HF_HUB_OFFLINE"] = "1"
    backend = ["--attention-backend", request.param] if request.param != "launcher default" else []
    cmd = launch_command(tiny_pair / "target", port=port, dtype="float32", extra_args=[
        *backend, "--max-total-tokens", str(USER_MAX_TOTAL_TOKENS), "--context-length", "1024",
        "--max-running-requests", "4", "--log-level", "warning"])
    srv = start(cmd, log, port=port, env=env)
    srv.backend = "mfd_cpu" if request.param == "launcher default" else request.param
    yield srv
    srv.stop()


def test_generate_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    for text in tiny_prompts[:3]:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        want = target_greedy(model, ids, MAX_NEW)
        got, _ = generate_ids(server, ids, MAX_NEW)
        assert got == want, f"prompt {text!r}: server {got} != HF {want}"


def test_completions_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    ids = tok(tiny_prompts[-1], add_special_tokens=False)["input_ids"]
    want = target_greedy(model, ids, MAX_NEW)
    got = completion_ids(server, ids, MAX_NEW)
    assert got == want, f"server {got} != HF {want}"


def test_chat_completions_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    messages = [{"role": "user", "content": tiny_prompts[0]}]
    ids = chat_template_ids(tok, messages)
    want = target_greedy(model, ids, MAX_NEW)
    prompt_ids, got = chat_ids(server, messages, MAX_NEW)
    assert prompt_ids == ids, f"server applied the chat template differently from HF: {prompt_ids} != {ids}"
    assert got == want, f"server {got} != HF {want}"


def test_launcher_cpu_defaults_and_user_flag_wins(server):
    first_lines = server.log().splitlines()[:5]
    line = next((l for l in first_lines if "CPU defaults added:" in l), None)
    assert line is not None, f"launcher did not print its defaults: {first_lines}"
    assert "--device cpu" in line and "--mem-fraction-static 0.5" in line
    assert "--max-total-tokens" not in line  # the user gave it
    assert ("--attention-backend mfd_cpu" in line) == (server.backend == "mfd_cpu")
    info = requests.get(server.base_url + "/get_server_info", timeout=60).json()
    assert info["device"] == "cpu"
    assert info["mem_fraction_static"] == 0.5
    assert info["max_total_tokens"] == USER_MAX_TOTAL_TOKENS
    assert info["attention_backend"] == server.backend


def test_apply_cpu_defaults_unit():
    from mfd_sglang.cpu.launch_server import apply_cpu_defaults

    argv, added = apply_cpu_defaults(["--model-path", "m"])
    assert dict(added) == {"--device": "cpu", "--max-total-tokens": "8192", "--mem-fraction-static": "0.5",
                           "--attention-backend": "mfd_cpu", "--disable-cuda-graph": None, "--sleep-on-idle": None}
    assert argv[-2:] == ["--disable-cuda-graph", "--sleep-on-idle"]
    assert argv[:2] == ["--model-path", "m"] and argv.count("--max-total-tokens") == 1
    argv, added = apply_cpu_defaults(["--max-total-tokens=100", "--device", "cpu", "--attention-backend", "triton"])
    assert [f for f, _ in added] == ["--mem-fraction-static", "--disable-cuda-graph", "--sleep-on-idle"]
    assert "--max-total-tokens=100" in argv and argv.count("--device") == 1
    assert apply_cpu_defaults(["--help"]) == (["--help"], [])
    # A PD decode server backs retracted requests up to CPU tensors (SGLang's host pool is CUDA-pinned).
    _, added = apply_cpu_defaults(["--model-path", "m", "--disaggregation-mode", "decode"])
    assert dict(added)["--disaggregation-decode-retraction-backup"] == "cpu_tensor"
    _, added = apply_cpu_defaults(["--disaggregation-mode=decode", "--disaggregation-decode-retraction-backup", "none"])
    assert "--disaggregation-decode-retraction-backup" not in dict(added)
    _, added = apply_cpu_defaults(["--model-path", "m", "--disaggregation-mode", "prefill"])
    assert "--disaggregation-decode-retraction-backup" not in dict(added)


def test_prepare_environment_unit():
    from mfd_sglang.cpu import ENV_FLAG, STANDIN_DIR, prepare_environment

    env = {"PYTHONPATH": "/x"}
    prepare_environment(env)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[ENV_FLAG] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STANDIN_DIR), "/x"]
    prepare_environment(env)  # idempotent
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STANDIN_DIR), "/x"]
    assert (STANDIN_DIR / "sgl_kernel" / "__init__.py").exists()
