"""The GPU check: the one device call that proves the GPU path, rows written as they finish.

    bash scripts/gpu_check.sh prepare            # here: build the device kit and the tiny pair it carries
    bash scripts/gpu_check.sh                    # on the GPU machine (part 1), ONE call
    bash scripts/gpu_check.sh --part 2           # the next visit: what part 1 leaves out
    bash scripts/gpu_check.sh --part flashinfer  # the FlashInfer visit (scripts/gpu_visit_flashinfer.sh)
    bash scripts/gpu_check.sh --cpu              # the rehearsal on a CPU (tests/test_device_kit.py)

gpu_check.sh sets one deadline for the whole call (MFD_GPU_CHECK_DEADLINE), IEEE fp32 for Triton
(TRITON_F32_DEFAULT=ieee), installs the kit and runs this script with the installed plugin only.

Part 1, most truth first (a section starts only while time is left; what the deadline cuts is reported):
  env            versions, nvidia-smi, nvcc / gcc, the kit install, and SGLang's engine importing against the
                 kit with MFD registered (a subprocess, as a server process does it)
  tree           Triton mixture-tree kernel and tree walks (layout, accept) vs the torch references,
                 bit-identical, no host sync (few shapes)
  tree_mask      every attention backend MFD allows applies the tree mask, eager and from a CUDA graph
  graph_tests    the CUDA-graph tests that need no server (tests/test_cuda_graph.py, tests/test_serving.py)
  servers_tiny   the make-tiny pair (carried), fp32, CUDA graphs + overlap: plain, MFD, MFD_D; exact tokens
                 and mean accept lengths of at least server_exactness.TINY_ACCEPT_BOUNDS
  servers_4b     the same three on a random Qwen3-4B-width pair (shapes, memory, graph capture); exact
  attention      fused mode attention vs the torch reference (fp32 and bf16)
  sync           the eager accept stage and the draft scoring without a host sync
  round_cost     one round (draft + tree + verify + commit, CUDA graphs) in decode steps at bs 1 and 32; the
                 replayed round equals the eager one (outputs and every cache write); each stage beside the
                 GPU cost ledger's prediction for the same shapes (round-cost-predictions.json in the pair),
                 and each round's kernels under torch.profiler (round-profile.txt)
  servers_bf16   the tiny pair in bf16 with graphs (MFD with no --attention-backend: FlashInfer where
                 installed, else Triton with one log line); at a divergence, a near-tie of the plain server
  tree_time, attention_time   Triton vs torch timings (a few shapes)
Part 2: tree (all shapes), vocab, vocab_time, round_cost at bs 4 / 16, tree_time (all shapes), servers
  eager (graphs off), paged (16-token pages), MFD_D with the automatic budget, SGLang's DFLASH beside MFD
  (tokens, accept lengths, round cost per server against plain decoding), hybrid_servers, fp8_draft (FP8
  drafter linears against their dequantized product; draft time and round cost at bs 1 / 8 / 32, FP8 vs bf16).
Part flashinfer: env, then servers_flashinfer (plain / MFD on FlashInfer with graphs, bf16, both pairs).

On a CPU (`--device cpu`, the rehearsal) every section runs through the same code on small shapes, Triton
under the interpreter, servers through the CPU launcher; a section or row that needs CUDA is recorded as a
structural skip with its reason.

Output folder (--out-dir): report.json (rewritten after every row), rows.jsonl (a line per row as it
finishes), server-logs.txt (every server's start-up events and log tail). Verdicts: a correctness row passes
(`ok`), fails, errs (`error`) or is skipped for a structural reason (`skipped`: needs CUDA on a CPU run,
FlashInfer where it is not installed). The exit status is 0 only when every section of the part ran and
nothing failed or erred.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib
import itertools
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (PYTHONSAFEPATH leaves it out)

import torch  # noqa: E402

from mfd_sglang.cuda_graph import host_syncs_raise  # noqa: E402
from mfd_sglang.mode_attention import mode_attention, random_inputs  # noqa: E402
from mfd_sglang.timing import mean_ms  # noqa: E402
from mfd_sglang.tree import DraftTree, build_mixture_tree  # noqa: E402
from mfd_sglang.tree_layout import tree_to_verify_layout  # noqa: E402
from mfd_sglang.verify import accept_path  # noqa: E402
from round_cost import STAGES as ROUND_STAGES, print_round_cost, round_cost_rows  # noqa: E402
from tree_build import time_build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths
CARRY_MARGIN = 8 * 2**20


class StructuralSkip(Exception):
    """A section this machine cannot run by construction (needs CUDA on a CPU run, FlashInfer where it is
    not installed); its message says why."""


@dataclass
class Check:
    device: str
    deadline: float  # time.time()
    out: Path
    pair: Path | None
    workdir: Path  # scratch: server logs, written models
    report: dict = field(default_factory=dict)
    logs: object = None  # server_exactness.ServerLogs

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def left(self) -> float:
        return self.deadline - time.time()

    def launch(self):
        from server_exactness import Launch

        return Launch(self.device, self.deadline, self.workdir, self.logs)


# --- environment --------------------------------------------------------------------------------------

REGISTRATION_PROBE = """
import json, sys
out = {}
import sglang, sglang.srt.entrypoints.engine
out["sglang"] = sglang.__version__
from sglang.srt.plugins import load_plugins
load_plugins()
import mfd_sglang
out["mfd_sglang"] = mfd_sglang.__file__
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
out["MFD"] = str(SpeculativeAlgorithm.from_string("MFD"))
out["MFD_D"] = str(SpeculativeAlgorithm.from_string("MFD_D"))
print(json.dumps(out))
"""


def command_output(cmd: list[str], timeout: float = 30) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()[:2000] or f"(exit {proc.returncode}, no output)"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not available: {type(exc).__name__}: {exc}"


def check_environment(check: Check) -> Iterator[dict]:
    """Versions and tools (a row without a verdict), then the registration probe: SGLang's engine imports
    against the kit and resolves MFD / MFD_D, in a subprocess started away from the repository."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": check.device,
            "machine": platform.node(), "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
            "kit_install_status": os.environ.get("MFD_GPU_CHECK_KIT_STATUS")}
    for name in ("triton", "transformers", "flashinfer"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as exc:  # report, do not stop: the check runs on partial installs too
            info[name] = f"not importable: {type(exc).__name__}: {exc}"
    if check.cuda:
        info.update(gpu=torch.cuda.get_device_name(check.device), cuda=torch.version.cuda)
    info["nvidia_smi"] = command_output(["nvidia-smi"])
    info["nvcc"] = command_output(["nvcc", "--version"]).splitlines()[-1:]
    info["gcc"] = command_output(["gcc", "--version"]).splitlines()[:1]
    yield {"env": info}
    row = {"probe": "SGLang engine import + MFD / MFD_D registered (load_plugins)", "ok": False}
    try:
        proc = subprocess.run([sys.executable, "-c", REGISTRATION_PROBE], capture_output=True, text=True,
                              cwd=check.workdir, timeout=max(10.0, min(300.0, check.left())))
        if proc.returncode == 0:
            found = json.loads(proc.stdout.strip().splitlines()[-1])
            row.update(found, ok=not found["mfd_sglang"].startswith(str(REPO / "mfd_sglang")))
        else:
            row["error"] = proc.stderr[-4000:]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    yield row


# --- rows ---------------------------------------------------------------------------------------------

def measured_row(labels: dict, measure: Callable[[dict], None], *, verdict: bool = True) -> dict:
    """One row: its labels, then what measure(row) records in it (inputs built, run, compared). An exception
    is recorded as the row's error, with ok False on a row that carries a verdict; what measure recorded
    before it stays."""
    row = dict(labels)
    try:
        measure(row)
    except Exception as exc:
        if verdict:
            row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        else:
            row["error"] = f"{type(exc).__name__}: {exc}"
    return row


# --- kernels ------------------------------------------------------------------------------------------

def random_logprobs(shape: tuple[int, ...], device: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    logits = torch.randn(shape, device=device, generator=gen) * 3.0
    return torch.log_softmax(logits, dim=-1).to(dtype)


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "parents", "depths", "modes", "valid")) \
        and torch.equal(a.scores.float(), b.scores.float())


