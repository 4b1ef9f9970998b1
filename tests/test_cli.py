"""The CLI contracts of architecture.md: make-tiny and generate (inspect: test_checkpoint.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from conftest import target_greedy
from mfd_sglang.checkpoint import load_drafter
from mfd_sglang.cli import main
from mfd_sglang.hf import load_target

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mfd_sglang", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_generate_json_is_the_targets_greedy_output_with_tau_at_least_2(tiny_pair, tiny_prompts):
    tokenizer = AutoTokenizer.from_pretrained(tiny_pair / "target")
    target = load_target(tiny_pair / "target")
    taus = []
    for prompt in tiny_prompts:
        proc = run_cli("generate", "--target", str(tiny_pair / "target"), "--drafter", str(tiny_pair / "drafter"),
                       "--prompt", prompt, "--max-new-tokens", "48", "--budget", "16", "--json")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        assert report["token_ids"] == target_greedy(target, ids, 48)
        assert set(report["stage_seconds"]) == {"draft", "tree", "verify", "commit"}
        taus.append(report["tau"])
    # The make-tiny contract: the drafter agrees with the target (tau >= 2 at budget 16 on its own prompts).
    assert sum(taus) / len(taus) >= 2.0, taus


def test_generate_prints_text_tau_and_stage_times(tiny_pair, capsys):
    code = main(["generate", "--target", str(tiny_pair / "target"), "--drafter", str(tiny_pair / "drafter"),
                 "--prompt", "one two three", "--max-new-tokens", "16", "--temperature", "0.8", "--seed", "3"])
    assert code == 0
    out = capsys.readouterr().out
    assert "tau" in out and "draft" in out and "verify" in out and "commit" in out


def test_generate_rejects_a_bad_budget_and_a_mismatched_pair(tiny_pair, tmp_path, capsys):
    args = ["generate", "--target", str(tiny_pair / "target"), "--drafter", str(tiny_pair / "drafter"),
            "--prompt", "one", "--max-new-tokens", "4"]
    assert main(args + ["--budget", "0"]) == 2
    assert "--budget must be >= 1" in capsys.readouterr().err
    config = json.loads((tiny_pair / "target" / "config.json").read_text())
    config["num_hidden_layers"] = 1  # below the drafter's target layer 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--target", str(tmp_path), "--drafter", str(tiny_pair / "drafter"),
                 "--prompt", "one", "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "target_layer_ids" in err


def test_make_tiny_is_deterministic_per_seed(tmp_path):
    def build(name: str, seed: int) -> Path:
        out = tmp_path / name
        assert main(["make-tiny", str(out), "--seed", str(seed), "--num-modes", "2", "--quiet",
                     "--target-steps", "8", "--drafter-steps", "4"]) == 0
        return out

    a, b, c = build("a", 0), build("b", 0), build("c", 1)
    for part in ("target/model.safetensors", "drafter-dflash/model.safetensors", "drafter/model.safetensors",
                 "drafter/config.json"):
        assert (a / part).read_bytes() == (b / part).read_bytes(), part
    assert (a / "drafter/model.safetensors").read_bytes() != (c / "drafter/model.safetensors").read_bytes()
    assert (a / "target/tokenizer.json").is_file() and (a / "prompts.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(a / "target")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "one two"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat.startswith("<|im_start|>user") and chat.endswith("<|im_start|>assistant\n")


def test_make_tiny_writes_a_single_mode_dflash_drafter_beside_the_mfd_one(tmp_path, capsys):
    out = tmp_path / "pair"
    assert main(["make-tiny", str(out), "--quiet", "--target-steps", "8", "--drafter-steps", "4"]) == 0
    single, mfd = load_drafter(out / "drafter-dflash"), load_drafter(out / "drafter")
    config = json.loads((out / "drafter-dflash/config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "mfd_config" not in config
    assert single.kind == "dflash" and single.config.num_modes == 1 and mfd.config.num_modes == 4
    assert set(mfd.weights) == set(single.weights) | {"mode_embed"}
    assert main(["make-tiny", str(tmp_path / "k1"), "--num-modes", "1"]) == 2
    assert "--num-modes must be >= 2" in capsys.readouterr().err and not (tmp_path / "k1").exists()


def test_help_explains_every_command():
    proc = run_cli("--help")
    assert proc.returncode == 0
    for command in ("make-tiny", "generate", "inspect"):
        assert command in proc.stdout
    proc = run_cli("generate", "--help")
    assert "--budget" in proc.stdout and "--single-mode" in proc.stdout


def test_every_option_of_every_command_has_a_help_text():
    import argparse

    from mfd_sglang.cli import build_parser

    def silent(parser: argparse.ArgumentParser, path: str):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from silent(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                yield f"{path}: {'/'.join(action.option_strings) or action.dest}"

    assert list(silent(build_parser(), "python -m mfd_sglang")) == []
