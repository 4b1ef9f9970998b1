"""The paper's tree diagnostics (lab/diagnostics.py) follow their definitions: the target's node
probabilities are its plain forwards' (a tiny random target with a 3-token vocabulary), the per-depth
tallies, forks and gain shares are those of hand-built cases, and the CLI's trees are evaluate's."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mfd_sglang.cli import main
from mfd_sglang.lab.diagnostics import (ForkTally, TreeTally, first_fork_depths, fork_steps, node_target_logprobs,
                                        prefix_of, target_pass)
from mfd_sglang.lab.evaluate import Continuation, RoundOutcome, continue_prompt, load_inputs, prompt_outcomes
from mfd_sglang.tree import DraftTree


def _tree(rows) -> DraftTree:
    """A batched tree from rows of (token, parent) lists (parent -1: the root); every node valid."""
    tokens = torch.tensor([[t for t, _ in row] for row in rows])
    parents = torch.tensor([[p for _, p in row] for row in rows])
    depths = torch.zeros_like(parents)
    for r, row in enumerate(rows):
        for i, (_, p) in enumerate(row):
            depths[r, i] = 1 if p < 0 else depths[r, p] + 1
    n = tokens.shape
    return DraftTree(tokens, parents, depths, torch.zeros(n), torch.zeros_like(tokens), torch.ones(n, dtype=torch.bool))


@pytest.fixture(scope="module")
def three_token_target():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=3, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than the init's near-uniform logits, so the probabilities differ
        model.lm_head.weight.mul_(40.0)
    return model


def test_node_probabilities_are_the_targets_plain_forwards(three_token_target):
    """Each node's last-step log-prob equals the target's plain forward over the sequence up to the anchor's
    root followed by the node's path (no cache, no mask): two anchors, depth-3 trees, every 3-token path of
    depth <= 2 at one of them. A smaller tree that is the bigger one's first nodes reads the same values."""
    target = three_token_target
    sequence = [0, 2, 1, 1, 0, 2, 2, 1]
    cont = Continuation(3, sequence[:6], (), sequence[6:])
    full = [(t, -1) for t in range(3)] + [(u, p) for p in range(3) for u in range(3)]  # 3 + 9 nodes
    other = [(1, -1), (2, 0), (0, 1), (2, -1), (0, 0), (1, 3)] + [(0, 3)] * 6
    tree = _tree([full, other])
    starts = torch.tensor([3, 4])
    tp = target_pass(target, cont)
    last = node_target_logprobs(target, tp, tree, starts, torch.tensor(sequence)[starts])
    for row, start in enumerate(starts.tolist()):
        for i in range(tree.tokens.shape[1]):
            path, node = [], i
            while node >= 0:
                path.insert(0, int(tree.tokens[row, node]))
                node = int(tree.parents[row, node])
            ids = torch.tensor([sequence[:start + 1] + path[:-1]])
            with torch.no_grad():
                expected = torch.log_softmax(target(ids).logits[0, -1].float(), -1)[path[-1]]
            assert float(last[row, i]) == pytest.approx(float(expected), abs=1e-5), (row, i, path)
    # The 3-token vocabulary's probabilities after one context sum to 1: a check on the reference itself.
    assert float(last[0, :3].exp().sum()) == pytest.approx(1.0, abs=1e-5)
    small = DraftTree(*(getattr(tree, f)[:, :4] for f in ("tokens", "parents", "depths", "scores", "modes", "valid")))
    assert prefix_of(small, tree)
    assert torch.allclose(node_target_logprobs(target, tp, small, starts, torch.tensor(sequence)[starts]),
                          last[:, :4], atol=1e-5)
    assert not prefix_of(_tree([full[1:5], other[:4]]), tree)


def test_tree_tally_counts_unlikely_steps_and_path_mass_per_depth():
    """One anchor, nodes (a) (b) (a x) (a y) (a x z) with last steps .5 .005 .3 .05 .001: depth 1 has 2 nodes, 1
    below 1%, mass .5 + .005; depth 2: 2 nodes, none below (.05 is above 1%), mass .5 x .3 + .5 x .05; depth 3: 1 node below
    1%, mass .5 x .3 x .001. A second anchor of one node (.9) adds 1 node and .9 at depth 1."""
    tree = _tree([[(0, -1), (1, -1), (2, 0), (1, 0), (2, 2)]])
    tally = TreeTally(depth=4)
    outcome = RoundOutcome(emitted=2, valid_nodes=5, accepted_modes=[], covered_mass=1.5, chimeras=1)
    tally.add(tree, torch.tensor([[0.5, 0.005, 0.3, 0.05, 0.001]]).log(), [outcome])
    tally.add(_tree([[(0, -1)]]), torch.tensor([[0.9]]).log(), [RoundOutcome(1, 1, [], 0.5)])
    s = tally.summary()
    assert tally.nodes == [3, 2, 1, 0] and tally.unlikely == [1, 0, 1, 0]
    assert s["unlikely_share_per_depth"][:3] == [pytest.approx(1 / 3), 0.0, 1.0] and s["unlikely_share_per_depth"][3] is None
    assert s["unlikely_share"] == pytest.approx(2 / 6)
    expected_mass = [(0.5 + 0.005 + 0.9) / 2, (0.15 + 0.025) / 2, 0.5 * 0.3 * 0.001 / 2, 0.0]
    assert s["target_mass_per_depth"] == pytest.approx(expected_mass, rel=1e-5)  # float32 log-probs
    assert s["target_mass"] == pytest.approx(sum(expected_mass), rel=1e-5)
    assert (s["anchors"], s["tau"], s["drafter_mass"], s["chimera_share"]) == (2, 1.5, 1.0, 1 / 6)
    assert s["nodes_per_depth"] == [1.5, 1.0, 0.5, 0.0]


