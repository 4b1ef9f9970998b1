"""The GPU check: the one device call that proves the GPU path, rows written as they finish.

    bash scripts/gpu_check.sh prepare            # here: build the device kit and the tiny pair it carries
    bash scripts/gpu_check.sh                    # on the GPU machine (part 1), ONE call
    bash scripts/gpu_check.sh --part 2           # the next visit: what part 1 leaves out
    bash scripts/gpu_check.sh --part flashinfer  # the FlashInfer visit (scripts/gpu_visit_flashinfer.sh)
    bash scripts/gpu_check.sh --cpu              # the rehearsal on a CPU (tests/test_device_kit.py)

gpu_check.sh sets one deadline for the whole call (MFD_GPU_CHECK_DEADLINE), IEEE fp32 for Triton
(TRITON_F32_DEFAULT=ieee), installs the kit and runs this script with the installed plugin only.

The sections run through `mfd_sglang.check` (its machinery, environment probe, kernel comparisons and server
groups: the same code as the user's self-check, `python -m mfd_sglang check`); this script holds the GPU
check's parts, their shapes and pairs, and the sections only it runs.

Part 1, most truth first (a section starts only while time is left; what the deadline cuts is reported):
  env            versions, nvidia-smi, nvcc / gcc, the kit install, and SGLang's engine importing against the
                 kit with MFD registered (a subprocess, as a server process does it)
  tree           Triton mixture-tree kernel and tree walks (layout, accept) vs the torch references,
                 bit-identical, no host sync (few shapes)
  tree_mask      every attention backend MFD allows applies the tree mask, eager and from a CUDA graph
  graph_tests    the CUDA-graph tests that need no server (tests/test_cuda_graph.py, tests/test_serving.py)
  servers_tiny   the make-tiny pair (carried), fp32, CUDA graphs + overlap: plain, MFD, MFD_D; exact tokens
                 and mean accept lengths of at least mfd_sglang.check.servers.TINY_ACCEPT_BOUNDS
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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling modules (PYTHONSAFEPATH leaves it out)

import torch  # noqa: E402

from mfd_sglang.check.environment import check_environment  # noqa: E402
from mfd_sglang.check.kernels import mode_attention_rows, random_logprobs, tree_rows, vocab_rows  # noqa: E402
from mfd_sglang.check.run import (Check, Section, StructuralSkip, Writer, failures, measured_row,  # noqa: E402,F401
                                  print_summary as print_report, run_sections, short)
from mfd_sglang.check.servers import ServerLogs, print_server_rows  # noqa: E402
from mfd_sglang.cuda_graph import host_syncs_raise  # noqa: E402
from mfd_sglang.mode_attention import mode_attention, random_inputs  # noqa: E402
from mfd_sglang.round_cost import STAGES as ROUND_STAGES, print_round_cost, round_cost_rows  # noqa: E402
from mfd_sglang.timing import mean_ms  # noqa: E402
from mfd_sglang.tree import build_mixture_tree  # noqa: E402
from tree_build import time_build  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CARRY_LIMIT = 64 * 2**20  # what one device call carries: the working tree and the carried paths
CARRY_MARGIN = 8 * 2**20


# --- kernels (mfd_sglang.check.kernels: the comparisons; here the GPU check's shapes) -----------------------

def check_tree_kernel(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 15, 32768, 64), (4, 8, 15, 151936, 64), (3, 4, 7, 5, 200)] if check.cuda else [(2, 2, 3, 50, 8)]
    yield from tree_rows(check.device, shapes)


def check_tree_kernel_all_shapes(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 15, 32768, 64), (4, 8, 15, 65536, 64), (16, 8, 15, 151936, 64), (2, 1, 15, 151936, 128),
              (3, 4, 7, 5, 200), (1, 8, 15, 65536, 16)]
    yield from tree_rows(check.device, shapes if check.cuda else [(2, 2, 3, 50, 8), (3, 1, 4, 7, 20)])


def check_accept_without_sync(check: Check) -> Iterator[dict]:
    """The accept stage outside the draft / verify CUDA graphs (the worker's eager glue under overlap
    scheduling): greedy and T > 0 tree verification (top-k with and without SGLang's max_top_k bound,
    top-p, min-p, seeds) and the draft scoring in vocabulary chunks, each under CUDA sync debug mode
    "error": a host sync there would stall the scheduler's overlap. On a CPU the cases run, unchecked."""
    from mfd_sglang.drafter import vocab_candidates
    from mfd_sglang.acceptance import Sampling, random_seeds, verify_tree_greedy, verify_tree_sampling

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
    """The fused lm_head + top-B Triton kernels (`kernels/draft_vocab.py`, the draft's on CUDA)
    against the torch `vocab_candidates` at serving shapes, without a host sync: on small-integer
    inputs (every logit exact whatever the GEMM's order) ids and logits bit for bit, ties included;
    on random bf16 inputs (rounding may move near-ties) >= 97% of the candidates shared."""
    shapes = [(1, 8, 15, 2560, 151936, 64), (16, 8, 15, 2560, 151936, 64), (4, 4, 7, 1024, 32000, 16)]
    grids = ("integers", "random")
    if not check.cuda:  # the interpreter's bf16 rounding differs from torch's: exact inputs only
        shapes, grids = [(2, 2, 3, 40, 50, 8)], ("integers",)
    yield from vocab_rows(check.device, shapes, grids)


