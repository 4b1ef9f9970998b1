"""Drafter checkpoints: the DFlash (z-lab) layout and its MFD extension load, every mismatch is a
CheckpointError naming field, found and expected value, the target fit check, and `inspect`."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mfd_sglang.checkpoint import (
    CheckpointError,
    check_fits_target,
    expected_shapes,
    load_drafter,
    parse_drafter_config,
)
from mfd_sglang.cli import describe_drafter, main
from mfd_sglang.drafter import MFDDrafter

REPO = Path(__file__).resolve().parents[1]

HIDDEN, VOCAB, TARGET_DEPTH = 32, 100, 4
LAYER_IDS = [0, 2]
MASK_ID = 97


def zlab_config(num_layers: int = 2, **overrides) -> dict:
    """A tiny Qwen3-style DFlash drafter config.json, as z-lab writes it."""
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": VOCAB,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "max_position_embeddings": 4096,
        "attention_bias": False,
        "torch_dtype": "float32",
        "block_size": 8,
        "num_target_layers": TARGET_DEPTH,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": list(LAYER_IDS)},
    }
    raw.update(overrides)
    return raw


def dflash_weights(raw: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random tensors of exactly the shapes a drafter with this config needs."""
    gen = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(parse_drafter_config(raw))
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def mfd_weights(raw: dict, num_modes: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1)
    weights = dflash_weights(raw, seed)
    weights["mode_embed"] = torch.randn(num_modes, HIDDEN, generator=gen)
    weights["mode_gate.weight"] = torch.randn(num_modes, 2 * HIDDEN, generator=gen)
    return weights


def write(path: Path, raw: dict | None, weights: dict[str, torch.Tensor], *, prefix: str = "",
          shards: int = 0) -> Path:
    """Write a drafter directory: config.json and model.safetensors (or `shards` shards + index)."""
    path.mkdir(parents=True, exist_ok=True)
    if raw is not None:
        (path / "config.json").write_text(json.dumps(raw, indent=2))
    named = {prefix + name: t.contiguous() for name, t in weights.items()}
    if not shards:
        save_file(named, str(path / "model.safetensors"))
        return path
    names = sorted(named)
    weight_map = {}
    for s in range(shards):
        shard = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: named[n] for n in part}, str(path / shard))
        weight_map |= {n: shard for n in part}
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in named.values())},
             "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def error_pattern(field: str, found: str, expected: str) -> str:
    """The CheckpointError message shape: `<field>: found <found>, expected <expected>...`."""
    return rf"{re.escape(field)}: found {found}, expected .*{expected}"


def assert_round_trip(ckpt, weights: dict[str, torch.Tensor]) -> None:
    """MFDDrafter.from_checkpoint then checkpoint_weights() gives back every tensor exactly."""
    drafter = MFDDrafter.from_checkpoint(ckpt)
    out = drafter.checkpoint_weights()
    assert set(out) == set(weights)
    for name, tensor in weights.items():
        assert out[name].dtype == tensor.dtype, name
        assert torch.equal(out[name], tensor), name


TARGET = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": HIDDEN, "vocab_size": VOCAB,
          "num_hidden_layers": TARGET_DEPTH}


# --- 1. DFlash (z-lab) layout ------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "model."])
@pytest.mark.parametrize("shards", [0, 2])
def test_dflash_zlab_layout_loads_as_one_mode(tmp_path, prefix, shards):
    raw = zlab_config()
    weights = dflash_weights(raw)
    path = write(tmp_path / "drafter", raw, weights, prefix=prefix, shards=shards)
    if shards:
        assert not (path / "model.safetensors").exists()
        assert len(list(path.glob("model-*-of-00002.safetensors"))) == 2

    ckpt = load_drafter(path)
    cfg = ckpt.config
    assert ckpt.kind == "dflash"
    assert ckpt.path == path
    assert ckpt.ignored == ()
    assert (cfg.num_modes, cfg.default_mode, cfg.draft_vocab_size) == (1, 0, None)
    assert cfg.hidden_size == HIDDEN and cfg.num_hidden_layers == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 8)
    assert cfg.block_size == 8 and cfg.num_draft_positions == 7
    assert cfg.target_layer_ids == tuple(LAYER_IDS)
    assert cfg.mask_token_id == MASK_ID
    assert cfg.num_target_layers == TARGET_DEPTH
    assert cfg.rope_theta == 1000000.0
    assert cfg.extra["architectures"] == ["DFlashDraftModel"]
    # Canonical names: the `model.` prefix is gone, values are the ones written.
    assert set(ckpt.weights) == set(weights)
    assert ckpt.weights["fc.weight"].shape == (HIDDEN, len(LAYER_IDS) * HIDDEN)
    assert all(torch.equal(ckpt.weights[n], t) for n, t in weights.items())
    assert_round_trip(ckpt, weights)


