"""Targets and verify paths on which MFD's tree verify would be silently wrong, refused by name.

MFD verifies its tree in one TARGET_VERIFY forward whose spec input says top-k 1 with a FULL_MASK
tree mask (SGLang 0.5.23's EAGLE verify layout). Three things next to that path ignore the tree:

- Hybrid linear-attention / Mamba targets (Qwen3-Next, Nemotron-H, Falcon-H1, Kimi-Linear, ...): at
  top-k 1 SGLang's hybrid linear-attention backend runs the verify window as a chain, so every
  recurrent / convolution layer reads each tree node as if it followed the previous node of the flat
  window. The exception, served: Gated DeltaNet hybrids of the Qwen3.5 family (Qwen3.5 / Qwen3.6),
  whose backend MFD switches to its tree path (`mfd_sglang.patches.hybrid_tree_verify`; proven
  token for token on CPU, `tests/test_hybrid_mfd_server.py`). The runner check holds the
  instantiated backend to that.
- Sliding-window or chunked attention (Gemma 2/3/4, gpt-oss, ...): FlashInfer trims the verify's keys
  to the window without the start index the tree mask rows assume, and Triton's window test uses a
  node's row in the window instead of its depth in the tree.
- Triton's split-KV verify kernels (AMD gfx95, on by default for top-k 1): they compute causal
  attention and never read the custom mask, by design. MFD turns them off at launch
  (`SGLANG_ENABLE_SPLITKV_VERIFY=0`) and refuses to serve if they are still on.

`target_refusal(...)` reads the target's config at launch (before any process starts);
`check_target_runner(model_runner)` re-checks what the scheduler actually built (the resolved window,
SGLang's own hybrid predicates, the instantiated attention backend) and raises before the first
request. Both name the architecture and the reason. `check_tree_verify_attention(attn_backend)`, run
by the worker at start too, raises unless the instantiated backend that runs TARGET_VERIFY applies
the tree mask at all (FlashInfer, Triton, or the CPU `mfd_cpu`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

# Layer kinds that are softmax attention over the KV cache; anything else in `layer_types` is a
# recurrent / convolution / state-space layer.
ATTENTION_LAYER_TYPES = {"full_attention", "attention", "sliding_attention", "chunked_attention"}
WINDOWED_LAYER_TYPES = {"sliding_attention", "chunked_attention"}
# Config keys that only hybrid linear-attention / state-space models carry.
HYBRID_CONFIG_KEYS = ("full_attention_interval", "linear_attn_config", "hybrid_override_pattern",
                      "layers_block_type", "linear_conv_kernel_dim", "mamba_d_state", "ssm_state_size")
SPLITKV_VERIFY_ENV = "SGLANG_ENABLE_SPLITKV_VERIFY"

# Hybrids whose recurrent layers are Gated DeltaNet run by SGLang's GDN backend, which verifies trees.
TREE_VERIFIED_HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
HYBRID_REASON = ("hybrid linear-attention / state-space target: SGLang verifies a top-k 1 window through "
                 "its recurrent layers as a chain, so tree nodes would read the state of the node before "
                 "them instead of their parent's and MFD would return wrong tokens (MFD verifies trees "
                 "on the Gated DeltaNet hybrids of the Qwen3.5 family only: model types "
                 f"{', '.join(TREE_VERIFIED_HYBRID_MODEL_TYPES)})")
WINDOW_REASON = ("sliding-window / chunked attention target: SGLang's windowed verify paths do not line up "
                 "the window with the tree mask (FlashInfer trims keys without the window start, Triton "
                 "windows by row instead of tree depth), so MFD would return wrong tokens")


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    return archs[0] if archs else str(config.get("model_type", "unknown"))


def _merged(config: dict) -> dict:
    """The model config with its text config's keys over it."""
    return {**config, **dict(config.get("text_config") or {})}


def hybrid_markers(config: dict) -> tuple[list[str], list[str]]:
    """(recurrent layer types, hybrid-only config keys) that a config.json names; both empty for a
    target made of attention layers only."""
    merged = _merged(config)
    layer_types = [str(t) for t in (merged.get("layer_types") or [])]
    recurrent = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    return recurrent, [k for k in HYBRID_CONFIG_KEYS if merged.get(k) is not None]


def tree_verified_hybrid(config: dict) -> bool:
    """A Gated DeltaNet hybrid of the Qwen3.5 family: recurrent layers of type linear_attention only."""
    recurrent, _ = hybrid_markers(config)
    model_types = {config.get("model_type"), _merged(config).get("model_type")}
    return set(recurrent) <= {"linear_attention"} and bool(model_types & set(TREE_VERIFIED_HYBRID_MODEL_TYPES))


def _raw_problems(config: dict) -> list[str]:
    """What the config.json itself says (model and text config both read)."""
    merged = _merged(config)
    layer_types = [str(t) for t in (merged.get("layer_types") or [])]
    problems = []
    recurrent, hybrid_keys = hybrid_markers(config)
    if (recurrent or hybrid_keys) and not tree_verified_hybrid(config):
        found = (f"layer_types {recurrent}" if recurrent else "") + (
            f"{'; ' if recurrent else ''}config keys {hybrid_keys}" if hybrid_keys else "")
        problems.append(f"{HYBRID_REASON} ({found})")
    windowed = sorted({t for t in layer_types if t in WINDOWED_LAYER_TYPES})
    if windowed or merged.get("attention_chunk_size") or merged.get("use_sliding_window") is True:
        found = f"layer_types {windowed}" if windowed else (
            "attention_chunk_size" if merged.get("attention_chunk_size") else "use_sliding_window true")
        problems.append(f"{WINDOW_REASON} ({found})")
    return problems