def check_mode_attention(check: Check) -> Iterator[dict]:
    shapes = [(1, 8, 16, 32, 8, 128, [4096]), (4, 8, 16, 32, 8, 128, [1, 700, 2048, 4096]),
              (3, 1, 16, 16, 16, 64, [0, 33, 900])]
    if not check.cuda:
        shapes = [(2, 2, 4, 2, 1, 16, [3, 20])]
    # The Triton interpreter's bf16 dot is broken: on a CPU, fp16 stands in for the half-precision check.
    yield from mode_attention_rows(check.device, shapes, (torch.float32, torch.bfloat16 if check.cuda else torch.float16))


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


# --- servers (mfd_sglang.check.servers: the groups and their rows; here the GPU check's pairs) ------------

def random_pair(outdir: Path, device: str):
    """A random Qwen3 target of Qwen3-4B's width (8 layers; a tiny one on a CPU) with a random K = 8
    drafter: shapes, memory and graph capture at a real size; accepts about nothing."""
    from mfd_sglang.check.servers import Pair
    from mfd_sglang.round_cost import TargetConfig

    cfg = TargetConfig.tiny() if device == "cpu" else dataclasses.replace(TargetConfig.qwen3_4b(), layers=8,
                                                                          draft_layers=2)
    target, drafter = write_random_pair(outdir, cfg, num_modes=8, device=device)
    gen = torch.Generator().manual_seed(2)
    lengths = (5, 17, 40, 9) if device == "cpu" else (7, 40, 100, 180, 260, 350, 430, 500)
    prompts = tuple(tuple(torch.randint(0, cfg.vocab - 1, (n,), generator=gen).tolist()) for n in lengths)
    name = "random, Qwen3-4B width, 8 layers" if device != "cpu" else "random, tiny shapes"
    return Pair(name, target, drafter, prompts, None)


