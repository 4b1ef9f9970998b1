"""A real SGLang server on CPU (`python -m mfd_sglang.cpu.launch_server`, plain decoding, fp32) on
the tiny target: /generate, /v1/completions and /v1/chat/completions must give exactly HF greedy
decoding's token ids, with SGLang's torch_native attention and with the launcher's default, this
plugin's mfd_cpu backend. One server per backend."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import requests
import torch

from conftest import target_greedy
from servers import ServerProcess, free_port, log_tail

REPO = Path(__file__).resolve().parents[1]
MAX_NEW = 16
USER_MAX_TOTAL_TOKENS = 1536  # given on the command line: must win over the launcher's 8192


@pytest.fixture(scope="module")
def hf_target(tiny_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_pair / "target", dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_pair / "target")
    return model, tok


@pytest.fixture(scope="module", params=["torch_native", "launcher default"])
def server(request, tiny_pair, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("cpu_server") / "server.log"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env["HF_HUB_OFFLINE"] = "1"
    cmd = [
        sys.executable, "-m", "mfd_sglang.cpu.launch_server",
        "--model-path", tiny_pair / "target",
        *(["--attention-backend", request.param] if request.param != "launcher default" else []),
        "--dtype", "float32",
        "--host", "127.0.0.1", "--port", port,
        "--max-total-tokens", USER_MAX_TOTAL_TOKENS,
        "--context-length", "1024",
        "--max-running-requests", "4",
        "--log-level", "warning",
    ]
    srv = ServerProcess(cmd, log, port=port, env=env, cwd=REPO, startup_timeout=600)
    srv.backend = "mfd_cpu" if request.param == "launcher default" else request.param
    srv.start()
    yield srv
    srv.stop()


def _post(server, path, payload, timeout=300):
    r = requests.post(server.base_url + path, json=payload, timeout=timeout)
    assert r.status_code == 200, f"{path}: HTTP {r.status_code}: {r.text[:2000]}\n--- log ---\n{log_tail(server.log_path)}"
    return r.json()


def _prompt_ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_generate_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    for text in tiny_prompts[:3]:
        ids = _prompt_ids(tok, text)
        want = target_greedy(model, ids, MAX_NEW)
        out = _post(server, "/generate", {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True},
        })
        got = out.get("output_ids") or out["meta_info"].get("output_ids")
        assert got == want, f"prompt {text!r}: server {got} != HF {want}"


def test_completions_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    text = tiny_prompts[-1]
    ids = _prompt_ids(tok, text)
    want = target_greedy(model, ids, MAX_NEW)
    out = _post(server, "/v1/completions", {
        "model": "default", "prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })
    choice = out["choices"][0]
    assert choice.get("token_ids") == want, f"server {choice.get('token_ids')} != HF {want}; response {out}"
    assert out["usage"]["completion_tokens"] == MAX_NEW


def test_chat_completions_matches_hf_greedy(server, hf_target, tiny_prompts):
    model, tok = hf_target
    messages = [{"role": "user", "content": tiny_prompts[0]}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    want = target_greedy(model, ids, MAX_NEW)
    out = _post(server, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": MAX_NEW, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "return_prompt_token_ids": True,
    })
    choice = out["choices"][0]
    # 0.5.23 puts the ids of a chat choice in prompt_token_ids / response_token_ids
    assert choice.get("prompt_token_ids") == ids, f"server applied the chat template differently from HF: {out}"
    got = choice.get("response_token_ids", choice.get("token_ids"))
    assert got == want, f"server {got} != HF {want}; response {out}"


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
                           "--attention-backend": "mfd_cpu", "--disable-cuda-graph": None}
    assert argv[-1] == "--disable-cuda-graph"
    assert argv[:2] == ["--model-path", "m"] and argv.count("--max-total-tokens") == 1
    argv, added = apply_cpu_defaults(["--max-total-tokens=100", "--device", "cpu", "--attention-backend", "triton"])
    assert [f for f, _ in added] == ["--mem-fraction-static", "--disable-cuda-graph"]
    assert "--max-total-tokens=100" in argv and argv.count("--device") == 1
    assert apply_cpu_defaults(["--help"]) == (["--help"], [])


def test_prepare_environment_unit():
    from mfd_sglang.cpu import ENV_FLAG, STANDIN_DIR, prepare_environment

    env = {"PYTHONPATH": "/x"}
    prepare_environment(env)
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env[ENV_FLAG] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STANDIN_DIR), "/x"]
    prepare_environment(env)  # idempotent
    assert env["PYTHONPATH"].split(os.pathsep) == [str(STANDIN_DIR), "/x"]
    assert (STANDIN_DIR / "sgl_kernel" / "__init__.py").exists()
