"""How often the fused vocabulary kernel's running threshold skips a tile's merge on real logits
(`kernels/draft_vocab.py`: a tile whose keys beat no row's current B-th key is not merged), forced on
at every plan here (serving turns it on only where this measured it to pay).

Random logits never skip (every tile brings new top-B entries to some row); this measures real ones.
The hidden states are SmolLM2-135M-Instruct's own final-normed states over real prompts (HumanEval code,
MT-Bench chat), each prompt's last 16 positions as one request's block, scored against its tied
lm_head (vocabulary 49,152): the target's next-token logits, which a drafter is trained to match. The
kernel's own counter (`skips=`) reports the (program, tile) merges skipped, under two launch plans of the
Qwen3-4B drafter's serving shapes (tile 128), at B = 64 and 16:
  bs 1:  16 rows a program, ~10 tiles a split (128 splits of Qwen3's 1,187 tiles);
  bs 32: 64 rows a program, ~132 tiles a split (9 splits).
On CPU it runs under the Triton interpreter (minutes); needs `prepare-target`'s SmolLM2 and the prompt sets:

    TRITON_INTERPRET=1 python benchmarks/vocab_threshold.py --out benchmarks/results/vocab-threshold-DATE
"""

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

BLOCK = 16  # rows of one request's block
PLANS = {"bs 1": (16, 10), "bs 32": (64, 132)}  # name -> (rows a program, tiles a split aimed at)
TILE = 128


def hidden_blocks(model, tokenizer, texts: list[str]) -> torch.Tensor:
    """[len(texts) * BLOCK, H]: each text's final-normed hidden states at its last BLOCK positions."""
    blocks = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        if ids.shape[1] < BLOCK:
            raise ValueError(f"a prompt of {ids.shape[1]} tokens is shorter than a block ({BLOCK})")
        with torch.no_grad():
            blocks.append(model.model(ids).last_hidden_state[0, -BLOCK:])
    return torch.cat(blocks)


def skipped_share(hidden: torch.Tensor, weight: torch.Tensor, count: int, rows: int, tiles_per_split: int) -> dict:
    from mfd_sglang.kernels.draft_vocab import vocab_top_logits_triton

    skips = torch.zeros(2, dtype=torch.int32, device=hidden.device)
    tiles = -(-weight.shape[0] // TILE)
    splits = max(1, tiles // tiles_per_split)
    vocab_top_logits_triton(hidden, weight, count, tile_v=TILE, rows_per_block=rows, max_splits=splits,
                            threshold=True, skips=skips)
    skipped, ran = skips.tolist()
    return {"splits": splits, "tiles_per_split": -(-tiles // splits), "skipped": skipped, "tiles": ran,
            "share": skipped / ran}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per set (code, chat)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 16], help="B: the top-B the kernel keeps")
    parser.add_argument("--out", type=Path, help="write PREFIX.json and PREFIX.md")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mfd_sglang.lab.prompts import load_prompts
    from mfd_sglang.lab.smollm2 import prepare_target

    target = prepare_target(progress=False).path
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight = model.get_output_embeddings().weight.detach().to(device)
    rows = []
    for set_name in ("code", "chat"):
        texts = [p.text for p in load_prompts(set_name, limit=args.prompts)]
        hidden = hidden_blocks(model, tokenizer, texts).to(device)
        for (plan, (per_program, tiles_per_split)), budget in itertools.product(PLANS.items(), args.budgets):
            start = time.perf_counter()
            row = {"set": set_name, "plan": plan, "budget": budget, "rows_per_program": per_program,
                   "requests": len(texts), **skipped_share(hidden, weight, budget, per_program, tiles_per_split)}
            print(f"{set_name:5s} {plan:6s} B {budget:3d} {row['skipped']:5d} of {row['tiles']:5d} merges skipped "
                  f"({100 * row['share']:.1f} %)  [{time.perf_counter() - start:.0f} s]", flush=True)
            rows.append(row)
    if args.out:
        report = {"target": "SmolLM2-135M-Instruct", "vocab": weight.shape[0], "tile": TILE, "block": BLOCK,
                  "rows": rows}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
        lines = ["# Running threshold of the vocabulary kernel on real logits", "",
                 "SmolLM2-135M-Instruct's final-normed hidden states, blocks of 16 positions, against its "
                 f"lm_head (V = {weight.shape[0]}, tile {TILE}). `{' '.join(['python', *sys.argv])}`",
                 "", "| set | plan | B | rows a program | splits x tiles | merges skipped |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['set']} | {r['plan']} | {r['budget']} | {r['rows_per_program']} | {r['splits']} x "
                  f"{r['tiles_per_split']} | "
                  f"{r['skipped']} of {r['tiles']} ({100 * r['share']:.1f} %) |" for r in rows]
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
