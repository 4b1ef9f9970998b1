"""The acceptance evaluation replays the reference engine's rounds exactly and reports them through
the CLI; its metrics follow their definitions, held to hand-built rounds."""

from __future__ import annotations

import json
import math
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from mfd_sglang.cli import main
from mfd_sglang.lab.evaluate import (Continuation, MethodStats, chimera_count, continue_prompt, covered_mass,
                                     node_paths, prompt_outcomes, round_outcomes, walk)
from mfd_sglang.hf import SamplingParams, SpeculativeGenerator, batch_sampling, eos_token_ids
from mfd_sglang.tree import DraftTree, build_mixture_tree

BUDGETS = (4, 16)


def _prompts(tiny_pair, n):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    texts = json.loads((tiny_pair / "prompts.json").read_text())[:n]
    return tokenizer, [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def _engines(tiny_pair, tiny_dflash_drafter) -> dict:
    """The reference engine of every (method, budget) cell (fp32)."""
    single = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_dflash_drafter, tree="chain", single_mode=True)
    mfd = SpeculativeGenerator.from_paths(tiny_pair / "target", tiny_pair / "drafter")
    cells = {("chain", str(single.drafter.cfg.block_size - 1)): single}
    for budget in BUDGETS:
        cells["ddtree", str(budget)] = SpeculativeGenerator(single.target, single.drafter, budget=budget, single_mode=True)
        cells["mfd", str(budget)] = SpeculativeGenerator(single.target, mfd.drafter, budget=budget)
    return cells


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_replay_gives_the_engine_rounds(tiny_pair, tiny_dflash_drafter, temperature):
    """Every method's replayed rounds are the reference engine's own, round for round: the tokens each
    round emits and the best modes of its accepted nodes (fp32, greedy; or sampled, prompt i with seed
    5 + i in both), and the continuation is the engine's output."""
    tokenizer, prompts = _prompts(tiny_pair, 3)
    cells = _engines(tiny_pair, tiny_dflash_drafter)
    chain = cells["chain", "7"]
    eos = eos_token_ids(tokenizer, chain.target.config)
    compared = 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=temperature, seed=5 + i)
        sampling = None if params.greedy else batch_sampling(1, params, "cpu")
        cont = continue_prompt(chain.target, prompt, 24, eos, sampling, lookahead=7)
        outcomes = prompt_outcomes(chain.target, chain.drafter, cells["mfd", "4"].drafter, cont, list(BUDGETS))
        assert set(outcomes) == set(cells)
        for cell, engine in cells.items():
            out = engine.generate(prompt, 24, params=params, eos_token_ids=eos)
            assert cont.sequence[len(prompt):] == out.token_ids, cell
            replayed = walk(outcomes[cell], cont)
            assert [(r.emitted, r.accepted_modes) for r in replayed] == \
                [(r.emitted, r.accepted_modes) for r in out.rounds], (i, cell)
            compared += len(replayed)
    assert compared > 3 * len(cells)  # several rounds per prompt and cell, not an empty comparison


def test_eval_cli_writes_table_json_and_plot(tiny_pair, tiny_dflash_drafter, tmp_path, capsys):
    """The CLI's cells are the engine's: tau and rounds of every (method, budget) over the prompts,
    sampled at T = 1 with seed 3 + i for prompt i; MFD's effective number of modes is exp(entropy) of
    the best modes of the nodes those runs accepted."""
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    code = main(["eval", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter),
                 "--mfd", str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"),
                 "--limit", "3", "--budgets", "4", "16", "--max-new-tokens", "24", "--out", str(out), "--plot", str(png),
                 "--temperature", "1", "--seed", "3"])
    assert code == 0
    table = capsys.readouterr().out
    assert "ddtree" in table and "mfd" in table and "chimeras" in table
    report = json.loads(out.read_text())
    assert report["budgets"] == [4, 16] and report["date"] and report["command"].startswith("python -m mfd_sglang eval")
    assert report["temperature"] == 1.0
    per_set = report["results"]["prompts"]
    assert per_set["prompts"] == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    tokenizer, prompts = _prompts(tiny_pair, 3)
    for (method, budget), engine in _engines(tiny_pair, tiny_dflash_drafter).items():
        eos = eos_token_ids(tokenizer, engine.target.config)
        rounds = [r for i, prompt in enumerate(prompts)
                  for r in engine.generate(prompt, 24, params=SamplingParams(temperature=1.0, seed=3 + i),
                                           eos_token_ids=eos).rounds]
        cell = per_set[method][budget]
        assert (cell["tau"], cell["rounds"]) == (sum(r.emitted for r in rounds) / len(rounds), len(rounds)), (method, budget)
        assert f"{cell['tau']:.2f}" in table
        if method == "mfd":
            modes = Counter(m for r in rounds for m in r.accepted_modes)
            total = sum(modes.values())
            entropy = -sum(c / total * math.log(c / total) for c in modes.values())
            assert cell["effective_modes"] == pytest.approx(math.exp(entropy))
    assert per_set["ddtree"]["16"]["chimera_share"] is not None


