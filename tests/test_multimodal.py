"""The multimodal universe: its known answer (sampling frequencies, exact continuations, the best
tree's covered mass against brute force), the paper's chimera bound on the real tree code, the
drafter's blindness to the cue by construction, and make-multimodal end to end on a tiny setting
(structure only: no assertion on how well anything trained)."""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from mfd_sglang.hf import SpeculativeGenerator
from mfd_sglang.lab import multimodal as mm
from mfd_sglang.lab.evaluate import chimera_count, node_paths
from mfd_sglang.tree import build_mixture_tree


@pytest.fixture(scope="module")
def universe():
    return mm.universe_for(mm.build_tokenizer())


def first_future(universe, seq, marker):
    return universe.future_of_first[seq[marker + 1]]


# --- the universe ------------------------------------------------------------------------------

def test_random_forks_follow_the_known_probabilities_and_cued_forks_their_cue(universe):
    rng = random.Random(0)
    random_counts, cued = Counter(), 0
    for i in range(400):
        kind = mm.SETS[i % 2]
        seq = universe.sample(rng, kind, mm.SEQ_LEN)
        assert universe.first_off_universe(seq) is None
        for m in universe.marker_positions(len(seq) - mm.FUTURE_LEN):
            j = first_future(universe, seq, m)
            assert tuple(seq[m + 1: m + 1 + mm.FUTURE_LEN]) == universe.future_ids[j]  # a whole, coherent future
            if universe.fork_kind(seq, m) == "cued":
                assert kind == "cued" and seq[m - mm.CUE_DISTANCE] == universe.cue_ids[j]
                cued += 1
            else:
                assert kind == "random" or m < mm.CUE_DISTANCE + 1  # the first forks have no cue before them
                random_counts[j] += 1
    total = sum(random_counts.values())
    assert cued > 500 and total > 1000
    for j, p in enumerate(mm.FUTURE_PROBS):
        # 5 standard deviations of a binomial share: a wrong probability fails, sampling noise does not.
        assert abs(random_counts[j] / total - p) < 5 * math.sqrt(p * (1 - p) / total), (j, random_counts)


def test_futures_are_coherent_and_disagree_at_most_positions():
    assert len(mm.FUTURES) == 4 and all(len(f) == mm.FUTURE_LEN == mm.BLOCK_SIZE - 1 for f in mm.FUTURES)
    for a, b in itertools.combinations(mm.FUTURES, 2):
        assert sum(x != y for x, y in zip(a, b)) == mm.FUTURE_LEN - 1  # they share one token ("then")
    assert sum(mm.FUTURE_PROBS) == pytest.approx(1.0)


def test_continuations_are_the_exact_distribution(universe):
    rng = random.Random(1)
    seq = universe.sample(rng, "random", mm.SEQ_LEN)
    marker = universe.marker_positions(mm.SEQ_LEN)[3]
    # Root 3 tokens before the marker: 2 filler tokens, the marker, then the fork at depth 4.
    prefix = seq[: marker - 2]
    conts = universe.continuations(prefix, mm.DRAFT_DEPTH)
    assert sum(conts.values()) == pytest.approx(1.0) and len(conts) == 4
    # Monte Carlo through the sampler agrees with the enumeration.
    counts = Counter()
    for _ in range(2000):
        s = list(prefix)
        while len(s) < len(prefix) + mm.DRAFT_DEPTH:
            tokens, probs = zip(*universe.next_token_distribution(s))
            s.append(rng.choices(tokens, probs)[0])
        counts[tuple(s[len(prefix):])] += 1
    for path, p in conts.items():
        assert abs(counts[path] / 2000 - p) < 5 * math.sqrt(p * (1 - p) / 2000)
    # A cued fork: the target is deterministic; a drafter that cannot see the cue has all 4 futures.
    seq = universe.sample(rng, "cued", mm.SEQ_LEN)
    marker = universe.marker_positions(mm.SEQ_LEN)[4]
    assert universe.fork_kind(seq, marker) == "cued"
    assert list(universe.continuations(seq[: marker + 1], mm.DRAFT_DEPTH).values()) == [1.0]
    blind = universe.continuations(seq[: marker + 1], mm.DRAFT_DEPTH, blind=True)
    assert sorted(blind) == sorted(universe.future_ids) and set(blind.values()) == {0.25}
    # A future spliced from two is off the universe: the position of the splice is found.
    j = first_future(universe, seq, marker)
    spliced = seq[: marker + 2] + [universe.future_ids[(j + 1) % 4][1]]
    assert universe.first_off_universe(seq) is None and universe.first_off_universe(spliced) == marker + 2