def same_walks(tree: DraftTree, device: str) -> tuple[bool, int]:
    """The Triton walks (`kernels.tree_walk`: verify layout, accepted path) equal the torch ones, without a
    host sync, for a target that follows each node's first child (deep paths); also the longest accept."""
    bs = tree.tokens.shape[0]
    roots, seq_lens = torch.arange(bs, device=device), torch.arange(bs, device=device) + 100
    layout = tree_to_verify_layout(tree, roots, seq_lens, backend="torch")
    target = layout.draft_token.gather(1, layout.retrive_next_token.clamp(min=0))
    result = accept_path(tree, target, backend="torch")
    with host_syncs_raise(device):
        fast = (tree_to_verify_layout(tree, roots, seq_lens, backend="triton"),
                accept_path(tree, target, backend="triton"))
    same = all(torch.equal(getattr(want, f.name), getattr(have, f.name))
               for want, have in zip((layout, result), fast) for f in dataclasses.fields(want))
    return same, int(result.accept_lens.max())


def tree_rows(check: Check, shapes) -> Iterator[dict]:
    for (bs, k, d, v, budget), dtype in itertools.product(shapes, (torch.float32, torch.bfloat16)):
        def compare(row):
            logprobs = random_logprobs((bs, k, d, v), check.device, dtype, seed=bs * 1000 + v)
            reference = build_mixture_tree(logprobs, budget, backend="torch")
            with host_syncs_raise(check.device):
                fast = build_mixture_tree(logprobs, budget, backend="triton")
            walks_ok, row["walk_accept_len"] = same_walks(reference, check.device)
            row["ok"] = same_tree(reference, fast) and walks_ok

        yield measured_row({"bs": bs, "K": k, "D": d, "V": v, "B": budget, "dtype": str(dtype).removeprefix("torch.")},
                           compare)


def check_tree_kernel(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 15, 32768, 64), (4, 8, 15, 151936, 64), (3, 4, 7, 5, 200)] if check.cuda else [(2, 2, 3, 50, 8)]
    yield from tree_rows(check, shapes)


