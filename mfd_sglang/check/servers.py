"""Real SGLang servers held to the same server without speculation, one row per speculative server as
soon as it has finished (the `servers` sections of `mfd_sglang.check`; on a CPU through the CPU launcher).

A group is one pair (target + drafter + prompts) and one server configuration (dtype, CUDA graphs with
overlap scheduling or neither, attention backend, KV page size): a plain server and the speculative
servers (MFD, MFD_D, ...) get the same prompts, all at once (so that batches of several requests are
verified), by token ids (`--skip-tokenizer-init`). Where several servers share the device (the GPU check:
`Launch.one_at_a_time` False) each is bounded in memory and, on a GPU, the servers of a group start together
(start-up is most of the time), and the plain server stays up until the group is done: the bf16 check asks it
questions. One at a time (the self-check, or a CPU): each server runs alone with its default memory and is
stopped before the next starts; a near-tie question starts the plain server again.

A row is `ok` when every request of both servers completed with all its tokens and
- fp32: the token ids equal the plain server's;
- bf16: at each request's first divergence from plain, the plain server's two most likely next tokens are
  the two servers' tokens and are a near-tie, at most NEAR_TIE_NATS apart in log-probability (asked of the
  plain server with the common prefix as the prompt). bf16 rounding differs between a tree verify and a
  one-token decode, so a near-tie may part them; a wrong tree mask, KV move or drafter context would not
  pick the runner-up of a near-tie, so the check still fails on such bugs;
- a pair that accepts drafts (`Pair.accept_bounds`): the speculative server's mean accept length (tokens per
  verify round, bonus included, as SGLang reports it) is at least its bound. A tree bug cannot show where
  nothing is accepted: a random target and drafter accept about nothing, so only such a pair tests the
  tree, the accepted-KV moves and the drafter context;
- the automatic budget with CUDA graphs: the start-up log lists a verify graph for every candidate budget's
  window, and the memory the extra windows took is more than nothing and within what the launch planned.
With `timed_alone` each prompt is also sent alone to each server and timed: the row then carries the round's
time and its cost in plain decode steps at batch size 1 (`round_cost`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Iterator

from mfd_sglang.serving.budget.rule import candidate_budgets
from mfd_sglang.server_process import ServerProcess, free_port, launch_command, log_tail, post_json

NEAR_TIE_NATS = 0.25
# Log lines worth returning from a server (JIT compiles, graph captures, memory, MFD's own start-up lines).
LOG_EVENTS = re.compile(r"^(?!.*Ignore import error).*(capture|cuda graph|compil|jit|autotun|avail mem|KV Cache is "
                        r"allocated|Load weight end|MFD|mem-fraction|Traceback|Error|error:)", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class Pair:
    name: str
    target: Path
    drafter: Path
    prompts: tuple[tuple[int, ...], ...]
    accept_bounds: dict[str, float] | None  # per speculative server, the mean accept length it must reach


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    dtype: str
    cuda_graphs: bool  # on a GPU: CUDA graphs and overlap scheduling on together, or both off
    attention: str | None  # --attention-backend of every server; None: each server's default
    attention_note: str
    page_size: int = 1
    spec_attention_flag: bool = True  # False: the speculative servers get no --attention-backend (MFD chooses)

    @property
    def name(self) -> str:
        return f"{self.dtype}-{'graphs' if self.cuda_graphs else 'eager'}-page{self.page_size}"


@dataclasses.dataclass(frozen=True)
class Server:
    name: str
    algorithm: str | None
    budget: int | None = None  # None: the algorithm's own default number of draft tokens
    env: tuple[tuple[str, str], ...] = ()
    drafter: str | None = None  # a folder beside the pair's drafter that it serves instead (DFLASH: the single-mode one)
    args: tuple[str, ...] = ()  # its own flags (e.g. --mfd-kernels)


PLAIN = Server("plain", None)
AUTO = "MFD_D auto"


def speculative_servers(budget: int) -> list[Server]:
    return [Server("MFD", "MFD", budget), Server("MFD_D", "MFD_D", budget)]


def auto_server(budget: int) -> Server:
    return Server(AUTO, "MFD_D", budget, (("MFD_SGLANG_AUTO_BUDGET", "1"),))


# SGLang's own DFLASH chain with the pair's single-mode drafter (make-tiny writes it as drafter-dflash).
DFLASH = Server("DFLASH", "DFLASH", drafter="drafter-dflash")


def attention_choice(dtype: str) -> tuple[str, str]:
    """(backend, why) for a GPU group of this dtype; every server of a group uses the same kernels."""
    if dtype == "float32":
        return "triton", "fp32: FlashInfer has no fp32 kernels"
    if importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer", "FlashInfer is importable"
    return "triton", "FlashInfer is not installed (the device kit carries none)"


def cpu_config() -> ServerConfig:
    return ServerConfig("float32", False, None, "CPU launcher default (mfd_cpu)")


def standin_env() -> dict:
    """Server environment when `sgl_kernel` is this project's pure-torch stand-in rather than the CUDA
    wheel: SGLang's fused ops then take their torch reference path (`forward_native`), and its start-up
    check for an installed `sglang-kernel` wheel (CUDA only) is skipped: the stand-in is no wheel."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is not None and "sgl_kernel_standin" in str(spec.origin):
        return {"SGLANG_FORCE_FUSED_OP_BACKEND": "torch",  # KernelBackend.TORCH: forward_native
                "SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK": "1"}
    return {}