@pytest.mark.parametrize("kind, offset, depth", [("cued", -2, 4), ("random", 0, 4)])
def test_ideal_covered_mass_is_the_best_tree_by_brute_force(universe, kind, offset, depth):
    """cued: filler, a 4-way cue marker (equal masses), then a future its earlier cue fixes; random:
    the marker, then a fork with the known unequal probabilities."""
    seq = universe.sample(random.Random(2), kind, mm.SEQ_LEN)
    marker = universe.marker_positions(mm.SEQ_LEN)[5]
    masses = mm.prefix_masses(universe.continuations(seq[: marker + offset], depth))
    prefixes = list(masses)
    assert len(masses) >= 10
    for budget in range(1, 7):
        best = 0.0
        for subset in itertools.combinations(prefixes, budget):
            chosen = set(subset)
            if all(p[:-1] in chosen or len(p) == 1 for p in chosen):  # a tree: prefix-closed
                best = max(best, mm.covered_mass(masses, list(chosen)))
        assert mm.ideal_covered_mass(masses, budget) == pytest.approx(best)
        tree = mm.ideal_tree(masses, budget)
        assert len(tree) == budget and all(p[:-1] in tree or len(p) == 1 for p in tree)
        assert mm.covered_mass(masses, list(tree)) == pytest.approx(best)


def test_oracle_on_the_universe_accepts_whole_blocks_with_a_large_budget(universe):
    seq = universe.sample(random.Random(3), "random", mm.SEQ_LEN)
    start, max_new = 30, 57  # 56 tokens after the prefill's root: 7 rounds of 8
    for temperature in (0.0, 1.0):
        assert mm.oracle_run(universe, seq, start, max_new, 64, temperature, False) == (56, 7)
    # Budget 1 at T = 0 holds the next token only: 2 tokens per round.
    assert mm.oracle_run(universe, seq, start, 9, 1, 0.0, False) == (8, 4)


# --- the chimera bound on the tree code -------------------------------------------------------

def two_future_marginals(a: list[int], b: list[int], vocab: int, gen: torch.Generator) -> torch.Tensor:
    """Per-position log-probabilities [D, V] of a product drafter that mixes futures a and b with
    generic (random, untied) weights, plus a little mass on other tokens."""
    probs = torch.rand(len(a), vocab, generator=gen) * 1e-3
    for i, (x, y) in enumerate(zip(a, b)):
        w = 0.2 + 0.6 * float(torch.rand(1, generator=gen))
        probs[i, x] += w
        probs[i, y] += 1 - w
    return (probs / probs.sum(-1, keepdim=True)).log()


def tree_node_paths(tree) -> list[tuple]:
    batched = type(tree)(**{k: v[None] for k, v in vars(tree).items()})
    return [tuple(t for t in p if t >= 0)
            for p, v in zip(node_paths(batched, 0).tolist(), tree.valid.tolist()) if v]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6])
def test_a_product_tree_holding_two_futures_holds_at_least_2_pow_m_minus_1_minus_1_chimeras(m):
    gen = torch.Generator().manual_seed(m)
    depth, vocab = 7, 40
    for trial in range(5):
        a = torch.randperm(vocab, generator=gen)[:depth].tolist()
        b = list(a)
        for i in torch.randperm(depth, generator=gen)[:m].tolist():
            b[i] = next(t for t in range(vocab) if t not in (a[i], b[i]) and t not in a)
        logprobs = two_future_marginals(a, b, vocab, gen)[None]  # K = 1: DDTree
        # The smallest budget whose product tree holds both futures (trees of growing budget are nested).
        def holds_both(budget):
            paths = tree_node_paths(build_mixture_tree(logprobs, budget))
            return tuple(a) in paths and tuple(b) in paths

        lo, hi = depth, 1024
        assert holds_both(hi)
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if holds_both(mid) else (mid + 1, hi)
        budget = lo
        paths = tree_node_paths(build_mixture_tree(logprobs, budget))
        splices = mm.splice_chimeras(paths, tuple(a), tuple(b))
        assert splices >= mm.chimera_bound(tuple(a), tuple(b)) == 2 ** (m - 1) - 1, (m, trial, budget, splices)
        # evaluate.py's chimera count (splices of the two futures, off both) sees at least as many.
        tree = build_mixture_tree(logprobs, budget)
        batched = type(tree)(**{k: v[None] for k, v in vars(tree).items()})
        assert chimera_count(node_paths(batched, 0), tree.valid, torch.tensor([a, b]), a) >= splices
        # The mixture tree with one mode per future holds both with no chimera at all, in exactly the
        # nodes of their own prefixes.
        modes = torch.stack([two_future_marginals(a, a, vocab, gen), two_future_marginals(b, b, vocab, gen)])
        own = {tuple(f[:d]) for f in (a, b) for d in range(1, depth + 1)}
        paths = tree_node_paths(build_mixture_tree(modes, len(own)))
        assert set(paths) == own and mm.splice_chimeras(paths, tuple(a), tuple(b)) == 0