def test_dflash_one_layer_and_keys_at_top_level(tmp_path):
    raw = zlab_config(num_layers=1)
    del raw["dflash_config"], raw["block_size"]
    raw |= {"mask_token_id": 5, "target_layer_ids": [1, 2, 3], "dflash_config": {"block_size": 4}}
    weights = dflash_weights(raw, seed=3)
    assert weights["fc.weight"].shape == (HIDDEN, 3 * HIDDEN)
    assert not any(n.startswith("layers.1.") for n in weights)

    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.kind == "dflash" and ckpt.config.num_modes == 1
    assert ckpt.config.mask_token_id == 5
    assert ckpt.config.target_layer_ids == (1, 2, 3)
    assert ckpt.config.block_size == 4
    assert_round_trip(ckpt, weights)


def test_dflash_config_block_wins_over_top_level(tmp_path):
    raw = zlab_config(mask_token_id=1, target_layer_ids=[3])
    ckpt = load_drafter(write(tmp_path / "d", raw, dflash_weights(raw)))
    assert ckpt.config.mask_token_id == MASK_ID
    assert ckpt.config.target_layer_ids == tuple(LAYER_IDS)


def test_default_block_size_is_16(tmp_path):
    raw = zlab_config()
    del raw["block_size"]
    assert load_drafter(write(tmp_path / "d", raw, dflash_weights(raw))).config.block_size == 16


def test_missing_shard_is_named(tmp_path):
    raw = zlab_config()
    path = write(tmp_path / "d", raw, dflash_weights(raw), shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match=error_pattern(
            "model.safetensors.index.json shard", "'model-00002-of-00002.safetensors'", "an existing file")):
        load_drafter(path)


@pytest.mark.parametrize("index", ["{not json", json.dumps({"metadata": {}})])
def test_broken_shard_index_is_a_checkpoint_error(tmp_path, index):
    raw = zlab_config()
    path = write(tmp_path / "d", raw, dflash_weights(raw), shards=2)
    (path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json.*: found .*, expected "):
        load_drafter(path)


# --- 2. MFD ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prefix", ["", "model."])
def test_mfd_infers_k_from_mode_embed_and_ignores_mode_gate(tmp_path, prefix):
    raw = zlab_config()
    weights = mfd_weights(raw, num_modes=5)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights, prefix=prefix))
    assert ckpt.kind == "mfd"
    assert ckpt.config.num_modes == 5
    assert ckpt.config.default_mode == 0
    assert ckpt.ignored == ("mode_gate.weight",)
    assert "mode_gate.weight" not in ckpt.weights
    assert torch.equal(ckpt.weights["mode_embed"], weights["mode_embed"])
    kept = {n: t for n, t in weights.items() if not n.startswith("mode_gate.")}
    assert_round_trip(ckpt, kept)
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert torch.equal(drafter.mode_vectors(single_mode=False), weights["mode_embed"])
    assert torch.equal(drafter.mode_vectors(single_mode=True), weights["mode_embed"][:1])


def test_mfd_sharded_with_prefix(tmp_path):
    raw = zlab_config(mfd_config={"num_modes": 4})
    weights = mfd_weights(raw, num_modes=4)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights, prefix="model.", shards=2))
    assert (ckpt.kind, ckpt.config.num_modes, ckpt.ignored) == ("mfd", 4, ("mode_gate.weight",))
    assert_round_trip(ckpt, {n: t for n, t in weights.items() if n != "mode_gate.weight"})


