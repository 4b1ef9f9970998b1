"""Targets and verify paths that would make MFD's tree verify silently wrong are refused by name:
hybrid linear-attention other than the Qwen3.5 family's Gated DeltaNet (Qwen3-Next), sliding-window
(Gemma 3, gpt-oss) and Triton's split-KV verify; a Qwen3.5 hybrid passes at launch, and at worker
start only with SGLang's GDN backend on its tree path. At launch from the target's config (in process and through a real CPU launch), and
at worker start from what SGLang built (its real ModelConfig and attention backend classes)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from mfd_sglang.server_process import free_port, launch_command
from mfd_sglang.serving.launch.target_checks import check_target_runner, target_refusal

REPO = Path(__file__).resolve().parents[1]
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            vocab_size=512, max_position_embeddings=1024)


def _write_config(path: Path, model_type: str, architecture: str, **changes) -> Path:
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type](**{**TINY, **changes})
    config.architectures = [architecture]
    path.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(path)
    return path


# (model_type, architecture, config changes, reason named in the refusal)
REFUSED = [
    ("qwen3_next", "Qwen3NextForCausalLM", {"num_hidden_layers": 4}, "hybrid linear-attention"),
    ("gemma3_text", "Gemma3ForCausalLM", {"num_hidden_layers": 6, "sliding_window": 32}, "sliding-window"),
    ("gpt_oss", "GptOssForCausalLM", {"num_hidden_layers": 2, "sliding_window": 32}, "sliding-window"),
    ("qwen3", "Qwen3ForCausalLM", {"num_hidden_layers": 2, "use_sliding_window": True, "sliding_window": 32,
                                   "max_window_layers": 1}, "sliding-window"),
]


@pytest.mark.parametrize("model_type, architecture, changes, reason", REFUSED, ids=[r[1] for r in REFUSED])
def test_unsupported_targets_are_refused_by_architecture(tmp_path, model_type, architecture, changes, reason):
    target = _write_config(tmp_path / "target", model_type, architecture, **changes)
    message = target_refusal(target)
    assert message is not None and architecture in message and reason in message, message


def test_dense_full_attention_targets_pass(tiny_pair, tmp_path):
    assert target_refusal(tiny_pair / "target") is None
    assert target_refusal(_write_config(tmp_path / "llama", "llama", "LlamaForCausalLM", num_hidden_layers=2)) is None


def test_qwen3_5_gated_deltanet_hybrids_pass_the_launch_check(tmp_path):
    target = _write_config(tmp_path / "qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM", num_hidden_layers=4)
    assert target_refusal(target) is None


def test_validate_server_args_refuses_a_hybrid_target_before_anything_else(tiny_pair, tmp_path):
    from mfd_sglang.serving.launch.resolve import validate_server_args

    target = _write_config(tmp_path / "target", "qwen3_next", "Qwen3NextForCausalLM", num_hidden_layers=4)
    args = SimpleNamespace(speculative_algorithm="MFD", model_path=str(target), trust_remote_code=False,
                           speculative_draft_model_path=str(tiny_pair / "drafter"), speculative_num_draft_tokens=9,
                           page_size=1, pp_size=1, tp_size=1, dp_size=1, enable_dp_attention=False,
                           disaggregation_mode="null", enable_hierarchical_cache=False,
                           speculative_draft_window_size=None, speculative_adaptive=False)
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM.*hybrid linear-attention"):
        validate_server_args(args)


def test_a_real_launch_with_a_hybrid_target_fails_early(tiny_pair, tmp_path):
    """The whole launcher path (SGLang's argument resolution, then the plugin's launch check) on a
    Qwen3-Next-shaped target: no process is left serving, and the message names the architecture."""
    target = _write_config(tmp_path / "target", "qwen3_next", "Qwen3NextForCausalLM", num_hidden_layers=4)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_pair / "target" / name, target / name)
    cmd = launch_command(target, port=free_port(), algorithm="MFD", drafter=tiny_pair / "drafter", dtype="float32")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "Qwen3NextForCausalLM" in output and "hybrid linear-attention" in output, output[-3000:]


def _runner(target: Path, attn_backend=None, sliding_window_size=None):
    """A model runner as the worker sees it: SGLang's real ModelConfig for `target` and a real
    attention backend instance (built without its GPU-only constructor)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    if attn_backend is None:
        attn_backend = object.__new__(TritonAttnBackend)
        attn_backend.use_verify_splitkv = attn_backend.use_verify_shared_kv = False
    return SimpleNamespace(model_config=ModelConfig(str(target)), attn_backend=attn_backend,
                           sliding_window_size=sliding_window_size)


def test_worker_start_check_on_sglang_model_configs(tiny_pair, tmp_path):
    check_target_runner(_runner(tiny_pair / "target"))
    hybrid = _write_config(tmp_path / "hybrid", "qwen3_next", "Qwen3NextForCausalLM", num_hidden_layers=4)
    with pytest.raises(RuntimeError, match=r"Qwen3NextForCausalLM.*hybrid linear-attention"):
        check_target_runner(_runner(hybrid))
    # A Qwen3.5 hybrid: served only by SGLang's GDN backend switched to its tree path (top-k > 1).
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend

    qwen3_5 = _write_config(tmp_path / "qwen3_5", "qwen3_5_text", "Qwen3_5ForCausalLM", num_hidden_layers=4)
    gdn = object.__new__(GDNAttnBackend)
    runner = _runner(qwen3_5)
    runner.attn_backend = SimpleNamespace(linear_attn_backend=gdn, full_attn_backend=runner.attn_backend)
    gdn.topk = 2
    check_target_runner(runner)
    gdn.topk = 1
    with pytest.raises(RuntimeError, match=r"Qwen3_5ForCausalLM.*GDNAttnBackend, tree path False"):
        check_target_runner(runner)
    # SGLang resolves the window from the model class; the worker reads what it resolved.
    with pytest.raises(RuntimeError, match="sliding-window.*window 32"):
        check_target_runner(_runner(tiny_pair / "target", sliding_window_size=32))


def test_worker_start_check_refuses_triton_split_kv_verify(tiny_pair):
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

    backend = object.__new__(TritonAttnBackend)
    backend.use_verify_splitkv, backend.use_verify_shared_kv = True, False  # what gfx95 sets by default
    with pytest.raises(RuntimeError, match="SGLANG_ENABLE_SPLITKV_VERIFY=0"):
        check_target_runner(_runner(tiny_pair / "target", attn_backend=backend))


def test_launch_turns_split_kv_verify_off(tiny_pair):
    from mfd_sglang.serving.launch.resolve import resolve_server_args

    args = SimpleNamespace(speculative_algorithm="MFD", speculative_draft_model_path=str(tiny_pair / "drafter"),
                           model_path=str(tiny_pair / "target"), dtype="float32", tp_size=1,
                           speculative_num_draft_tokens=9, speculative_num_steps=None, speculative_eagle_topk=None,
                           enable_mixed_chunk=False, device="cpu", max_running_requests=None,
                           attention_backend="mfd_cpu", prefill_attention_backend=None,
                           decode_attention_backend=None)
    environ = os.environ.copy()
    try:
        os.environ["SGLANG_ENABLE_SPLITKV_VERIFY"] = "1"
        resolve_server_args(args)
        assert os.environ["SGLANG_ENABLE_SPLITKV_VERIFY"] == "0"
        from sglang.srt.environ import envs

        assert envs.SGLANG_ENABLE_SPLITKV_VERIFY.get() is False
    finally:
        os.environ.clear()
        os.environ.update(environ)