def check_tree_kernel_all_shapes(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 15, 32768, 64), (4, 8, 15, 65536, 64), (16, 8, 15, 151936, 64), (2, 1, 15, 151936, 128),
              (3, 4, 7, 5, 200), (1, 8, 15, 65536, 16)]
    yield from tree_rows(check, shapes if check.cuda else [(2, 2, 3, 50, 8), (3, 1, 4, 7, 20)])


def check_accept_without_sync(check: Check) -> Iterator[dict]:
    """The accept stage outside the draft / verify CUDA graphs (the worker's eager glue under overlap
    scheduling): greedy and T > 0 tree verification (top-k with and without SGLang's max_top_k bound,
    top-p, min-p, seeds) and the draft scoring in vocabulary chunks, each under CUDA sync debug mode
    "error": a host sync there would stall the scheduler's overlap. On a CPU the cases run, unchecked."""
    from mfd_sglang.drafter import vocab_candidates
    from mfd_sglang.verify import Sampling, random_seeds, verify_tree_greedy, verify_tree_sampling

    device = check.device
    bs, k, d, v, budget = (16, 8, 15, 151936, 64) if check.cuda else (2, 2, 3, 50, 8)
    gen = torch.Generator(device=device).manual_seed(0)
    tree = build_mixture_tree(random_logprobs((bs, k, d, v), device, torch.float32, seed=7), budget,
                              backend="triton" if check.cuda else "torch")
    logits = torch.randn(bs, budget + 1, v, device=device, generator=gen)
    hidden = torch.randn(bs, k, d, 64, device=device, generator=gen)
    head = torch.randn(v, 64, device=device, generator=gen)
    positions = torch.arange(bs, device=device) + 100

    def sampling(max_top_k):
        return Sampling(torch.full((bs,), 0.8, device=device), torch.full((bs,), 20, device=device),
                        torch.full((bs,), 0.9, device=device), torch.full((bs,), 0.05, device=device),
                        random_seeds(bs, device), max_top_k)

    cases = {"greedy": lambda: verify_tree_greedy(tree, logits),
             "sampling, max_top_k bound": lambda: verify_tree_sampling(tree, logits, sampling(20), positions),
             "sampling, full sort (seeded)": lambda: verify_tree_sampling(tree, logits, sampling(None), positions),
             "draft scoring in vocabulary chunks": lambda: vocab_candidates(hidden, head, budget)}
    for name, run in cases.items():
        def run_without_sync(row):
            with host_syncs_raise(device):
                run()
            if check.cuda:
                row["ok"] = True  # sync debug mode "error" raises on the first host sync
            else:
                row["skipped"] = "needs CUDA: host syncs exist on CUDA only (the case ran, unchecked)"

        yield measured_row({"case": name}, run_without_sync)


def check_vocab_kernel(check: Check) -> Iterator[dict]:
    """The fused lm_head + top-B Triton kernels (`kernels/vocab_candidates.py`, the draft's on CUDA)
    against the torch `vocab_candidates` at serving shapes, without a host sync: on small-integer
    inputs (every logit exact whatever the GEMM's order) ids and logits bit for bit, ties included;
    on random bf16 inputs (rounding may move near-ties) >= 97% of the candidates shared."""
    from mfd_sglang.drafter import vocab_candidates

    shapes = [(1, 8, 15, 2560, 151936, 64), (16, 8, 15, 2560, 151936, 64), (4, 4, 7, 1024, 32000, 16)]
    grids = ("integers", "random")
    if not check.cuda:  # the interpreter's bf16 rounding differs from torch's: exact inputs only
        shapes, grids = [(2, 2, 3, 40, 50, 8)], ("integers",)
    for (bs, k, d, h, v, budget), grid in itertools.product(shapes, grids):
        def compare(row):
            gen = torch.Generator(device=check.device).manual_seed(bs * 7 + h)
            if grid == "integers":
                hidden = torch.randint(-3, 4, (bs, k, d, h), device=check.device, generator=gen).to(torch.bfloat16)
                head = torch.randint(-3, 4, (v, h), device=check.device, generator=gen).to(torch.bfloat16)
            else:
                hidden = torch.randn(bs, k, d, h, device=check.device, generator=gen).to(torch.bfloat16)
                head = (0.05 * torch.randn(v, h, device=check.device, generator=gen)).to(torch.bfloat16)
            with host_syncs_raise(check.device):
                fast = vocab_candidates(hidden, head, budget, backend="triton")
            reference = vocab_candidates(hidden, head, budget)
            shared = float((fast.tokens[..., :, None] == reference.tokens[..., None, :]).any(-1).float().mean())
            row["shared"] = round(shared, 4)
            row["max_logprob_diff"] = float((fast.logprobs - reference.logprobs).abs().max())
            row["ok"] = torch.equal(fast.tokens, reference.tokens) if grid == "integers" else shared >= 0.97

        yield measured_row({"bs": bs, "K": k, "D": d, "H": h, "V": v, "B": budget, "inputs": grid}, compare)


