"""The acceptance evaluation runs end to end on the tiny pair; its metrics follow their definitions."""

from __future__ import annotations

import json

import pytest
import torch

from mfd_sglang.cli import main
from mfd_sglang.evaluate import chimera_count, covered_mass, node_paths
from mfd_sglang.tree import build_mixture_tree


def test_eval_cli_writes_table_json_and_plot(tiny_pair, tiny_dflash_drafter, tmp_path, capsys):
    out, png = tmp_path / "acc.json", tmp_path / "acc.png"
    code = main(["eval", "--target", str(tiny_pair / "target"), "--single", str(tiny_dflash_drafter),
                 "--mfd", str(tiny_pair / "drafter"), "--prompts-file", str(tiny_pair / "prompts.json"),
                 "--limit", "3", "--budgets", "4", "16", "--max-new-tokens", "24", "--out", str(out), "--plot", str(png)])
    assert code == 0
    table = capsys.readouterr().out
    assert "ddtree" in table and "mfd" in table and "chimeras" in table
    report = json.loads(out.read_text())
    assert report["budgets"] == [4, 16] and report["date"] and report["command"].startswith("python -m mfd_sglang eval")
    per_set = report["results"]["prompts"]
    for method in ("ddtree", "mfd"):
        for budget in ("4", "16"):
            cell = per_set[method][budget]
            assert cell["tau"] >= 1.0 and cell["speedup"] > 0 and cell["rounds"] > 0
    assert 1.0 <= per_set["mfd"]["16"]["effective_modes"] <= 4.0
    assert per_set["ddtree"]["16"]["effective_modes"] == pytest.approx(1.0)
    assert 0.0 <= per_set["ddtree"]["16"]["chimera_share"] <= 1.0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