def test_known_answer_at_a_random_fork(universe):
    """Closed form: a perfect single-mode drafter's product tree wastes budget on chimeras that a
    perfect K = 4 mixture tree does not build; neither beats the best tree."""
    known = mm.known_answer_at_fork(universe, (4, 16, 32))
    for cell in known.values():
        assert cell["best"] + 1e-9 >= max(cell["product"], cell["mixture"])
    # 28 nodes hold all four whole futures: the mixture tree takes exactly those at B = 32.
    assert known["32"]["mixture"] == pytest.approx(mm.FUTURE_LEN) == known["32"]["best"]
    # B = 16: four depths of each future (4.0) against a product tree whose budget half goes to chimeras.
    assert known["16"]["mixture"] == pytest.approx(4.0)
    assert known["16"]["product"] < 3.0 and known["16"]["product_chimera_share"] >= 0.25
    assert known["4"]["product_chimera_share"] == 0.0  # depth 1 alone: nothing to splice yet
    # With exact modes, adding each mode's prior to its scores makes the mixture tree the best tree.
    for cell in known.values():
        assert cell["mixture_with_priors"] == pytest.approx(cell["best"])


# --- what the drafter can see -------------------------------------------------------------------

def test_the_cue_is_out_of_the_drafters_reach(universe, tmp_path):
    """Every block whose drafted tokens reach into a future ignores the context at that future's cue:
    changing the target features there changes nothing, while changing them next to the root does."""
    from transformers import Qwen3ForCausalLM

    from mfd_sglang.checkpoint import load_drafter
    from mfd_sglang.drafter import MFDDrafter

    tokenizer = mm.build_tokenizer()
    gen = torch.Generator().manual_seed(0)
    target = Qwen3ForCausalLM(mm.target_config(tokenizer)).eval()
    mm.write_seed_drafter(tmp_path / "seed", target, tokenizer, gen)
    drafter = MFDDrafter.from_checkpoint(load_drafter(tmp_path / "seed"))
    assert drafter.cfg.num_hidden_layers == 1 and drafter.cfg.sliding_window == mm.DRAFTER_WINDOW
    seq = universe.sample(random.Random(4), "cued", mm.SEQ_LEN)
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    features = torch.randn(1, len(seq), len(drafter.cfg.target_layer_ids) * 64, generator=gen)
    marker = universe.marker_positions(mm.SEQ_LEN)[4]
    cue = marker - mm.CUE_DISTANCE

    def draft(feats, root):
        slots = torch.arange(len(seq))[None]
        context = drafter.context_kv(feats, slots, slots < root)
        with torch.inference_mode():
            return drafter.block_logprobs(torch.tensor([seq[root]]), torch.tensor([root]), context, embed, head)

    for root in range(marker - (mm.BLOCK_SIZE - 2), marker + 1):  # every block that drafts a future token
        changed = features.clone()
        changed[:, cue] += 10.0
        torch.testing.assert_close(draft(changed, root), draft(features, root))
        near = features.clone()
        near[:, root - 1] += 10.0
        assert not torch.allclose(draft(near, root), draft(features, root))


# --- make-multimodal end to end (tiny) ----------------------------------------------------------