def check_mode_attention(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 16, 32, 8, 128, [4096]), (4, 8, 16, 32, 8, 128, [1, 700, 2048, 4096]),
              (3, 1, 16, 16, 16, 64, [0, 33, 900])]
    if not check.cuda:
        shapes = [(2, 2, 4, 2, 1, 16, [3, 20])]
    # The Triton interpreter's bf16 dot is broken: on a CPU, fp16 stands in for the half-precision check.
    dtypes = (torch.float32, torch.bfloat16 if check.cuda else torch.float16)
    for (bs, k, t, hq, hkv, d, lens), dtype in itertools.product(shapes, dtypes):
        def compare(row):
            case = random_inputs(bs, bs, k, t, hq, hkv, d, lens, dtype, check.device)
            reference = mode_attention(**{n: (x.float() if x.is_floating_point() else x) for n, x in case.items()},
                                       num_modes=k)
            fast = mode_attention(**case, num_modes=k, backend="triton")
            row["max_abs_error"] = float((fast.float() - reference).abs().max())
            row["ok"] = row["max_abs_error"] <= (1e-4 if dtype == torch.float32 else 3e-2)

        yield measured_row({"bs": bs, "K": k, "T": t, "Hq": hq, "Hkv": hkv, "d": d,
                            "dtype": str(dtype).removeprefix("torch.")}, compare)


def check_tree_masks(check: Check) -> Iterator[dict]:
    from tree_mask_check import tree_mask_section

    for row in tree_mask_section(check.device, not check.cuda):
        yield row


# --- timings (rows without a verdict) -------------------------------------------------------------------

def backend_times(run, device: str, repeats: int) -> dict:
    """run(backend) timed for "torch" and "triton": {torch_ms, triton_ms, speedup}."""
    row = {f"{backend}_ms": round(mean_ms(lambda: run(backend), device, repeats), 4) for backend in ("torch", "triton")}
    row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)
    return row


def tree_time_rows(check: Check, grid) -> Iterator[dict]:
    if not check.cuda:
        raise StructuralSkip("needs CUDA: Triton timings need a GPU (the interpreter's mean nothing)")
    for bs, budget, v in grid:
        def time_backends(row):
            for backend in ("torch", "triton"):
                row[f"{backend}_ms"] = round(time_build(bs, 8, 15, v, budget, check.device, backend, 20,
                                                        torch.bfloat16), 4)
            row["speedup"] = round(row["torch_ms"] / row["triton_ms"], 2)

        yield measured_row({"bs": bs, "K": 8, "D": 15, "B": budget, "V": v}, time_backends, verdict=False)


def time_tree_build(check: Check) -> Iterator[dict]:
    """ms per tree build, torch vs Triton, K 8, D 15, bf16 (paper's engine ~0.35 ms; target <= 0.10 ms at
    bs 1, B 64, V 65536)."""
    yield from tree_time_rows(check, [(1, 64, 65536), (1, 64, 151936), (4, 64, 151936), (16, 64, 151936)])


def time_tree_build_all_shapes(check: Check) -> Iterator[dict]:
    yield from tree_time_rows(check, itertools.product((1, 4, 16), (16, 32, 64, 128), (32768, 65536, 151936)))


def time_mode_attention(check: Check) -> Iterator[dict]:
    """ms per drafter attention call, Triton vs the generic path: K 8, block 16, context 4K, 32 query / 8 kv
    heads of 128 (a Qwen3-4B-shaped drafter), bf16 (target >= 1.5x)."""
    if not check.cuda:
        raise StructuralSkip("needs CUDA: Triton timings need a GPU (the interpreter's mean nothing)")
    for bs in (1, 4, 16):
        case = random_inputs(0, bs, 8, 16, 32, 8, 128, [4096] * bs, torch.bfloat16, check.device)
        timed = backend_times(lambda backend: mode_attention(**case, num_modes=8, backend=backend), check.device, 20)
        yield {"bs": bs, "K": 8, "T": 16, "context": 4096, **timed}


def time_vocab_kernel(check: Check) -> Iterator[dict]:
    """The drafter's vocabulary top-B: torch chunks vs the fused Triton kernel (bf16, H 2560, V 151936)."""
    if not check.cuda:
        raise StructuralSkip("needs CUDA: Triton timings need a GPU (the interpreter's mean nothing)")
    from mfd_sglang.drafter import vocab_candidates

    for bs, budget in itertools.product((1, 4, 16), (16, 64)):
        gen = torch.Generator(device=check.device).manual_seed(bs)
        hidden = torch.randn(bs, 8, 15, 2560, device=check.device, generator=gen).to(torch.bfloat16)
        head = (0.05 * torch.randn(151936, 2560, device=check.device, generator=gen)).to(torch.bfloat16)
        timed = backend_times(lambda backend: vocab_candidates(hidden, head, budget, backend=backend), check.device, 10)
        yield {"bs": bs, "K": 8, "D": 15, "B": budget, **timed}


PREDICTIONS = "round-cost-predictions.json"  # in the carried pair (gpu_check.sh prepare: the GPU cost ledger's)
PREDICTED = ("ar_step", *ROUND_STAGES, "round")  # what each prediction row holds, as <stage>_ms


