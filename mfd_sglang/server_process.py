"""Start and stop a real SGLang server process (used by the demo, the closed-loop benchmark and the tests).

`ServerProcess(cmd, log_path, port=...).start()` starts the command in its own process group with
stdout+stderr going to `log_path`, waits for `GET /health` to answer 200, and on failure or early exit
raises with the tail of the log. `stop()` always kills the whole process group (SIGTERM, then SIGKILL)
and waits for it, so no scheduler or detokenizer process outlives it (SGLang's pre-crash diagnostics off
unless the environment turns them on: QUIET_STOP_ENV). Use it as a context manager.
`launch_command(...)` builds the command line for a target with or without an MFD drafter: SGLang's
own launcher on a GPU machine, `mfd_sglang.cpu.launch_server` on a CPU-only one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import requests


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, n_chars: int = 6000) -> str:
    try:
        text = Path(path).read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return text[-n_chars:]


# A stop of ours is not a crash: the group's SIGTERM ends the scheduler, SGLang's launcher takes that for a
# failed child and its SIGQUIT handler sleeps 5 s before py-spy / CUDA-coredump diagnostics. Off unless the
# caller's environment sets them.
QUIET_STOP_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}


class PortInUse(RuntimeError):
    pass


class ServerProcess:
    def __init__(self, cmd: list[str], log_path: Path, *, port: int, env: dict | None = None,
                 cwd: str | Path | None = None, startup_timeout: float = 600.0):
        self.cmd = [str(c) for c in cmd]
        self.log_path = Path(log_path)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.env = {**QUIET_STOP_ENV, **(os.environ if env is None else env)}
        self.cwd = cwd
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    def start(self, port_attempts: int = 3) -> "ServerProcess":
        """Start and wait for /health. A port found free can be taken by another socket before the
        server binds it (the HTTP server then logs EADDRINUSE and never answers): the server is then
        restarted on a fresh port (the `--port` value of the command), up to `port_attempts` times."""
        for attempt in range(port_attempts):
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")
            self.proc = subprocess.Popen(
                self.cmd, stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=self.env, cwd=self.cwd, start_new_session=True,
            )
            try:
                self._wait_healthy()
                return self
            except PortInUse:
                self.stop()
                if attempt == port_attempts - 1:
                    raise
                self._use_port(free_port())
            except BaseException:
                self.stop()
                raise
        return self

    def _use_port(self, port: int) -> None:
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                raise RuntimeError(
                    f"server exited with code {rc} before answering /health\n"
                    f"command: {' '.join(self.cmd)}\n--- log tail ({self.log_path}) ---\n{log_tail(self.log_path)}"
                )
            try:
                # a server under load (or the Triton interpreter) can take seconds to answer
                if requests.get(self.base_url + "/health", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                if "address already in use" in log_tail(self.log_path, 2000):
                    raise PortInUse(f"port {self.port} was taken before the server bound it")
            time.sleep(1.0)
        raise TimeoutError(
            f"server did not answer /health within {self.startup_timeout:.0f} s\n"
            f"command: {' '.join(self.cmd)}\n--- log tail ({self.log_path}) ---\n{log_tail(self.log_path)}"
        )

    def stop(self) -> None:
        proc = self.proc
        if proc is not None:
            try:
                pgid = os.getpgid(proc.pid)
            except ProcessLookupError:
                pgid = None
            if pgid is not None:
                for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
                    try:
                        os.killpg(pgid, sig)
                    except ProcessLookupError:
                        break
                    try:
                        proc.wait(timeout=wait_s)
                    except subprocess.TimeoutExpired:
                        continue
                    # the leader is gone; make sure no child of the group survives
                    try:
                        os.killpg(pgid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    break
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def wait_until_idle(self, deadline_s: float = 300.0) -> dict:
        """Poll the schedulers' load snapshots (/v1/loads: one per data-parallel replica) until two
        successive ones of every replica, all published after this call, show no running and no
        waiting request; returns the first replica's last. While idle a scheduler republishes its
        snapshot on every pass of its idle loop, right after SGLang's strict KV-leak check
        (SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1 kills the scheduler on a leak), so each replica's
        second idle snapshot follows at least one check of its idle pools. Raises RuntimeError (with
        the log's tail) when the server stops answering or does not go idle in time."""
        start = time.time()
        idle_since, loads = None, None  # per replica, the timestamp of its last idle snapshot seen
        while time.time() < start + deadline_s:
            try:
                loads = sorted(requests.get(self.base_url + "/v1/loads", timeout=60).json()["loads"],
                               key=lambda load: load.get("dp_rank") or 0)
            except requests.RequestException as e:  # e.g. the leak check killed the server
                raise RuntimeError(f"/v1/loads: {type(e).__name__}: {e}\n{log_tail(self.log_path)}") from e
            stamps = [load["timestamp"] for load in loads]
            idle = all(load["timestamp"] > start and load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
                       for load in loads)
            if not idle:
                idle_since = None
            elif idle_since is None:  # replicas republish at their own times: each must pass its first idle stamp
                idle_since = stamps
            elif all(now > then for now, then in zip(stamps, idle_since)):
                return loads[0]
            time.sleep(0.2)
        raise RuntimeError(f"the server did not go idle within {deadline_s:.0f} s (last loads: {loads})\n"
                           f"{log_tail(self.log_path)}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_command(target, *, port: int, algorithm: str | None = None, drafter=None, budget: int | None = None,
                   device: str = "cpu", dtype: str = "bfloat16", extra_args: list[str] = ()) -> list[str]:
    """The server command line; `algorithm` None serves the target without speculation."""
    import sys

    module = "mfd_sglang.cpu.launch_server" if device == "cpu" else "sglang.launch_server"
    cmd = [sys.executable, "-m", module, "--model-path", str(target), "--dtype", dtype,
           "--host", "127.0.0.1", "--port", str(port)]
    if algorithm is not None:
        cmd += ["--speculative-algorithm", algorithm, "--speculative-draft-model-path", str(drafter)]
        if budget is not None:
            cmd += ["--speculative-num-draft-tokens", str(budget + 1)]
    return cmd + list(extra_args)


def post_json(server: ServerProcess, path: str, payload: dict, timeout: float = 300) -> dict:
    """POST a JSON request to the server; an answer other than 200 raises with the server's log."""
    r = requests.post(server.base_url + path, json=payload, timeout=timeout)
    if r.status_code != 200:
        raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:2000]}\n--- log ---\n{log_tail(server.log_path)}")
    return r.json()


