"""One-call GPU check: correctness and timing of everything GPU-only, a table printed last, JSON saved.

    python benchmarks/gpu_check.py                  # on a GPU machine: the full check (< 9 min on one H200)
    python benchmarks/gpu_check.py --quick --device cpu --allow-skip   # smoke run of the script itself (CI)
    python benchmarks/gpu_check.py --only servers   # some sections only

Sections, in this order (the most important results first; each reports what it ran):
  tree      Triton mixture-tree kernel vs the torch reference: bit-identical trees (fp32, bf16),
            and no host sync inside the kernel launch (CUDA sync debug mode "error")
  attention fused mode-attention kernel vs the torch reference (gather + masked SDPA, the generic
            path), fp32 and bf16, max abs error
  sync      the eager accept stage (greedy and T > 0 tree verification) and chunked draft scoring
            run without a host sync (CUDA sync debug mode "error"), as overlap scheduling needs
  tree_mask every attention backend MFD allows applies the tree mask of a top-k 1 verify, eagerly and
            replayed from a CUDA graph (benchmarks/tree_mask_check.py); the first section of the server part
  servers   real SGLang servers (plain, MFD K = 8 B = 64, MFD_D) on a random Qwen3-4B-width target,
            8 concurrent greedy requests by token ids, fp32 and bf16, CUDA graphs + overlap on, then off
            (benchmarks/server_exactness.py)
  round_cost one speculative round (draft + tree + verify + commit, each a CUDA graph) in plain decode
            steps on a random Qwen3-4B-shaped target, bs {1,4,16}: MFD K=8 B=64, MFD_D, DDTree
            (benchmarks/round_cost.py; target: MFD at bs 1 <= 1.45); graph replay must equal eager
  tree_time tree-build ms per round, torch vs Triton: bs {1,4,16}, K=8, D=15, B {16,32,64,128},
            V {32768,65536,151936} (paper's engine ~0.35 ms; target <= 0.10 ms at bs=1, B=64, V=65536)
  attention_time  ms per drafter attention call, Triton vs the generic path: K=8, block 16, context 4K,
            32 query / 8 kv heads of 128 (Qwen3-4B-shaped drafter), bs {1,4,16} (target >= 1.5x)
  hybrid_servers  a hybrid Gated DeltaNet target (make-tiny --hybrid, fp32) in plain, MFD (B = 8) and
            MFD_D automatic-budget servers, CUDA graphs + overlap on, concurrent then from the radix
            cache: every token equal to the plain server's (benchmarks/server_exactness.py)
The exit status is 0 only when every correctness item passed: a mismatch, an error (a section that
raised, a row with an error) or a skip (a section or row this machine cannot run) makes it 1, and the
table ends with the list of what failed. `--allow-skip` lets skips pass (for a local or CPU run).
Results go to benchmarks/results/gpu-check-<date>-<machine>.json (or --out), rewritten after every
section, so that a run cut short keeps what it finished; a section that raised records its traceback.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import itertools
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

from mfd_sglang.cuda_graph import host_syncs_raise
from mfd_sglang.mode_attention import mode_attention, random_inputs
from mfd_sglang.tree import DraftTree, build_mixture_tree
# benchmarks/ is on sys.path when this runs as a script
from round_cost import print_round_cost, round_cost_section
from server_exactness import hybrid_server_section, print_server_rows, server_section
from tree_build import mean_ms, time_build

RESULTS = Path(__file__).resolve().parent / "results"


def environment(device: str) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
            "machine": platform.node()}
    for name in ("triton", "transformers", "sglang"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as exc:  # report, do not stop: the check runs on partial installs too
            info[name] = f"not importable: {type(exc).__name__}: {exc}"
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def random_logprobs(shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(shape, device=device, generator=gen) * 3.0
    return torch.log_softmax(logits, dim=-1).to(dtype)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "modes", "valid")) \
        and torch.equal(a.scores.float(), b.scores.float())


def check_tree_kernel(device: str, quick: bool) -> list[dict]:
    shapes = [(1, 8, 15, 32768, 64), (4, 8, 15, 65536, 64), (2, 1, 15, 151936, 128), (3, 4, 7, 5, 200)]
    if quick:
        shapes = [(2, 2, 3, 50, 8)]
    rows = []
    for (bs, k, d, v, budget), dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
        row = {"bs": bs, "K": k, "D": d, "V": v, "B": budget, "dtype": str(dtype).removeprefix("torch.")}
        try:
            logprobs = random_logprobs((bs, k, d, v), device, dtype, seed=bs * 1000 + v)
            reference = build_mixture_tree(logprobs, budget, backend="torch")
            with host_syncs_raise(device):
                fast = build_mixture_tree(logprobs, budget, backend="triton")
            row["identical"] = same_tree(reference, fast)
        except Exception as exc:
            row["identical"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def check_accept_without_sync(device: str, quick: bool) -> list[dict]:
    """The accept stage outside the draft / verify CUDA graphs (the worker's eager glue under overlap
    scheduling): greedy and T > 0 tree verification (top-k with and without SGLang's max_top_k bound,
    top-p, min-p, seeds) and the draft scoring in vocabulary chunks, each under CUDA sync debug mode
    "error": a host sync there would stall the scheduler's overlap."""
    from mfd_sglang.drafter import vocab_candidates
    from mfd_sglang.verify import Sampling, random_seeds, verify_tree_greedy, verify_tree_sampling

    bs, k, d, v, budget = (2, 2, 3, 50, 8) if quick else (16, 8, 15, 151936, 64)
    gen = torch.Generator(device=device).manual_seed(0)
    tree = build_mixture_tree(random_logprobs((bs, k, d, v), device, torch.float32, seed=7), budget,
                              backend="triton" if device.startswith("cuda") else "torch")
    logits = torch.randn(bs, budget + 1, v, device=device, generator=gen)
    hidden = torch.randn(bs, k, d, 64, device=device, generator=gen)
    head = torch.randn(v, 64, device=device, generator=gen)

    def sampling(max_top_k):
        return Sampling(torch.full((bs,), 0.8, device=device), torch.full((bs,), 20, device=device),
                        torch.full((bs,), 0.9, device=device), torch.full((bs,), 0.05, device=device),
                        random_seeds(bs, device), max_top_k)

    cases = {"greedy": lambda: verify_tree_greedy(tree, logits),
             "sampling, max_top_k bound": lambda: verify_tree_sampling(tree, logits, sampling(20), positions),
             "sampling, full sort (seeded)": lambda: verify_tree_sampling(tree, logits, sampling(None), positions),
             "draft scoring in vocabulary chunks": lambda: vocab_candidates(hidden, head, budget)}
    positions = torch.arange(bs, device=device) + 100
    on_cuda = device.startswith("cuda")
    rows = []
    for name, run in cases.items():
        row = {"case": name}
        try:
            with host_syncs_raise(device):
                run()
            if on_cuda:
                row["sync_free"] = True  # sync debug mode "error" raises on the first host sync
            else:
                row["skipped"] = "host syncs exist on CUDA only (ran, unchecked)"
        except Exception as exc:
            row["sync_free"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def check_vocab_kernel(device: str, quick: bool) -> list[dict]:
    """The fused lm_head + top-B Triton kernel (`kernels/vocab_candidates.py`, not yet on the serving
    path) against the torch `vocab_candidates` at serving shapes, without a host sync: on small-integer
    inputs (every logit exact whatever the GEMM's order) ids and logits bit for bit, ties included;
    on random bf16 inputs (rounding may move near-ties) >= 97% of the candidates shared."""
    from mfd_sglang.drafter import vocab_candidates

    shapes = [(1, 8, 15, 2560, 151936, 64), (16, 8, 15, 2560, 151936, 64), (4, 4, 7, 1024, 32000, 16)]
    grids = ("integers", "random")
    if quick:  # the interpreter's bf16 rounding differs from torch's: exact inputs only
        shapes, grids = [(2, 2, 3, 40, 50, 8)], ("integers",)
    rows = []
    for (bs, k, d, h, v, budget), grid in itertools.product(shapes, grids):
        row = {"bs": bs, "K": k, "D": d, "H": h, "V": v, "B": budget, "inputs": grid}
        try:
            gen = torch.Generator(device=device).manual_seed(bs * 7 + h)
            if grid == "integers":
                hidden = torch.randint(-3, 4, (bs, k, d, h), device=device, generator=gen).to(torch.bfloat16)
                head = torch.randint(-3, 4, (v, h), device=device, generator=gen).to(torch.bfloat16)
            else:
                hidden = torch.randn(bs, k, d, h, device=device, generator=gen).to(torch.bfloat16)
                head = (0.05 * torch.randn(v, h, device=device, generator=gen)).to(torch.bfloat16)
            with host_syncs_raise(device):
                fast = vocab_candidates(hidden, head, budget, backend="triton")
            reference = vocab_candidates(hidden, head, budget)
            shared = float((fast.tokens[..., :, None] == reference.tokens[..., None, :]).any(-1).float().mean())
            row["shared"] = round(shared, 4)
            row["max_logprob_diff"] = float((fast.logprobs - reference.logprobs).abs().max())
            row["ok"] = torch.equal(fast.tokens, reference.tokens) if grid == "integers" else shared >= 0.97
        except Exception as exc:
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def time_vocab_kernel(device: str, quick: bool) -> list[dict]:
    """The drafter's vocabulary top-B: torch chunks vs the fused Triton kernel (bf16, H 2560, V 151936)."""
    if not device.startswith("cuda"):
        raise SectionSkipped("Triton timings need a GPU (the interpreter's mean nothing)")
    from mfd_sglang.drafter import vocab_candidates

    rows = []
    for bs, budget in itertools.product((1, 4, 16), (16, 64)):
        gen = torch.Generator(device=device).manual_seed(bs)
        hidden = torch.randn(bs, 8, 15, 2560, device=device, generator=gen).to(torch.bfloat16)
        head = (0.05 * torch.randn(151936, 2560, device=device, generator=gen)).to(torch.bfloat16)
        timed = backend_times(lambda backend: vocab_candidates(hidden, head, budget, backend=backend), device, 10)
        rows.append({"bs": bs, "K": 8, "D": 15, "B": budget, **timed})
    return rows


def backend_times(run, device: str, repeats: int) -> dict:
    """run(backend) timed for "torch" and "triton": {torch_ms, triton_ms, speedup}."""
    row = {f"{backend}_ms": round(mean_ms(lambda: run(backend), device, repeats), 4) for backend in ("torch", "triton")}
    row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
    return row


def time_tree_build(device: str, quick: bool) -> list[dict]:
    grid = itertools.product((1, 4, 16), (16, 32, 64, 128), (32768, 65536, 151936))
    if quick:
        grid = [(1, 8, 64)]
    # The Triton interpreter on a CPU takes seconds per build: time Triton on a GPU only.
    backends = ("torch", "triton") if device.startswith("cuda") else ("torch",)
    rows = []
    for bs, budget, v in grid:
        row = {"bs": bs, "K": 8, "D": 15, "B": budget, "V": v}
        for backend in backends:
            try:
                ms = time_build(bs, 8, 15, v, budget, device, backend, 1 if quick else 20, torch.bfloat16)
                row[f"{backend}_ms"] = round(ms, 4)
            except Exception as exc:
                row[f"{backend}_ms"] = None
                row[f"{backend}_error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def check_mode_attention(device: str, quick: bool) -> list[dict]:
    shapes = [(1, 8, 16, 32, 8, 128, [4096]), (4, 8, 16, 32, 8, 128, [1, 700, 2048, 4096]),
              (3, 1, 16, 16, 16, 64, [0, 33, 900])]
    if quick:
        shapes = [(2, 2, 4, 2, 1, 16, [3, 20])]
    # The Triton interpreter's bf16 dot is broken: on a CPU, fp16 stands in for the half-precision check.
    dtypes = (torch.float32, torch.bfloat16 if device.startswith("cuda") else torch.float16)
    rows = []
    for (bs, k, t, hq, hkv, d, lens), dtype in itertools.product(shapes, dtypes):
        row = {"bs": bs, "K": k, "T": t, "Hq": hq, "Hkv": hkv, "d": d, "dtype": str(dtype).removeprefix("torch.")}
        try:
            case = random_inputs(bs, bs, k, t, hq, hkv, d, lens, dtype, device)
            reference = mode_attention(**{n: (x.float() if x.is_floating_point() else x) for n, x in case.items()},
                                       num_modes=k)
            fast = mode_attention(**case, num_modes=k, backend="triton")
            row["max_abs_error"] = float((fast.float() - reference).abs().max())
            row["ok"] = row["max_abs_error"] <= (1e-4 if dtype == torch.float32 else 3e-2)
        except Exception as exc:
            row["ok"] = False
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
    return rows


def time_mode_attention(device: str, quick: bool) -> list[dict]:
    if not device.startswith("cuda"):
        raise SectionSkipped("Triton timings need a GPU (the interpreter's mean nothing)")
    rows = []
    for bs in (1, 4, 16):
        case = random_inputs(0, bs, 8, 16, 32, 8, 128, [4096] * bs, torch.bfloat16, device)
        timed = backend_times(lambda backend: mode_attention(**case, num_modes=8, backend=backend), device, 20)
        rows.append({"bs": bs, "K": 8, "T": 16, "context": 4096, **timed})
    return rows


def check_tree_masks(device: str, quick: bool) -> list[dict]:
    """benchmarks/tree_mask_check.py, imported here so that the check runs before that module exists;
    a missing module is this section's error (never a pass)."""
    from tree_mask_check import tree_mask_section

    return tree_mask_section(device, quick)


def check_servers(device: str, quick: bool) -> list[dict]:
    """The SGLang server step; needs sglang (on the device: from the kit, see scripts/device_kit.sh)."""
    if importlib.util.find_spec("sglang") is None:
        raise SectionSkipped("sglang is not installed here; on the device, carry .device-kit "
                             "(bash scripts/device_kit.sh)")
    # An SGLang that is there but does not import (e.g. a kernel name missing from sgl_kernel) is an error.
    import sglang.srt.entrypoints.engine  # noqa: F401  (what a server imports first)

    return server_section(device, quick)


def check_hybrid_servers(device: str, quick: bool) -> list[dict]:
    """The hybrid target's servers (benchmarks/server_exactness.py: hybrid_server_section), last: on the
    first GPU run nothing before it waits for it. The CPU smoke run skips it (tests/test_hybrid_target.py
    runs these servers on CPU); `--only hybrid_servers --device cpu` runs it on a CPU."""
    if quick and device == "cpu":
        raise SectionSkipped("CPU smoke run: tests/test_hybrid_target.py holds hybrid servers on CPU")
    if importlib.util.find_spec("sglang") is None:
        raise SectionSkipped("sglang is not installed here; on the device, carry .device-kit")
    return hybrid_server_section(device, quick)


# Per section: the row field that must be true. Rows of every section fail on an `error` field and
# count as skipped on a `skipped` field.
CORRECTNESS = {"tree": "identical", "attention": "ok", "sync": "sync_free", "tree_mask": "ok", "servers": "ok",
               "round_cost": "graph_equals_eager", "vocab": "ok", "hybrid_servers": "ok"}


def failures(report: dict, sections: list[str], allow_skip: bool) -> list[str]:
    """What makes the check fail, one line each: a section that raised, was skipped or did not run,
    an empty correctness section, and every row that failed, errored or was skipped."""
    out = []
    for section in sections:
        if f"{section}_error" in report:
            out.append(f"{section}: ERROR {report[section + '_error'].strip().splitlines()[-1]}")
            continue
        if f"{section}_skipped" in report:
            if not allow_skip:
                out.append(f"{section}: SKIPPED {report[section + '_skipped']}")
            continue
        if section not in report:
            out.append(f"{section}: did not run")
            continue
        if section in CORRECTNESS and not report[section]:
            out.append(f"{section}: no rows (nothing was checked)")
        field = CORRECTNESS.get(section)
        for i, row in enumerate(report[section]):
            label = f"{section}[{i}]"
            # error text: "error" or "<what>_error" (a number such as max_abs_error is a measurement)
            errors = {k: v for k, v in row.items() if (k == "error" or k.endswith("_error")) and isinstance(v, str)}
            if errors:
                out.append(f"{label}: ERROR " + "; ".join(f"{k}: {str(v).strip().splitlines()[0]}" for k, v in errors.items()))
            elif row.get("skipped"):
                if not allow_skip:
                    out.append(f"{label}: SKIPPED {row['skipped']}")
            elif field is not None and not row.get(field):
                shown = {k: v for k, v in row.items() if not isinstance(v, list)}
                out.append(f"{label}: FAILED ({field} is {row.get(field)!r}) {shown}")
    return out


class SectionSkipped(Exception):
    """A section that cannot run on this machine; its reason goes into the report."""


def print_table(report: dict) -> None:
    print("\n=== GPU check", report["date"], report["env"].get("gpu", report["env"]["device"]), "===")
    tree = report.get("tree", [])
    ok = sum(r["identical"] for r in tree)
    print(f"tree kernel vs torch reference: {ok}/{len(tree)} identical")
    for r in tree:
        if not r["identical"]:
            print("  MISMATCH", r)
    print(f"\n{'bs':>3} {'B':>4} {'V':>7} {'torch ms':>10} {'triton ms':>10}")
    for r in report.get("tree_time", []):
        t, g = r.get("torch_ms"), r.get("triton_ms")
        print(f"{r['bs']:>3} {r['B']:>4} {r['V']:>7} {t if t is not None else '-':>10} {g if g is not None else '-':>10}")
    attention = report.get("attention", [])
    print(f"\nmode attention vs torch reference: {sum(r['ok'] for r in attention)}/{len(attention)} within tolerance")
    for r in attention:
        if not r["ok"]:
            print("  MISMATCH", r)
    for r in report.get("attention_time", []):
        print(f"  bs {r['bs']:>2}: torch {r['torch_ms']} ms, triton {r['triton_ms']} ms, {r['speedup']}x")
    for r in report.get("sync", []):
        verdict = "no host sync" if r.get("sync_free") else r.get("skipped") or f"HOST SYNC: {r.get('error')}"
        print(f"accept stage without host sync, {r['case']}: {verdict}")
    for r in report.get("vocab", []):
        print(f"fused vocabulary top-B vs torch, bs {r['bs']} V {r['V']} B {r['B']} {r['inputs']}: "
              f"{'ok' if r['ok'] else 'MISMATCH'} (shared {r.get('shared')})")
    for r in report.get("vocab_time", []):
        print(f"  vocabulary top-B bs {r['bs']:>2} B {r['B']}: torch {r['torch_ms']} ms, triton {r['triton_ms']} ms, {r['speedup']}x")
    if report.get("round_cost"):
        print_round_cost(report["round_cost"])
    if report.get("tree_mask"):
        from tree_mask_check import print_tree_mask_rows

        print_tree_mask_rows(report["tree_mask"])
    if report.get("servers"):
        print_server_rows(report["servers"])
    if report.get("hybrid_servers"):
        print_server_rows(report["hybrid_servers"], "hybrid target (make-tiny --hybrid)")
    for section in SECTIONS:
        for suffix in ("skipped", "error"):
            if f"{section}_{suffix}" in report:
                print(f"\n{section} {suffix.upper()}: {report[f'{section}_{suffix}'].strip().splitlines()[-1]}")
    failed = report.get("failures", [])
    print(f"\nRESULT: {'FAIL' if failed else 'PASS'}" + (f" ({len(failed)} items)" if failed else ""))
    for line in failed:
        print("  " + line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes only (a smoke run of the script)")
    parser.add_argument("--out", type=Path, help="JSON path (default: benchmarks/results/gpu-check-<date>-<machine>.json)")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), help="run these sections only")
    parser.add_argument("--allow-skip", action="store_true",
                        help="skipped sections / rows do not fail the check (local or CPU runs)")
    parser.add_argument("--time-budget", type=float, default=None, metavar="S",
                        help="start no section after S seconds (it is then recorded as an error)")
    args = parser.parse_args()
    date = dt.date.today().isoformat()
    report = {"date": date, "command": "python benchmarks/gpu_check.py" + (" --quick" if args.quick else ""),
              "env": environment(args.device)}
    sections = [name for name in SECTIONS if not args.only or name in args.only]
    begin = time.perf_counter()
    out = args.out or RESULTS / f"gpu-check-{date}-{report['env'].get('gpu', args.device).replace(' ', '_')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for section in sections:
        fn = SECTIONS[section]
        start = time.perf_counter()
        if args.time_budget is not None and start - begin > args.time_budget:
            report[section] = []
            report[f"{section}_error"] = f"not started: the time budget of {args.time_budget:.0f} s was spent"
            continue
        print(f"[gpu_check] {section} ...", flush=True)
        try:
            report[section] = fn(args.device, args.quick)
        except SectionSkipped as skipped:
            report[section] = []
            report[f"{section}_skipped"] = str(skipped)
        except Exception:
            report[section] = []
            report[f"{section}_error"] = traceback.format_exc()
        report[f"{section}_seconds"] = round(time.perf_counter() - start, 1)
        report["failures"] = failures(report, sections, args.allow_skip)
        out.write_text(json.dumps(report, indent=1) + "\n")
    report["failures"] = failures(report, sections, args.allow_skip)
    report["passed"] = not report["failures"]
    out.write_text(json.dumps(report, indent=1) + "\n")
    print_table(report)
    print(f"\nwrote {out}")
    sys.exit(0 if report["passed"] else 1)


# The order they run in: kernel exactness, then the server part (tree masks first, then real servers),
# then costs and timings.
SECTIONS = {"tree": check_tree_kernel, "vocab": check_vocab_kernel, "attention": check_mode_attention,
            "sync": check_accept_without_sync, "tree_mask": check_tree_masks,
            "servers": check_servers, "round_cost": round_cost_section, "tree_time": time_tree_build,
            "attention_time": time_mode_attention, "vocab_time": time_vocab_kernel,
            "hybrid_servers": check_hybrid_servers}

if __name__ == "__main__":
    main()