def with_predictions(row: dict, predictions: dict | None) -> dict:
    """The row with the ledger's prediction for its config and batch size beside it (each stage's ms and
    launches), and measured / predicted per stage where both are of the same shapes."""
    match = next((p for p in (predictions or {}).get("rows", [])
                  if (p["config"], p["bs"]) == (row["config"], row["bs"])), None)
    if match is None:
        return {**row, "predicted": f"no prediction ({PREDICTIONS} not carried)" if predictions is None else None}
    row = {**row, "predicted": {k: v for k, v in match.items() if k not in ("config", "bs")},
           "launch_floor_us": predictions["launch_floor_us"]}
    if match["shape"] == row["shape"]:
        row["measured_over_predicted"] = {
            stage: round(row[f"{stage}_ms"] / match[f"{stage}_ms"], 3)
            for stage in PREDICTED if match.get(f"{stage}_ms")}
    return row


def print_predictions(rows: list[dict]) -> None:
    print("the GPU cost ledger's prediction (H200 model) for the same config and bs; measured / predicted where "
          "the shapes agree")
    for r in rows:
        p = r.get("predicted")
        if isinstance(p, dict):
            print(f"{r['config']:>7} {r['bs']:>3} predicted ({p['shape']}) ms: " + " ".join(
                f"{s} {p[s + '_ms']:.3f}" for s in PREDICTED)
                  + f"; launches {p['round_launches']} (profiled {r.get('profiled_kernel_launches')})"
                  + (f"; measured / predicted {r['measured_over_predicted']}" if "measured_over_predicted" in r else ""))
        else:
            print(f"{r['config']:>7} {r['bs']:>3} {p}")


def round_cost_bs1(check: Check) -> Iterator[dict]:
    """bs 1 and 32 on a GPU (bs 1 on a CPU), each round's kernels profiled into round-profile.txt, the ledger's
    prediction beside each row."""
    path = check.pair / PREDICTIONS if check.pair else None
    predictions = json.loads(path.read_text()) if path and path.is_file() else None
    for row in round_cost_rows(check.device, not check.cuda, batch_sizes=(1, 32) if check.cuda else (1,),
                               profile_to=check.out / "round-profile.txt"):
        yield with_predictions(row, predictions)


def round_cost_batches(check: Check) -> Iterator[dict]:
    yield from round_cost_rows(check.device, not check.cuda, batch_sizes=(4, 16) if check.cuda else (2,))


# --- tests that need CUDA and no server -----------------------------------------------------------------

GRAPH_TESTS = ["tests/test_cuda_graph.py::test_padded_batches_match_unpadded_as_cuda_graphs",
               "tests/test_serving.py::test_worker_draft_graphs_match_eager_drafting_as_cuda_graphs"]


def run_graph_tests(check: Check) -> Iterator[dict]:
    """pytest on the CUDA-graph tests that need no server, with the carried tiny pair as their fixture.
    On a CPU they are collected and skip themselves (which rehearses their imports): a structural skip."""
    env = {**os.environ, "MFD_SGLANG_TINY_PAIR": str(check.pair.resolve()) if check.pair else ""}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *GRAPH_TESTS],
                          cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=max(10.0, min(400.0, check.left() - 10)))
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    row = {"tests": GRAPH_TESTS, "summary": summary, "returncode": proc.returncode,
           "output_tail": (proc.stdout + proc.stderr)[-3000:]}
    passed = f"{len(GRAPH_TESTS)} passed" in summary and "skipped" not in summary and "failed" not in summary
    if check.cuda or passed:
        row["ok"] = proc.returncode == 0 and passed
    elif proc.returncode == 0 and f"{len(GRAPH_TESTS)} skipped" in summary:
        row["skipped"] = "needs CUDA: the tests were collected and skipped themselves"
    else:
        row["ok"] = False
    yield row


# --- servers ------------------------------------------------------------------------------------------

def tiny(check: Check):
    from server_exactness import tiny_pair

    if check.pair is None or not (check.pair / "drafter" / "config.json").is_file():
        raise FileNotFoundError(f"the tiny pair is not at {check.pair}: build it with `bash scripts/gpu_check.sh "
                                "prepare` and carry .gpu-check-pair")
    return tiny_pair(check.pair, check.device)


def graphs_config(check: Check, dtype: str, **kw):
    from server_exactness import ServerConfig, attention_choice, cpu_config

    return cpu_config() if not check.cuda else ServerConfig(dtype, True, *attention_choice(dtype), **kw)


def servers_tiny(check: Check) -> Iterator[dict]:
    from server_exactness import server_group, speculative_servers

    yield from server_group(check.launch(), tiny(check), graphs_config(check, "float32"), speculative_servers(16),
                            "tiny", max_new_tokens=32)


def servers_4b(check: Check) -> Iterator[dict]:
    from server_exactness import random_pair, server_group, speculative_servers

    pair = random_pair(Path(tempfile.mkdtemp(dir=check.workdir, prefix="random-pair-")), check.device)
    yield from server_group(check.launch(), pair, graphs_config(check, "float32"), speculative_servers(64),
                            "qwen3-4b-width", max_new_tokens=96 if check.cuda else 16)