def _tree(tokens, parents, modes) -> DraftTree:
    """A one-row tree from each node's token, parent (-1: the root) and best mode."""
    depths, n = [], len(tokens)
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    t = lambda values: torch.tensor([values])
    return DraftTree(t(tokens), t(parents), t(depths), torch.zeros(1, n), t(modes), torch.ones(1, n, dtype=torch.bool))


def test_round_outcomes_of_hand_built_rounds():
    """Two hand-built rounds with known counts. The drafter's modes are sure of one chain each (mode 0:
    1 2 3, mode 1: 4 5 6; every other token has probability ~0), so a path's covered mass is 1/2 when
    it follows one mode's chain and 0 otherwise. The prompt is 11 12, the continuation 7 1 2 0 4 9.
      round 1 (root 7), the continuation goes on 1 2 0: nodes (1) (1 5) (4) (1 2); accepted (1)(1 2),
        by mode 0; emitted 1 2 0. chimeras: (1 5) only ((1 2) is the continuation's path, (4) and (1)
        follow one mode); mass 0.5 x 3.
      round 2 (root 0), the continuation goes on 4 9: nodes (4) (7) (4 5); accepted (4) by mode 1;
        emitted 4 9, the end. chimeras: none; mass (4) 0.5 + (4 5) 0.5.
    So tau (3 + 2) / 2, chimera share 1 / 7, covered mass (1.5 + 1) / 2 per round, and modes used
    0, 0, 1: effective modes exp(entropy(2/3, 1/3))."""
    chains = torch.tensor([[1, 2, 3], [4, 5, 6]])
    logprobs = torch.full((1, 2, 3, 10), -80.0)  # e^-80: far below what pytest.approx resolves
    for mode in range(2):
        logprobs[0, mode, torch.arange(3), chains[mode]] = 0.0
    cont = Continuation(2, [11, 12, 7, 1, 2, 0, 4, 9], ())
    drafter = SimpleNamespace(to_draft_ids=lambda ids: ids)  # the draft vocabulary is the target's
    outcomes = {}
    for start, tree in ((2, _tree([1, 5, 4, 2], [-1, 0, -1, 0], [0, 1, 1, 0])), (5, _tree([4, 7, 5], [-1, -1, 0], [1, 0, 1]))):
        outcomes[start], = round_outcomes(tree, logprobs, torch.tensor([start]), cont, drafter, chains[None])
    outcomes[3] = outcomes[4] = None  # starts no round of this walk reaches
    rounds = walk(outcomes, cont)
    assert [(r.emitted, r.accepted_modes, r.chimeras) for r in rounds] == [(3, [0, 0], 1), (2, [1], 0)]
    stats = MethodStats()
    for r in rounds:
        stats.add(r)
    summary = stats.summary()
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
    # A path through a token outside the draft vocabulary (mapped to -1) holds no mass; nor does an invalid node.
    assert covered_mass(probs.log(), paths, valid, lambda ids: torch.where(ids == 1, -1, ids)) == pytest.approx(0.75)
    assert covered_mass(probs.log(), paths, torch.tensor([False, True, True]), lambda ids: ids) == pytest.approx(0.4375 + 0.25)
