"""The main job: MFD in a real SGLang server, against the same server without speculation.

`python -m mfd_sglang demo` (what `scripts/demo.sh` runs after set-up):
1. prepares the embedded default target, SmolLM2-135M-Instruct (converted once from its pip
   package, cached), and takes the shipped MFD drafter `drafters/smollm2-135m/mfd`;
2. starts a plain SGLang server, sends a few chat requests through the OpenAI client, stops it;
3. starts the same server with `--speculative-algorithm MFD` and the automatic budget
   (--mfd-auto-budget: the budget, at most --budget, and plain decoding when speculation does
   not pay, chosen from what the server measures), sends the same requests, stops it;
4. prints the answers, tau (SGLang's average accepted tokens per verify round), the budget the server
   chose and the speed of both servers: the median over `repeats` passes over the requests.
On a machine with a GPU the servers run there (`sglang.launch_server`) in bfloat16; otherwise on the
CPU through `mfd_sglang.cpu.launch_server` in float32, where MFD's answers equal plain decoding's token
for token (in bf16 a verify of many tokens rounds otherwise than one-token decoding). Server logs go to a
temporary folder that is printed.
"""

from __future__ import annotations

import os
import re
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .server_process import ServerProcess, free_port, launch_command

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DRAFTER = REPO / "drafters" / "smollm2-135m" / "mfd"
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Give three tips for staying focused while studying.",
    "What is 17 times 23? Explain the steps.",
)


@dataclass
class ServerRun:
    label: str
    answers: list[str] = field(default_factory=list)  # of the first pass
    completion_tokens: int = 0  # per pass
    pass_seconds: list[float] = field(default_factory=list)
    verify_rounds: int = 0  # SGLang's spec_verify_ct summed over the first pass's requests (0 without speculation)
    budget_choice: str | None = None  # the automatic budget's last choice for one request at a time

    @property
    def tau(self) -> float | None:
        """Tokens per verify round (SGLang's spec_accept_length over all requests)."""
        return self.completion_tokens / self.verify_rounds if self.verify_rounds else None

    @property
    def seconds(self) -> float:
        """The median pass."""
        return statistics.median(self.pass_seconds) if self.pass_seconds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.seconds if self.seconds else 0.0


def serve_and_ask(label: str, cmd: list[str], port: int, prompts, max_tokens: int, log_path: Path,
                  say=print, repeats: int = 1) -> ServerRun:
    from openai import OpenAI

    env = dict(os.environ, HF_HUB_OFFLINE="1")
    say(f"[demo] starting the {label} server (log: {log_path}) ...")
    run = ServerRun(label)
    with ServerProcess(cmd, log_path, port=port, env=env, startup_timeout=900) as server:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused")

        def ask(prompt: str):
            return client.chat.completions.create(model="default", messages=[{"role": "user", "content": prompt}],
                                                  max_tokens=max_tokens, temperature=0,
                                                  extra_body={"return_spec_tokens_details": True})

        ask(prompts[0])  # warm-up: the first request pays one-time set-up costs
        for r in range(repeats):
            seconds = 0.0
            for i, prompt in enumerate(prompts, 1):
                say(f"[demo] {label}: pass {r + 1}/{repeats}, request {i}/{len(prompts)}")
                start = time.perf_counter()
                reply = ask(prompt)
                seconds += time.perf_counter() - start
                if r == 0:
                    run.answers.append(reply.choices[0].message.content)
                    run.completion_tokens += reply.usage.completion_tokens
                    details = ((reply.model_extra or {}).get("sglext") or {}).get("spec_tokens_details") or {}
                    run.verify_rounds += int(details.get("spec_verify_ct", 0))
            run.pass_seconds.append(seconds)
    say(f"[demo] {label} server stopped.")
    run.budget_choice = auto_budget_choice(log_path.read_text(errors="replace"))
    return run


def auto_budget_choice(log: str, bucket: int = 1) -> str | None:
    """The automatic budget's last choice for batches of <= bucket requests, read from the server's log."""
    choices = re.findall(rf"MFD auto budget: batch size <= {bucket} -> (.*?) \(\d", log)
    return choices[-1] if choices else None


def run_demo(target, drafter, *, prompts=DEFAULT_PROMPTS, max_tokens: int = 96, budget: int = 16,
             auto_budget: bool = True, repeats: int = 3, device: str | None = None, dtype: str | None = None,
             log_dir: Path | None = None, say=print) -> tuple[ServerRun, ServerRun]:
    """dtype None: float32 on the CPU (exact), bfloat16 on a GPU."""
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = dtype or ("float32" if device == "cpu" else "bfloat16")
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="mfd-demo-"))
    runs = []
    for label, algorithm in (("plain", None), ("MFD", "MFD")):
        port = free_port()
        cmd = launch_command(target, port=port, algorithm=algorithm, drafter=drafter, budget=budget,
                             device=device, dtype=dtype,
                             extra_args=["--max-running-requests", "4", "--context-length", "2048",
                                         "--log-level", "info" if algorithm and auto_budget else "warning",
                                         *(["--mfd-auto-budget"] if algorithm and auto_budget else [])])
        runs.append(serve_and_ask(label, cmd, port, list(prompts), max_tokens, log_dir / f"{label}.log", say,
                                  repeats=repeats))
    plain, mfd = runs
    report(plain, mfd, prompts, device=device, dtype=dtype, budget=budget, auto_budget=auto_budget, say=say)
    return plain, mfd


def report(plain: ServerRun, mfd: ServerRun, prompts, *, device: str, dtype: str, budget: int, auto_budget: bool,
           say=print) -> None:
    for i, (prompt, answer) in enumerate(zip(prompts, mfd.answers), 1):
        same = "same as plain" if answer == plain.answers[i - 1] else "differs from plain (see below)"
        say(f"\n--- request {i}: {prompt}\n{answer}\n[{same}]")
    budget_text = (f"automatic budget (at most {budget}), chosen for one request at a time: "
                   f"{mfd.budget_choice or 'not settled yet'}" if auto_budget else f"tree budget {budget}")
    say(f"\n[demo] {device}, {dtype}, MFD with {budget_text}; greedy, {len(prompts)} chat requests one at a time, "
        f"median of {len(plain.pass_seconds)} pass(es)")
    say(f"  plain: {plain.completion_tokens} tokens in {plain.seconds:.2f} s = {plain.tokens_per_second:.1f} tok/s")
    say(f"  MFD:   {mfd.completion_tokens} tokens in {mfd.seconds:.2f} s = {mfd.tokens_per_second:.1f} tok/s, "
        f"tau {mfd.tau if mfd.tau is None else round(mfd.tau, 2)}")
    if plain.tokens_per_second:
        say(f"  speed of MFD against plain: {mfd.tokens_per_second / plain.tokens_per_second:.2f}x")
    if any(a != b for a, b in zip(plain.answers, mfd.answers)):
        say("  Note: in bf16 the verify forward (many tokens at once) rounds differently from one-token "
            "decoding, so a near-tie can flip and the texts part ways; in fp32 MFD's output equals plain "
            "decoding token for token (tests/test_mfd_server.py).")
