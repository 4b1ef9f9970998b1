"""The paper's Table 1 on the reference engine: per prompt set, the speed-up over plain decoding and
tau of the chain (DFlash), DDTree (single-mode tree) and MFD, each at its best budget, batch 1, at
T = 0 and T = 1. Every number comes from this one run on this machine.

    python benchmarks/hf_speed.py --target $(python -m mfd_sglang prepare-target) \\
        --single drafters/smollm2-135m/dflash --mfd drafters/smollm2-135m/mfd \\
        --sets code,chat,math --limit 4 --budgets 8 16 32 --dtype bfloat16 \\
        --out benchmarks/results/hf-speed.json --markdown benchmarks/results/hf-speed.md

The AR baseline is plain greedy decoding of the target (its cost does not depend on T). T = 1
samples (lossless: one target sample per tree node), so its tau is an estimate over the prompts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from mfd_sglang.lab.evaluate import load_inputs
from mfd_sglang.hf import SamplingParams, SpeculativeGenerator

METHODS = ("chain", "ddtree", "mfd")


def ar_tokens_per_second(engine: SpeculativeGenerator, prompts: list[list[int]], max_new: int, eos: set[int]) -> float:
    """Plain greedy decoding speed of the engine's target over the prompts (batch 1): the baseline."""
    start = time.perf_counter()
    tokens = sum(len(engine.autoregressive(ids, max_new, eos)) for ids in prompts)
    return tokens / (time.perf_counter() - start)


def tau_and_speed(engine: SpeculativeGenerator, prompts: list[list[int]], max_new: int, eos: set[int],
                  params: SamplingParams) -> tuple[float, float]:
    """(tau, tokens per second) of the engine generating every prompt, batch 1."""
    tokens = rounds = 0
    start = time.perf_counter()
    for ids in prompts:
        out = engine.generate(ids, max_new, params=params, eos_token_ids=eos)
        tokens += sum(r.emitted for r in out.rounds)
        rounds += len(out.rounds)
    return tokens / max(rounds, 1), tokens / (time.perf_counter() - start)


def measure(target, drafters, prompt_sets, budgets, temperatures, max_new: int, eos, seed: int, bar) -> dict:
    """{set: {T: {method: {budget: {tau, speedup}}}}} plus the AR speed per set."""
    results = {}
    for name, prompts in prompt_sets.items():
        ar = SpeculativeGenerator(target, drafters["single"], tree="chain", single_mode=True)
        ar_tps = ar_tokens_per_second(ar, prompts, max_new, eos)
        results[name] = {"ar_tokens_per_second": ar_tps, "prompts": len(prompts)}
        for temperature in temperatures:
            params = SamplingParams(temperature=temperature, seed=seed if temperature > 0 else None)
            per_method = {}
            for method in METHODS:
                drafter = drafters["mfd" if method == "mfd" else "single"]
                method_budgets = [drafter.cfg.block_size - 1] if method == "chain" else budgets
                per_method[method] = {}
                for budget in method_budgets:
                    engine = SpeculativeGenerator(target, drafter, budget=budget, single_mode=method != "mfd",
                                                  tree="chain" if method == "chain" else "mixture")
                    tau, tokens_per_second = tau_and_speed(engine, prompts, max_new, eos, params)
                    per_method[method][str(budget)] = {"tau": tau, "speedup": tokens_per_second / ar_tps}
                    bar.update(1)
            results[name][str(temperature)] = per_method
    return results


def best(per_budget: dict) -> tuple[str, dict]:
    return max(per_budget.items(), key=lambda item: item[1]["speedup"] or 0.0)


def markdown(results: dict, header: str) -> str:
    lines = [header, "", "| set | T | method | best B | tau | speed-up |", "|---|---|---|---|---|---|"]
    for name, per_set in results.items():
        for temperature, per_method in per_set.items():
            if not isinstance(per_method, dict):
                continue
            for method, per_budget in per_method.items():
                budget, row = best(per_budget)
                lines.append(f"| {name} | {temperature} | {method} | {budget} | {row['tau']:.2f} | {row['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="HF target directory")
    parser.add_argument("--single", required=True, help="single-mode (DFlash) drafter: chain and DDTree")
    parser.add_argument("--mfd", required=True, help="MFD drafter")
    parser.add_argument("--sets", default="code,chat,math", help="prompt sets (held-out split; default code,chat,math)")
    parser.add_argument("--prompts-file", default=None, help="JSON list of raw texts instead of --sets (one set 'prompts')")
    parser.add_argument("--limit", type=int, default=4, help="prompts per set (default 4)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32], help="tree budgets tried (default 8 16 32)")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0], help="default 0 1")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed for T > 0 (default 0)")
    parser.add_argument("--out", default=None, help="write the results as JSON")
    parser.add_argument("--markdown", default=None, help="write the best-budget table as Markdown")
    args = parser.parse_args(argv)

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, drafters, prompt_sets, eos = load_inputs(args.target, args.single, args.mfd, dtype,
                                                     sets=args.sets.split(","), limit=args.limit,
                                                     prompts_file=args.prompts_file)
    steps = len(prompt_sets) * len(args.temperatures) * (1 + 2 * len(args.budgets))
    with tqdm(total=steps, desc="hf_speed", unit="config", file=sys.stderr) as bar:
        results = measure(target, drafters, prompt_sets, args.budgets, args.temperatures, args.max_new_tokens,
                          eos, args.seed, bar)
    machine = f"{platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}"
    command = "python benchmarks/hf_speed.py " + " ".join(sys.argv[1:] if argv is None else argv)
    header = f"Reference engine, batch 1, {dt.date.today()}, {machine}; `{command}`"
    table = markdown(results, header)
    print(table)
    if args.out:
        Path(args.out).write_text(json.dumps({"date": str(dt.date.today()), "machine": machine, "command": command,
                                              "results": results}, indent=2))
        print(f"wrote {args.out}", file=sys.stderr)
    if args.markdown:
        Path(args.markdown).write_text(table)
        print(f"wrote {args.markdown}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