def test_forks_are_runner_up_tokens_of_ten_percent_within_the_depth():
    """Per position: a token other than the one taken with p >= 10% makes a fork (the argmax counts when
    another token was taken); an anchor's first fork is the first such step within the depth, 0 if none
    of the steps that exist forks."""
    probs = torch.tensor([[0.85, 0.12, 0.03], [0.95, 0.03, 0.02], [0.85, 0.12, 0.03], [0.6, 0.3, 0.1], [0.98, 0.01, 0.01]])
    taken = torch.tensor([0, 0, 1, 0, 0])
    fork = fork_steps(probs.log(), taken)
    assert fork.tolist() == [True, False, True, True, False]
    # Brute force: every (anchor, depth) against the definition.
    for depth in (1, 2, 3):
        starts = torch.arange(5)
        got = first_fork_depths(fork, starts, depth).tolist()
        expected = [next((d for d in range(1, depth + 1) if s + d - 1 < 5 and fork[s + d - 1]), 0) for s in range(5)]
        assert got == expected, depth
    assert first_fork_depths(fork, torch.arange(5), 2).tolist() == [1, 2, 1, 1, 0]


def test_fork_tally_splits_the_gain_between_fork_anchors_and_the_rest():
    """Anchors with first forks 1, 0, 3, 0; DDTree emits 2 1 1 3, MFD 4 1 2 2: the gain 2 + 0 + 1 - 1 = 2, of
    which the forks carry 3 (150%); tau at forks DDTree 1.5, MFD 3, elsewhere 2 and 1.5."""
    tally = ForkTally(depth=3)
    tally.add(torch.tensor([1, 0, 3, 0]), {(8, "ddtree"): [2, 1, 1, 3], (8, "mfd"): [4, 1, 2, 2]})
    s = tally.summary([8])
    assert (s["anchors"], s["fork_share"], s["fork_share_within_depth"]) == (4, 0.5, [0.25, 0.25, 0.5])
    gain = s["per_budget"]["8"]
    assert (gain["gain_tokens"], gain["gain_tokens_at_forks"], gain["gain_share_at_forks"]) == (2, 3, 1.5)
    assert gain["gain_tokens_by_first_fork_depth"] == [-1, 2, 0, 1]
    assert gain["tau_at_forks"] == {"ddtree": 1.5, "mfd": 3.0} and gain["tau_elsewhere"] == {"ddtree": 2.0, "mfd": 1.5}
    tally.add(torch.tensor([2]), {(8, "ddtree"): [3], (8, "mfd"): [1]})  # gain 0 in all: no share
    assert tally.summary([8])["per_budget"]["8"]["gain_share_at_forks"] is None


def test_diagnose_cli_on_the_tiny_pair(tiny_pair, tiny_dflash_drafter, tmp_path, capsys):
    """The CLI's trees are the evaluation's: each method's tau over every anchor equals the mean of
    prompt_outcomes' emitted tokens over every round start; node counts fill the budget, the target mass of
    each depth is a probability, the JSON and the Markdown table are written."""
    out = tmp_path / "diag.json"
    budgets = [4, 16]
    argv = ["diagnose", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter), "--mfd",
            str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"), "--limit", "4",
            "--every", "2", "--budgets", *map(str, budgets), "--max-new-tokens", "16", "--out", str(out)]
    assert main(argv) == 0
    assert "MFD gain at forks" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert out.with_suffix(".md").read_text().startswith("`python -m mfd_sglang diagnose")
    group = report["results"]["all"]
    assert group["prompts"] == 2 and report["results"]["prompts"]["prompts"] == 2

    target, drafters, sets, eos = load_inputs(tiny_pair / "target", tiny_dflash_drafter, tiny_pair / "drafter",
                                              torch.float32, limit=4, prompts_file=tiny_pair / "prompts.json")
    depth = drafters["mfd"].cfg.block_size - 1
    emitted, anchors = {}, 0
    for prompt in sets["prompts"][::2]:
        cont = continue_prompt(target, prompt, 16, eos, lookahead=depth)
        anchors += len(cont.round_starts)
        for (method, budget), outcomes in prompt_outcomes(target, drafters["single"], drafters["mfd"], cont, budgets).items():
            emitted[method, budget] = emitted.get((method, budget), 0) + sum(o.emitted for o in outcomes.values())
    assert group["forks"]["anchors"] == anchors > 10
    for method, budget in itertools.product(("ddtree", "mfd"), budgets):
        cell = group["trees"][method][str(budget)]
        assert cell["anchors"] == anchors
        assert cell["tau"] == pytest.approx(emitted[method, str(budget)] / anchors)
        assert sum(cell["nodes_per_depth"]) == pytest.approx(budget)
        assert all(0.0 <= m <= 1.0 + 1e-6 for m in cell["target_mass_per_depth"])
        assert cell["target_mass"] > 0.0 and 0.0 <= cell["unlikely_share"] <= 1.0
    within = group["forks"]["fork_share_within_depth"]
    assert within == sorted(within) and within[-1] == pytest.approx(group["forks"]["fork_share"])
    assert main(argv[:-2] + ["--every", "0"]) == 2
    assert math.isfinite(group["trees"]["mfd"]["16"]["drafter_mass"])
