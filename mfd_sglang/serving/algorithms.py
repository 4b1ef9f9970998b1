"""The MFD and MFD_D speculative algorithms, registered in SGLang 0.5.23's plugin registry.

`SpeculativeAlgorithm.register(name, spec_class=..., validate_server_args=...)` (see
`sglang/srt/speculative/spec_registry.py`) decorates a factory that returns the worker class. The
spec class answers the capability questions the 0.5.23 core asks every algorithm:

- `is_dflash_family()` True: the target captures the hidden states of the drafter's
  `target_layer_ids` (`spec_aux_hidden_state._resolve_dflash_aux_hidden_state`), the decode batch
  reserves its verify slots through the draft input's `prepare_for_decode`, and requests pass
  through `validate_dflash_request` (extended by `mfd_sglang.patches.request_checks`).
  `is_dflash()` stays False: the stock DFlash worker and its launch hook are not ours.
- `--speculative-num-draft-tokens` is the verify width N = B + 1 (root included), so KV reservation,
  logits buffers and CUDA-graph widths are sized by it.

Launch-time checks (`validate_server_args`, run in the launcher before any process starts) refuse
targets whose tree verify SGLang would get silently wrong (`target_checks`: hybrid linear-attention,
sliding-window), load the drafter and compare it with the target, so a wrong drafter fails at launch
with a message that names the field, not in the scheduler.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

ALGORITHMS = ("MFD", "MFD_D")


def _spec_class():
    """The CustomSpecAlgo subclass (built lazily: sglang is imported only inside SGLang processes)."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class MFDSpecAlgo(CustomSpecAlgo):
        """MFD / MFD_D: a one-pass block drafter, a mixture tree, one tree verify per round."""

        @property
        def single_mode_switch(self) -> bool:
            return self.name == "MFD_D"

        def is_dflash_family(self) -> bool:
            return True

        def supports_target_verify_for_draft(self) -> bool:
            return True

        def supports_prefill_shared_read_done(self) -> bool:
            # The worker consumes the prefill's hidden states inside the same call.
            return True

        def has_draft_kv(self) -> bool:
            return True

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def get_platform_worker_cls(self):
            return None

        def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
            return None

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)

        def get_num_tokens_per_req_for_target_verify(self, num_draft_tokens: int, is_draft_worker: bool) -> int:
            return num_draft_tokens

        def handle_server_args(self, server_args) -> None:
            resolve_server_args(server_args)

    return MFDSpecAlgo


def resolve_server_args(server_args) -> None:
    """Fill the SGLang fields MFD implies (called on SGLang's recording stand-in at launch)."""
    from .memory import plan_launch_memory
    from .options import default_num_draft_tokens
    from .target_checks import disable_splitkv_verify

    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = default_num_draft_tokens(server_args.device)
    # EAGLE's step/top-k knobs do not apply; generic accounting reads them, so pin them to 1.
    server_args.speculative_num_steps = 1
    server_args.speculative_eagle_topk = 1
    server_args.enable_mixed_chunk = False
    disable_splitkv_verify()
    # Overlap scheduling follows SGLang's flag on every device. SGLang turns it off for its own
    # speculative algorithms on CPU; MFD's worker keeps the V2 contract (no host sync, on_publish,
    # inputs kept alive), so a CPU server runs the same scheduler flow as a GPU one by default.
    if server_args.max_running_requests is None:
        server_args.max_running_requests = 48
    resolve_attention_backend(server_args)
    plan_launch_memory(server_args)


# Attention backends that apply a custom mask to a TARGET_VERIFY whose spec input says top-k 1 (MFD's
# tree verify): FlashInfer and Triton read the mask of any EAGLE verify input; FA3 / FA4 / TRT-LLM
# take top-k 1 for a chain and attend causally, which would accept wrong tokens without an error.
TREE_VERIFY_ATTENTION_BACKENDS = {"cuda": ("flashinfer", "triton"), "cpu": ("mfd_cpu", "triton")}
# The same backends by class, for the check on the model runner's instantiated backend.
TREE_VERIFY_ATTENTION_CLASSES = ("FlashInferAttnBackend", "TritonAttnBackend", "CpuSdpaAttnBackend")


