"""Closed-loop batch-size benchmark of real SGLang servers (the paper's batch-size experiment).

For each configuration and each batch size b, exactly b requests are in flight: each one that finishes
is replaced by the next prompt until --requests-per-size have run. Requests are streaming OpenAI chat
completions (/v1/chat/completions, the server applies the chat template), so the time to the first
token (prefill) is separated from decoding; the final chunks carry the usage and SGLang's acceptance
counters (`return_spec_tokens_details`). Per configuration and b: decode tokens/s (all decoded tokens after each request's first,
over the wall time of that b), speed-up over the AR server at the same b, tau (completion tokens per
verify round, SGLang's spec_accept_length), mean TTFT and failed requests.

    python benchmarks/closed_loop.py --target $(python -m mfd_sglang prepare-target) \\
        --single-drafter drafters/smollm2-135m/dflash --mfd-drafter drafters/smollm2-135m/mfd \\
        --batch-sizes 1 2 4 --requests-per-size 8 --record

Configurations: ar (no speculation), dflash (SGLang's own DFLASH chain with the single-mode drafter: it
verifies the drafter's block, block_size tokens per request and round; on a CPU through the CPU launcher's
hooks, mfd_sglang/patches/cpu_dflash.py), mfd, mfd_d, ddtree (MFD with the single-mode drafter, K = 1). A
tree one may name its budget: `mfd_d@8` (B = 8; plain `mfd_d` uses --budget), or `mfd_d@auto` (the automatic
budget, --mfd-auto-budget, at most --budget; with a drafter that has a mode gate its paths include
each request's K/2 and 1 best modes), or `mfd@auto-kmodes` (the same over all K modes only,
--mfd-mode-subsets off: the automatic budget without the mode subsets). Every configuration's speed-up over AR at the same b is
reported (`speedup`; with repeats also `speedup_paired`, the median of the per-turn ratios). With an `@auto`
configuration and fixed budgets of the same one, the report also compares auto with AR and with the best
fixed budget at each b (`auto_vs`):

    python benchmarks/closed_loop.py --target ... --mfd-drafter drafters/smollm2-135m/mfd --budget 16 \
        --configs ar,mfd_d@4,mfd_d@8,mfd_d@16,mfd_d@auto --batch-sizes 1 2 4 8 --warmup --record

The servers are launched here one at a time (GPU if there is one, else CPU through
mfd_sglang.cpu.launch_server), or given with --base-url NAME=URL (then nothing is launched for NAME).
With --repeats R (CPU) they all run at once and each b is measured R times, the configurations taking
turns (the order rotates each time), and the median run is reported: on a shared or throttling CPU
two configurations measured minutes apart differ by 5-10% by themselves, and turns put the drift on
every configuration alike.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
from tqdm.auto import tqdm

from mfd_sglang.server_process import ServerProcess, free_port, launch_command

CONFIGS = ("ar", "dflash", "mfd", "mfd_d", "ddtree")
TREE_CONFIGS = ("mfd", "mfd_d", "ddtree")  # those with a tree budget (@B, @auto, @auto-kmodes)
AUTO_FLAGS = {"auto": ["--mfd-auto-budget"], "auto-kmodes": ["--mfd-auto-budget", "--mfd-mode-subsets", "off"]}
DRAFTER_FLAG = {"dflash": "single_drafter", "ddtree": "single_drafter", "mfd": "mfd_drafter", "mfd_d": "mfd_drafter"}


def split_config(name: str) -> tuple[str, str | None]:
    """`mfd_d@8` -> ("mfd_d", "8"); `mfd_d@auto` -> ("mfd_d", "auto"); `ar` -> ("ar", None)."""
    base, _, budget = name.partition("@")
    return base, budget or None


def parse_configs(text: str) -> list[str]:
    """The configurations of a comma list; ValueError naming the first one that is not a configuration."""
    configs = [c for c in text.split(",") if c]
    for name in configs:
        base, budget = split_config(name)
        if base not in CONFIGS:
            raise ValueError(f"unknown configuration {name!r}; choose from {CONFIGS}, the last three with an "
                             "optional @B, @auto or @auto-kmodes")
        if budget is not None and base not in TREE_CONFIGS:
            raise ValueError(f"configuration {name!r}: only {TREE_CONFIGS} take a tree budget (dflash verifies "
                             "its drafter's block)")
        if budget not in (None, *AUTO_FLAGS) and not (budget.isdigit() and int(budget) >= 1):
            raise ValueError(f"configuration {name!r}: the budget must be an integer >= 1, 'auto' or 'auto-kmodes'")
    if len(set(configs)) < len(configs):
        raise ValueError(f"configurations named twice in {text!r}")
    return configs


def server_command(name: str, args, port: int, device: str, max_batch: int) -> list[str]:
    """The launch command of one configuration."""
    extra = ["--max-running-requests", str(max_batch), "--context-length", str(args.context_length),
             "--log-level", "info" if split_config(name)[1] in AUTO_FLAGS else "warning",
             *AUTO_FLAGS.get(split_config(name)[1], [])]
    common = dict(port=port, device=device, dtype=args.dtype, extra_args=extra)
    name, budget = split_config(name)
    budget = args.budget if budget in (None, *AUTO_FLAGS) else int(budget)
    if name == "ar":
        return launch_command(args.target, **common)
    if name == "dflash":  # block_size from the drafter
        return launch_command(args.target, algorithm="DFLASH", drafter=args.single_drafter, **common)
    algorithm = "MFD_D" if name == "mfd_d" else "MFD"
    drafter = args.single_drafter if name == "ddtree" else args.mfd_drafter
    return launch_command(args.target, algorithm=algorithm, drafter=drafter, budget=budget, **common)


def compare_auto(results: dict) -> dict:
    """Per `X@auto` configuration and b: its speed over AR's and over the best fixed `X@B`'s (medians), and
    when `X@auto-kmodes` ran, `X@auto`'s over it (`vs_auto_kmodes`: what the mode subsets gave). With repeats, also the median of the paired ratios (`vs_ar_paired`, `vs_best_fixed_paired`): the
    configurations of one repeat ran in one turn, so a ratio within a turn is free of the drift between
    turns that the two medians may catch at different times."""
    report = {}
    for name, runs in results.items():
        base, budget = split_config(name)
        if budget not in AUTO_FLAGS:
            continue
        fixed = {n: r for n, r in results.items() if split_config(n)[0] == base and split_config(n)[1] not in (None, *AUTO_FLAGS)}
        report[name] = {}
        for b, run in runs.items():
            entry = ratios(run, results["ar"][b], "vs_ar") if "ar" in results else {"vs_ar": None}
            if fixed:
                best = max(fixed, key=lambda n: fixed[n][b]["decode_tokens_per_second"])
                entry["best_fixed"] = best
                entry.update(ratios(run, fixed[best][b], "vs_best_fixed"))
            if budget == "auto" and f"{base}@auto-kmodes" in results:
                entry.update(ratios(run, results[f"{base}@auto-kmodes"][b], "vs_auto_kmodes"))
            report[name][b] = entry
    return report


def ratios(run: dict, other: dict, key: str) -> dict:
    """{key: median speed over other's} and, when both have the same number of repeats,
    {key_paired: the median of the per-repeat ratios}."""
    out = {key: run["decode_tokens_per_second"] / other["decode_tokens_per_second"]}
    mine, theirs = run.get("repeats_decode_tokens_per_second"), other.get("repeats_decode_tokens_per_second")
    if mine and theirs and len(mine) == len(theirs):
        out[key + "_paired"] = statistics.median(a / b for a, b in zip(mine, theirs))
    return out


def stream_one(base_url: str, text: str, max_tokens: int, timeout: float) -> dict:
    """One streaming chat completion: ttft, decode time, completion tokens and verify rounds (or the error)."""
    payload = {"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
               "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
               "return_spec_tokens_details": True}
    start = time.perf_counter()
    first = None
    tokens = rounds = 0
    try:
        with requests.post(base_url + "/v1/chat/completions", json=payload, stream=True, timeout=timeout) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {r.text[:200]}"}
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if first is None and any(c.get("delta", {}).get("content") for c in chunk.get("choices") or []):
                    first = time.perf_counter()
                tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
                details = (chunk.get("sglext") or {}).get("spec_tokens_details") or {}
                rounds = details.get("spec_verify_ct", rounds)
    except requests.RequestException as e:
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter()
    return {"ttft": (first or end) - start, "decode_seconds": end - (first or end), "tokens": int(tokens),
            "rounds": int(rounds or 0)}


def closed_loop(base_url: str, prompts: list[str], batch: int, total: int, max_tokens: int,
                timeout: float, bar) -> dict:
    """`total` requests with exactly `batch` in flight; returns the aggregate for this batch size."""
    work: queue.Queue = queue.Queue()
    for i in range(total):
        work.put(prompts[i % len(prompts)])
    records, lock = [], threading.Lock()

    def client():
        while True:
            try:
                text = work.get_nowait()
            except queue.Empty:
                return
            record = stream_one(base_url, text, max_tokens, timeout)
            with lock:
                records.append(record)
                bar.update(1)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in records if "error" not in r]
    decoded = sum(max(r["tokens"] - 1, 0) for r in ok)
    rounds = sum(r["rounds"] for r in ok)
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_messages": sorted({r["error"] for r in records if "error" in r})[:5],
        "decode_tokens_per_second": decoded / wall if wall else 0.0,
        "tau": sum(r["tokens"] for r in ok) / rounds if rounds else None,
        "mean_ttft_seconds": sum(r["ttft"] for r in ok) / len(ok) if ok else None,
        "wall_seconds": wall,
    }


def chat_prompts(sets: list[str], limit: int, prompts_file: str | None = None) -> list[str]:
    """User messages: the held-out split of `sets`, or the texts of a JSON list file."""
    from mfd_sglang.lab.prompts import load_prompts

    if prompts_file:
        return json.loads(Path(prompts_file).read_text())[:limit]
    return [p.text for name in sets for p in load_prompts(name, split="heldout", limit=limit)]


def plot(results: dict, batch_sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, taus) = plt.subplots(1, 2, figsize=(11, 4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, per_batch) in enumerate(results.items()):
        for ax, key in ((speed, "speedup"), (taus, "tau")):
            points = [(b, per_batch[str(b)].get(key)) for b in batch_sizes if str(b) in per_batch]
            points = [(b, v) for b, v in points if v is not None]
            if points:  # a configuration has its color in both panels (AR has no tau)
                ax.plot(*zip(*points), marker="o", label=name, color=colors[i % len(colors)])
    speed.axhline(1.0, color="grey", lw=0.8, ls="--")
    speed.set_ylabel("decode speed-up over AR (median run)")
    taus.set_ylabel("tau (tokens per verify round)")
    for ax in (speed, taus):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight (closed loop)")
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def machine_name(device: str) -> str:
    if device != "cpu":
        import torch

        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu{os.cpu_count()}"


def add_speedups(results: dict) -> None:
    """Every run's `speedup` over AR's at its b (None without a positive AR speed) and, when both were
    measured in the same turns, `speedup_paired`."""
    for runs in results.values():
        for b, run in runs.items():
            ar = results["ar"][b]
            if ar["decode_tokens_per_second"] > 0:
                run.update(ratios(run, ar, "speedup"))
            else:
                run["speedup"] = None


def median_run(measured: list[dict]) -> dict:
    """The run of median decode speed (the lower middle one of an even count), with every run's speed."""
    ranked = sorted(measured, key=lambda run: run["decode_tokens_per_second"])
    run = dict(ranked[(len(ranked) - 1) // 2])
    if len(measured) > 1:
        run["repeats_decode_tokens_per_second"] = [r["decode_tokens_per_second"] for r in measured]
    return run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF target directory of the launched servers")
    parser.add_argument("--single-drafter", default=None, help="single-mode (DFlash) drafter: dflash and ddtree")
    parser.add_argument("--mfd-drafter", default=None, help="MFD drafter: mfd and mfd_d")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {CONFIGS} (default all)")
    parser.add_argument("--base-url", action="append", default=[], metavar="NAME=URL",
                        help="use a running server for configuration NAME instead of launching one")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--requests-per-size", type=int, default=16, help="requests per batch size (default 16)")
    parser.add_argument("--max-tokens", type=int, default=128, help="new tokens per request (default 128)")
    parser.add_argument("--sets", default="chat", help="prompt sets, held-out split (default chat)")
    parser.add_argument("--prompts-file", default=None, help="JSON list of texts instead of --sets")
    parser.add_argument("--limit", type=int, default=16, help="prompts per set (default 16)")
    parser.add_argument("--budget", type=int, default=None, help="MFD tree budget B of configurations without "
                        "@B, the largest of @auto ones (default: the plugin's)")
    parser.add_argument("--warmup", action="store_true", help="before each measured batch size, one unmeasured "
                        "closed loop of b requests (lets @auto time its choices at that size; every configuration "
                        "gets it)")
    parser.add_argument("--repeats", type=int, default=1, help="measure each b this many times with every "
                        "server up at once, configurations taking turns, and report the median run (CPU only: "
                        "on a GPU the servers would share its memory; default 1, one server at a time)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=900, help="per-request timeout in seconds")
    parser.add_argument("--out", default=None, help="JSON path (default with --record: "
                        "benchmarks/results/closed-loop-<machine>-<date>.json)")
    parser.add_argument("--plot", default=None, help="PNG path (default: next to the JSON)")
    parser.add_argument("--record", action="store_true", help="write into benchmarks/results/")
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temporary folder)")
    args = parser.parse_args(argv)

    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        configs = parse_configs(args.configs)
    except ValueError as exc:
        parser.error(str(exc))
    urls = dict(item.split("=", 1) for item in args.base_url)
    for name in configs:
        flag = DRAFTER_FLAG.get(split_config(name)[0])
        if flag and name not in urls and getattr(args, flag) is None:
            parser.error(f"configuration {name} needs --{flag.replace('_', '-')} (or --base-url {name}=URL)")
    prompts = chat_prompts(args.sets.split(","), args.limit, args.prompts_file)
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="closed-loop-")).resolve()
    # Each server starts in the log folder: started in the repository root, `python -m` would import the source
    # folder mfd_sglang/, which the plugin refuses. So local model paths are made absolute (hub ids stay).
    for field in ("target", "single_drafter", "mfd_drafter"):
        if getattr(args, field) is not None and Path(getattr(args, field)).exists():
            setattr(args, field, str(Path(getattr(args, field)).resolve()))
    max_batch = max(args.batch_sizes)

    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.repeats > 1 and args.device != "cpu":
        parser.error("--repeats runs every server at once: CPU only (on a GPU they would share its memory)")
    runs = {name: {str(b): [] for b in args.batch_sizes} for name in configs}
    total = len(configs) * sum(args.repeats * args.requests_per_size + (b if args.warmup else 0) for b in args.batch_sizes)

    def serve(name: str, stack: contextlib.ExitStack) -> str:
        """The base URL of configuration `name` (launched within `stack`)."""
        if name in urls:
            return urls[name]
        port = free_port()
        cmd = server_command(name, args, port, args.device, max_batch)
        bar.set_postfix_str(f"starting {name}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        srv = stack.enter_context(ServerProcess(cmd, log_dir / f"{name}.log", port=port, env=env, startup_timeout=900,
                                                cwd=log_dir))
        stream_one(srv.base_url, prompts[0], 8, args.timeout)  # warm-up
        return srv.base_url

    def measure(name: str, base_url: str, b: int, repeat: int) -> None:
        bar.set_postfix_str(f"{name} b={b}")
        if args.warmup and repeat == 0:
            closed_loop(base_url, prompts[::-1], b, b, args.max_tokens, args.timeout, bar)
        runs[name][str(b)].append(closed_loop(base_url, prompts, b, args.requests_per_size, args.max_tokens,
                                              args.timeout, bar))

    with tqdm(total=total, desc="closed loop", unit="req", file=sys.stderr) as bar:
        if args.repeats == 1:
            for name in configs:
                with contextlib.ExitStack() as stack:
                    base_url = serve(name, stack)
                    for b in args.batch_sizes:
                        measure(name, base_url, b, 0)
        else:
            with contextlib.ExitStack() as stack:
                served = {name: serve(name, stack) for name in configs}
                for b in args.batch_sizes:
                    for repeat in range(args.repeats):
                        turn = list(served)[repeat % len(served):] + list(served)[:repeat % len(served)]
                        for name in turn:
                            measure(name, served[name], b, repeat)
    results = {name: {b: median_run(measured) for b, measured in per_b.items()} for name, per_b in runs.items()}
    if "ar" in results:
        add_speedups(results)

    auto_vs = compare_auto(results)
    print(f"{'config':<10} {'b':>4} {'decode tok/s':>13} {'speed-up':>9} {'paired':>7} {'tau':>6} {'TTFT s':>7} "
          f"{'errors':>6}")
    for name, runs in results.items():
        for b, run in runs.items():
            speedup = "-" if run.get("speedup") is None else f"{run['speedup']:.2f}x"
            paired = "-" if run.get("speedup_paired") is None else f"{run['speedup_paired']:.2f}x"
            tau = "-" if run["tau"] is None else f"{run['tau']:.2f}"
            ttft = "-" if run["mean_ttft_seconds"] is None else f"{run['mean_ttft_seconds']:.2f}"
            print(f"{name:<10} {b:>4} {run['decode_tokens_per_second']:>13.1f} {speedup:>9} {paired:>7} {tau:>6} "
                  f"{ttft:>7} {run['errors']:>6}")
    for name, per_b in auto_vs.items():
        for b, entry in per_b.items():
            print(f"{name} at b = {b}: " + ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in entry.items() if v is not None))

    out = args.out
    machine = machine_name(args.device)
    if out is None and args.record:
        out = f"benchmarks/results/closed-loop-{machine}-{dt.date.today()}.json"
    if out:
        command = "python benchmarks/closed_loop.py " + " ".join(sys.argv[1:] if argv is None else argv)
        report = {"date": str(dt.date.today()), "machine": machine, "device": args.device, "platform": platform.platform(),
                  "command": command, "settings": {k: v for k, v in vars(args).items() if k != "base_url"},
                  "results": results, "auto_vs": auto_vs}
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))
        png = Path(args.plot or Path(out).with_suffix(".png"))
        plot(results, args.batch_sizes, png)
        print(f"wrote {out} and {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
