"""Soak: a closed loop of mixed requests against one MFD (or MFD_D) CPU server on the make-tiny pair.

    python benchmarks/soak.py --duration 1200 --out benchmarks/results/soak-cpu2-DATE.json

Workers send requests back to back until --duration runs out, each drawn at random:
  greedy     short, long and shared-prefix prompts; the output must equal the target's greedy
             decoding (fp32 Transformers, computed here);
  penalised  greedy with a frequency penalty; must equal the target's penalised greedy decoding;
  sampled    T = 1, top-p 0.9, a sampling_seed; sent twice, both answers must be equal;
  aborted    streamed, aborted by its id after a few chunks; must end with finish reason "abort".
The KV pool (--max-total-tokens) is small, so more requests are in flight than fit in it and the
scheduler queues and retracts. The server runs SGLang's strict idle KV-leak check. At the end the
server must go idle, answer /health, hold its idle KV usage and resident memory at the level measured
after warm-up (RSS may grow by --rss-slack-mib), and have logged no error; the JSON records counts,
failures, memory and tokens. Exit status 1 on any failure. `tests/test_soak.py` runs a short version.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests
import torch
from transformers import AutoTokenizer

from mfd_sglang.hf import load_target, plain_greedy
from mfd_sglang.lab.tiny import make_tiny
from mfd_sglang.server_process import ServerProcess, free_port, launch_command, stream_then_abort

REPO = Path(__file__).resolve().parents[1]
KINDS = {"greedy": 0.45, "penalised": 0.15, "sampled": 0.2, "aborted": 0.2}
LOG_ERRORS = ("Traceback", " ERROR ", "memory leak", "Exception")


@dataclass
class Tally:
    counts: dict = field(default_factory=lambda: {k: 0 for k in KINDS})
    failures: list = field(default_factory=list)
    tokens: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, tokens: int, failure: str | None) -> None:
        with self.lock:
            self.counts[kind] += 1
            self.tokens += tokens
            if failure is not None:
                self.failures.append(failure)


class Reference:
    """The target's greedy decoding (optionally with a frequency penalty), memoised per request."""

    def __init__(self, target_dir: Path):
        self.model = load_target(target_dir, dtype=torch.float32)
        self.cache: dict[tuple, list[int]] = {}
        self.lock = threading.Lock()

    def greedy(self, ids: list[int], max_new: int, frequency_penalty: float = 0.0) -> list[int]:
        key = (tuple(ids), max_new, frequency_penalty)
        with self.lock:
            if key not in self.cache:
                self.cache[key] = plain_greedy(self.model, ids, max_new, frequency_penalty=frequency_penalty)
            return self.cache[key]


def server_rss_mib(server) -> float:
    """Resident memory of the server's whole process tree."""
    root = psutil.Process(server.proc.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) / 2**20


def idle_kv_usage(load: dict) -> int:
    """KV slots held by requests (the radix cache's evictable prefixes not counted)."""
    return load["num_used_tokens"]


def make_prompts(rng: random.Random, vocab: list[int]) -> dict[str, list[int]]:
    shared = [rng.choice(vocab) for _ in range(300)]
    return {"short": [rng.choice(vocab) for _ in range(rng.randint(2, 8))],
            "long": [rng.choice(vocab) for _ in range(rng.randint(200, 400))],
            "shared": shared + [rng.choice(vocab) for _ in range(rng.randint(1, 4))]}


