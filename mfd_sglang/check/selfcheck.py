"""`python -m mfd_sglang check --target T --drafter D`: the self-check a user runs on their installed SGLang
and sends back (one JSON report, a short printed summary, exit status 1 on any mismatch).

Sections, in order (each a `run.Section` of this package, rows as `mfd_sglang.check` describes):
  env            versions (SGLang, torch, Triton, transformers, FlashInfer, this plugin, CUDA, the driver), the
                 GPU, and the plugin registering in SGLang as a server process loads it
  tree           the Triton mixture tree, verify layout, custom mask and accepted path against torch, bit for
                 bit, at the pair's K modes (and MFD_D's one), block and draft vocabulary and the budget B
  vocab          the fused lm_head + top-B kernel at the drafter's width and vocabulary
  attention      the mode attention at the drafter's heads, head dim, K and block, over long contexts
  drafter_steps  q / k norm + rope, residual add + RMSNorm and SiLU x up, the block input at the drafter's
                 widths, and the drafter itself (its weights, float32) on "triton" against "torch"
  commit         the commit's rows at the target's feature width, window B + 1 and the block
  graphs         the verify window (tree, layout, accept) captured as CUDA graphs per batch-size bucket, its
                 replays against eager (a structural skip without CUDA)
  servers        plain, MFD and MFD_D servers on the pair (SGLang's defaults: CUDA graphs and overlap on a GPU,
                 the served dtype; one server at a time), the same prompts all at once then each alone, timed:
                 token-identical to plain (bf16 / fp16: a divergence only at a near-tie of the plain server), with
                 the accept lengths and each round's time and cost in plain decode steps
The kernel sections use the shapes the servers run: batch sizes 1 and 8 (1 and 2 on a CPU), the served dtype
and float32. With `--mfd-kernels torch` the servers run every step on the torch path and the kernel sections are
skipped with that reason; `auto` and `triton` resolve as a server resolves them (`mfd_sglang.backend`).

On a CPU (no CUDA) the same command runs through the same code: Triton under its interpreter (TRITON_INTERPRET=1,
set here before any kernel is imported; float32), servers through the CPU launcher (`mfd_sglang.cpu`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .environment import check_environment
from .run import Check, Section, StructuralSkip, Writer, print_summary, run_sections

# The prompts of a pair without --prompts (sent through the target's chat template where it has one).
DEFAULT_PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and two tests.",
    "Explain in three short paragraphs why the sky is blue.",
    "A train leaves at 9:40 and arrives at 13:05. How long is the journey? Show each step.",
    "List five everyday uses of a hash map and say for each why it fits.",
    "Translate into French: The meeting is moved to Thursday because the room is booked.",
    "Summarise the rules of chess in a numbered list of at most eight items.",
)
BATCH_SIZES = {"cuda": (1, 8), "cpu": (1, 2)}
CONTEXT_LENGTHS = {"cuda": (4096, 1, 700, 2048, 33, 900, 5, 3000), "cpu": (20, 3)}  # one per request, bs <= 8


@dataclass
class SelfCheck(Check):
    """The check of one target + drafter pair at budget B, with the servers' kernel choice."""

    target: Path = Path()
    drafter: Path = Path()
    budget: int = 0  # B, of the kernel sections and the servers alike
    kernels: str = "auto"  # --mfd-kernels as given
    backend: str = "torch"  # what the servers' round runs (resolve_backend)
    dtype: str = "float32"  # the servers' --dtype
    prompts: tuple[tuple[int, ...], ...] = ()
    max_new_tokens: int = 64
    shapes: dict = field(default_factory=dict)  # the pair's: `pair_shapes`

    def launch(self):
        from .servers import Launch

        return Launch(self.device, self.deadline, self.workdir, self.logs, one_at_a_time=True)

    @property
    def kind(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def kernel_dtypes(self):
        """float32, and on a GPU the served dtype (the interpreter's half precision differs from torch's)."""
        import torch

        served = getattr(torch, self.dtype)
        return (torch.float32,) if not self.cuda or served == torch.float32 else (torch.float32, served)

    def compared(self) -> None:
        """StructuralSkip when the servers run no Triton kernel (--mfd-kernels torch)."""
        if self.kernels == "torch":
            raise StructuralSkip("--mfd-kernels torch: every step of the round runs on the torch path, no Triton "
                                 "kernel to compare")


def pair_shapes(drafter_cfg, target_cfg: dict, context_features: int) -> dict:
    """What the kernels see on this pair: the drafter's K, block, widths, heads, draft vocabulary; the target's
    vocabulary and drafter features."""
    return {"K": drafter_cfg.num_modes, "block": drafter_cfg.block_size, "D": drafter_cfg.block_size - 1,
            "H": drafter_cfg.hidden_size, "intermediate": drafter_cfg.intermediate_size,
            "layers": drafter_cfg.num_hidden_layers, "heads": drafter_cfg.num_attention_heads,
            "kv_heads": drafter_cfg.num_key_value_heads, "head_dim": drafter_cfg.head_dim,
            "rope_theta": drafter_cfg.rope_theta, "rms_norm_eps": drafter_cfg.rms_norm_eps,
            "mask_token_id": drafter_cfg.mask_token_id, "vocab": target_cfg["vocab_size"],
            "draft_vocab": drafter_cfg.draft_vocab_size or target_cfg["vocab_size"], "features": context_features}


# --- sections --------------------------------------------------------------------------------------------

def tree_section(check: SelfCheck) -> Iterator[dict]:
    from .kernels import tree_rows

    check.compared()
    s = check.shapes
    shapes = [(bs, k, s["D"], s["draft_vocab"], check.budget) for k in sorted({s["K"], 1}, reverse=True)
              for bs in BATCH_SIZES[check.kind]]
    yield from tree_rows(check.device, shapes, dtypes=check.kernel_dtypes())


def vocab_section(check: SelfCheck) -> Iterator[dict]:
    from .kernels import vocab_rows

    check.compared()
    s = check.shapes
    shapes = [(bs, s["K"], s["D"], s["H"], s["draft_vocab"], check.budget) for bs in BATCH_SIZES[check.kind]]
    yield from vocab_rows(check.device, shapes, ("integers", "random") if check.cuda else ("integers",))


def attention_section(check: SelfCheck) -> Iterator[dict]:
    import torch

    from .kernels import mode_attention_rows

    check.compared()
    s = check.shapes
    shapes = [(bs, s["K"], s["block"], s["heads"], s["kv_heads"], s["head_dim"],
               list(CONTEXT_LENGTHS[check.kind][:bs])) for bs in BATCH_SIZES[check.kind]]
    # The Triton interpreter's bf16 dot is broken: on a CPU, fp16 stands in for the half-precision check.
    half = getattr(torch, check.dtype) if check.cuda and check.dtype != "float32" else torch.float16
    yield from mode_attention_rows(check.device, shapes, (torch.float32, half))


def drafter_steps_section(check: SelfCheck) -> Iterator[dict]:
    import torch

    from mfd_sglang.checkpoint import load_drafter
    from mfd_sglang.drafter import MFDDrafter

    from .kernels import block_input_rows, drafter_rows, norm_rope_rows, residual_mlp_rows

    check.compared()
    s, sizes = check.shapes, BATCH_SIZES[check.kind]
    rows = s["K"] * s["block"]  # a block's rows per request: K modes of block slots
    for dtype in check.kernel_dtypes():
        yield from norm_rope_rows(check.device, [(dtype, bs, rows, s["heads"], s["kv_heads"], s["head_dim"],
                                                  s["layers"], s["rope_theta"], s["rms_norm_eps"]) for bs in sizes])
        yield from residual_mlp_rows(check.device, [(dtype, bs * rows, s["H"], s["intermediate"]) for bs in sizes])
        yield from block_input_rows(check.device, [(dtype, bs, s["K"], s["block"], s["H"], s["vocab"],
                                                    s["mask_token_id"]) for bs in sizes])
    drafter = MFDDrafter.from_checkpoint(load_drafter(check.drafter), dtype=torch.float32).to(check.device)
    yield from drafter_rows(check.device, drafter, s["vocab"], sizes, context_len=512 if check.cuda else 9)


def commit_section(check: SelfCheck) -> Iterator[dict]:
    from .kernels import commit_rows_rows

    check.compared()
    s = check.shapes
    width = min(s["block"], check.budget + 1)  # the root and the longest path a round commits
    yield from commit_rows_rows(check.device, [(dtype, bs, check.budget + 1, s["features"], width)
                                               for dtype in check.kernel_dtypes() for bs in BATCH_SIZES[check.kind]])


def graphs_section(check: SelfCheck) -> Iterator[dict]:
    from .graphs import graph_rows

    s = check.shapes
    yield from graph_rows(check.device, check.backend, {"MFD": s["K"], "MFD_D": 1}, s["D"], s["draft_vocab"],
                          check.budget)


def servers_section(check: SelfCheck) -> Iterator[dict]:
    from .servers import Pair, Server, ServerConfig, server_group

    pair = Pair(f"{check.target.name} + {check.drafter.name}", check.target, check.drafter, check.prompts, None)
    config = ServerConfig(check.dtype, check.cuda, None, "each server's default")
    flags = ("--mfd-kernels", check.kernels)
    servers = [Server(name, name, check.budget, args=flags) for name in ("MFD", "MFD_D")]
    yield from server_group(check.launch(), pair, config, servers, "self-check", check.max_new_tokens,
                            timed_alone=True)


SECTIONS = [Section("env", check_environment, True, 0), Section("tree", tree_section, True, 0),
            Section("vocab", vocab_section, True, 0), Section("attention", attention_section, True, 0),
            Section("drafter_steps", drafter_steps_section, True, 0), Section("commit", commit_section, True, 0),
            Section("graphs", graphs_section, True, 0), Section("servers", servers_section, True, 0)]


# --- the command -------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `check` subcommand's options (cli.py; no heavy import here)."""
    from mfd_sglang.backend import KERNEL_CHOICES

    p.add_argument("--target", required=True, type=Path, help="the target's HF model directory")
    p.add_argument("--drafter", required=True, type=Path, help="the MFD / DFlash drafter directory")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget", type=int, metavar="B", help="tree budget B (default: the server's, 64 on CUDA, "
                        "16 elsewhere)")
    budget.add_argument("--speculative-num-draft-tokens", type=int, metavar="N", help="as for the server: B = N - 1")
    p.add_argument("--mfd-kernels", choices=KERNEL_CHOICES, default="auto", help="as for the server: auto (Triton on "
                   "CUDA), triton or torch (every step on the torch path: the kernel sections are skipped)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the servers' and kernels' dtype (default: the target's on a GPU, float32 on a CPU)")
    p.add_argument("--prompts", type=Path, help="a JSON list of raw prompts (no chat template) instead of the "
                   "built-in ones (sent through the target's chat template)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per request (default 64)")
    p.add_argument("--out", type=Path, help="the report's folder (default: ./mfd-check-DATE)")
    p.add_argument("--only", nargs="+", choices=[s.name for s in SECTIONS], help="run these sections only")


def tokenized_prompts(target: Path, prompts_file: Path | None) -> tuple[tuple[int, ...], ...]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if prompts_file is not None:
        return tuple(tuple(tokenizer(p)["input_ids"]) for p in json.loads(prompts_file.read_text()))
    if tokenizer.chat_template:
        return tuple(tuple(tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                                         add_generation_prompt=True, return_dict=False))
                     for p in DEFAULT_PROMPTS)
    return tuple(tuple(tokenizer(p)["input_ids"]) for p in DEFAULT_PROMPTS)


