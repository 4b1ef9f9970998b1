"""`make-multimodal`: its settings, the run (target, drafters, diagnostics, evaluation), its report (bounds,
expectations, goals, the table and the plot) and its results files."""

from __future__ import annotations

import datetime as dt
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ...checkpoint import load_drafter
from ...drafter import MFDDrafter
from ...hf import SpeculativeGenerator, load_target
from ..train import TrainConfig, train
from .evaluation import (
    drafter_fork_knowledge,
    fork_blocks,
    gate_at_forks,
    known_answer_at_fork,
    mode_assignment,
    run_cell,
    target_fit,
)
from .target import (
    SEQ_LEN,
    TARGET_LAYERS,
    build_tokenizer,
    corpus,
    sample_target,
    train_universe_target,
    universe_for,
    write_seed_drafter,
    write_training_data,
)
from .universe import (
    BLOCK_SIZE,
    CUE_DISTANCE,
    CYCLE,
    DRAFTER_WINDOW,
    FUTURE_PROBS,
    FUTURES,
    HEADERS,
    Universe,
)


BUDGETS = (4, 8, 16, 32, 64)
TEMPERATURES = (0.0, 1.0)
SETS = HEADERS  # prompt sets: "random" and "cued" sequences
KINDS = ("generation", "fork")  # whole generations; single rounds rooted at a marker


@dataclass
class Settings:
    """One make-multimodal run (the subcommand's options; lr: the fine-tuning's, base_lr: the base's)."""

    seed: int = 0
    target_steps: int = 300
    target_sequences: int = 1024
    data_sequences: int = 512
    base_steps: int = 300  # the base single-mode drafter, from random weights
    steps: int = 300  # each drafter's fine-tuning from the base: single-mode and MFD alike
    gate_steps: int | None = None  # then the MFD gate alone, body frozen (`TrainConfig.gate_steps`); None: steps
    num_modes: int = 4
    base_lr: float = 3e-3
    lr: float = 1e-3
    batch_size: int = 8
    anchors: int = 32
    budgets: tuple = BUDGETS
    temperatures: tuple = TEMPERATURES
    prompts: int = 24  # per set, whole generations
    fork_prompts: int = 64  # per set, rounds rooted at a marker
    max_new_tokens: int = 64
    probe_sequences: int = 64  # teacher-forced diagnostics (target fit, drafter knowledge, modes)


def evaluation_prompts(universe: Universe, rng: random.Random, settings: Settings) -> dict:
    """{kind: {set: prompts}}: generation prompts end anywhere after two cycles; fork prompts end just
    before a marker with a marker CUE_DISTANCE before it (in a cued sequence: its cue), so the first
    round's root is that marker and its drafted block is exactly the future that follows."""
    longest = SEQ_LEN - settings.max_new_tokens
    if longest <= 2 * CYCLE:
        raise ValueError(f"--max-new-tokens {settings.max_new_tokens} leaves no room for a prompt in {SEQ_LEN} tokens")
    out: dict = {"generation": {}, "fork": {}}
    for name in SETS:
        out["generation"][name] = [universe.sample(rng, name, SEQ_LEN)[: rng.randint(2 * CYCLE + 1, longest)]
                                   for _ in range(settings.prompts)]
        markers = [m for m in universe.marker_positions(SEQ_LEN) if CUE_DISTANCE < m < SEQ_LEN - BLOCK_SIZE - 2]
        out["fork"][name] = [universe.sample(rng, name, SEQ_LEN)[: rng.choice(markers)]
                             for _ in range(settings.fork_prompts)]
    return out


