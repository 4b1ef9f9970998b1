"""The acceptance evaluation runs end to end on the tiny pair and reports what the reference engine
does on the same prompts; its metrics follow their definitions, held to hand-built rounds."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.lab import evaluate
from mfd_sglang.cli import main
from mfd_sglang.lab.evaluate import chimera_count, covered_mass, node_paths, run_method
from mfd_sglang.hf import GenerationOutput, RoundStats, SamplingParams, SpeculativeGenerator, eos_token_ids
from mfd_sglang.tree import DraftTree, build_mixture_tree
from mfd_sglang.verify import TreeVerifyResult


@pytest.mark.parametrize("temperature,batch_size", [(0.0, 1), (1.0, 2)])
def test_eval_cli_writes_table_json_and_plot(tiny_pair, tiny_dflash_drafter, tmp_path, capsys, temperature, batch_size):
    """Each cell's tau and rounds are those of the reference engine run directly on the same prompts in
    the same batches (fp32 greedy, or sampled with the given seed: deterministic), and MFD's effective
    number of modes is exp(entropy) of the best modes of the nodes those runs accepted. Speed-ups are
    timings, measured at batch 1 only: only their presence is checked."""
    from transformers import AutoTokenizer

    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    code = main(["eval", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter),
                 "--mfd", str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"),
                 "--limit", "3", "--budgets", "4", "16", "--max-new-tokens", "24", "--out", str(out), "--plot", str(png),
                 "--temperature", str(temperature), "--seed", "3", "--batch-size", str(batch_size)])
    assert code == 0
    table = capsys.readouterr().out
    assert "ddtree" in table and "mfd" in table and "chimeras" in table
    report = json.loads(out.read_text())
    assert report["budgets"] == [4, 16] and report["date"] and report["command"].startswith("python -m mfd_sglang eval")
    assert report["temperature"] == temperature
    params = SamplingParams(temperature=temperature, seed=3) if temperature > 0 else None
    per_set = report["results"]["prompts"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"]
               for t in json.loads((tiny_pair / "prompts.json").read_text())[:3]]
    single = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_dflash_drafter, tree="chain", single_mode=True)
    eos = eos_token_ids(tokenizer, single.target.config)
    cells = {("chain", "7"): single}
    for budget in (4, 16):
        cells["ddtree", str(budget)] = SpeculativeGenerator(single.target, single.drafter, budget=budget, single_mode=True)
        cells["mfd", str(budget)] = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_pair / "drafter",
                                                                    budget=budget)
    for (method, budget), engine in cells.items():
        rounds = [r for first in range(0, len(prompts), batch_size)
                  for out in engine.generate_batch(prompts[first : first + batch_size], 24, params=params,
                                                   eos_token_ids=eos)
                  for r in out.rounds]
        cell = per_set[method][budget]
        assert (cell["tau"], cell["rounds"]) == (sum(r.emitted for r in rounds) / len(rounds), len(rounds)), (method, budget)
        assert (cell["speedup"] is not None) == (batch_size == 1)
        assert (f"{cell['tau']:.2f} (" if batch_size == 1 else f"{cell['tau']:.2f}") in table
        if method == "mfd":
            modes = Counter(m for r in rounds for m in r.accepted_modes)
            total = sum(modes.values())
            entropy = -sum(c / total * math.log(c / total) for c in modes.values())
            assert cell["effective_modes"] == pytest.approx(math.exp(entropy))
    assert per_set["ddtree"]["16"]["chimera_share"] is not None


class HandBuiltRounds:
    """Plays hand-built rounds of one request through run_method's hook, as SpeculativeGenerator does:
    on_round(row, committed length, log-probs [1, K, D, V], tree [1, N], result) before each commit."""

    drafter = SimpleNamespace(to_draft_ids=lambda ids: ids)  # the draft vocabulary is the target's

    def __init__(self, first_token: int, rounds: list[tuple]):
        self.first_token, self.rounds = first_token, rounds  # rounds: (logprobs, tree, result, emitted tokens)

    def generate_batch(self, prompts, max_new, params=None, eos_token_ids=(), on_round=None):
        length, tokens, stats = len(prompts[0]), [self.first_token], []
        for logprobs, tree, result, emitted in self.rounds:
            on_round(0, length, logprobs, tree, result)
            tokens += emitted
            length += len(emitted)  # the root and all but the last emitted token are committed
            stats.append(RoundStats(len(emitted), len(emitted) - 1, [], []))
        return [GenerationOutput(tokens, stats, {}, 0.0, "length")]


def _tree(tokens, parents, modes) -> DraftTree:
    """A one-row tree from each node's token, parent (-1: the root) and best mode."""
    depths, n = [], len(tokens)
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    t = lambda values: torch.tensor([values])
    return DraftTree(t(tokens), t(parents), t(depths), torch.zeros(1, n), t(modes), torch.ones(1, n, dtype=torch.bool))