def test_make_multimodal_cli_tiny(tmp_path, capsys):
    from mfd_sglang.cli import main

    out, results = tmp_path / "universe", tmp_path / "results" / "multimodal.json"
    code = main(["make-multimodal", str(out), "--quiet", "--target-steps", "20", "--target-sequences", "32",
                 "--data-sequences", "16", "--base-steps", "4", "--steps", "4", "--budgets", "4", "16",
                 "--prompts", "2", "--fork-prompts", "3", "--max-new-tokens", "20", "--probe-sequences", "3",
                 "--out", str(results)])
    assert code == 0
    table = capsys.readouterr().out
    assert "### T = 1, random sequences, whole generations" in table and "chimera share DDTree" in table
    report = json.loads(results.read_text())
    assert report["command"].startswith("python -m mfd_sglang make-multimodal") and report["date"]
    assert results.with_suffix(".md").read_text().strip() == table.strip()
    assert results.with_suffix(".png").stat().st_size > 0 and (out / "report.png").stat().st_size > 0
    assert json.loads((out / "report.json").read_text())["results"] == report["results"]
    for t in ("0.0", "1.0"):
        for name in mm.SETS:
            for kind in mm.KINDS:
                block = report["results"][t][name][kind]
                # Lossless verification: every method emits the same tokens for the same seed.
                assert block["identical_outputs"]
                assert set(block["ddtree"]) == set(block["mfd"]) == {"4", "16"}
                for method in ("ddtree", "mfd"):
                    for b in ("4", "16"):
                        cell = block[method][b]
                        # (This target is barely trained: its samples may leave the universe, and those rounds
                        # are set aside, not counted.)
                        if kind == "fork":
                            assert cell["rounds"] + cell["off_universe_rounds"] == 3
                        if cell["rounds"]:
                            assert 1.0 <= cell["tau"] <= mm.BLOCK_SIZE and 1.0 <= cell["ceiling_tau"] <= mm.BLOCK_SIZE
                        if t == "1.0":  # no tree of the same budget covers more than the best one
                            assert cell["ceiling_expected_accepted"] + 1e-9 >= cell["expected_accepted"]
    # The drafters: one single-mode and one K-mode, same data and steps, with the sliding window.
    single = json.loads((out / "drafters" / "single" / "config.json").read_text())
    mfd = json.loads((out / "drafters" / "mfd" / "config.json").read_text())
    assert single["mfd_config"]["num_modes"] == 1 and mfd["mfd_config"]["num_modes"] == 4
    assert single["sliding_window"] == mfd["sliding_window"] == mm.DRAFTER_WINDOW
    settings = [json.loads((out / "drafters" / n / "train_state" / "settings.json").read_text()) for n in ("single", "mfd")]
    assert settings[0]["data"] == settings[1]["data"] and settings[0]["steps"] == settings[1]["steps"] == 4
    assert len(report["diagnostics"]["mfd_mode_assignment"]) == 4
    # Every sampled training sequence is recorded with its header as the prompt.
    records = [json.loads(line) for line in (out / "data.jsonl").read_text().splitlines()]
    assert len(records) == 16 and all(len(r["input_ids"]) == 1 and len(r["input_ids"] + r["response_ids"]) == mm.SEQ_LEN
                                      for r in records)
    # Read back (the benchmarks' way in), the run replays its own evaluation: same prompts, same numbers.
    run = mm.load_run(out)
    replay = mm.evaluate_engines(run, {"mfd": lambda b: SpeculativeGenerator(run.target, run.mfd, budget=b)},
                                 log=lambda *a: None)
    assert {(t, n, k): block["mfd"] for t, per_t in replay.items() for n, per_set in per_t.items()
            for k, block in per_set.items()} == \
        {(t, n, k): block["mfd"] for t, per_t in report["results"].items() for n, per_set in per_t.items()
         for k, block in per_set.items()}
    # Fewer modes per request (benchmarks/mode_subsets.py): every arm is lossless and its table names them all.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from mode_subsets import engines_of, markdown

    engines, slots = engines_of(run)
    assert set(engines) == {"ddtree", "K", "K'=2 gate-first", "K'=2 oracle", "K'=1 gate-first", "K'=1 oracle"}
    subsets = mm.evaluate_engines(run, engines, log=lambda *a: None)
    assert all(block["identical_outputs"] for per_t in subsets.values() for per_set in per_t.values()
               for block in per_set.values())
    assert slots["K'=2 gate-first"] == (2 * mm.BLOCK_SIZE + 4) / (4 * mm.BLOCK_SIZE)
    assert markdown(subsets, slots).count("K'=1 gate-first") == 8  # T x set x kind
    # The same seed gives the same run: data, models' verdicts, every number of the report but the clock.
    again = mm.make_multimodal(tmp_path / "again", mm.Settings(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in report["settings"].items()}), progress=False,
        log=lambda *a: None)
    assert (tmp_path / "again" / "data.jsonl").read_bytes() == (out / "data.jsonl").read_bytes()
    for key in ("results", "diagnostics", "bound", "expectation"):
        assert again[key] == report[key], key