def evaluate_universe(target, single, mfd, universe: Universe, prompts: dict, settings: Settings, log=print) -> dict:
    """{T: {set: {kind: {"chain": summary, "ddtree": {B: summary}, "mfd": {B: summary}, ["mfd_uniform":
    {B: summary}], "identical_outputs": bool}}}}: every method on the same prompts with the same sampling
    seeds; "mfd" weighs the modes by the MFD drafter's gate, "mfd_uniform" (when it has one) is the same
    drafter's unweighted tree."""
    trees = {"mfd": mfd} if mfd.mode_prior is None else {"mfd": mfd, "mfd_uniform": mfd.without_mode_gate()}
    results: dict = {}
    for temperature in settings.temperatures:
        for name in SETS:
            for kind in KINDS:
                rows = prompts[kind][name]
                max_new = settings.max_new_tokens if kind == "generation" else BLOCK_SIZE + 1
                runs = [("chain", None, SpeculativeGenerator(target, single, tree="chain", single_mode=True))]
                for budget in settings.budgets:
                    runs.append(("ddtree", budget, SpeculativeGenerator(target, single, budget=budget, single_mode=True)))
                    runs += [(method, budget, SpeculativeGenerator(target, drafter, budget=budget))
                             for method, drafter in trees.items()]
                block: dict = {"ddtree": {}, **{method: {} for method in trees}}
                outputs = []
                for method, budget, engine in runs:
                    cell, out = run_cell(engine, universe, rows, max_new, temperature, settings.seed, budget,
                                         first_round_only=kind == "fork", product_tree=method in ("chain", "ddtree"))
                    summary = cell.summary()
                    if method == "chain":
                        block["chain"] = summary
                    else:
                        block[method][str(budget)] = summary
                    outputs.append(out)
                # Verification is lossless and a sample is a function of (seed, position): every method
                # must emit the very same tokens.
                block["identical_outputs"] = all(o == outputs[0] for o in outputs)
                results.setdefault(str(temperature), {}).setdefault(name, {})[kind] = block
                b16 = str(16 if 16 in settings.budgets else settings.budgets[0])
                taus = [block["chain"]["tau"], block["ddtree"][b16]["tau"], block["mfd"][b16]["tau"],
                        block["mfd"][b16]["ceiling_tau"]]
                log(f"[make-multimodal] T={temperature:g} {name:<6} {kind:<10} tau chain / ddtree / mfd / ceiling "
                    f"(B={b16}): " + " / ".join("-" if t is None else f"{t:.2f}" for t in taus))
    return results


@dataclass
class Run:
    """A make-multimodal OUTDIR read back: its settings, universe, evaluation prompts (the same draws as its
    report's) and models."""

    settings: Settings
    universe: Universe
    prompts: dict  # {kind: {set: prompts}} (`evaluation_prompts`)
    target: object
    single: MFDDrafter
    mfd: MFDDrafter


def format_tau(tau: float | None) -> str:
    """A cell's tau, "-" for a cell without rounds (every row left the universe)."""
    return "-" if tau is None else f"{tau:.2f}"


def cell_table(results: dict, what: str, rows: list) -> str:
    """A Markdown table of `evaluate_engines` results: per (T, set, kind of round), one line per row
    (label, text(block, budget)) over the results' budgets; `what` heads the label column."""
    blocks = [(t, name, kind, block) for t, per_t in results.items() for name, per_set in per_t.items()
              for kind, block in per_set.items()]
    budgets = sorted({int(b) for *_, block in blocks for per_engine in block.values() if isinstance(per_engine, dict)
                      for b in per_engine})
    lines = [f"| T | set | rounds | {what} | " + " | ".join(f"B={b}" for b in budgets) + " |",
             "|---|---|---|---|" + "---|" * len(budgets)]
    for t, name, kind, block in blocks:
        for i, (label, text) in enumerate(rows):
            head = f"| {float(t):g} | {name} | {kind} |" if i == 0 else "| | | |"
            lines.append(f"{head} {label} | " + " | ".join(text(block, b) for b in budgets) + " |")
    return "\n".join(lines)


def load_run(outdir) -> Run:
    outdir = Path(outdir)
    report = json.loads((outdir / "report.json").read_text())
    settings = Settings(**{k: tuple(v) if isinstance(v, list) else v for k, v in report["settings"].items()})
    universe = universe_for(build_tokenizer())
    probe_rng = random.Random(settings.seed + 1)  # make_multimodal's draws: the probes, then the prompts
    corpus(universe, probe_rng, settings.probe_sequences)
    prompts = evaluation_prompts(universe, probe_rng, settings)
    drafters = {name: MFDDrafter.from_checkpoint(load_drafter(outdir / "drafters" / name)) for name in ("single", "mfd")}
    return Run(settings, universe, prompts, load_target(outdir / "target"), drafters["single"], drafters["mfd"])