def tiny_pair(path: Path, device: str) -> Pair:
    """The carried make-tiny pair (seed 0, K = 4): a drafter trained on its target, so trees are accepted."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path / "target")
    prompts = tuple(tuple(tokenizer(p)["input_ids"]) for p in json.loads((path / "prompts.json").read_text()))
    return Pair("make-tiny (seed 0, K = 4)", path / "target", path / "drafter", prompts, TINY_ACCEPT_BOUNDS)


# The tiny pair's mean accept length at B = 16 in real CPU servers (fp32, its six prompts at once, 32 tokens
# each; the rehearsal in tests/test_device_kit.py asserts these bounds too): MFD 6.32, MFD_D 4.55 (its single
# mode). A GPU server verifies the same trees, so it accepts as much; the bounds are 80% of that, so that a
# drafter context, tree or KV move that goes wrong on some rounds shows here even where the tokens stay exact.
TINY_ACCEPT_BOUNDS = {"MFD": 5.0, "MFD_D": 3.6}


class ServerLogs:
    """The log of every server the check started; `write()` puts each one's start-up events and tail into
    one file of the returned folder (a device call returns at most 8 files), refreshed every `every` s by
    a daemon thread so that a call killed at its limit still returns what its servers said."""

    def __init__(self, path: Path | None, every: float = 15.0):
        self.path, self.logs, self.lock = path, {}, threading.Lock()
        if path is not None:
            threading.Thread(target=self._refresh, args=(every,), daemon=True).start()

    def add(self, name: str, log: Path) -> None:
        with self.lock:
            self.logs[name] = log

    def write(self) -> None:
        if self.path is None:
            return
        with self.lock:
            parts = [f"===== {name} ({log}) =====\n--- events ---\n" + "\n".join(log_events(log))
                     + f"\n--- tail ---\n{log_tail(log, 4000)}\n" for name, log in self.logs.items()]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("\n".join(parts))
        tmp.replace(self.path)

    def _refresh(self, every: float) -> None:
        while True:
            time.sleep(every)
            try:
                self.write()
            except OSError:
                pass


def log_events(log: Path, first: int = 30, last: int = 10) -> list[str]:
    """The log's lines about JIT compiles, graph captures, memory and MFD's start-up (the first `first`
    and the last `last` of them)."""
    try:
        lines = [line for line in Path(log).read_text(errors="replace").splitlines() if LOG_EVENTS.search(line)]
    except OSError:
        return []
    lines = [line[:300] for line in lines]
    return lines if len(lines) <= first + last else lines[:first] + ["..."] + lines[-last:]


@dataclasses.dataclass
class Launch:
    """What a group needs from the check: device, deadline, where logs go, and whether its servers share the
    device (module docstring)."""
    device: str
    deadline: float  # time.time() after which nothing new may start
    logdir: Path
    logs: ServerLogs
    one_at_a_time: bool = False

    def left(self) -> float:
        return self.deadline - time.time()


def start_server(launch: Launch, pair: Pair, config: ServerConfig, server: Server, group: str,
                 extra_args: tuple[str, ...] = ()) -> ServerProcess:
    """Start (and wait for) one server of a group; its start-up may take what is left before the deadline."""
    timeout = min(900.0, launch.left() - 15)
    if timeout < 30:
        raise TimeoutError(f"not started: {launch.left():.0f} s left before the call's deadline")
    port = free_port()
    extra = ["--skip-tokenizer-init", "--max-running-requests", str(len(pair.prompts)), *extra_args]
    if launch.device == "cpu":
        extra += ["--mem-fraction-static", "0.6"]
    else:
        if not launch.one_at_a_time:  # several servers share the GPU: bound each KV pool and the graphs captured
            extra += ["--mem-fraction-static", "0.7", "--max-total-tokens", "32768",
                      "--cuda-graph-max-bs", str(len(pair.prompts))]
        if not config.cuda_graphs:
            extra += ["--disable-cuda-graph", "--disable-overlap-schedule"]
    if config.attention is not None and (server.algorithm is None or config.spec_attention_flag):
        extra += ["--attention-backend", config.attention]
    if config.page_size != 1:
        extra += ["--page-size", str(config.page_size)]
    drafter = pair.drafter if server.drafter is None else pair.drafter.parent / server.drafter
    cmd = launch_command(pair.target, port=port, algorithm=server.algorithm, drafter=drafter,
                         budget=server.budget, device=launch.device, dtype=config.dtype,
                         extra_args=[*extra, *server.args])
    name = f"{group}-{config.name}-{server.name}".replace(" ", "-")
    log = launch.logdir / f"{name}.log"
    launch.logs.add(name, log)
    # The server's working directory is its log folder: `python -m` puts the working directory first on
    # sys.path, and a repository root there would shadow the installed plugin with its source folder.
    return ServerProcess(cmd, log, port=port, env={**os.environ, **standin_env(), **dict(server.env)},
                         cwd=launch.logdir, startup_timeout=timeout).start()


def generate_all(launch: Launch, server: ServerProcess, prompts, max_new_tokens: int) -> list[tuple[list[int], dict]]:
    """Every prompt at once, greedy; (output ids, meta_info) per prompt."""
    def one(ids):
        payload = {"input_ids": list(ids), "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens,
                                                                "ignore_eos": True}}
        out = post_json(server, "/generate", payload, timeout=max(10.0, min(600.0, launch.left())))
        return out.get("output_ids") or out["meta_info"].get("output_ids"), out["meta_info"]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def serve(launch: Launch, pair: Pair, config: ServerConfig, server: Server, group: str, max_new_tokens: int,
          extra_args: tuple[str, ...] = (), keep: list | None = None, then_one_by_one: bool = False,
          timed_alone: bool = False) -> dict:
    """One server's outputs, or the error that stopped it; `keep` (a list) receives the running server
    instead of it being stopped. `then_one_by_one`: after all prompts at once, each again alone (from the
    radix cache), its outputs appended. `timed_alone`: then each prompt alone again, timed (batch size 1:
    seconds, tokens and verify rounds per request, for the round cost)."""
    begin = time.perf_counter()
    proc = None
    try:
        proc = start_server(launch, pair, config, server, group, extra_args)
        ready = time.perf_counter() - begin
        outs = generate_all(launch, proc, pair.prompts, max_new_tokens)
        if then_one_by_one:
            outs += [out for prompt in pair.prompts for out in generate_all(launch, proc, [prompt], max_new_tokens)]
        alone = [timed_request(launch, proc, prompt, max_new_tokens) for prompt in pair.prompts] if timed_alone else None
        log = proc.log()
    except Exception as exc:
        if proc is not None:
            proc.stop()
        return {"error": f"{type(exc).__name__}: {exc}"[:6000]}
    if keep is None:
        proc.stop()
    else:
        keep.append(proc)
    captured = re.search(r"tree-verify CUDA graphs captured for windows of \[([\d, ]*)\] tokens per request in "
                         r"[\d.]+ s \(the extra widths took (-?\d+) MiB", log)
    planned = re.search(r"verify graphs of the other windows (\d+) MiB", log)
    return {"ids": [ids for ids, _ in outs], "startup_s": round(ready, 1), "alone": alone,
            "accept_length": [meta.get("spec_accept_length") for _, meta in outs],
            "log_events": log_events(proc.log_path),
            "fallback_to_triton_logged": "FlashInfer is not installed" in log,
            "verify_graph_widths": [int(w) for w in captured.group(1).split(",")] if captured else None,
            "verify_graph_mib": {"measured": int(captured.group(2)) if captured else None,
                                 "planned": int(planned.group(1)) if planned else None}}


def timed_request(launch: Launch, server: ServerProcess, prompt, max_new_tokens: int) -> dict:
    """One request alone (batch size 1), timed by the client: seconds, tokens, verify rounds (SGLang's
    spec_verify_ct; a plain server's rounds are its tokens)."""
    start = time.perf_counter()
    (ids, meta), = generate_all(launch, server, [prompt], max_new_tokens)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": len(ids), "rounds": meta.get("spec_verify_ct") or len(ids)}


def round_cost(spec_alone: list[dict], plain_alone: list[dict]) -> dict:
    """A speculative round's cost in plain decode steps at batch size 1, from the same requests timed
    alone on both servers (prefill included on both sides, so short outputs flatter neither), and the
    speed-up of the whole requests."""
    spec_s, plain_s = sum(r["seconds"] for r in spec_alone), sum(r["seconds"] for r in plain_alone)
    round_s = spec_s / sum(r["rounds"] for r in spec_alone)
    step_s = plain_s / sum(r["tokens"] for r in plain_alone)
    return {"round_ms": round(1e3 * round_s, 3), "plain_step_ms": round(1e3 * step_s, 3),
            "round_cost": round(round_s / step_s, 3), "speedup": round(plain_s / spec_s, 3),
            "tokens_per_round": round(sum(r["tokens"] for r in spec_alone) / sum(r["rounds"] for r in spec_alone), 3)}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def near_tie(launch: Launch, plain: ServerProcess, prompt, plain_ids: list[int], spec_ids: list[int]) -> dict:
    """The plain server's two most likely tokens after prompt + the common prefix, and whether they are the
    two servers' tokens within NEAR_TIE_NATS of each other."""
    at = first_divergence(plain_ids, spec_ids)
    payload = {"input_ids": list(prompt) + plain_ids[:at], "return_logprob": True, "top_logprobs_num": 2,
               "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    top = post_json(plain, "/generate", payload, timeout=max(10.0, min(300.0, launch.left())))["meta_info"][
        "output_top_logprobs"][0]
    (lp1, id1), (lp2, id2) = [(float(t[0]), int(t[1])) for t in top[:2]]
    return {"at": at, "tokens": [plain_ids[at], spec_ids[at]], "top2": [id1, id2], "gap": round(lp1 - lp2, 4),
            "ok": {id1, id2} == {plain_ids[at], spec_ids[at]} and lp1 - lp2 <= NEAR_TIE_NATS}


def compare(launch: Launch | None, pair: Pair, config: ServerConfig, server: Server, spec: dict, plain: dict,
            max_new_tokens: int, plain_server: Callable[[], ServerProcess] | None = None) -> dict:
    """The row of one speculative server against the plain server of its group (plain_server: gives the
    running plain server, started again if need be, for near-tie questions)."""
    row = {"server": server.name, "pair": pair.name, "dtype": config.dtype, "cuda_graphs": config.cuda_graphs,
           "overlap": config.cuda_graphs, "page_size": config.page_size,
           "attention": (config.attention if config.spec_attention_flag else None) or "default",
           "attention_note": config.attention_note, "B": server.budget, "prompts": len(pair.prompts),
           "max_new_tokens": max_new_tokens, "exact_required": config.dtype == "float32",
           "accept_bound": (pair.accept_bounds or {}).get(server.name)}
    errors = [f"{who}: {r['error']}" for who, r in ((server.name, spec), ("plain", plain)) if "error" in r]
    if errors:
        return {**row, "ok": False, "error": "\n".join(errors), "log_events": spec.get("log_events")}
    ids, ref = spec["ids"], plain["ids"]
    complete = all(len(x) == max_new_tokens for x in ids + ref)
    exact = ids == ref
    accepts = [a for a in spec["accept_length"] if a is not None]
    mean_accept = round(sum(accepts) / len(accepts), 3) if accepts else None
    accept_ok = row["accept_bound"] is None or (mean_accept is not None and mean_accept >= row["accept_bound"])
    near_ties, ties_ok = [], exact or row["exact_required"]
    if not exact and not row["exact_required"]:
        try:
            near_ties = [near_tie(launch, plain_server(), prompt, r, x)
                         for prompt, r, x in zip(pair.prompts, ref, ids) if r != x]
            ties_ok = all(t["ok"] for t in near_ties)
        except Exception as exc:
            row["error"] = f"near-tie check: {type(exc).__name__}: {exc}"[:3000]
            ties_ok = False
    graphs_ok = True
    if server.name == AUTO and config.cuda_graphs:  # a verify graph for every budget it may play,
        row["verify_graph_widths"] = spec.get("verify_graph_widths")  # within the memory planned for them
        row["verify_graph_mib"] = mib = spec.get("verify_graph_mib") or {}
        graphs_ok = (row["verify_graph_widths"] == [b + 1 for b in candidate_budgets(server.budget)]
                     and None not in (mib.get("measured"), mib.get("planned"))
                     and 1 <= mib["measured"] <= mib["planned"])
    row.update(exact=exact, complete=complete, first_divergence=[first_divergence(x, y) for x, y in zip(ids, ref)],
               near_ties=near_ties, accept_length=spec["accept_length"], mean_accept=mean_accept,
               startup_s=spec["startup_s"], plain_startup_s=plain["startup_s"],
               fallback_to_triton_logged=spec["fallback_to_triton_logged"], log_events=spec["log_events"],
               **(round_cost(spec["alone"], plain["alone"]) if spec.get("alone") and plain.get("alone") else {}),
               ok=complete and (exact or (not row["exact_required"] and ties_ok)) and accept_ok and graphs_ok)
    return row


def server_group(launch: Launch, pair: Pair, config: ServerConfig, servers: list[Server], group: str,
                 max_new_tokens: int, extra_args: tuple[str, ...] = (), then_one_by_one: bool = False,
                 timed_alone: bool = False) -> Iterator[dict]:
    """Plain and `servers` on one pair and config; yields each speculative server's row as soon as it
    and the plain server are done (on a GPU shared by the group all start at once, else one after the
    other; with `timed_alone`, which times requests, one after the other everywhere)."""
    kept: list[ServerProcess] = []
    run = lambda server, keep=None: serve(launch, pair, config, server, group, max_new_tokens,  # noqa: E731
                                          extra_args, keep, then_one_by_one, timed_alone)
    parallel = launch.device != "cpu" and not timed_alone and not launch.one_at_a_time

    def plain_server() -> ServerProcess:
        if not kept:  # one at a time: the plain server was stopped; it starts again, alone, for a near-tie question
            kept.append(start_server(launch, pair, config, PLAIN, group, extra_args))
        return kept[0]

    try:
        with ThreadPoolExecutor(1 + len(servers) if parallel else 1) as pool:
            plain_future = pool.submit(run, PLAIN, None if launch.one_at_a_time else kept)
            futures: dict[Server, Future] = {s: pool.submit(run, s) for s in servers} if parallel else {}
            plain = plain_future.result()
            for server in servers:
                spec = futures[server].result() if parallel else run(server)
                row = compare(launch, pair, config, server, spec, plain, max_new_tokens, plain_server)
                if launch.one_at_a_time:  # the next server starts alone
                    while kept:
                        kept.pop().stop()
                yield row
    finally:
        for proc in kept:
            proc.stop()
        launch.logs.write()


def print_server_rows(rows: list[dict]) -> None:
    for r in rows:
        mode = "graphs+overlap" if r.get("cuda_graphs") else "eager"
        head = (f"  {r['server']:>10} {r['dtype']:>8} {mode:>14} page {r.get('page_size', 1):>2} "
                f"{r['attention']} B={r['B']} [{r['pair']}]:")
        if "error" in r:
            print(f"{head} ERROR {r['error'].strip().splitlines()[0]}")
            continue
        verdict = "EXACT" if r["exact"] else ("DIFFERS" if r["exact_required"] else
                                              f"differs at near-ties {[t['gap'] for t in r['near_ties']]}")
        cost = (f"; round cost {r['round_cost']} plain steps ({r['round_ms']} ms), {r['speedup']}x plain at bs 1"
                if "round_cost" in r else "")
        print(f"{head} {verdict}{'' if r['complete'] else ' INCOMPLETE'}; mean accept {r['mean_accept']}"
              f"{'' if r['accept_bound'] is None else ' (bound ' + str(r['accept_bound']) + ')'}{cost}; "
              f"{'ok' if r['ok'] else 'FAILED'}")
