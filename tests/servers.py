"""Server helpers for tests: starting real SGLang CPU servers (refused when a hook did not apply), the
check every server's fixture ends with (idle, healthy, no KV leak), requests against an
OpenAI-compatible SGLang server that return generated token ids, the test plugins' environment and the
rounds the round-trace plugin logged (`round_traces`), and SGLang's argument resolution of an MFD launch
(`resolve`: where launch refusals are held to SGLang's own parsing)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import NamedTuple

import requests

from mfd_sglang.hf import plain_greedy
from mfd_sglang.server_process import (  # noqa: F401 (re-exported)
    ServerProcess, free_port, generate_ids, launch_command, log_tail, post_json,
)

REPO = Path(__file__).resolve().parents[1]
# What SGLang 0.5.23's HookRegistry.apply_hooks logs, with the traceback, in any process where a hook's
# target did not resolve or could not be patched; SGLang then carries on without that hook.
HOOK_FAILURE = "Failed to apply hooks"


def plugin_env(*names: str) -> dict:
    """The environment that loads the test plugins `names` (folders of tests/plugins: `rank_rng`,
    `round_trace`) into every server process, beside what PYTHONPATH already holds."""
    folders = [str(REPO / "tests" / "plugins" / name) for name in names]
    return {"PYTHONPATH": os.pathsep.join(filter(None, [*folders, os.environ.get("PYTHONPATH")]))}


def hold_file(server: ServerProcess) -> Path:
    """Where the `hold_admission` test plugin of a server from `start_server` reads its armed hold."""
    return server.log_path.parent / "hold_admission"


@contextlib.contextmanager
def admitted_together(server: ServerProcess, requests: int, timeout: float = 600, *, schedulers: int = 1):
    """Within the block, `server` (started with `plugin_env("hold_admission")`) admits no waiting request
    until `requests` wait, so that the block's concurrent requests share their first batch on any machine.
    Yields `wait()`, which returns once they were admitted (for a test that must act on them in flight); on
    leaving, checks that they were admitted together. A server of data-parallel replicas or attention-DP
    ranks has `schedulers` waiting queues, each holding until its own `requests` wait (the tensor-parallel ranks
    of one queue hold and log alike)."""
    path = hold_file(server)
    generation = int(path.read_text().split()[0]) + 1 if path.exists() else 1
    armed = path.with_suffix(".new")
    armed.write_text(f"{generation} {requests}\n")
    os.replace(armed, path)  # the scheduler never reads half a file
    since = len(server.log())
    line = f"hold_admission: generation {generation} admitting {requests} waiting requests"

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while server.log()[since:].count(line) < schedulers:
            assert time.monotonic() < deadline and server.proc.poll() is None, log_tail(server.log_path)
            time.sleep(0.2)

    yield wait
    assert server.log()[since:].count(line) >= schedulers, log_tail(server.log_path)  # tensor-parallel ranks: each


def held_rid(tokens: int) -> str:
    """A request id that the `hold_decode` test plugin holds: once the request has `tokens` output tokens, its
    server decodes no further until the request is aborted, so an abort sent after them lands in flight."""
    return f"hold-after-{tokens}-{uuid.uuid4().hex}"


class TracedRound(NamedTuple):
    """One request's decode round as the round-trace plugin logged it: the arm drafted, what was accepted."""

    batch_size: int  # requests in the round's batch
    arm: tuple  # (single_mode, budget, modes): the serving worker's `Arm`
    accepted: int  # accepted draft tokens, the bonus token excluded


ROUND_TRACE = re.compile(r"round_trace: tp_rank=(\d+) rid=(\S+) bs=(\d+) single_mode=([01]) budget=(\d+) modes=(\w+) "
                         r"accepted=(\d+)")


def round_traces(server: ServerProcess, *, tp_rank: int | None = None, since: int = 0) -> dict[str, list[TracedRound]]:
    """{rid: its rounds, in order} of a server started with `plugin_env("round_trace")`, as tensor-parallel
    rank `tp_rank` ran them (None: every rank's lines, for servers whose ranks hold different requests:
    replicas, attention DP), from character `since` of its log on."""
    rounds = collections.defaultdict(list)
    for rank, rid, bs, single, budget, modes, accepted in ROUND_TRACE.findall(server.log()[since:]):
        if tp_rank is None or int(rank) == tp_rank:
            arm = (single == "1", int(budget), None if modes == "all" else int(modes))
            rounds[rid].append(TracedRound(int(bs), arm, int(accepted)))
    return dict(rounds)