def one_request(server, reference: Reference, rng: random.Random, vocab: list[int], tally: Tally) -> None:
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    prompts = make_prompts(rng, vocab)
    ids = prompts[rng.choice(list(prompts))]
    max_new = rng.randint(4, 48)

    url = server.base_url + "/generate"
    try:
        if kind in ("greedy", "penalised"):
            penalty = 0.8 if kind == "penalised" else 0.0
            r = requests.post(url, json={"input_ids": ids, "sampling_params": {
                "temperature": 0, "max_new_tokens": max_new, "ignore_eos": True, "frequency_penalty": penalty}},
                timeout=600)
            r.raise_for_status()
            out = r.json()["output_ids"]
            expected = reference.greedy(ids, max_new, penalty)
            failure = None if out == expected else f"{kind}: {len(ids)}-token prompt, got {out}, expected {expected}"
            tally.add(kind, len(out), failure)
        elif kind == "sampled":
            payload = {"input_ids": ids, "sampling_params": {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": max_new,
                                                            "ignore_eos": True, "sampling_seed": rng.randrange(2**31)}}
            outs = []
            for _ in range(2):
                r = requests.post(url, json=payload, timeout=600)
                r.raise_for_status()
                outs.append(r.json()["output_ids"])
            failure = None if outs[0] == outs[1] and len(outs[0]) == max_new else f"sampled: seeded answers differ {outs}"
            tally.add(kind, 2 * len(outs[0]), failure)
        else:
            rid = f"soak-{uuid.uuid4().hex}"
            payload = {"rid": rid, "input_ids": ids, "stream": True,
                       "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}}
            abort_after = rng.randint(1, 4)
            chunks = stream_then_abort(server, payload, abort_after)
            last = chunks[-1] if chunks else {}
            reason = (last.get("finish_reason") or {}).get("type")
            # A request can finish in the round in which the abort arrives; it may not run on.
            failure = None if reason == "abort" or (reason == "length" and len(chunks) <= abort_after + 1) else \
                f"aborted: {rid} finish reason {reason} after {len(chunks)} chunks (abort sent after {abort_after})"
            tally.add(kind, last.get("completion_tokens", 0), failure)
    except (requests.RequestException, KeyError, ValueError) as e:
        tally.add(kind, 0, f"{kind}: {type(e).__name__}: {e}")


def soak(pair: Path, *, algorithm: str, budget: int, duration: float, workers: int, max_total_tokens: int,
         rss_slack_mib: float, seed: int, log_dir: Path, log=print) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(str(pair / "target"))
    vocab = sorted(i for token, i in tokenizer.get_vocab().items() if token.isalpha())  # words: no special token
    reference = Reference(pair / "target")
    port = free_port()
    plain = algorithm == "none"  # the same loop against the plain server, for comparison
    cmd = launch_command(pair / "target", port=port, algorithm=None if plain else algorithm,
                         drafter=None if plain else pair / "drafter", budget=None if plain else budget,
                         dtype="float32", extra_args=["--max-total-tokens", str(max_total_tokens),
                                                      "--context-length", "1024", "--max-running-requests", "8"])
    env = dict(os.environ, HF_HUB_OFFLINE="1", SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE="1")
    env.setdefault("OMP_NUM_THREADS", "2")
    tally = Tally()
    with ServerProcess(cmd, log_dir / "soak-server.log", port=port, env=env, cwd=REPO) as server:
        warm = random.Random(seed + 1)
        for _ in range(3):
            one_request(server, reference, warm, vocab, Tally())
        start_load = server.wait_until_idle()
        start_rss = server_rss_mib(server)
        log(f"[soak] warm: RSS {start_rss:.0f} MiB, idle load {start_load}")
        deadline = time.time() + duration

        def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.time() < deadline:
                one_request(server, reference, rng, vocab, tally)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
        t0 = time.time()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        elapsed = time.time() - t0
        end_load = server.wait_until_idle()
        end_rss = server_rss_mib(server)
        healthy = requests.get(server.base_url + "/health", timeout=60).status_code == 200
        errors = [line for line in server.log().splitlines() if any(e in line for e in LOG_ERRORS)]
    failures = list(tally.failures)
    if not healthy:
        failures.append("the server did not answer /health after the loop")
    if idle_kv_usage(end_load) != idle_kv_usage(start_load):
        failures.append(f"idle KV usage {idle_kv_usage(start_load)} -> {idle_kv_usage(end_load)}")
    if end_rss > start_rss + rss_slack_mib:
        failures.append(f"server RSS grew from {start_rss:.0f} to {end_rss:.0f} MiB (slack {rss_slack_mib:.0f})")
    failures += [f"server log: {line}" for line in errors[:20]]
    return {"algorithm": algorithm, "budget": budget, "duration_s": round(elapsed, 1), "workers": workers,
            "max_total_tokens": max_total_tokens, "requests": tally.counts, "output_tokens": tally.tokens,
            "rss_mib": {"after_warmup": round(start_rss, 1), "end": round(end_rss, 1)},
            "idle_kv_usage": {"after_warmup": idle_kv_usage(start_load), "end": idle_kv_usage(end_load)},
            "failures": failures, "passed": not failures}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--pair", type=Path, help="a make-tiny OUTDIR (default: a fresh one, seed 0, in a temp dir)")
    p.add_argument("--algorithm", default="MFD", choices=["MFD", "MFD_D", "none"],
                   help="none: the plain server (no speculation), to compare with")
    p.add_argument("--budget", type=int, default=8, help="tree budget B")
    p.add_argument("--duration", type=float, default=1200.0, help="seconds of closed loop")
    p.add_argument("--workers", type=int, default=6, help="concurrent clients")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="KV pool size (small: requests queue)")
    p.add_argument("--rss-slack-mib", type=float, default=64.0, help="allowed growth of the server's RSS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the JSON result here")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        pair = args.pair
        if pair is None:
            pair = make_tiny(Path(tmp) / "tiny", seed=0, num_modes=4, log=lambda *a: None)
        result = soak(pair, algorithm=args.algorithm, budget=args.budget, duration=args.duration,
                      workers=args.workers, max_total_tokens=args.max_total_tokens, rss_slack_mib=args.rss_slack_mib,
                      seed=args.seed, log_dir=Path(tmp))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