def served_dtype(choice: str, cuda: bool, target_cfg: dict) -> str:
    if choice != "auto":
        return choice
    if not cuda:
        return "float32"  # CPU servers: float32, where MFD's output equals plain decoding token for token
    found = str(target_cfg.get("torch_dtype") or target_cfg.get("dtype") or "bfloat16")
    return found if found in ("float32", "bfloat16", "float16") else "bfloat16"


def summary_details(name: str, rows: list[dict]) -> None:
    from .servers import print_server_rows

    if name == "env" and rows:
        v = rows[0].get("env", {})
        print("  " + ", ".join(f"{k} {v.get(k)}" for k in ("sglang", "mfd_sglang", "torch", "triton", "transformers",
                                                          "flashinfer", "cuda", "driver", "gpu") if k in v))
    elif name == "servers":
        print_server_rows(rows)
        for r in rows:
            if r.get("mean_accept") is not None and r["mean_accept"] <= 1.05:
                print(f"  NOTE {r['server']}: mean accept length {r['mean_accept']}: almost no draft token accepted "
                      "(does the drafter fit the target?); the tokens are exact, but few tree paths were checked")


def main(args: argparse.Namespace) -> int:
    """The check (module docstring); returns the exit status (0: everything passed)."""
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:  # read when Triton decorates a kernel: before any of ours is imported
        if any(name.startswith("mfd_sglang.kernels.") for name in sys.modules) and os.environ.get(
                "TRITON_INTERPRET") != "1":
            raise RuntimeError("the Triton kernels were imported before TRITON_INTERPRET=1 was set; run the check "
                               "with TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    from mfd_sglang.backend import resolve_backend
    from mfd_sglang.checkpoint import check_fits_target, load_drafter, target_text_config
    from mfd_sglang.serving.launch.options import MAX_BUDGET, default_num_draft_tokens

    from .servers import ServerLogs

    device = "cuda" if cuda else "cpu"
    ckpt = load_drafter(args.drafter)
    check_fits_target(ckpt, args.target)  # a CheckpointError names the field (the CLI prints it)
    target_cfg = target_text_config(args.target)
    tokens = (args.speculative_num_draft_tokens if args.speculative_num_draft_tokens is not None
              else args.budget + 1 if args.budget is not None else default_num_draft_tokens(device))
    budget = tokens - 1  # without a flag, the server's default
    if not 1 <= budget <= MAX_BUDGET:
        print(f"error: --budget must be in 1..{MAX_BUDGET} (--speculative-num-draft-tokens in 2..{MAX_BUDGET + 1}), "
              f"got B = {budget}", file=sys.stderr)
        return 2
    backend = resolve_backend(args.mfd_kernels, device)
    date = dt.date.today().isoformat()
    out = (args.out or Path(f"mfd-check-{date}")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "rows.jsonl").unlink(missing_ok=True)
    sections = [s for s in SECTIONS if not args.only or s.name in args.only]
    dtype = served_dtype(args.dtype, cuda, target_cfg)
    shapes = pair_shapes(ckpt.config, target_cfg, ckpt.weights["fc.weight"].shape[1])
    report = {"date": date, "device": device, "command": "python -m mfd_sglang " + " ".join(args.argv),
              "target": str(args.target.resolve()), "drafter": str(args.drafter.resolve()),
              "budget": budget, "kernels": {"flag": args.mfd_kernels, "round": backend}, "dtype": dtype,
              "pair": shapes, "sections": {}}
    workdir = Path(tempfile.mkdtemp(prefix="mfd-check-"))
    check = SelfCheck(device, math.inf, out, None, workdir, report,  # no deadline: every section runs
                      ServerLogs(out / "server-logs.txt"), target=args.target.resolve(),
                      drafter=args.drafter.resolve(), budget=budget,
                      kernels=args.mfd_kernels, backend=backend, dtype=dtype,
                      prompts=tokenized_prompts(args.target, args.prompts), max_new_tokens=args.max_new_tokens,
                      shapes=shapes)
    writer = Writer(out, report, sections)
    try:
        run_sections(check, sections, writer, tag="check")
    finally:
        check.logs.write()
        writer.save()
        shutil.rmtree(workdir, ignore_errors=True)
    gpu = report["sections"].get("env", {}).get("rows", [{}])[0].get("env", {}).get("gpu", device)
    print_summary(report, f"MFD self-check, {date}, {gpu}, B = {budget}, --mfd-kernels {args.mfd_kernels} "
                          f"(round: {backend}), {dtype}", summary_details)
    print(f"\nwrote {out / 'report.json'} (send it with {out / 'server-logs.txt'})")
    return 0 if report["passed"] else 1