def stream_then_abort(server: ServerProcess, payload: dict, abort_after: int, timeout: float = 600, *,
                      tokens: bool = False) -> list[dict]:
    """Stream /generate for `payload` (its "rid" set, "stream" on) and abort the request by its id through
    /abort_request once `abort_after` chunks have arrived (`tokens`: once the chunks report `abort_after`
    tokens generated); returns the meta_info of every chunk."""
    chunks, aborted = [], False
    with requests.post(server.base_url + "/generate", json=payload, stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            body = line[len(b"data:"):].strip() if line.startswith(b"data:") else b""
            if body == b"[DONE]":
                break
            if body:
                chunks.append(json.loads(body)["meta_info"])
                reached = chunks[-1]["completion_tokens"] if tokens else len(chunks)
                if not aborted and reached >= abort_after:
                    requests.post(server.base_url + "/abort_request", json={"rid": payload["rid"]},
                                  timeout=60).raise_for_status()
                    aborted = True
    return chunks


def generate_ids(server: ServerProcess, input_ids: list[int], max_new_tokens: int, **sampling) -> tuple[list[int], dict]:
    """(output ids, meta_info) of /generate on a token-id prompt, greedy unless `sampling` says otherwise."""
    params = {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True, **sampling}
    out = post_json(server, "/generate", {"input_ids": input_ids, "sampling_params": params})
    return out.get("output_ids") or out["meta_info"].get("output_ids"), out["meta_info"]