def evaluate_engines(run: Run, engines: dict, log=print) -> dict:
    """{T: {set: {kind: {name: {B: summary}, "identical_outputs": bool}}}} of engines {name: budget ->
    engine} at every cell of the run's evaluation (its temperatures, sets, kinds of round and budgets), each
    run as `evaluate_universe` runs it; identical_outputs: every engine emitted the same tokens (lossless)."""
    settings, results = run.settings, {}
    for temperature in settings.temperatures:
        for name in SETS:
            for kind in KINDS:
                rows = run.prompts[kind][name]
                max_new = settings.max_new_tokens if kind == "generation" else BLOCK_SIZE + 1
                block: dict = {engine: {} for engine in engines}
                outputs = []
                for budget in settings.budgets:
                    for engine, make in engines.items():
                        cell, out = run_cell(make(budget), run.universe, rows, max_new, temperature, settings.seed,
                                             budget, first_round_only=kind == "fork", product_tree=False)
                        block[engine][str(budget)] = cell.summary()
                        outputs.append(out)
                block["identical_outputs"] = all(o == outputs[0] for o in outputs)
                results.setdefault(str(temperature), {}).setdefault(name, {})[kind] = block
                log(f"T={temperature:g} {name:<6} {kind:<10} tau {' / '.join(engines)} by B: " + "  ".join(
                    "/".join(format_tau(block[e][str(b)]["tau"]) for e in engines) for b in settings.budgets))
    return results