def servers_bf16(check: Check) -> Iterator[dict]:
    """bf16: plain on Triton, the speculative servers with no --attention-backend (MFD resolves it:
    FlashInfer where installed, else Triton with one log line, which the row records)."""
    from server_exactness import ServerConfig, server_group, speculative_servers

    config = ServerConfig("bfloat16", check.cuda, "triton" if check.cuda else None,
                          "plain: triton; speculative servers: MFD's own choice", spec_attention_flag=False)
    yield from server_group(check.launch(), tiny(check), config, speculative_servers(16), "tiny-bf16",
                            max_new_tokens=32)


def servers_eager_and_paged(check: Check) -> Iterator[dict]:
    """Part 2: graphs and overlap off (fp32, bf16), and 16-token KV pages with graphs (fp32), tiny pair."""
    from server_exactness import ServerConfig, attention_choice, server_group, speculative_servers

    if not check.cuda:
        raise StructuralSkip("needs CUDA: graphs off / pages: the CPU servers already run eager (servers_tiny)")
    pair = tiny(check)
    configs = [ServerConfig("float32", False, *attention_choice("float32")),
               ServerConfig("bfloat16", False, *attention_choice("bfloat16")),
               ServerConfig("float32", True, *attention_choice("float32"), page_size=16)]
    for config in configs:
        yield from server_group(check.launch(), pair, config, speculative_servers(16), "tiny", max_new_tokens=32)


def servers_auto(check: Check) -> Iterator[dict]:
    """Part 2: MFD_D with the automatic budget (draft and verify graphs per budget, start-up calibration)."""
    from server_exactness import auto_server, server_group

    if not check.cuda:
        raise StructuralSkip("needs CUDA: the automatic budget's graphs need CUDA (tests/test_auto_budget.py holds it on CPU)")
    yield from server_group(check.launch(), tiny(check), graphs_config(check, "float32"), [auto_server(16)],
                            "tiny-auto", max_new_tokens=32)


