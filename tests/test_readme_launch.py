"""The README's launch, started as written, and each `--mfd-*` option it documents for a fixed budget.

The `python -m sglang.launch_server ...` command of README.md's Launch section runs through the CPU launcher
(`python -m mfd_sglang.cpu.launch_server`, the same flags: what the README says to do on a CPU) in a folder
where `./target` and `./drafter` are the make-tiny pair, with one flag added: `--port` (a free one). No
test-only flag: the dtype, max running requests, context length and log level are what SGLang and MFD
resolve at launch, beside the CPU launcher's documented defaults. Then the same launch with MFD_D and the
options table's `--mfd-switch-threshold N`, `--mfd-num-modes K` and `--mfd-kernels torch` as the table writes them. (The table's
`--mfd-auto-budget` runs without --max-running-requests in test_auto_budget's server; `--mfd-mode-subsets`
in test_mode_subsets_server's. `sglang serve` is SGLang's other entry point to the same launch: its flags
are parsed in test_docs, it has no CPU launcher to start it here.)

Checked: the server answers the OpenAI endpoints and /generate and speculates (the accept length is
printed and bounded below), and the worker in the scheduler process runs what the launch resolved: its
memory plan at MFD's 48 running requests, the same as the launch planned (and on a GPU reserves), tree
budget 16 (the launch gives no `--speculative-num-draft-tokens`: MFD's CPU default, 17; on CUDA the default is
the budget schedule, tests/test_budget_schedule.py), and what
each option changes, seen in what ran (MFD_D's switch logged by the rounds that crossed it). Exact tokens
are not asserted here: as written, SGLang serves the pair's float32 checkpoint in float16 (`--dtype auto`),
whose tree verify and one-token decode may round apart; the float32 servers (test_mfd_server and the others)
hold the tokens to plain decoding.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import sys

import pytest
import requests

from servers import admitted_together, free_port, log_tail, plugin_env, post_json, served_without_leaks, start
from test_docs import documented_commands

MAX_NEW = 32
MIN_MEAN_ACCEPT = 3.0  # tokens per verify round, float16 here (float32 at B = 16 accepts 4.5-6.3: mfd_sglang.check.servers)


def readme_launch() -> list[str]:
    """The README's launch command, as parsed for test_docs (continuations joined)."""
    launches = [c.argv for c in documented_commands() if c.doc.name == "README.md" and not c.inline
                and c.argv[:3] == ["python", "-m", "sglang.launch_server"]]
    assert len(launches) == 1, launches
    return launches[0]


def test_the_readme_launch_names_the_pair_as_this_test_lays_it_out():
    argv = readme_launch()
    assert argv[argv.index("--model-path") + 1] == "./target"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == "./drafter"
    assert argv[argv.index("--speculative-algorithm") + 1] == "MFD"


def with_flags(argv: list[str], **flags) -> list[str]:
    """argv with `--name value` set (replaced where given, else appended); value None: a switch."""
    argv = list(argv)
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag] if value is None else [flag, value]
    return argv


LAUNCHES = {
    "as-written": {},
    "mfd_d-options": {"speculative_algorithm": "MFD_D", "mfd_switch_threshold": "2", "mfd_num_modes": "2",
                      "mfd_kernels": "torch"},
}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def readme_server(request, tiny_pair, tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    (folder / "target").symlink_to(tiny_pair / "target")
    (folder / "drafter").symlink_to(tiny_pair / "drafter")
    argv = with_flags(readme_launch(), **LAUNCHES[request.param])
    port = free_port()
    cmd = [sys.executable, "-m", "mfd_sglang.cpu.launch_server", *argv[3:], "--port", str(port)]
    # the hold_admission test plugin (an environment, not a flag): the concurrent requests share a batch
    env = dict(os.environ, SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1", MFD_TEST_HOLD_FILE=str(folder / "hold_admission"),
               **plugin_env("hold_admission"))
    srv = start(cmd, folder / "server.log", port=port, env=env, cwd=folder)
    srv.launch, srv.argv = request.param, argv
    yield from served_without_leaks(srv)


def test_the_launch_serves_and_speculates(readme_server, tiny_prompts):
    """Each prompt through /v1/completions and /v1/chat/completions, then all at once through /generate:
    every answer complete, and the rounds accept long paths."""
    for prompt in tiny_prompts[:2]:
        completion = post_json(readme_server, "/v1/completions", {
            "model": "./target", "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True})
        assert completion["usage"]["completion_tokens"] == MAX_NEW and completion["choices"][0]["text"], completion
        chat = post_json(readme_server, "/v1/chat/completions", {
            "model": "./target", "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_NEW,
            "temperature": 0, "ignore_eos": True})
        assert chat["usage"]["completion_tokens"] == MAX_NEW and chat["choices"][0]["message"]["content"], chat

    def generate(prompt):
        return post_json(readme_server, "/generate", {"text": prompt, "sampling_params": {
            "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}})["meta_info"]

    with admitted_together(readme_server, len(tiny_prompts)), \
            concurrent.futures.ThreadPoolExecutor(len(tiny_prompts)) as pool:
        metas = list(pool.map(generate, tiny_prompts))
    assert all(m["completion_tokens"] == MAX_NEW for m in metas), metas
    mean_accept = sum(m["completion_tokens"] for m in metas) / sum(m["spec_verify_ct"] for m in metas)
    print(f"{readme_server.launch}: mean accept length {mean_accept:.2f} over {len(metas)} requests")
    assert mean_accept >= MIN_MEAN_ACCEPT, [m["spec_accept_length"] for m in metas]


def test_the_scheduler_runs_what_the_launch_resolved(readme_server, tiny_prompts):
    """The worker's own lines in the scheduler process: 48 running requests (MFD's default, resolved at launch
    in another process), budget 16 (the CPU default), and for MFD_D the options: 2 modes drafted, the single-mode path taken by
    the rounds of 2 or more running requests (the concurrent requests above, admitted together) and left at
    fewer."""
    info = requests.get(readme_server.base_url + "/server_info", timeout=60).json()
    assert info["max_running_requests"] == 48 and info["context_length"] is None, info
    log = readme_server.log()
    # the plan the launch made (and on a GPU reserves) is the one the scheduler's worker computes
    planned = re.findall(r"MFD memory at launch: (.*)", log)
    logged = re.findall(r"MFD memory: (.*)", log)
    assert len(planned) == len(logged) == 1 and planned == logged, (planned, logged)
    assert "at most 48 requests" in logged[0], logged
    algorithm = readme_server.argv[readme_server.argv.index("--speculative-algorithm") + 1]
    worker = re.search(rf"{algorithm} worker: drafter \./drafter \(\d+ layer\(s\), K = (\d+) mode\(s\).*?, tree "
                       r"budget (\d+), single-mode switch at (\w+) running requests", log)
    assert worker, log_tail(readme_server.log_path)
    kernels = re.search(r"kernels (\w+) \(--mfd-kernels (\w+)\)", log)
    assert kernels, log_tail(readme_server.log_path)
    assert kernels.groups() == ("torch", "auto" if readme_server.launch == "as-written" else "torch"), kernels.group(0)
    if readme_server.launch == "as-written":
        assert worker.groups() == ("4", "16", "never"), worker.group(0)
        assert "switching to the" not in log
    else:
        assert worker.groups() == ("2", "16", "2"), worker.group(0)
        switches = re.findall(r"MFD_D: (\d+) running requests, switching to the (\S+) path", log)
        assert switches and all((int(n) >= 2) == (path == "single-mode") for n, path in switches), switches
