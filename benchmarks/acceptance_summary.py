"""Acceptance over prompt sets, from the JSONs of `python -m mfd_sglang eval` written one per drafter
pair, temperature and set (`scripts/train_smollm2_drafters.sh` names them PAIR-T<T>-SET.json): per pair,
T and budget, the mean over sets of tau (chain, DDTree, MFD), MFD / DDTree, DDTree's chimera share and
MFD's effective modes, as a markdown table; `--plot` draws tau and the chimera share against the budget.

    python benchmarks/acceptance_summary.py runs/smollm2-v2/eval/*.json --markdown summary.md --plot summary.png

A pair's row says which sets and how many prompts it covers (a group still being evaluated has fewer).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pair_name(path: Path) -> str:
    """PAIR of PAIR-T<T>-SET.json (the whole stem when it does not follow that pattern)."""
    return path.stem.rsplit("-T", 1)[0]


def group_results(paths: list[Path]) -> dict:
    """{(pair, T): {"budgets": [...], "sets": {set: per-set results}}}; budgets must agree within a group."""
    groups: dict = {}
    for path in paths:
        payload = json.loads(path.read_text())
        temperature = float(payload.get("temperature", 0.0))  # eval was greedy before it had --temperature
        group = groups.setdefault((pair_name(path), temperature),
                                  {"budgets": payload["budgets"], "sets": {}})
        if group["budgets"] != payload["budgets"]:
            raise ValueError(f"{path}: budgets {payload['budgets']} differ from {group['budgets']} of the same pair and T")
        group["sets"].update(payload["results"])
    return groups


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize(group: dict) -> dict:
    """Means over the group's sets: chain tau, and per budget DDTree / MFD tau, their ratio, chimera
    share and effective modes."""
    sets = list(group["sets"].values())
    per_budget = {}
    for b in group["budgets"]:
        ddtree, mfd = (mean([s[m][str(b)]["tau"] for s in sets]) for m in ("ddtree", "mfd"))
        per_budget[b] = {"ddtree": ddtree, "mfd": mfd, "mfd_over_ddtree": mfd / ddtree,
                         "chimera_share": mean([s["ddtree"][str(b)]["chimera_share"] for s in sets]),
                         "effective_modes": mean([s["mfd"][str(b)]["effective_modes"] for s in sets])}
    return {"sets": list(group["sets"]), "prompts": sum(s["prompts"] for s in sets),
            "chain": mean([next(iter(s["chain"].values()))["tau"] for s in sets]), "budgets": per_budget}


def markdown(groups: dict) -> str:
    budgets = sorted({b for g in groups.values() for b in g["budgets"]})
    lines = ["| pair | T | sets (prompts) | row | " + " | ".join(f"B={b}" for b in budgets) + " |",
             "|---|---|---|---|" + "---|" * len(budgets)]
    rows = (("ddtree", "DDTree tau", "{:.3f}"), ("mfd", "MFD tau", "{:.3f}"),
            ("mfd_over_ddtree", "MFD / DDTree", "{:.3f}x"), ("chimera_share", "DDTree chimera share", "{:.3f}"),
            ("effective_modes", "MFD effective modes", "{:.2f}"))
    for (pair, temperature), group in sorted(groups.items()):
        summary = summarize(group)
        head = f"| {pair} | {temperature:g} | {','.join(summary['sets'])} ({summary['prompts']}) |"
        lines.append(f"{head} chain tau | {summary['chain']:.3f} (any budget) |" + " |" * (len(budgets) - 1))
        for key, label, fmt in rows:
            cells = [summary["budgets"].get(b, {}).get(key) for b in budgets]
            lines.append(f"| | | | {label} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")
    return "\n".join(lines)


def plot(groups: dict, path: Path) -> None:
    """One column per temperature: tau of DDTree (dashed) and MFD (solid) per pair above, DDTree's
    chimera share below, against the budget (means over sets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({t for _, t in groups})
    fig, axes = plt.subplots(2, len(temperatures), figsize=(5 * len(temperatures), 6.5), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    pairs = sorted({pair for pair, _ in groups})
    for column, temperature in enumerate(temperatures):
        tau_ax, share_ax = axes[0, column], axes[1, column]
        for pair in pairs:
            if (pair, temperature) not in groups:
                continue
            summary = summarize(groups[pair, temperature])
            budgets = sorted(summary["budgets"])
            color = colors[pairs.index(pair) % len(colors)]
            row = [summary["budgets"][b] for b in budgets]
            tau_ax.plot(budgets, [r["ddtree"] for r in row], "--", marker="o", color=color, label=f"{pair}: DDTree")
            tau_ax.plot(budgets, [r["mfd"] for r in row], "-", marker="o", color=color, label=f"{pair}: MFD")
            share_ax.plot(budgets, [r["chimera_share"] for r in row], "--", marker="o", color=color, label=pair)
        tau_ax.set_title(f"T = {temperature:g}, mean over sets")
        tau_ax.set_ylabel("tau (tokens per round)")
        share_ax.set_ylabel("DDTree chimera share")
        share_ax.set_xlabel("tree budget B")
        for ax in (tau_ax, share_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.grid(alpha=0.3)
        tau_ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path, help="eval JSONs (PAIR-T<T>-SET.json)")
    parser.add_argument("--markdown", type=Path, help="also write the table here")
    parser.add_argument("--plot", type=Path, help="also write the tau and chimera-share plot here (PNG)")
    args = parser.parse_args()
    groups = group_results(args.files)
    table = markdown(groups)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if args.plot:
        plot(groups, args.plot)


if __name__ == "__main__":
    main()