def hybrid_servers(check: Check) -> Iterator[dict]:
    """Part 2: a hybrid Gated DeltaNet target (make-tiny --hybrid, fp32) in plain, MFD (B 8) and MFD_D
    automatic-budget servers, concurrent and then each prompt alone (radix-cache hits)."""
    from mfd_sglang.lab.tiny import make_tiny
    from server_exactness import Pair, Server, auto_server, server_group

    if not check.cuda:
        raise StructuralSkip("needs CUDA: tests/test_hybrid_target.py holds hybrid servers on CPU")
    pair_dir = make_tiny(Path(tempfile.mkdtemp(dir=check.workdir, prefix="hybrid-")), seed=0, num_modes=4,
                         hybrid=True, log=lambda *a: None)
    vocab = json.loads((pair_dir / "target" / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(12, vocab, (n,), generator=gen).tolist() for n in (3, 9, 14, 21, 33, 40)]
    prompts.append(prompts[4][:20] + prompts[1])  # shares a 20-token prefix with another
    pair = Pair("make-tiny --hybrid", pair_dir / "target", pair_dir / "drafter", tuple(map(tuple, prompts)), None)
    extra = ("--chunked-prefill-size", "8", "--context-length", "512", "--max-mamba-cache-size", "64")
    yield from server_group(check.launch(), pair, graphs_config(check, "float32"),
                            [Server("MFD", "MFD", 8), auto_server(16)], "hybrid", max_new_tokens=24,
                            extra_args=extra, then_one_by_one=True)


def servers_dflash(check: Check) -> Iterator[dict]:
    """Part 2: SGLang's own DFLASH chain (the tiny pair's single-mode drafter) beside MFD and MFD_D, plain
    as the reference, fp32 with CUDA graphs: tokens exact, accept lengths, and each one's round cost in plain
    decode steps with the speed-up, from the same requests timed alone on each server, in one run."""
    from server_exactness import DFLASH, server_group, speculative_servers

    pair = tiny(check)
    if not (pair.drafter.parent / DFLASH.drafter / "config.json").is_file():
        raise FileNotFoundError(f"no single-mode drafter at {pair.drafter.parent / DFLASH.drafter}: "
                                "make-tiny writes it (bash scripts/gpu_check.sh prepare)")
    yield from server_group(check.launch(), pair, graphs_config(check, "float32"), [DFLASH, *speculative_servers(16)],
                            "tiny-dflash", max_new_tokens=64, timed_alone=True)


def servers_flashinfer(check: Check) -> Iterator[dict]:
    """Plain and MFD / MFD_D on FlashInfer with CUDA graphs, bf16: the tiny pair, then the random
    Qwen3-4B-width pair (the FlashInfer visit compiles its JIT modules first)."""
    from server_exactness import ServerConfig, random_pair, server_group, speculative_servers

    if importlib.util.find_spec("flashinfer") is None:
        raise StructuralSkip("FlashInfer is not installed (scripts/gpu_visit_flashinfer.sh installs it)")
    config = ServerConfig("bfloat16", True, "flashinfer", "FlashInfer (the Hopper path MFD chooses)")
    yield from server_group(check.launch(), tiny(check), config, speculative_servers(16), "tiny-flashinfer",
                            max_new_tokens=32)
    pair = random_pair(Path(tempfile.mkdtemp(dir=check.workdir, prefix="random-pair-")), check.device)
    yield from server_group(check.launch(), pair, config, speculative_servers(64), "qwen3-4b-width-flashinfer",
                            max_new_tokens=96)


def fp8_draft(check: Check) -> Iterator[dict]:
    """benchmarks/fp8_draft.py's rows: FP8 drafter linears against their dequantized product, then draft time
    and round cost at bs 1 / 8 / 32 with FP8 and unquantized linears in the same run (tiny shapes, bs 2 on a CPU)."""
    from fp8_draft import fp8_rows

    yield from fp8_rows(check.device, quick=not check.cuda, batch_sizes=None if check.cuda else (2,))


# --- the run --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Section:
    name: str
    run: Callable[[Check], Iterator[dict]]
    verdicts: bool  # rows carry ok / skipped (correctness); False: measurements
    min_seconds: float  # not started with less time left (its rows would not finish)


PARTS: dict[str, list[Section]] = {
    "1": [Section("env", check_environment, True, 10), Section("tree", check_tree_kernel, True, 20),
          Section("tree_mask", check_tree_masks, True, 20), Section("graph_tests", run_graph_tests, True, 30),
          Section("servers_tiny", servers_tiny, True, 60), Section("servers_4b", servers_4b, True, 90),
          Section("attention", check_mode_attention, True, 15), Section("sync", check_accept_without_sync, True, 15),
          Section("round_cost", round_cost_bs1, True, 30), Section("servers_bf16", servers_bf16, True, 60),
          Section("tree_time", time_tree_build, False, 15), Section("attention_time", time_mode_attention, False, 15)],
    "2": [Section("env", check_environment, True, 10), Section("tree", check_tree_kernel_all_shapes, True, 30),
          Section("vocab", check_vocab_kernel, True, 30), Section("vocab_time", time_vocab_kernel, False, 30),
          Section("round_cost", round_cost_batches, True, 40),
          Section("tree_time", time_tree_build_all_shapes, False, 30),
          Section("servers_eager_paged", servers_eager_and_paged, True, 90),
          Section("servers_auto", servers_auto, True, 90), Section("servers_dflash", servers_dflash, True, 90),
          Section("hybrid_servers", hybrid_servers, True, 120), Section("fp8_draft", fp8_draft, True, 90)],
    "flashinfer": [Section("env", check_environment, True, 10),
                   Section("servers_flashinfer", servers_flashinfer, True, 90)],
}


def section_failures(name: str, entry: dict, verdicts: bool) -> list[str]:
    """What makes one section fail, a line each: not run, raised, no rows where a verdict is due, and every
    row that failed or erred (a `skipped` row or section is structural and passes)."""
    if "not_run" in entry:
        return [f"{name}: NOT RUN ({entry['not_run']})"]
    if "error" in entry:
        return [f"{name}: ERROR {entry['error'].strip().splitlines()[-1]}"]
    if "skipped" in entry:
        return []
    rows, out = entry.get("rows", []), []
    if verdicts and not any("ok" in r or "skipped" in r for r in rows):
        out.append(f"{name}: no rows with a verdict (nothing was checked)")
    for i, row in enumerate(rows):
        label = f"{name}[{i}]"
        errors = {k: v for k, v in row.items() if (k == "error" or k.endswith("_error")) and isinstance(v, str)}
        if errors:
            out.append(f"{label}: ERROR " + "; ".join(f"{k}: {str(v).strip().splitlines()[0]}" for k, v in errors.items()))
        elif "skipped" not in row and row.get("ok") is False:
            shown = {k: v for k, v in row.items() if not isinstance(v, (list, dict))}
            out.append(f"{label}: FAILED {shown}")
    return out


def failures(report: dict, sections: list[Section]) -> list[str]:
    return [line for s in sections for line in section_failures(s.name, report["sections"].get(s.name, {}), s.verdicts)]


class Writer:
    """report.json rewritten (atomically) and rows.jsonl appended as each row finishes."""

    def __init__(self, out: Path, report: dict, sections: list[Section]):
        self.out, self.report, self.sections = out, report, sections

    def save(self) -> None:
        self.report["failures"] = failures(self.report, self.sections)
        self.report["passed"] = not self.report["failures"]
        tmp = self.out / "report.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str) + "\n")
        tmp.replace(self.out / "report.json")

    def row(self, section: str, row: dict) -> None:
        self.report["sections"][section].setdefault("rows", []).append(row)
        with open(self.out / "rows.jsonl", "a") as f:
            f.write(json.dumps({"section": section, **row}, default=str) + "\n")
        self.save()


def run_sections(check: Check, sections: list[Section], writer: Writer) -> None:
    for section in sections:
        entry = check.report["sections"].setdefault(section.name, {})
        if check.left() < section.min_seconds:
            entry["not_run"] = f"{check.left():.0f} s left before the call's deadline"
            writer.save()
            continue
        print(f"[gpu_check] {section.name} ({check.left():.0f} s left) ...", flush=True)
        start = time.perf_counter()
        try:
            for row in section.run(check):
                writer.row(section.name, row)
                print(f"[gpu_check]   {section.name}: {short(row)}", flush=True)
        except StructuralSkip as skipped:
            entry["skipped"] = str(skipped)
        except Exception:
            entry["error"] = traceback.format_exc()[-6000:]
        entry["seconds"] = round(time.perf_counter() - start, 1)
        writer.save()


def short(row: dict) -> str:
    shown = {k: v for k, v in row.items() if not isinstance(v, (list, dict)) and k not in ("output_tail",)}
    return json.dumps(shown, default=str)[:400]


def print_summary(report: dict) -> None:
    from server_exactness import print_server_rows

    print(f"\n=== GPU check part {report['part']}, {report['date']}, {report['device']} ===")
    for name, entry in report["sections"].items():
        rows = entry.get("rows", [])
        if "not_run" in entry or "error" in entry or "skipped" in entry:
            why = entry.get("not_run") or entry.get("skipped") or entry["error"].strip().splitlines()[-1]
            print(f"{name}: {'NOT RUN' if 'not_run' in entry else 'SKIPPED' if 'skipped' in entry else 'ERROR'}: {why}")
            continue
        verdict = [r for r in rows if "ok" in r]
        print(f"{name}: {sum(bool(r['ok']) for r in verdict)}/{len(verdict)} ok"
              + (f", {sum('skipped' in r for r in rows)} skipped" if any("skipped" in r for r in rows) else "")
              + f" ({entry.get('seconds')} s)")
        if name.startswith("servers") or name == "hybrid_servers":
            print_server_rows(rows)
        elif name == "round_cost":
            print_round_cost(rows)
            print_predictions(rows)
        elif name.endswith("_time"):
            for r in rows:
                print("  " + short(r))
    failed = report.get("failures", [])
    print(f"\nRESULT: {'FAIL' if failed else 'PASS'}" + (f" ({len(failed)} items)" if failed else ""))
    for line in failed:
        print("  " + line)


def carry_size(paths: list[str]) -> dict:
    """Bytes one device call carries: the repository's working tree (tracked and untracked, not ignored)
    plus the carried paths, against the 64 MiB limit less an 8 MiB margin."""
    tree = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                          check=True).stdout.decode().split("\0")
    sizes = {"working tree": sum((REPO / p).stat().st_size for p in tree if p and (REPO / p).is_file())}
    for path in paths:
        sizes[path] = sum(f.stat().st_size for f in (REPO / path).rglob("*") if f.is_file())
    total = sum(sizes.values())
    return {"bytes": sizes, "total": total, "limit": CARRY_LIMIT, "margin": CARRY_MARGIN,
            "fits": total <= CARRY_LIMIT - CARRY_MARGIN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="1", choices=list(PARTS))
    parser.add_argument("--cpu", action="store_true", help="the rehearsal: run on the CPU, Triton interpreted")
    parser.add_argument("--out-dir", type=Path, help="where the results go (default: benchmarks/results/gpu-check-<date>-<device>)")
    parser.add_argument("--pair", type=Path, default=REPO / ".gpu-check-pair", help="the tiny pair (make-tiny seed 0, K 4)")
    parser.add_argument("--deadline", type=float, default=float(os.environ.get("MFD_GPU_CHECK_DEADLINE", 0)) or None,
                        help="time.time() after which no section or server starts (default: MFD_GPU_CHECK_DEADLINE, else 530 s from now)")
    parser.add_argument("--only", nargs="+", help="run these sections of the part only")
    parser.add_argument("--carry-size", nargs="*", metavar="PATH", help="print what a device call carrying PATHs weighs, and exit")
    args = parser.parse_args()
    if args.carry_size is not None:
        size = carry_size(args.carry_size)
        print("[gpu_check] a device call carries " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in size["bytes"].items())
              + f": {size['total'] / 2**20:.1f} MiB of {size['limit'] / 2**20:.0f} (margin {size['margin'] / 2**20:.0f})")
        sys.exit(0 if size["fits"] else 1)
    device = "cpu" if args.cpu or not torch.cuda.is_available() else "cuda"
    date = dt.date.today().isoformat()
    out = args.out_dir or REPO / "benchmarks" / "results" / f"gpu-check-{date}-{device}"
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").unlink(missing_ok=True)
    sections = [s for s in PARTS[args.part] if not args.only or s.name in args.only]
    report = {"date": date, "part": args.part, "device": device, "command": " ".join(sys.argv),
              "deadline_s": None, "sections": {}}
    deadline = args.deadline or time.time() + 530
    report["deadline_s"] = round(deadline - time.time())
    from server_exactness import ServerLogs

    workdir = Path(tempfile.mkdtemp(prefix="mfd-gpu-check-"))
    # absolute: servers start in their own folder, not in the repository root
    check = Check(device, deadline, out, args.pair.resolve() if args.pair.exists() else None, workdir, report,
                  ServerLogs(out / "server-logs.txt"))
    writer = Writer(out, report, sections)
    try:
        run_sections(check, sections, writer)
    finally:
        check.logs.write()
        writer.save()
        shutil.rmtree(workdir, ignore_errors=True)
    print_summary(report)
    print(f"\nwrote {out}/report.json")
    sys.exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
