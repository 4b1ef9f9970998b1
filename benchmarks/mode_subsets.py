"""Fewer modes per request (issue 43 item 4): how much acceptance does a request keep when it drafts only the
K' modes its gate weighs most? On the multimodal universe's drafters (a `make-multimodal` OUTDIR whose MFD
drafter has a mode gate), at every cell of its evaluation, with the reference engine:

  ddtree          the single-mode drafter's tree (the baseline MFD must not fall below);
  K               every mode (what MFD drafts today);
  K'=k gate-first the k modes of highest weight under the gate on the root-only block's anchors, chosen
                  before the draft (`MFDDrafter.gate_modes`: what a server can do, since the draft is what
                  it wants to save);
  K'=k oracle     the k modes of highest weight under the gate on the full draft's anchors (the draft of all
                  K modes is needed to know them, so nothing is saved: the bound of any gate-first choice
                  with this gate).

Draft cost is reported as drafted slots per round relative to K (the forward's tokens: K' blocks, plus the
root-only pre-pass's K slots), not as time: on a GPU at large batches the draft's cost grows with its slots.

    python benchmarks/mode_subsets.py runs/multimodal --out benchmarks/results/mode-subsets-multimodal.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

from mfd_sglang.drafter import ModeSubset
from mfd_sglang.hf import SpeculativeGenerator
from mfd_sglang.lab import multimodal as mm


class FullBlockGateGenerator(SpeculativeGenerator):
    """The reference engine keeping each request's `keep` modes of highest gate weight on the full K-mode
    draft's own anchors (the oracle of a gate-first choice: nothing of the draft is saved)."""

    def __init__(self, *args, keep: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.keep = keep

    @torch.inference_mode()
    def draft_blocks(self, roots, lengths, context, *, single_mode=False):
        _, log_prior = self.drafter.block_hidden(roots, lengths, context, self.embed_weight)
        return self.drafter.block_logprobs(roots, lengths, context, self.embed_weight, self.lm_head_weight,
                                           modes=ModeSubset.best(log_prior, self.keep))


def engines_of(run: mm.Run) -> tuple[dict, dict]:
    """({name: budget -> engine}, {name: drafted slots per round relative to K})."""
    target, mfd, single = run.target, run.mfd, run.single
    k, block = mfd.cfg.num_modes, mfd.cfg.block_size
    engines = {"ddtree": lambda b: SpeculativeGenerator(target, single, budget=b, single_mode=True),
               "K": lambda b: SpeculativeGenerator(target, mfd, budget=b)}
    slots = {"ddtree": 1 / k, "K": 1.0}
    for keep in sorted({k // 2, 1} - {k}, reverse=True):
        engines[f"K'={keep} gate-first"] = lambda b, keep=keep: SpeculativeGenerator(target, mfd, budget=b,
                                                                                     num_modes=keep)
        engines[f"K'={keep} oracle"] = lambda b, keep=keep: FullBlockGateGenerator(target, mfd, budget=b, keep=keep)
        slots[f"K'={keep} gate-first"] = (keep * block + k) / (k * block)
        slots[f"K'={keep} oracle"] = 1.0
    return engines, slots


def markdown(results: dict, slots: dict) -> str:
    def cell(engine):
        def text(block, b):
            tau, ddtree = block[engine][str(b)]["tau"], block["ddtree"][str(b)]["tau"]
            ratio = engine != "ddtree" and tau is not None and ddtree
            return mm.format_tau(tau) + (f" ({tau / ddtree:.3f}x)" if ratio else "")
        return text

    rows = [(f"{engine} ({share:.2f})", cell(engine)) for engine, share in slots.items()]
    return mm.cell_table(results, "method (draft slots / K's)", rows) + \
        "\n\ntau per round; in brackets: over DDTree's at the same budget."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outdir", type=Path, help="a make-multimodal OUTDIR (its MFD drafter has a mode gate)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here (and the table as .md next to it)")
    args = parser.parse_args()
    run = mm.load_run(args.outdir)
    if run.mfd.mode_prior is None:
        raise SystemExit(f"{args.outdir}/drafters/mfd has no mode gate: there is nothing to choose modes by")
    engines, slots = engines_of(run)
    results = mm.evaluate_engines(run, engines, log=lambda *a: print(*a, file=sys.stderr))
    table = markdown(results, slots)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/mode_subsets.py " + " ".join(sys.argv[1:])
        args.out.write_text(json.dumps({"date": dt.date.today().isoformat(), "command": command,
                                        "draft_slots_over_k": slots, "results": results}, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