def test_mfd_config_num_modes_agreeing(tmp_path):
    raw = zlab_config(mfd_config={"num_modes": 3})
    ckpt = load_drafter(write(tmp_path / "d", raw, mfd_weights(raw, num_modes=3)))
    assert ckpt.config.num_modes == 3 and ckpt.kind == "mfd"


def test_default_mode_explicit_index(tmp_path):
    raw = zlab_config(mfd_config={"default_mode": 2})
    weights = mfd_weights(raw, num_modes=4)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.config.default_mode == 2
    assert describe_drafter(ckpt)["default_path"] == "mode 2"
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert drafter.default_mode_embed is None
    assert torch.equal(drafter.mode_vectors(single_mode=True), weights["mode_embed"][2:3])


@pytest.mark.parametrize("mfd_config", [{"default_mode": "embed"}, None], ids=["embed", "config-silent"])
def test_default_mode_embed_tensor(tmp_path, mfd_config):
    raw = zlab_config() if mfd_config is None else zlab_config(mfd_config=mfd_config)
    weights = mfd_weights(raw, num_modes=4)
    weights["default_mode_embed"] = torch.randn(HIDDEN, generator=torch.Generator().manual_seed(9))
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.config.default_mode is None
    assert describe_drafter(ckpt)["default_path"] == "default_mode_embed"
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert torch.equal(drafter.mode_vectors(single_mode=True), weights["default_mode_embed"][None])
    assert_round_trip(ckpt, {n: t for n, t in weights.items() if n != "mode_gate.weight"})


def test_draft_vocab(tmp_path):
    raw = zlab_config(mfd_config={"draft_vocab_size": 6})
    weights = mfd_weights(raw, num_modes=2)
    weights["draft_vocab"] = torch.tensor([0, 3, 4, 10, 57, VOCAB - 1], dtype=torch.int64)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.config.draft_vocab_size == 6
    assert describe_drafter(ckpt)["draft_vocab_size"] == 6
    assert torch.equal(ckpt.weights["draft_vocab"], weights["draft_vocab"])


def test_draft_vocab_round_trip(tmp_path):
    raw = zlab_config()
    weights = mfd_weights(raw, num_modes=2)
    weights["draft_vocab"] = torch.tensor([0, 3, 4, 10, 57, VOCAB - 1], dtype=torch.int64)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    drafter = MFDDrafter.from_checkpoint(ckpt)
    assert torch.equal(drafter.to_target_ids(torch.tensor([1, 5])), torch.tensor([3, VOCAB - 1]))
    assert_round_trip(ckpt, {n: t for n, t in weights.items() if n != "mode_gate.weight"})


def test_single_row_mode_embed_round_trip(tmp_path):
    raw = zlab_config()
    weights = mfd_weights(raw, num_modes=1)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.kind == "mfd" and ckpt.config.num_modes == 1
    assert_round_trip(ckpt, {n: t for n, t in weights.items() if n != "mode_gate.weight"})


def test_draft_vocab_size_inferred_when_config_silent(tmp_path):
    raw = zlab_config()
    weights = dflash_weights(raw)
    weights["draft_vocab"] = torch.arange(0, VOCAB, 3, dtype=torch.int64)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.config.draft_vocab_size == len(range(0, VOCAB, 3))
    assert ckpt.kind == "dflash"


# --- 3. every mismatch is a CheckpointError naming field, found and expected -------------------

def _drop(name):
    def edit(raw, weights):
        del weights[name]
    return edit


def _set_cfg(**changes):
    def edit(raw, weights):
        raw.update(changes)
    return edit


def _set_dflash(**changes):
    def edit(raw, weights):
        raw["dflash_config"].update(changes)
    return edit


def _set_mfd(**changes):
    def edit(raw, weights):
        raw.setdefault("mfd_config", {}).update(changes)
    return edit


def _set_tensor(name, tensor):
    def edit(raw, weights):
        weights[name] = tensor
    return edit