def _sglang_problems(model_path: str, trust_remote_code: bool, revision, tree_verified: bool) -> list[str]:
    """What SGLang's own predicates say of the config it will load (its config classes, its hybrid
    and hybrid-SWA architecture lists); tree_verified: a hybrid MFD verifies trees on."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config
    from sglang.srt.configs.model_config import is_hybrid_swa_model
    from sglang.srt.utils.hf_transformers.config import get_config

    try:
        hf_config = get_config(model_path, trust_remote_code=trust_remote_code, revision=revision)
    except Exception:
        # SGLang itself will report a config it cannot load; the config.json checks above still ran.
        return []
    view = SimpleNamespace(hf_config=hf_config, is_draft_model=False,
                           linear_attn_registry_result=get_linear_attn_config(hf_config))
    problems = []
    if mambaish_config(view) is not None and not tree_verified:
        problems.append(f"{HYBRID_REASON} (SGLang serves {type(hf_config).__name__} with its hybrid "
                        "linear-attention backend)")
    if is_hybrid_swa_model(list(hf_config.architectures or []), hf_config.get_text_config()):
        problems.append(f"{WINDOW_REASON} (SGLang serves it with hybrid sliding-window memory)")
    return problems


def target_refusal(model_path, *, trust_remote_code: bool = False, revision=None) -> str | None:
    """A message naming the target's architecture and why MFD cannot verify trees on it, or None.
    Reads `model_path/config.json` and SGLang's view of it; no weights are loaded."""
    config_path = Path(model_path) / "config.json"
    if not config_path.is_file():
        return None  # a hub id or a GGUF file: SGLang resolves it, the worker check still runs
    config = json.loads(config_path.read_text())
    problems = _raw_problems(config)
    for problem in _sglang_problems(str(model_path), trust_remote_code, revision, tree_verified_hybrid(config)):
        if problem.split(" (")[0] not in {p.split(" (")[0] for p in problems}:
            problems.append(problem)
    if not problems:
        return None
    return (f"--model-path {model_path} ({_architecture(config)}) cannot be served with MFD / MFD_D: "
            + "; ".join(problems) + ". Serve it without --speculative-algorithm, or with a dense "
            "full-attention target.")


def disable_splitkv_verify(environ=os.environ) -> None:
    """Turn off Triton's split-KV verify (it ignores the tree mask); the launcher's environment is
    inherited by the scheduler processes."""
    environ[SPLITKV_VERIFY_ENV] = "0"


def verify_attention_backend(attn_backend):
    """The backend instance that runs TARGET_VERIFY, through SGLang's wrappers (hybrid prefill /
    decode, two-batch overlap, hybrid linear attention)."""
    from sglang.srt.layers.attention.hybrid_attn_backend import HybridAttnBackend
    from sglang.srt.layers.attention.tbo_backend import TboAttnBackend
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    backend = attn_backend
    for _ in range(4):
        if isinstance(backend, HybridAttnBackend):
            backend = backend._select_backend(ForwardMode.TARGET_VERIFY)
        elif isinstance(backend, TboAttnBackend):
            backend = backend.primary
        elif getattr(backend, "full_attn_backend", None) is not None:
            backend = backend.full_attn_backend
        else:
            break
    return backend


# The attention backends (by class) that apply the tree mask of a top-k 1 TARGET_VERIFY: the classes of
# `launch.TREE_VERIFY_ATTENTION_BACKENDS`, checked on the backend the model runner instantiated.
TREE_VERIFY_ATTENTION_CLASSES = ("FlashInferAttnBackend", "TritonAttnBackend", "CpuSdpaAttnBackend")


def check_tree_verify_attention(attn_backend) -> None:
    """RuntimeError unless the target's instantiated attention backend applies the tree mask (the
    last line of defence if a launch path skipped `launch.resolve_attention_backend`)."""
    name = type(verify_attention_backend(attn_backend)).__name__
    if name not in TREE_VERIFY_ATTENTION_CLASSES:
        raise RuntimeError(f"MFD cannot verify its tree with the {name} attention backend (it ignores the "
                           "tree mask of a top-k 1 verify). Start the server with --attention-backend "
                           "flashinfer (GPU), triton, or mfd_cpu (CPU).")


def check_target_runner(model_runner) -> None:
    """RuntimeError, at worker start, when the target the scheduler built cannot verify trees exactly."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    model_config = model_runner.model_config
    arch = (list(model_config.hf_config.architectures or []) or [type(model_config.hf_config).__name__])[0]
    problems = []
    if mambaish_config(model_config) is not None:  # SGLang's own test for its hybrid linear backend
        linear = getattr(model_runner.attn_backend, "linear_attn_backend", None)
        if type(linear).__name__ != "GDNAttnBackend" or linear.topk <= 1:
            problems.append(f"{HYBRID_REASON} (linear-attention backend {type(linear).__name__}"
                            f"{'' if linear is None else f', tree path {linear.topk > 1}'})")
    window = getattr(model_runner, "sliding_window_size", None)
    if window is not None or getattr(model_config, "is_hybrid_swa", False):
        problems.append(f"{WINDOW_REASON} (window {window})")
    backend = verify_attention_backend(model_runner.attn_backend)
    if getattr(backend, "use_verify_splitkv", False) or getattr(backend, "use_verify_shared_kv", False):
        problems.append(f"{type(backend).__name__} runs its split-KV verify kernels, which ignore the tree "
                        f"mask; start the server with {SPLITKV_VERIFY_ENV}=0")
    if problems:
        raise RuntimeError(f"MFD cannot verify trees on this target ({arch}): " + "; ".join(problems) + ".")