def resolve_attention_backend(server_args) -> None:
    """SGLang has already picked the attention backends when the algorithm's hook runs (on Hopper
    often fa3). On a GPU, switch to FlashInfer when they cannot verify a tree (Triton where FlashInfer
    is not installed, with one log line); on a CPU refuse."""
    device = "cpu" if str(server_args.device) == "cpu" else "cuda"
    supported = TREE_VERIFY_ATTENTION_BACKENDS[device]
    chosen = {flag: getattr(server_args, field, None) for flag, field in (
        ("--attention-backend", "attention_backend"), ("--prefill-attention-backend", "prefill_attention_backend"),
        ("--decode-attention-backend", "decode_attention_backend"))}
    wrong = {flag: value for flag, value in chosen.items() if value is not None and value not in supported}
    if not wrong and any(value is not None for value in chosen.values()):
        return
    if device == "cpu":
        raise ValueError("MFD on CPU needs --attention-backend mfd_cpu (python -m mfd_sglang.cpu.launch_server "
                         f"sets it) or triton; got {wrong or 'none'}.")
    backend = "flashinfer" if importlib.util.find_spec("flashinfer") is not None else "triton"
    if wrong:
        logger.warning("MFD: attention backend %s cannot verify a tree (it treats a top-k 1 verify as a "
                       "chain); using %s instead. Pass --attention-backend flashinfer or triton to "
                       "silence this.", ", ".join(f"{f} {v}" for f, v in wrong.items()), backend)
    if backend == "triton":
        logger.warning("MFD: FlashInfer is not installed (pip install flashinfer-python), so the target "
                       "verifies its trees with the triton attention backend.")
    server_args.attention_backend = backend
    server_args.prefill_attention_backend = None
    server_args.decode_attention_backend = None


def check_tree_verify_attention(attn_backend) -> None:
    """RuntimeError unless the target's instantiated attention backend applies the tree mask (the
    last line of defence if a launch path skipped `resolve_attention_backend`)."""
    from .target_checks import verify_attention_backend

    name = type(verify_attention_backend(attn_backend)).__name__
    if name not in TREE_VERIFY_ATTENTION_CLASSES:
        raise RuntimeError(f"MFD cannot verify its tree with the {name} attention backend (it ignores the "
                           "tree mask of a top-k 1 verify). Start the server with --attention-backend "
                           "flashinfer (GPU), triton, or mfd_cpu (CPU).")


def attention_dp_size(server_args) -> int:
    """The attention data-parallel width of `server_args`, in either spelling: SGLang 0.5.23's first
    resolution hook (`arg_groups/parallel_hook.py::handle_deprecated_dp_attention`) rewrites
    `--dp-size N --enable-dp-attention` into `attn_dp_size=N, dp_size=1` long before an algorithm's
    check runs; arguments that did not go through it still carry the old spelling."""
    attn_dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) and attn_dp == 1:
        return int(getattr(server_args, "dp_size", 1) or 1)
    return attn_dp


def _unsupported(server_args) -> list[str]:
    problems = []
    if int(server_args.pp_size or 1) > 1:
        problems.append(f"--pp-size {server_args.pp_size}: pipeline parallelism is not supported")
    attn_dp = attention_dp_size(server_args)
    if attn_dp > 1:
        problems.append(f"--attn-dp-size {attn_dp} (attention data parallelism; SGLang also accepts it as "
                        f"--dp-size {attn_dp} --enable-dp-attention) is not supported: the ranks of one TP group "
                        "would hold different batches, with idle ranks, and MFD broadcasts one accepted path "
                        "over the whole TP group. Use --dp-size N without --enable-dp-attention (replicas)")
    if getattr(server_args, "disaggregation_mode", "null") not in (None, "null"):
        problems.append(f"--disaggregation-mode {server_args.disaggregation_mode}: PD disaggregation is not "
                        "supported (the drafter context of the prompt does not move with the target's KV, and "
                        "the decode server's first round has no draft input). Use --dp-size N replicas, or "
                        "replicas behind sglang-router")
    if getattr(server_args, "enable_hierarchical_cache", False):
        problems.append("--enable-hierarchical-cache (HiCache) is not supported")
    if getattr(server_args, "speculative_draft_window_size", None) is not None:
        problems.append("--speculative-draft-window-size is not supported")
    if str(getattr(server_args, "device", "")) == "cpu" and getattr(server_args, "enable_torch_compile", False):
        problems.append("--enable-torch-compile on CPU: SGLang's CPU graph runner captures no tree mask "
                        "(drop the flag)")
    if getattr(server_args, "speculative_adaptive", False):
        problems.append("--speculative-adaptive is not supported")
    return problems