def _both(*edits):
    def edit(raw, weights):
        for e in edits:
            e(raw, weights)
    return edit


def _no_target_layer_ids(raw, weights):
    del raw["dflash_config"]["target_layer_ids"]


N_TENSORS = 3 + 2 * 11  # fc, hidden_norm, norm + 11 per layer

BAD_CASES = {
    "target_layer_ids missing": (
        _no_target_layer_ids, "dflash_config.target_layer_ids", "None", "a non-empty list of layer indices"),
    "target_layer_ids empty": (
        _set_dflash(target_layer_ids=[]), "dflash_config.target_layer_ids", r"\[\]", "a non-empty list"),
    "mask_token_id negative": (
        _set_dflash(mask_token_id=-1), "dflash_config.mask_token_id", "-1", "a token id >= 0"),
    "mask_token_id not an int": (
        _set_dflash(mask_token_id="97"), "dflash_config.mask_token_id", "'97'", "a token id >= 0"),
    "block_size 1": (_set_cfg(block_size=1), "block_size", "1", "an integer >= 2"),
    "hidden_size missing": (_set_cfg(hidden_size=None), "config.json hidden_size", "None", "an integer"),
    "rope yarn": (
        _set_cfg(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type", "'yarn'",
        "'default'"),
    "rope legacy type key": (
        _set_cfg(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling.rope_type", "'linear'",
        "'default'"),
    "missing tensor": (
        _drop("layers.1.mlp.up_proj.weight"), "weights", r".*missing .*'layers\.1\.mlp\.up_proj\.weight'.*",
        f"all {N_TENSORS} DFlash tensors"),
    "wrong layer shape": (
        _set_tensor("layers.0.self_attn.k_proj.weight", torch.zeros(16, HIDDEN + 1)),
        "layers.0.self_attn.k_proj.weight shape", r"\(16, 33\)", r"\[16, 32\]"),
    "wrong norm shape": (
        _set_tensor("layers.1.self_attn.q_norm.weight", torch.zeros(HIDDEN)),
        "layers.1.self_attn.q_norm.weight shape", r"\(32,\)", r"\[8\]"),
    "fc not a multiple of the layer count": (
        _set_tensor("fc.weight", torch.zeros(HIDDEN, 2 * HIDDEN + 1)), "fc.weight shape", r"\(32, 65\)",
        r"\[32, 2 x target hidden size\]"),
    "unknown tensor": (
        _set_tensor("lm_head.weight", torch.zeros(VOCAB, HIDDEN)), "weights",
        r".*unknown tensors \['lm_head\.weight'\].*", "only DFlash/MFD drafter tensors"),
    "mode_embed wrong hidden": (
        _set_tensor("mode_embed", torch.zeros(4, HIDDEN - 1)), "mode_embed shape", r"\(4, 31\)", r"\[K, 32\]"),
    "mode_embed 1-D": (
        _set_tensor("mode_embed", torch.zeros(HIDDEN)), "mode_embed shape", r"\(32,\)", r"\[K, 32\]"),
    "num_modes disagrees": (
        _both(_set_mfd(num_modes=3), _set_tensor("mode_embed", torch.zeros(4, HIDDEN))),
        "mfd_config.num_modes", "3", r"4 \(rows of mode_embed\)"),
    "num_modes without mode_embed": (
        _set_mfd(num_modes=4), "mode_embed", "None", r"a \[4, 32\] tensor"),
    "num_modes zero": (_set_mfd(num_modes=0), "mfd_config.num_modes", "0", "an integer >= 1"),
    "default_mode >= K": (
        _both(_set_mfd(default_mode=4), _set_tensor("mode_embed", torch.zeros(4, HIDDEN))),
        "mfd_config.default_mode", "4", "a mode index below K = 4"),
    "default_mode >= K (dflash)": (
        _set_mfd(default_mode=1), "mfd_config.default_mode", "1", "a mode index below K = 1"),
    "default_mode negative": (
        _both(_set_mfd(default_mode=-1), _set_tensor("mode_embed", torch.zeros(4, HIDDEN))),
        "mfd_config.default_mode", "-1", "a mode index >= 0"),
    "default_mode unknown word": (
        _set_mfd(default_mode="best"), "mfd_config.default_mode", "'best'", "a mode index >= 0"),
    "default_mode embed without tensor": (
        _set_mfd(default_mode="embed"), "default_mode_embed", "None", r"a \[32\] tensor"),
    "default_mode index with a default_mode_embed tensor": (
        _both(_set_mfd(default_mode=1), _set_tensor("mode_embed", torch.zeros(4, HIDDEN)),
              _set_tensor("default_mode_embed", torch.zeros(HIDDEN))),
        "default_mode_embed", r"'a \[32\] tensor'", "none with mfd_config.default_mode = 1"),
    "default_mode_embed wrong shape": (
        _set_tensor("default_mode_embed", torch.zeros(HIDDEN + 1)), "default_mode_embed shape", r"\(33,\)",
        r"\[32\]"),
    "draft_vocab unsorted": (
        _set_tensor("draft_vocab", torch.tensor([1, 5, 3], dtype=torch.int64)), "draft_vocab",
        "'unsorted or repeated ids'", "strictly increasing target token ids"),
    "draft_vocab repeated": (
        _set_tensor("draft_vocab", torch.tensor([1, 5, 5], dtype=torch.int64)), "draft_vocab",
        "'unsorted or repeated ids'", "strictly increasing target token ids"),
    "draft_vocab float": (
        _set_tensor("draft_vocab", torch.tensor([1.0, 2.0])), "draft_vocab", r"'torch\.float32 \(2,\)'",
        "a 1-D int64 tensor"),
    "draft_vocab id >= vocab": (
        _set_tensor("draft_vocab", torch.tensor([0, 7, VOCAB], dtype=torch.int64)), "draft_vocab ids",
        rf"\(0, {VOCAB}\)", rf"ids in \[0, {VOCAB}\)"),
    "draft_vocab_size disagrees": (
        _both(_set_mfd(draft_vocab_size=4), _set_tensor("draft_vocab", torch.tensor([1, 2, 3]))),
        "mfd_config.draft_vocab_size", "4", r"3 \(length of draft_vocab\)"),
    "sliding layer without window": (
        _set_cfg(layer_types=["sliding_attention", "full_attention"]), "sliding_window", "None",
        "an integer when layer_types has sliding_attention"),
    "layer_types wrong length": (
        _set_cfg(layer_types=["full_attention"]), "layer_types", r"\['full_attention'\]",
        "2 entries of 'full_attention'/'sliding_attention'"),
}


@pytest.mark.parametrize("case", list(BAD_CASES), ids=list(BAD_CASES))
def test_mismatch_is_a_checkpoint_error(tmp_path, case):
    edit, field, found, expected = BAD_CASES[case]
    raw = zlab_config()
    weights = dflash_weights(raw)
    edit(raw, weights)
    path = write(tmp_path / "d", raw, weights)
    with pytest.raises(CheckpointError, match=error_pattern(field, found, expected)):
        load_drafter(path)


def test_valid_variants_of_the_bad_cases_load(tmp_path):
    """The edits above fail for their values, not for the kind of edit: nearby values load."""
    raw = zlab_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4, use_sliding_window=True,
                      rope_scaling={"rope_type": "default"}, mfd_config={"num_modes": 4, "default_mode": 3})
    weights = mfd_weights(raw, num_modes=4)
    weights["draft_vocab"] = torch.tensor([0, 7, VOCAB - 1], dtype=torch.int64)
    ckpt = load_drafter(write(tmp_path / "d", raw, weights))
    assert ckpt.config.is_sliding(0) and not ckpt.config.is_sliding(1)
    assert ckpt.config.sliding_window == 4
    assert (ckpt.config.num_modes, ckpt.config.default_mode, ckpt.config.draft_vocab_size) == (4, 3, 3)


def test_missing_config_json(tmp_path):
    raw = zlab_config()
    path = write(tmp_path / "d", None, dflash_weights(raw))
    with pytest.raises(CheckpointError, match=error_pattern("config.json", "None", re.escape(str(path / "config.json")))):
        load_drafter(path)


@pytest.mark.parametrize("text,found", [('{"hidden_size": 32,', "'invalid JSON.*"), ("[1, 2]", "'list'")])
def test_config_that_is_not_a_json_object(tmp_path, text, found):
    raw = zlab_config()
    path = write(tmp_path / "d", raw, dflash_weights(raw))
    (path / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=error_pattern("config.json", found, "a JSON object")):
        load_drafter(path)


def test_no_safetensors_file(tmp_path):
    raw = zlab_config()
    path = tmp_path / "d"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(raw))
    torch.save(dflash_weights(raw), path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=error_pattern(
            "weights", re.escape("['config.json', 'pytorch_model.bin']"),
            r"model\.safetensors or model\.safetensors\.index\.json")):
        load_drafter(path)