def make_multimodal(outdir, settings: Settings | None = None, *, progress: bool = True, log=print) -> dict:
    """Build the universe's target and drafters in OUTDIR, evaluate them, write OUTDIR/report.json,
    OUTDIR/report.md and OUTDIR/report.png (`plot_report`); returns the report. OUTDIR must be new or empty (nothing is overwritten)."""
    settings = settings or Settings()
    outdir = Path(outdir)
    if outdir.exists() and any(outdir.iterdir()):
        raise FileExistsError(f"{outdir} is not empty: give a new OUTDIR")
    outdir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    seconds: dict = {}

    def stage(name: str, t0: float) -> None:
        seconds[name] = round(time.perf_counter() - t0, 1)

    rng = random.Random(settings.seed)
    torch.manual_seed(settings.seed)
    generator = torch.Generator().manual_seed(settings.seed)
    tokenizer = build_tokenizer()
    universe = universe_for(tokenizer)

    t0 = time.perf_counter()
    log(f"[make-multimodal] target: {TARGET_LAYERS}-layer Qwen3, {settings.target_steps} steps on "
        f"{settings.target_sequences} universe samples")
    model = train_universe_target(tokenizer, universe, rng, generator, steps=settings.target_steps,
                                  sequences=settings.target_sequences, log=log)
    model.save_pretrained(outdir / "target", safe_serialization=True)
    tokenizer.save_pretrained(outdir / "target")
    target = load_target(outdir / "target")
    stage("target", t0)

    t0 = time.perf_counter()
    log(f"[make-multimodal] drafter data: {settings.data_sequences} target samples at T = 1")
    headers = [[universe.ids[SETS[i % 2]]] for i in range(settings.data_sequences)]
    data = sample_target(target, headers, SEQ_LEN, generator)
    write_training_data(outdir / "data.jsonl", data)
    off = sum(universe.first_off_universe(seq) is not None for seq in data)
    write_seed_drafter(outdir / "drafters" / "seed", target, tokenizer, generator)
    stage("data", t0)

    def run_train(name: str, init: str, num_modes: int, steps: int, lr: float, gate_steps: int = 0) -> Path:
        t = time.perf_counter()
        log(f"[make-multimodal] drafter {name}: K = {num_modes}, {steps} steps from {init}")
        out = outdir / "drafters" / name
        train(TrainConfig(target=str(outdir / "target"), out=str(out), data=str(outdir / "data.jsonl"),
                          num_modes=num_modes, init_from=str(outdir / "drafters" / init), steps=steps,
                          batch_size=settings.batch_size, anchors=settings.anchors, lr=lr, seed=settings.seed,
                          save_every=steps, mode_gate=num_modes > 1, gate_steps=gate_steps), progress=progress, log=log)
        stage(f"drafter_{name}", t)
        return out

    run_train("base", "seed", 1, settings.base_steps, settings.base_lr)
    single_dir = run_train("single", "base", 1, settings.steps, settings.lr)
    mfd_dir = run_train("mfd", "base", settings.num_modes, settings.steps, settings.lr,
                        settings.steps if settings.gate_steps is None else settings.gate_steps)
    single = MFDDrafter.from_checkpoint(load_drafter(single_dir))
    mfd = MFDDrafter.from_checkpoint(load_drafter(mfd_dir))

    t0 = time.perf_counter()
    log("[make-multimodal] diagnostics (teacher forced on fresh universe samples)")
    probe_rng = random.Random(settings.seed + 1)
    probes = corpus(universe, probe_rng, settings.probe_sequences)
    mfd_blocks = fork_blocks(target, mfd, universe, probes, single_mode=False)
    diagnostics = {
        "target_fit": target_fit(target, universe, probes),
        "target_samples_off_universe": off / max(len(data), 1),
        "single_drafter_at_forks": drafter_fork_knowledge(universe, fork_blocks(target, single, universe, probes,
                                                                                single_mode=True)),
        "mfd_mode_assignment": mode_assignment(mfd, universe, mfd_blocks),
        "mfd_gate_at_forks": gate_at_forks(mfd, universe, mfd_blocks),
        "known_answer_at_random_fork": known_answer_at_fork(universe, settings.budgets),
    }
    stage("diagnostics", t0)

    t0 = time.perf_counter()
    log(f"[make-multimodal] evaluation: budgets {list(settings.budgets)}, T {list(settings.temperatures)}")
    prompts = evaluation_prompts(universe, probe_rng, settings)
    results = evaluate_universe(target, single, mfd, universe, prompts, settings, log=log)
    stage("evaluation", t0)


    seconds["total"] = round(time.perf_counter() - start, 1)
    report = {
        "settings": {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(settings).items()},
        "universe": {"futures": [list(f) for f in FUTURES], "future_probs": list(FUTURE_PROBS), "cycle": CYCLE,
                     "cue_distance": CUE_DISTANCE, "block_size": BLOCK_SIZE, "drafter_window": DRAFTER_WINDOW,
                     "seq_len": SEQ_LEN},
        "results": results,
        "diagnostics": diagnostics,
        "bound": bound_summary(results),
        "expectation": expectation(results, settings),
        "goals": goals(results),
        "seconds": seconds,
    }

    (outdir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (outdir / "report.md").write_text(format_report(report) + "\n")
    plot_report(report, outdir / "report.png")
    log(f"[make-multimodal] wrote {outdir} in {seconds['total']:.0f} s")
    return report


TREE_METHODS = ("ddtree", "mfd", "mfd_uniform")


def _cells(results: dict):
    """(T, set, kind, method, budget, summary) for every tree cell."""
    for t, per_t in results.items():
        for name, per_set in per_t.items():
            for kind, block in per_set.items():
                for method in (m for m in TREE_METHODS if m in block):
                    for budget, summary in block[method].items():
                        yield t, name, kind, method, budget, summary


def bound_summary(results: dict) -> dict:
    """The paper's bound over every DDTree built in the evaluation: a product tree that holds two
    futures differing in m positions holds >= 2^(m-1) - 1 of their splices."""
    checks = sum(s["bound_checks"] for *_, m, _, s in _cells(results) if m == "ddtree")
    violations = sum(s["bound_violations"] for *_, m, _, s in _cells(results) if m == "ddtree")
    return {"checks": checks, "violations": violations}


EXPECTED_RATIO, EXPECTED_CHIMERAS, EXPECTED_BUDGET = 1.3, 0.25, 16


def expectation(results: dict, settings: Settings) -> dict:
    """Issue 16's expectation at T = 1, B = 16: MFD tau >= 1.3 x DDTree's, DDTree chimera share >= 25%."""
    out = {}
    per_t = results.get("1.0")
    if per_t is None or EXPECTED_BUDGET not in settings.budgets:
        return out
    b = str(EXPECTED_BUDGET)
    for name, per_set in per_t.items():
        for kind, block in per_set.items():
            ratio = _ratio(block["mfd"][b]["tau"], block["ddtree"][b]["tau"])
            share = block["ddtree"][b]["chimera_share"]
            out[f"{name}/{kind}"] = {"mfd_over_ddtree": ratio, "ddtree_chimera_share": share,
                                     "ceiling_over_ddtree": _ratio(block["mfd"][b]["ceiling_tau"], block["ddtree"][b]["tau"]),
                                     "met": ratio is not None and share is not None
                                     and ratio >= EXPECTED_RATIO and share >= EXPECTED_CHIMERAS}
    return out


GOAL_CEILING_SHARE, GOAL_CEILING_FROM = 0.95, 16


def goals(results: dict) -> dict:
    """Issue 43's goals, cell by cell: MFD / DDTree tau in every cell (>= 1), and MFD / the best tree
    (and / the cue-blind best tree) on whole generations from B = GOAL_CEILING_FROM (>= .95); the cells
    that miss each, and the same for the unweighted tree when there is one."""
    out: dict = {}
    for method in ("mfd", "mfd_uniform"):
        over_ddtree, over_ceiling = {}, {}
        for t, name, kind, m, budget, summary in _cells(results):
            if m != method:
                continue
            key = f"T={float(t):g}/{name}/{kind}/B={budget}"
            over_ddtree[key] = _ratio(summary["tau"], results[t][name][kind]["ddtree"][budget]["tau"])
            if kind == "generation" and int(budget) >= GOAL_CEILING_FROM:
                over_ceiling[key] = {"ceiling": _ratio(summary["tau"], summary["ceiling_tau"]),
                                     "blind_ceiling": _ratio(summary["tau"], summary["blind_ceiling_tau"])}
        if over_ddtree:
            out[method] = {
                "over_ddtree": over_ddtree,
                "below_ddtree": sorted(k for k, r in over_ddtree.items() if r is not None and r < 1.0),
                "over_ceiling": over_ceiling,
                "below_ceiling_goal": sorted(k for k, r in over_ceiling.items()
                                             if r["ceiling"] is not None and r["ceiling"] < GOAL_CEILING_SHARE)}
    return out


def format_report(report: dict) -> str:
    """The report as Markdown: one table per temperature, set and kind of round, then the diagnostics."""
    budgets = report["settings"]["budgets"]
    lines = []
    for t, per_t in report["results"].items():
        for name, per_set in per_t.items():
            for kind, block in per_set.items():
                what = ("whole generations" if kind == "generation"
                        else "fork rounds (root = a marker: the block is one whole future)")
                lines += ["", f"### T = {float(t):g}, {name} sequences, {what}", "",
                          "| | " + " | ".join(f"B={b}" for b in budgets) + " |",
                          "|---|" + "---|" * len(budgets)]

                def row(label: str, method: str, key: str, fmt: str = "{:.2f}") -> None:
                    cells = [block[method][str(b)][key] for b in budgets]
                    lines.append(f"| {label} | " + " | ".join("-" if c is None else fmt.format(c) for c in cells) + " |")

                def ratio_row(label: str, top: tuple, bottom: tuple) -> None:
                    ratios = [_ratio(block[top[0]][str(b)][top[1]], block[bottom[0]][str(b)][bottom[1]]) for b in budgets]
                    lines.append(f"| {label} | " + " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios) + " |")

                chain = block["chain"]["tau"]
                lines.append(f"| tau chain | {'-' if chain is None else f'{chain:.2f}'} (any budget) |" + " |" * (len(budgets) - 1))
                row("tau DDTree", "ddtree", "tau")
                row("tau MFD", "mfd", "tau")
                ratio_row("MFD / DDTree", ("mfd", "tau"), ("ddtree", "tau"))
                if "mfd_uniform" in block:
                    row("tau MFD unweighted (same drafter, no gate)", "mfd_uniform", "tau")
                    ratio_row("MFD unweighted / DDTree", ("mfd_uniform", "tau"), ("ddtree", "tau"))
                row("tau ceiling (best tree, same output)", "mfd", "ceiling_tau")
                ratio_row("ceiling / DDTree (no tree does better)", ("mfd", "ceiling_tau"), ("ddtree", "tau"))
                ratio_row("MFD / ceiling", ("mfd", "tau"), ("mfd", "ceiling_tau"))
                row("tau blind ceiling (best tree of the cue-blind law)", "mfd", "blind_ceiling_tau")
                ratio_row("MFD / blind ceiling", ("mfd", "tau"), ("mfd", "blind_ceiling_tau"))
                if float(t) > 0:
                    row("E[accepted] DDTree (exact)", "ddtree", "expected_accepted")
                    row("E[accepted] MFD (exact)", "mfd", "expected_accepted")
                    if "mfd_uniform" in block:
                        row("E[accepted] MFD unweighted (exact)", "mfd_uniform", "expected_accepted")
                    row("E[accepted] best tree (exact ceiling)", "mfd", "ceiling_expected_accepted")
                row("chimera share DDTree", "ddtree", "chimera_share", "{:.3f}")
                row("chimera share MFD", "mfd", "chimera_share", "{:.3f}")
                row("effective modes MFD", "mfd", "effective_modes")
                row("share of rounds whose block can branch (MFD)", "mfd", "multimodal_round_share")
                if kind == "generation":
                    row("share of rounds rooted at a marker, DDTree", "ddtree", "marker_root_share")
                    row("share of rounds rooted at a marker, MFD", "mfd", "marker_root_share")
                last = block["mfd"][str(budgets[-1])]
                lines.append(f"\nrounds (MFD, B={budgets[-1]}): {last['rounds']} (+ {last['off_universe_rounds']} after a "
                             f"target error, not counted); identical outputs across methods: {block['identical_outputs']}")
    d = report["diagnostics"]
    known = d["known_answer_at_random_fork"]
    lines += ["", "### Known answer at a random fork (closed form, no training): E[accepted draft tokens]", "",
              "| | " + " | ".join(f"B={b}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for key, label in (("product", "product tree of the exact marginals (ideal DDTree)"),
                       ("mixture", "mixture tree, one exact mode per future, unweighted (ideal MFD, no gate)"),
                       ("mixture_with_priors", "the same with a perfect gate, pi_j = P(F_j) (weighted MFD)"),
                       ("best", "best tree (ceiling)"), ("product_chimera_share", "chimera share, ideal DDTree")):
        lines.append(f"| {label} | " + " | ".join(f"{known[str(b)][key]:.2f}" for b in budgets) + " |")
    fit, know = d["target_fit"], d["single_drafter_at_forks"]
    lines += ["", "### Known answer vs what was learned", "",
              f"- target at random forks: P(F0..F3) = {_fmt(fit['random_fork_future_probs'])} "
              f"(known {_fmt(fit['known_future_probs'])})",
              f"- target at cued forks: P(cued future) = {fit['cued_future_prob']:.3f}, argmax right "
              f"{fit['cued_argmax_accuracy']:.3f}; deterministic tokens: P = {fit['deterministic_token_prob']:.3f}; "
              f"cue markers: P(cue0..cue3) = {_fmt(fit['cue_marker_probs'])}",
              f"- target samples (drafter data) that leave the universe: {d['target_samples_off_universe']:.3f}",
              f"- single-mode drafter at random forks: P(F0..F3 first token) = "
              f"{_fmt(know['random_fork_future_probs'])}; at cued forks P(cued future) = "
              f"{know['cued_fork_cued_future_prob']:.3f} (reads the cue: 1, blind: 0.25)",
              "- MFD mode -> future (share of fork blocks whose mode argmax chain follows it):"]
    for k, row in enumerate(d["mfd_mode_assignment"]):
        lines.append(f"  - mode {k}: " + ", ".join(f"{n} {v:.2f}" for n, v in row.items()))
    for kind, gate in d.get("mfd_gate_at_forks", {}).items():
        lines.append(f"- MFD's mode gate at {kind} forks ({gate['blocks']} blocks): weight on the modes of F0..F3 "
                     f"{_fmt(gate['weight_on_future'])}"
                     + (f" (known {_fmt(list(FUTURE_PROBS))})" if kind == "random" else " (blind: .25 each)")
                     + f"; its top mode follows the future that came in {gate['top_mode_follows_it']:.2f} of them")
    b = report["bound"]
    lines += [f"- bound 2^(m-1) - 1 on DDTree trees holding two futures: {b['checks']} checks, "
              f"{b['violations']} violations"]
    for key, e in report["expectation"].items():
        ratio, share = e["mfd_over_ddtree"], e["ddtree_chimera_share"]
        lines.append(f"- expectation at T = 1, B = {EXPECTED_BUDGET} ({key}): MFD / DDTree "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} (>= {EXPECTED_RATIO}), DDTree chimera share "
                     f"{'-' if share is None else f'{share:.3f}'} (>= {EXPECTED_CHIMERAS}): {'met' if e['met'] else 'NOT met'}"
                     + ("" if e["ceiling_over_ddtree"] is None
                        else f"; the best tree itself reaches {e['ceiling_over_ddtree']:.2f}x DDTree"))
    for method, goal in report.get("goals", {}).items():
        label = "MFD" if method == "mfd" else "MFD unweighted"
        lines.append(f"- goal, {label} >= DDTree in all {len(goal['over_ddtree'])} cells: "
                     + ("met" if not goal["below_ddtree"] else
                        f"{len(goal['below_ddtree'])} below: " + ", ".join(
                            f"{k} {goal['over_ddtree'][k]:.2f}x" for k in goal["below_ddtree"])))
        lines.append(f"- goal, {label} >= {GOAL_CEILING_SHARE} x the best tree on whole generations from "
                     f"B = {GOAL_CEILING_FROM}: " + ("met" if not goal["below_ceiling_goal"] else ", ".join(
                         f"{k} {goal['over_ceiling'][k]['ceiling']:.2f} (blind ceiling: "
                         f"{_fmt_ratio(goal['over_ceiling'][k]['blind_ceiling'])})" for k in goal["below_ceiling_goal"])))
    lines.append("- wall time: " + ", ".join(f"{k} {v:.0f} s" for k, v in report["seconds"].items()))
    return "\n".join(lines).lstrip("\n")


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _fmt_ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _fmt(values: list[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def plot_report(report: dict, path) -> None:
    """Whole generations, one column per (T, set): tau against the budget for DDTree, MFD (and MFD
    unweighted), the best tree (the ceiling) and the cue-blind best tree, and below it the chimera share
    of DDTree's and MFD's trees."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = [(t, name) for t in report["results"] for name in report["results"][t]]
    fig, axes = plt.subplots(2, len(columns), figsize=(3.2 * len(columns), 5.5), squeeze=False)
    for col, (t, name) in enumerate(columns):
        block = report["results"][t][name]["generation"]
        budgets = sorted(int(b) for b in block["ddtree"])
        tau, share = axes[0][col], axes[1][col]
        for method, label in (("ddtree", "DDTree"), ("mfd", "MFD"), ("mfd_uniform", "MFD unweighted")):
            if method not in block:
                continue
            style = ":" if method == "mfd_uniform" else "-"
            tau.plot(budgets, [block[method][str(b)]["tau"] for b in budgets], style, marker="o", label=label)
            share.plot(budgets, [block[method][str(b)]["chimera_share"] for b in budgets], style, marker="o", label=label)
        tau.plot(budgets, [block["ddtree"][str(b)]["ceiling_tau"] for b in budgets], "--", color="gray",
                 label="best tree")
        tau.plot(budgets, [block["ddtree"][str(b)]["blind_ceiling_tau"] for b in budgets], ":", color="gray",
                 label="best tree, cue-blind")
        tau.set_title(f"T = {float(t):g}, {name} sequences", fontsize=9)
        for ax in (tau, share):
            ax.set_xscale("log", base=2)
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.grid(alpha=0.3)
        share.set_xlabel("tree budget B")
    axes[0][0].set_ylabel("tau (tokens per round)")
    axes[1][0].set_ylabel("chimera share of the tree")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(path), dpi=110)
    plt.close(fig)


def write_results(report: dict, path, command: str) -> None:
    """The report as JSON at `path` (with the date and the command), as Markdown and as a plot next to it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"date": dt.date.today().isoformat(), "command": command, **report}
    path.write_text(json.dumps(payload, indent=1) + "\n")
    path.with_suffix(".md").write_text(format_report(report) + "\n")
    plot_report(report, path.with_suffix(".png"))