def write_random_pair(outdir: Path, cfg, num_modes: int, device: str) -> tuple[Path, Path]:
    """OUTDIR/target (HF Qwen3, random weights) and OUTDIR/drafter (MFD, random weights) of round_cost's
    TargetConfig cfg."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from mfd_sglang.checkpoint import save_drafter
    from mfd_sglang.round_cost import drafter_raw_config, random_drafter, spread_layer_ids

    config = Qwen3Config(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_eps,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config)
    target.save_pretrained(outdir / "target", safe_serialization=True)
    layer_ids = spread_layer_ids(cfg.layers, cfg.draft_layers)
    drafter = random_drafter(cfg, layer_ids, num_modes, seed=1, device=device, dtype=torch.float32)
    save_drafter(outdir / "drafter", drafter_raw_config(cfg, layer_ids, num_modes), drafter.checkpoint_weights())
    return outdir / "target", outdir / "drafter"


def tiny(check: Check):
    from mfd_sglang.check.servers import tiny_pair

    if check.pair is None or not (check.pair / "drafter" / "config.json").is_file():
        raise FileNotFoundError(f"the tiny pair is not at {check.pair}: build it with `bash scripts/gpu_check.sh "
                                "prepare` and carry .gpu-check-pair")
    return tiny_pair(check.pair, check.device)


def graphs_config(check: Check, dtype: str, **kw):
    from mfd_sglang.check.servers import ServerConfig, attention_choice, cpu_config

    return cpu_config() if not check.cuda else ServerConfig(dtype, True, *attention_choice(dtype), **kw)


def servers_tiny(check: Check) -> Iterator[dict]:
    from mfd_sglang.check.servers import server_group, speculative_servers

    yield from server_group(check.launch(), tiny(check), graphs_config(check, "float32"), speculative_servers(16),
                            "tiny", max_new_tokens=32)


def servers_4b(check: Check) -> Iterator[dict]:
    from mfd_sglang.check.servers import server_group, speculative_servers

    pair = random_pair(Path(tempfile.mkdtemp(dir=check.workdir, prefix="random-pair-")), check.device)
    yield from server_group(check.launch(), pair, graphs_config(check, "float32"), speculative_servers(64),
                            "qwen3-4b-width", max_new_tokens=96 if check.cuda else 16)


def servers_bf16(check: Check) -> Iterator[dict]:
    """bf16: plain on Triton, the speculative servers with no --attention-backend (MFD resolves it:
    FlashInfer where installed, else Triton with one log line, which the row records)."""
    from mfd_sglang.check.servers import ServerConfig, server_group, speculative_servers

    config = ServerConfig("bfloat16", check.cuda, "triton" if check.cuda else None,
                          "plain: triton; speculative servers: MFD's own choice", spec_attention_flag=False)
    yield from server_group(check.launch(), tiny(check), config, speculative_servers(16), "tiny-bf16",
                            max_new_tokens=32)


def servers_eager_and_paged(check: Check) -> Iterator[dict]:
    """Part 2: graphs and overlap off (fp32, bf16), and 16-token KV pages with graphs (fp32), tiny pair."""
    from mfd_sglang.check.servers import ServerConfig, attention_choice, server_group, speculative_servers

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
    from mfd_sglang.check.servers import auto_server, server_group

    if not check.cuda:
        raise StructuralSkip("needs CUDA: the automatic budget's graphs need CUDA (tests/test_auto_budget.py holds it on CPU)")
    yield from server_group(check.launch(), tiny(check), graphs_config(check, "float32"), [auto_server(16)],
                            "tiny-auto", max_new_tokens=32)


def hybrid_servers(check: Check) -> Iterator[dict]:
    """Part 2: a hybrid Gated DeltaNet target (make-tiny --hybrid, fp32) in plain, MFD (B 8) and MFD_D
    automatic-budget servers, concurrent and then each prompt alone (radix-cache hits)."""
    from mfd_sglang.lab.tiny import make_tiny
    from mfd_sglang.check.servers import Pair, Server, auto_server, server_group

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
    from mfd_sglang.check.servers import DFLASH, server_group, speculative_servers

    pair = tiny(check)
    if not (pair.drafter.parent / DFLASH.drafter / "config.json").is_file():
        raise FileNotFoundError(f"no single-mode drafter at {pair.drafter.parent / DFLASH.drafter}: "
                                "make-tiny writes it (bash scripts/gpu_check.sh prepare)")
    yield from server_group(check.launch(), pair, graphs_config(check, "float32"), [DFLASH, *speculative_servers(16)],
                            "tiny-dflash", max_new_tokens=64, timed_alone=True)


def servers_flashinfer(check: Check) -> Iterator[dict]:
    """Plain and MFD / MFD_D on FlashInfer with CUDA graphs, bf16: the tiny pair, then the random
    Qwen3-4B-width pair (the FlashInfer visit compiles its JIT modules first)."""
    from mfd_sglang.check.servers import ServerConfig, server_group, speculative_servers

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


def section_details(name: str, rows: list[dict]) -> None:
    if name.startswith("servers") or name == "hybrid_servers":
        print_server_rows(rows)
    elif name == "round_cost":
        print_round_cost(rows)
        print_predictions(rows)
    elif name.endswith("_time"):
        for r in rows:
            print("  " + short(r))


def print_summary(report: dict) -> None:
    print_report(report, f"GPU check part {report['part']}, {report['date']}, {report['device']}", section_details)


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
    workdir = Path(tempfile.mkdtemp(prefix="mfd-gpu-check-"))
    # absolute: servers start in their own folder, not in the repository root
    check = Check(device, deadline, out, args.pair.resolve() if args.pair.exists() else None, workdir, report,
                  ServerLogs(out / "server-logs.txt"), source_root=REPO)
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