def hub_cache_with(cache: Path, repo_id: str, drafter: Path) -> Path:
    """A Hugging Face hub cache (the layout `snapshot_download` reads offline) holding a copy of `drafter` as
    `repo_id` at revision main; returns the snapshot directory."""
    import shutil

    commit = "0" * 39 + "1"
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(commit)
    return Path(shutil.copytree(drafter, storage / "snapshots" / commit))


def start(cmd: list, log_path: Path, *, port: int, env: dict, startup_timeout: float = 600,
          cwd: Path = REPO) -> ServerProcess:
    """A started server (`/health` answers) whose log shows every HookRegistry hook applied: MFD's
    exactness on CPU rests on hooks (FULL_MASK, split KV off, the hybrid tree verify, penalties) and
    SGLang only logs a hook it could not apply. Stopped again when the check fails."""
    server = ServerProcess(cmd, log_path, port=port, env=env, cwd=cwd, startup_timeout=startup_timeout).start()
    try:
        assert_hooks_applied(server)
    except BaseException:
        server.stop()
        raise
    return server


def assert_hooks_applied(server: ServerProcess) -> None:
    assert HOOK_FAILURE not in server.log(), f"a hook did not apply:\n{log_tail(server.log_path)}"


def start_server(tmp_path_factory, tiny_pair, drafter: Path | None, algorithm: str | None, budget: int | None, *,
                 threshold: int | None = None, max_running: int | None = None, log_level: str = "warning",
                 extra_args: tuple[str, ...] = (), extra_env: dict | None = None,
                 target: Path | str | None = None) -> ServerProcess:
    """A CPU server on the tiny pair's target (fp32; `target`: the same target under another name, e.g. a hub
    id), with `algorithm` and its drafter or (None) without speculation, under SGLang's strict idle KV-leak
    check (which kills the scheduler on a leak). Only `--max-total-tokens` bounds it (a KV pool sized from host
    RAM would take seconds to allocate): max running requests and context length are what the launch resolves
    (MFD's 48, the target's own) unless a test sets `max_running`."""
    port = free_port()
    log = tmp_path_factory.mktemp("mfd_server") / "server.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1",
               MFD_TEST_HOLD_FILE=str(log.parent / "hold_admission"), **(extra_env or {}))
    env.setdefault("OMP_NUM_THREADS", "2")
    threshold_flag = () if threshold is None else ("--mfd-switch-threshold", str(threshold))
    cmd = launch_command(target or tiny_pair / "target", port=port, algorithm=algorithm, drafter=drafter,
                         budget=budget, dtype="float32", extra_args=[
                             "--max-total-tokens", "4096",
                             *(("--max-running-requests", str(max_running)) if max_running else ()),
                             "--log-level", log_level, *threshold_flag, *extra_args])
    return start(cmd, log, port=port, env=env)


def assert_healthy_without_leaks(server: ServerProcess) -> None:
    server.wait_until_idle()
    assert requests.get(server.base_url + "/health", timeout=60).status_code == 200, log_tail(server.log_path)
    assert "memory leak" not in server.log(), log_tail(server.log_path)


def served_without_leaks(server: ServerProcess):
    """A module fixture's body: yield the server to its tests, then check it idle, healthy and leak-free,
    and stop it (also when the check fails). Use as `yield from served_without_leaks(server)`."""
    yield server
    try:
        assert_healthy_without_leaks(server)
    finally:
        server.stop()