def test_path_not_a_directory(tmp_path):
    file = tmp_path / "drafter.safetensors"
    save_file({"x": torch.zeros(1)}, str(file))
    for path in (file, tmp_path / "nowhere"):
        with pytest.raises(CheckpointError, match=error_pattern(
                "drafter path", re.escape(repr(str(path))), "a directory with config.json")):
            load_drafter(path)


# --- 4. the fit check against a target ---------------------------------------------------------

@pytest.fixture
def dflash_ckpt(tmp_path):
    raw = zlab_config()
    return load_drafter(write(tmp_path / "drafter", raw, dflash_weights(raw)))


def _target_dir(tmp_path: Path, config: dict, name: str = "target") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_fits_target_dict_and_directory(tmp_path, dflash_ckpt):
    check_fits_target(dflash_ckpt, dict(TARGET))
    check_fits_target(dflash_ckpt, _target_dir(tmp_path, TARGET))
    check_fits_target(dflash_ckpt, str(_target_dir(tmp_path, TARGET, "as-str")))


def test_fits_nested_text_config_target(tmp_path, dflash_ckpt):
    multimodal = {"architectures": ["Qwen3_5ForConditionalGeneration"], "vision_config": {"hidden_size": 8},
                  "text_config": dict(TARGET)}
    check_fits_target(dflash_ckpt, multimodal)
    check_fits_target(dflash_ckpt, _target_dir(tmp_path, multimodal))
    bad = copy.deepcopy(multimodal)
    bad["text_config"]["vocab_size"] = VOCAB + 8
    with pytest.raises(CheckpointError, match=error_pattern("vocab_size", str(VOCAB), f"{VOCAB + 8}")):
        check_fits_target(dflash_ckpt, bad)