def _result(accepted_nodes, budget) -> TreeVerifyResult:
    local = torch.full((1, budget + 1), -1)
    local[0, : len(accepted_nodes)] = torch.tensor(accepted_nodes) + 1  # local index = node + 1 (root 0)
    return TreeVerifyResult(torch.tensor([len(accepted_nodes) + 1]), local.clone(), local, torch.zeros(1, dtype=torch.long))


def test_run_method_reports_hand_built_rounds(monkeypatch):
    """Two hand-built rounds with known counts. The drafter's modes are sure of one chain each (mode 0:
    1 2 3, mode 1: 4 5 6; every other token has probability ~0), so a path's covered mass is 1/2 when
    it follows one mode's chain and 0 otherwise.
      round 1, target continues 1 2 0: nodes (1) (1 5) (4) (1 2); accepted (1)(1 2) by mode 0.
        chimeras: (1 5) only ((1 2) is the target's path, (4) and (1) follow one mode); mass 0.5 x 3.
      round 2, target continues 4 9: nodes (4) (7) (4 5); accepted (4) by mode 1.
        chimeras: none; mass (4) 0.5 + (4 5) 0.5.
    So tau (3 + 2) / 2, chimera share 1 / 7, covered mass (1.5 + 1) / 2 per round, and modes used
    0, 0, 1: effective modes exp(entropy(2/3, 1/3))."""
    chains = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logprobs = torch.full((1, 2, 3, 10), -80.0)  # e^-80: far below what pytest.approx resolves
    for mode in range(2):
        logprobs[0, mode, torch.arange(3), chains[mode]] = 0.0
    rounds = [
        (logprobs, _tree([1, 5, 4, 2], [-1, 0, -1, 0], [0, 1, 1, 0]), _result([0, 3], 4), [1, 2, 0]),
        (logprobs, _tree([4, 7, 5], [-1, -1, 0], [1, 0, 1]), _result([0], 3), [4, 9]),
    ]
    # The modes' argmax chains at each round's root, as mode_argmax_chains would compute them.
    monkeypatch.setattr(evaluate, "mode_argmax_chains", lambda reference, sequence, lengths: chains.expand(len(lengths), -1, -1))
    stats, outputs = run_method(HandBuiltRounds(7, rounds), [[11, 12]], 24, set(), chimera_reference=object())
    summary = stats.summary(ar_tokens_per_second=1.0)
    assert outputs == [[7, 1, 2, 0, 4, 9]]
    assert (summary["tau"], summary["rounds"], summary["chimera_share"]) == (2.5, 2, 1 / 7)
    assert summary["covered_mass"] == pytest.approx((1.5 + 1.0) / 2)
    assert summary["effective_modes"] == pytest.approx(math.exp(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3)))


def test_node_paths_follow_parents():
    logprobs = torch.log_softmax(torch.randn(1, 2, 4, 6, generator=torch.Generator().manual_seed(0)), -1)
    tree = build_mixture_tree(logprobs, 12)
    paths = node_paths(tree, 0)
    for i in range(12):
        depth = int(tree.depths[0, i])
        expected, node = [], i
        while node >= 0:
            expected.append(int(tree.tokens[0, node]))
            node = int(tree.parents[0, node])
        assert paths[i, :depth].tolist() == expected[::-1]
        assert (paths[i, depth:] == -1).all()


def test_chimera_is_a_splice_of_mode_chains_off_the_target_path():
    chains = torch.tensor([[1, 2, 3], [4, 5, 6]])  # mode 0 says 1 2 3, mode 1 says 4 5 6
    paths = torch.tensor([[1, 5, -1], [1, 2, 3], [4, 2, 6], [7, -1, -1], [4, 5, -1], [1, 2, -1]])
    valid = torch.ones(6, dtype=torch.bool)
    # (1 5) and (4 2 6) splice both modes; (1 2 3), (4 5) follow one mode; (7) is on no mode;
    # (1 2) would be a plain prefix anyway. A splice the target really takes is not a chimera.
    assert chimera_count(paths, valid, chains, future=[9, 9, 9]) == 2
    assert chimera_count(paths, valid, chains, future=[1, 5, 0]) == 1
    assert chimera_count(paths, torch.tensor([False, True, False, True, True, True]), chains, [9, 9, 9]) == 0


def test_covered_mass_is_the_mixture_probability_summed_over_nodes():
    probs = torch.tensor([[[0.5, 0.5], [0.25, 0.75]], [[1.0, 1e-9], [0.5, 0.5]]])  # [K=2, D=2, V=2]
    paths = torch.tensor([[0, -1], [0, 1], [1, -1]])
    valid = torch.ones(3, dtype=torch.bool)
    mass = covered_mass(probs.log(), paths, valid, lambda ids: ids)
    expected = (0.5 + 1.0) / 2 + (0.5 * 0.75 + 1.0 * 0.5) / 2 + (0.5 + 1e-9) / 2
    assert mass == pytest.approx(expected)