# --- requests against an OpenAI-compatible SGLang server, returning generated token ids ---------
def completion_ids(server: ServerProcess, input_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy /v1/completions on a token-id prompt; checks the usage count too."""
    out = post_json(server, "/v1/completions", {
        "model": "default", "prompt": input_ids, "max_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    })
    assert out["usage"]["completion_tokens"] == max_new_tokens, out
    return out["choices"][0].get("token_ids")


def chat_ids(server: ServerProcess, messages: list[dict], max_new_tokens: int) -> tuple[list[int], list[int]]:
    """(prompt ids after the server's chat template, response ids) of a greedy /v1/chat/completions."""
    out = post_json(server, "/v1/chat/completions", {
        "model": "default", "messages": messages, "max_tokens": max_new_tokens, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True, "return_prompt_token_ids": True,
    })
    choice = out["choices"][0]
    # 0.5.23 puts the ids of a chat choice in prompt_token_ids / response_token_ids
    return choice.get("prompt_token_ids"), choice.get("response_token_ids", choice.get("token_ids"))


class Served(NamedTuple):
    """A greedy request a test sent: its prompt, max_new_tokens and the server's meta_info."""

    input_ids: list[int]
    max_new_tokens: int
    meta: dict


def run_six_and_one(server: ServerProcess, hf_target, tiny_prompts: list[str]) -> list[Served]:
    """Six requests of different lengths at once (6 -> 1 running; admitted together, so on any machine: the
    server loads `plugin_env("hold_admission")`), then one alone: greedy output equal to the target's
    (`hf_target`: the tiny pair's fp32 model and tokenizer). Returns the seven requests, the lone one last
    (its accept length: completion_tokens / spec_verify_ct)."""
    six, outputs = six_at_once(server, hf_target, tiny_prompts, [8, 24, 12, 32, 10, 16])
    alone, meta = generate_ids(server, six[1].input_ids, 24)
    assert alone == outputs[1]
    return six + [Served(six[1].input_ids, 24, meta)]


def six_at_once(server: ServerProcess, hf_target, tiny_prompts: list[str],
                lengths: list[int]) -> tuple[list[Served], list[list[int]]]:
    """The first six prompts at once, lengths[i] new tokens each (admitted together: the server loads
    `plugin_env("hold_admission")`), greedy output equal to the target's; (the requests, their outputs)."""
    model, tok = hf_target
    prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in tiny_prompts[:6]]
    with admitted_together(server, 6), concurrent.futures.ThreadPoolExecutor(6) as pool:
        outputs = list(pool.map(lambda i: generate_ids(server, prompts[i], lengths[i]), range(6)))
    for ids, n, (got, _) in zip(prompts, lengths, outputs):
        assert got == plain_greedy(model, ids, n), log_tail(server.log_path)
    return [Served(ids, n, meta) for ids, n, (_, meta) in zip(prompts, lengths, outputs)], [got for got, _ in outputs]


def run_six_long(server: ServerProcess, hf_target, tiny_prompts: list[str], max_new_tokens: int) -> list[Served]:
    """Six requests of max_new_tokens at once (`six_at_once`): under the automatic budget, enough request-rounds
    to measure its drafting paths in turn (each from `BudgetChooser.min_requests`, 64)."""
    return six_at_once(server, hf_target, tiny_prompts, [max_new_tokens] * 6)[0]


def chat_template_ids(tokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


# --- SGLang's argument resolution -------------------------------------------------------------------
RESOLVE = """
import json, os, sys
from sglang.srt.arg_groups.overrides import resolution_result
from sglang.srt.arg_groups.pipeline import run_resolution_pipeline
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

load_plugins()  # the plugin's entry point, then its hooks (MFD's flags on SGLang's parser)
pair, results = sys.argv[1], []
for extra, env in json.loads(sys.argv[2]):
    os.environ.update(env)
    try:
        args = prepare_server_args(["--model-path", pair + "/target", "--device", "cpu", "--attention-backend",
                                    "mfd_cpu", "--speculative-algorithm", "MFD", "--speculative-draft-model-path",
                                    pair + "/drafter", *extra])
        run_resolution_pipeline(args)
        results.append({"dp_size": resolution_result(args, "dp_size"),
                        "attn_dp_size": resolution_result(args, "attn_dp_size"), "mfd_options": args.mfd_options})
    except ValueError as e:
        results.append({"error": str(e)})
    for name in env:
        del os.environ[name]
print(json.dumps(results))
"""


def resolve(tiny_pair, *argvs: list[str], env: dict | None = None, with_log: bool = False):
    """SGLang 0.5.23's own CLI parsing and resolution pipeline (where MFD's `validate_server_args` runs)
    of an MFD launch of the tiny pair with each extra argument list (a later flag overrides the launch's:
    e.g. another --speculative-draft-model-path), under the environment variables `env`: the resolved
    layout and the MFD flags given (`mfd_options`), or the refusal's message; with_log: (those, the warnings logged, all cases together)."""
    return resolve_cases(tiny_pair, [(argv, env or {}) for argv in argvs], with_log=with_log)


def resolve_cases(tiny_pair, cases: list[tuple[list[str], dict]], *, with_log: bool = False):
    """`resolve` of (extra arguments, environment variables) cases, each under its own environment, in one
    process (SGLang is imported once)."""
    out = subprocess.run([sys.executable, "-c", RESOLVE, str(tiny_pair), json.dumps(cases)], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    results = json.loads(out.stdout.splitlines()[-1])
    return (results, out.stderr) if with_log else results