MISFITS = {
    "hidden size": ({"hidden_size": 64}, "hidden_size", str(HIDDEN), "64"),
    "vocab": ({"vocab_size": 256}, "vocab_size", str(VOCAB), "256"),
    "layer id beyond depth": (
        {"num_hidden_layers": 2}, "dflash_config.target_layer_ids", re.escape(str(LAYER_IDS)),
        r"below the target's depth 2 \(out of range: \[2\]\)"),
    "depth disagrees": ({"num_hidden_layers": 6}, "num_target_layers", str(TARGET_DEPTH), "6"),
}


@pytest.mark.parametrize("case", list(MISFITS), ids=list(MISFITS))
def test_does_not_fit_target(tmp_path, dflash_ckpt, case):
    change, field, found, expected = MISFITS[case]
    target = TARGET | change
    pattern = error_pattern(field, found, expected)
    with pytest.raises(CheckpointError, match=pattern):
        check_fits_target(dflash_ckpt, target)
    with pytest.raises(CheckpointError, match=pattern):
        check_fits_target(dflash_ckpt, _target_dir(tmp_path, target))


def test_mask_token_beyond_target_vocab(tmp_path):
    raw = zlab_config(dflash_config={"mask_token_id": VOCAB, "target_layer_ids": LAYER_IDS})
    ckpt = load_drafter(write(tmp_path / "d", raw, dflash_weights(raw)))
    with pytest.raises(CheckpointError, match=error_pattern(
            "dflash_config.mask_token_id", str(VOCAB), f"below the target's vocab_size {VOCAB}")):
        check_fits_target(ckpt, TARGET)


