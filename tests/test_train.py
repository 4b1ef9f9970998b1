"""The drafter training pipeline: data regeneration, D-PACE, mode weighting, resumable training, checkpoints."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from conftest import target_greedy
from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.cli import main
from mfd_sglang.drafter import MFDDrafter
from mfd_sglang.hf import SpeculativeGenerator, load_target
from mfd_sglang.lab.train import (
    TrainConfig, block_loss, build_draft_vocab, chain_coverage, dpace_weights, load_sequences, mode_weights, train,
)
from mfd_sglang.lab.tiny import tiny_prompts
from mfd_sglang.lab.train_data import read_records, regenerate

MAX_NEW = 32


@pytest.fixture(scope="module")
def target(tiny_pair):
    return load_target(tiny_pair / "target")


@pytest.fixture(scope="module")
def data(tiny_pair, target, tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "data.jsonl"
    regenerate(tiny_pair / "target", path, tiny_prompts(tiny_pair, 48), max_new_tokens=MAX_NEW,
               batch_size=16, chat_template=False, progress=False, target=target)
    return path


def small(tiny_pair, data, out, **kw) -> TrainConfig:
    settings = dict(target=str(tiny_pair / "target"), out=str(out), data=str(data), steps=8, batch_size=4,
                    anchors=8, block_size=8, layers=1, lr=3e-3, save_every=4)
    settings.update(kw)
    return TrainConfig(**settings)


def assert_lossless(tiny_pair, target, drafter_dir, single_mode=False):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    engine = SpeculativeGenerator(target, MFDDrafter.from_checkpoint(load_drafter(drafter_dir)), budget=8,
                                  single_mode=single_mode)
    for prompt in json.loads((tiny_pair / "prompts.json").read_text())[:3]:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert engine.generate(ids, 24).token_ids == target_greedy(target, ids, 24)


# --- the loss pieces ----------------------------------------------------------------------------

def test_dpace_weights_equal_a_direct_computation():
    q = torch.tensor([[0.9, 0.2, 0.6, 0.05], [0.5, 1.0, 0.0, 0.7]])
    alpha = 0.5
    expected = torch.zeros_like(q)
    for row in range(2):
        for k in range(4):
            for j in range(k, 4):
                prod = 1.0
                for i in range(j + 1):
                    prod *= (1 - alpha) * float(q[row, i]) + alpha
                expected[row, k] += prod
    torch.testing.assert_close(dpace_weights(q, alpha), expected)
    # Past the end of the sequence nothing counts: the chain stops there.
    in_seq = torch.tensor([[True, True, False, False], [True, True, True, True]])
    cut = dpace_weights(q, alpha, in_seq)
    g0, g1 = 0.5 * 0.9 + 0.5, 0.5 * 0.2 + 0.5
    torch.testing.assert_close(cut[0], torch.tensor([g0 + g0 * g1, g0 * g1, 0.0, 0.0]))


def test_mode_weighting_gives_the_highest_coverage_mode_the_largest_weight():
    # 2 examples, 3 modes, 3 positions: label probabilities per mode.
    q = torch.tensor([[[0.9, 0.1, 0.1], [0.6, 0.6, 0.6], [0.2, 0.9, 0.9]],
                      [[0.1, 0.9, 0.9], [0.3, 0.3, 0.3], [0.95, 0.95, 0.9]]])
    coverage = chain_coverage(q)
    torch.testing.assert_close(coverage[0, 1], torch.tensor(0.6 + 0.36 + 0.216))
    w = mode_weights(coverage, 0.9)
    # Mode 0 has the best first token in example 0 but mode 1 covers more of the block.
    assert w[0].argmax() == 1 and w[1].argmax() == 2
    assert torch.all(w > 0) and torch.allclose(w.sum(-1), torch.ones(2))
    assert float(w.min()) == pytest.approx(0.1 / 3)


# --- data ---------------------------------------------------------------------------------------

def test_regeneration_is_the_targets_greedy_output_and_resumable(tiny_pair, target, data, tmp_path):
    records = read_records(data)
    assert len(records) == 48 and len({r["id"] for r in records}) == 48
    assert set(records[0]) == {"id", "set", "input_ids", "response_ids"}
    for r in records[:4]:
        assert r["response_ids"] == target_greedy(target, r["input_ids"], MAX_NEW, {2})
    # A second call adds nothing; an interrupted one (a torn last line) is completed.
    assert regenerate(tiny_pair / "target", data, tiny_prompts(tiny_pair, 48), max_new_tokens=MAX_NEW,
                      chat_template=False, progress=False, target=target) == 0
    partial = tmp_path / "partial.jsonl"
    lines = data.read_text().splitlines()
    partial.write_text("\n".join(lines[:10]) + "\n" + lines[10][:15])
    assert regenerate(tiny_pair / "target", partial, tiny_prompts(tiny_pair, 48), max_new_tokens=MAX_NEW,
                      batch_size=16, chat_template=False, progress=False, target=target) == 38
    again = read_records(partial)
    assert sorted(r["id"] for r in again) == sorted(r["id"] for r in records)
    by_id = {r["id"]: r for r in records}
    assert all(r == by_id[r["id"]] for r in again)


def test_regeneration_uses_the_training_split_only(tiny_pair, tmp_path):
    from mfd_sglang.lab.prompts import load_prompts, split_of
    from mfd_sglang.lab.train_data import TrainPrompt, training_prompts

    code = training_prompts(["code"])
    assert code and all(split_of(p.set, p.text) == "train" for p in code)
    assert len(code) == len(load_prompts("code", split="train")) < len(load_prompts("code"))
    held = load_prompts("code", split="heldout", limit=1)
    with pytest.raises(ValueError, match="held-out"):
        regenerate(tiny_pair / "target", tmp_path / "x.jsonl", [TrainPrompt(p.id, p.set, p.text) for p in held])


# --- training -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def single_mode(tiny_pair, data, tmp_path_factory):
    """A single-mode drafter trained from scratch through the CLI."""
    out = tmp_path_factory.mktemp("single") / "drafter"
    assert main(["train", "--target", str(tiny_pair / "target"), "--out", str(out), "--data", str(data),
                 "--steps", "150", "--batch-size", "4", "--anchors", "8", "--block-size", "8", "--layers", "1",
                 "--lr", "3e-3", "--save-every", "50", "--quiet"]) == 0
    return out


def test_training_lowers_the_loss_and_writes_a_lossless_checkpoint(tiny_pair, target, single_mode):
    log = [json.loads(line) for line in (single_mode / "train_state" / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in log] == list(range(1, 151))
    # D-PACE's weights grow as the drafter starts to agree, so its loss falls slower than the cross-entropy.
    losses = [entry["loss"] for entry in log]
    assert sum(losses[-8:]) / 8 < 0.8 * sum(losses[:8]) / 8, losses
    ce = [entry["cross_entropy"] for entry in log]
    assert sum(ce[-8:]) / 8 < 0.5 * sum(ce[:8]) / 8, ce
    assert sum(entry["accuracy"][0] for entry in log[-10:]) / 10 > 0.5, [entry["accuracy"] for entry in log[-10:]]
    ckpt = load_drafter(single_mode)
    assert ckpt.config.num_modes == 1 and ckpt.kind == "dflash" and ckpt.config.block_size == 8
    assert_lossless(tiny_pair, target, single_mode)


def test_mfd_from_a_single_mode_drafter_with_its_default_path(tiny_pair, target, data, single_mode, tmp_path):
    base = MFDDrafter.from_checkpoint(load_drafter(single_mode))
    cfg = small(tiny_pair, data, tmp_path / "mfd", num_modes=2, init_from=str(single_mode), block_size=None,
                layers=None, steps=4, lr=1e-3)
    result = train(cfg, progress=False, log=lambda *a: None)
    assert len(result.mode_usage) == 2 and sum(result.mode_usage) == pytest.approx(1.0)
    ckpt = load_drafter(tmp_path / "mfd")
    assert ckpt.config.num_modes == 2 and ckpt.config.default_mode is None  # "embed": default_mode_embed
    assert json.loads((tmp_path / "mfd" / "config.json").read_text())["mfd_config"]["default_mode"] == "embed"
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert drafter.default_mode_embed is not None and not torch.equal(drafter.default_mode_embed, torch.zeros(64))
    # Copied from the single-mode drafter, then fine-tuned a little (not re-initialised).
    assert (drafter.fc.weight - base.fc.weight).abs().max() < 0.05
    assert not torch.equal(drafter.mode_embed[0], drafter.mode_embed[1])
    assert_lossless(tiny_pair, target, tmp_path / "mfd")
    assert_lossless(tiny_pair, target, tmp_path / "mfd", single_mode=True)


def test_resume_continues_bit_identically(tiny_pair, data, tmp_path):
    quiet = dict(progress=False, log=lambda *a: None)
    whole = train(small(tiny_pair, data, tmp_path / "whole", num_modes=2, steps=6, save_every=3), **quiet)
    cut = small(tiny_pair, data, tmp_path / "cut", num_modes=2, steps=6, save_every=3)
    first = train(cut, stop_after=3, **quiet)
    assert first.step == 3
    with pytest.raises(FileExistsError):
        train(cut, **quiet)  # an existing run is never overwritten silently
    with pytest.raises(ValueError, match="differs"):
        train(small(tiny_pair, data, tmp_path / "cut", num_modes=2, steps=6, save_every=3, lr=1e-3),
              resume=True, **quiet)
    second = train(cut, resume=True, **quiet)
    assert second.step == 6
    assert first.losses + second.losses == whole.losses
    a, b = load_drafter(tmp_path / "whole").weights, load_drafter(tmp_path / "cut").weights
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_draft_vocabulary_trains_and_maps_back_to_target_ids(tiny_pair, target, data, tmp_path):
    sequences = load_sequences(data, 512)
    vocab = build_draft_vocab(sequences, 12)
    assert vocab.numel() == 12 and torch.all(vocab[1:] > vocab[:-1])
    result = train(small(tiny_pair, data, tmp_path / "dv", draft_vocab_size=12, steps=6), progress=False,
                   log=lambda *a: None)
    assert all(torch.isfinite(torch.tensor(result.losses)))
    ckpt = load_drafter(tmp_path / "dv")
    assert ckpt.config.draft_vocab_size == 12 and torch.equal(ckpt.weights["draft_vocab"], vocab)
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert torch.equal(drafter.to_target_ids(torch.arange(12)), vocab)
    assert_lossless(tiny_pair, target, tmp_path / "dv")
    # Labels outside the draft vocabulary carry no loss: a block whose labels are all outside costs nothing.
    outside = next(t for t in range(drafter.cfg.vocab_size) if t not in set(vocab.tolist()))
    tokens = torch.full((1, 20), outside)
    features = torch.randn(1, 20, drafter.fc.weight.shape[1])
    embed = target.get_input_embeddings().weight.detach()
    lm_head = target.get_output_embeddings().weight.detach()
    for loss in ("dpace", "decay"):
        out = block_loss(drafter, embed, lm_head, tokens, features, torch.tensor([[3, 5]]), loss=loss)
        assert float(out.loss.detach()) == 0.0


def test_bfloat16_training_runs(tiny_pair, data, tmp_path):
    result = train(small(tiny_pair, data, tmp_path / "bf16", dtype="bfloat16", steps=3), progress=False,
                   log=lambda *a: None)
    assert len(result.losses) == 3 and all(torch.isfinite(torch.tensor(result.losses)))
    assert load_drafter(tmp_path / "bf16").weights["fc.weight"].dtype == torch.float32


def test_train_cli_regenerates_tiny_data_and_explains_itself(tiny_pair, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for option in ("--regenerate-sets", "--num-modes", "--init-from", "--resume", "--draft-vocab-size", "--device",
                   "SmolLM2"):
        assert option in help_text
    out = tmp_path / "cli"
    args = ["train", "--target", str(tiny_pair / "target"), "--out", str(out), "--regenerate-sets", "tiny",
            "--limit", "10", "--max-new-tokens", "16", "--steps", "2", "--block-size", "8", "--anchors", "4",
            "--quiet"]
    if not torch.cuda.is_available():  # refused before any work, naming the flag
        assert main(args + ["--device", "cuda"]) == 2 and "--device cuda: PyTorch sees no CUDA device" in \
            capsys.readouterr().err and not out.exists()
    assert main(args) == 0
    settings = json.loads((out / "train_state" / "settings.json").read_text())
    assert settings["device"] == ("cuda" if torch.cuda.is_available() else "cpu"), settings  # the default
    assert len(read_records(out / "train_state" / "data.jsonl")) == 10
    assert main(args) == 2  # the state exists: --resume or a new --out
    assert main(args + ["--resume"]) == 0  # nothing left to do, nothing regenerated
    assert len(read_records(out / "train_state" / "data.jsonl")) == 10
    load_drafter(out)