def validate_server_args(server_args) -> None:
    """Reject, at launch, every configuration MFD cannot serve; each message names the fix."""
    from mfd_sglang.checkpoint import CheckpointError, check_fits_target, load_drafter

    from .options import budget_from_num_draft_tokens, draft_quantization, read_options
    from .target_checks import target_refusal

    algo = str(server_args.speculative_algorithm).upper()
    problems = _unsupported(server_args)
    if problems:
        raise ValueError(f"--speculative-algorithm {algo}: unsupported configuration: "
                         + "; ".join(problems) + ".")
    refusal = target_refusal(server_args.model_path, trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
                             revision=getattr(server_args, "revision", None))
    if refusal:
        raise ValueError(refusal)
    options = read_options()
    if options.auto_budget and int(server_args.tp_size or 1) > 1:
        # Each rank would choose from its own round times: the ranks could verify different trees.
        raise ValueError(f"MFD_SGLANG_AUTO_BUDGET=1 with --tp-size {server_args.tp_size}: the automatic "
                         "budget runs with one rank only for now; use a fixed budget "
                         "(--speculative-num-draft-tokens) under tensor parallelism.")
    if server_args.speculative_num_draft_tokens is not None:
        budget_from_num_draft_tokens(server_args.speculative_num_draft_tokens)
    draft_quantization(server_args)  # a method the drafter cannot run is refused here

    path = server_args.speculative_draft_model_path
    check_drafter_path(algo, path)
    try:
        ckpt = load_drafter(path)
        check_fits_target(ckpt, server_args.model_path)
        check_capturable_layers(ckpt, server_args.model_path)
    except CheckpointError as e:
        raise ValueError(f"--speculative-draft-model-path {path} does not fit --model-path "
                         f"{server_args.model_path}: {e}") from None
    if options.num_modes is not None and options.num_modes > ckpt.config.num_modes:
        raise ValueError(f"MFD_SGLANG_NUM_MODES={options.num_modes} but the drafter at {path} has "
                         f"{ckpt.config.num_modes} mode(s); set at most {ckpt.config.num_modes} or unset it.")


def check_drafter_path(algo: str, path) -> None:
    """ValueError unless `path` is a local drafter directory (SGLang reads its config.json before
    any algorithm-specific check, see `mfd_sglang.patches.launch_checks`)."""
    if not path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path DIR: a "
                         "DFlash or MFD drafter directory (config.json + safetensors) trained for "
                         "this target.")
    if not Path(path).is_dir():
        raise ValueError(f"--speculative-draft-model-path {path}: no such directory. MFD loads drafters "
                         "from a local directory (config.json + *.safetensors); download or convert "
                         "the drafter first.")


def check_capturable_layers(ckpt, target) -> None:
    """SGLang captures a target layer's output as the input of the next layer, so the last layer's
    output (which HF reports after the final norm) cannot feed the drafter."""
    from mfd_sglang.checkpoint import _err, _target_text_config

    num_layers = _target_text_config(target).get("num_hidden_layers")
    bad = [i for i in ckpt.config.target_layer_ids if i >= num_layers - 1]
    if bad:
        raise _err("dflash_config.target_layer_ids", list(ckpt.config.target_layer_ids),
                   f"layer indices below {num_layers - 1} (the target's last layer cannot be captured "
                   f"in SGLang; offending: {bad})", "Train the drafter on earlier target layers.")


def _worker_factory(server_args):
    # Imported here so that an error in the worker module surfaces at launch with its own
    # traceback instead of hiding behind "Unknown speculative algorithm".
    from .worker import MFDWorkerV2

    return MFDWorkerV2


def register_algorithms() -> tuple[str, ...]:
    """Register MFD and MFD_D (idempotent per process). Returns the names registered now."""
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec as registered_spec

    spec_class = _spec_class()
    added = []
    for name in ALGORITHMS:
        if registered_spec(name) is not None:
            continue
        SpeculativeAlgorithm.register(name, supports_overlap=True, validate_server_args=validate_server_args,
                                      spec_class=spec_class)(_worker_factory)
        added.append(name)
    return tuple(added)