def test_drafter_without_num_target_layers_fits_any_deep_enough_target(tmp_path):
    raw = zlab_config()
    del raw["num_target_layers"]
    ckpt = load_drafter(write(tmp_path / "d", raw, dflash_weights(raw)))
    assert ckpt.config.num_target_layers is None
    check_fits_target(ckpt, TARGET | {"num_hidden_layers": 12})
    with pytest.raises(CheckpointError, match="dflash_config.target_layer_ids"):
        check_fits_target(ckpt, TARGET | {"num_hidden_layers": 2})


def test_target_directory_problems(tmp_path, dflash_ckpt):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match=error_pattern("target config.json", "None", "a file at")):
        check_fits_target(dflash_ckpt, empty)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{")
    with pytest.raises(CheckpointError, match=error_pattern("target config.json", "'invalid JSON.*", "a JSON object")):
        check_fits_target(dflash_ckpt, broken)


# --- 5. the `inspect` command ------------------------------------------------------------------

@pytest.fixture
def mfd_dir(tmp_path):
    raw = zlab_config(mfd_config={"num_modes": 4, "default_mode": 2})
    return write(tmp_path / "mfd", raw, mfd_weights(raw, num_modes=4), prefix="model.")


def test_inspect_prints_description(mfd_dir, capsys):
    assert main(["inspect", str(mfd_dir)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    rows = dict(line.split(None, 1) for line in out.strip().splitlines())
    info = describe_drafter(load_drafter(mfd_dir))
    assert set(rows) == set(info)
    assert rows["kind"].strip() == "mfd"
    assert rows["num_modes"].strip() == "4"
    assert rows["default_path"].strip() == "mode 2"
    assert rows["ignored_tensors"].strip() == "['mode_gate.weight']"


def test_inspect_json(mfd_dir, capsys):
    assert main(["inspect", str(mfd_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["kind"] == "mfd"
    assert info["num_modes"] == 4
    assert info["default_path"] == "mode 2"
    assert info["path"] == str(mfd_dir)
    assert info["target_layer_ids"] == LAYER_IDS
    assert info["ignored_tensors"] == ["mode_gate.weight"]
    assert "fits_target" not in info
    shapes = expected_shapes(load_drafter(mfd_dir).config)
    expected_params = sum(math.prod(shape) for shape in shapes.values()) + 4 * HIDDEN  # + mode_embed
    assert info["parameters"] == expected_params


def test_inspect_dflash_json(tmp_path, capsys):
    raw = zlab_config()
    path = write(tmp_path / "d", raw, dflash_weights(raw))
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["kind"], info["num_modes"], info["default_path"]) == ("dflash", 1, "mode 0")


def test_inspect_with_fitting_target(tmp_path, mfd_dir, capsys):
    target = _target_dir(tmp_path, TARGET)
    assert main(["inspect", str(mfd_dir), "--target", str(target), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fits_target"] is True
    assert info["target"] == str(target)


def test_inspect_with_mismatched_target(tmp_path, mfd_dir, capsys):
    target = _target_dir(tmp_path, TARGET | {"hidden_size": 64})
    assert main(["inspect", str(mfd_dir), "--target", str(target), "--json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: ")
    assert "hidden_size: found 32, expected 64" in err
    assert "Traceback" not in err


def test_inspect_broken_checkpoint(tmp_path, capsys):
    raw = zlab_config()
    weights = dflash_weights(raw)
    del weights["norm.weight"]
    path = write(tmp_path / "d", raw, weights)
    assert main(["inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: weights: found ") and "norm.weight" in err
    assert "Traceback" not in err


def test_module_entry_point(mfd_dir, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    ok = subprocess.run([sys.executable, "-m", "mfd_sglang", "inspect", str(mfd_dir), "--json"],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    info = json.loads(ok.stdout)
    assert (info["kind"], info["num_modes"], info["default_path"]) == ("mfd", 4, "mode 2")
