"""Launch-time resolution and validation of an MFD / MFD_D server's arguments (SGLang 0.5.23).

Everything here runs in the launcher, inside SGLang's argument resolution
(`arg_groups/speculative_hook.py::handle_speculative_decoding`), before any scheduler process starts.
SGLang hands a registered algorithm's callbacks its recording stand-in for `ServerArgs`
(`arg_groups/overrides.py::record_foreign_defaults`), which declares the fields they write. In order:

- `validate_server_args(server_args)`, the algorithm's validator (`algorithms.register_algorithms`):
  a ValueError, whose message names the flag and the fix, for every configuration MFD cannot serve:
  `unsupported_configuration` (pipeline parallelism, attention data parallelism without
  --enable-dp-lm-head, PD disaggregation with attention DP, HiCache, ...), a target whose tree verify SGLang would get silently wrong (`target_checks.target_refusal`),
  plugin options that do not fit (--mfd-kernels triton without CUDA: `mfd_sglang.backend`), and a drafter that is missing (`check_drafter_path`: a local directory, or a
  Hugging Face hub id resolved to its snapshot as SGLang resolves a hub model), or does not
  fit the target (`checkpoint.check_fits_target`, `check_capturable_layers`).
- `resolve_server_args(server_args)`, the spec class's `handle_server_args`: fills the fields MFD
  implies (the drafter's local directory for a hub id, default draft tokens, EAGLE knobs pinned to 1, running-request cap, memory reserve) and
  picks an attention backend that applies the tree mask (`resolve_attention_backend`, one of
  `TREE_VERIFY_ATTENTION_BACKENDS`).

Two checks run earlier, as hooks (`mfd_sglang.patches.launch_checks`): the target refusal, before
SGLang's model-specific resolution steps, and `check_drafter_path`, before SGLang reads the drafter's
config.json. The scheduler re-checks what it built (`target_checks.check_target_runner`,
`target_checks.check_tree_verify_attention`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from mfd_sglang.serving.launch.options import attention_dp_size

logger = logging.getLogger(__name__)


def resolve_server_args(server_args) -> None:
    """Fill the SGLang fields MFD implies (called on SGLang's recording stand-in at launch)."""
    from mfd_sglang.serving.launch.options import default_num_draft_tokens
    from mfd_sglang.serving.launch.target_checks import disable_splitkv_verify

    # A hub id becomes its local snapshot here, so every scheduler process loads the drafter from disk.
    drafter = drafter_dir(server_args)
    if drafter != server_args.speculative_draft_model_path:
        logger.info("MFD: drafter %s is %s", server_args.speculative_draft_model_path, drafter)
        server_args.speculative_draft_model_path = drafter
    if server_args.speculative_num_draft_tokens is None:
        server_args.speculative_num_draft_tokens = default_num_draft_tokens(server_args.device)
        logger.warning("speculative_num_draft_tokens is not set; defaulting to %d for MFD (a tree of %d draft "
                       "tokens plus the root%s).", server_args.speculative_num_draft_tokens,
                       server_args.speculative_num_draft_tokens - 1,
                       ", at most: on CUDA each round's budget follows its batch size, by the default schedule "
                       "('MFD budget' below) or --mfd-auto-budget"
                       if str(server_args.device).startswith("cuda") else "")
    # EAGLE's step/top-k knobs do not apply; generic accounting reads them, so pin them to 1 (saying so
    # when they were set otherwise, as SGLang's DFLASH does).
    for field in ("speculative_num_steps", "speculative_eagle_topk"):
        value = getattr(server_args, field)
        if value is not None and int(value) != 1:
            logger.warning("MFD only supports %s == 1; overriding %s=%s to 1.", field, field, value)
        setattr(server_args, field, 1)
    if server_args.enable_mixed_chunk:
        logger.warning("MFD verifies its trees in decode rounds of their own; overriding --enable-mixed-chunk "
                       "to off.")
    server_args.enable_mixed_chunk = False
    disable_splitkv_verify()
    # Overlap scheduling follows SGLang's flag on every device. SGLang turns it off for its own
    # speculative algorithms on CPU; MFD's worker keeps the V2 contract (no host sync, on_publish,
    # inputs kept alive), so a CPU server runs the same scheduler flow as a GPU one by default.
    if server_args.max_running_requests is None:
        server_args.max_running_requests = 48
        logger.warning("Max running requests is reset to 48 for speculative decoding. You can override this by "
                       "explicitly setting --max-running-requests.")
    resolve_attention_backend(server_args)
    plan_launch_memory(server_args)


# Attention backends that apply a custom mask to a TARGET_VERIFY whose spec input says top-k 1 (MFD's
# tree verify): FlashInfer and Triton read the mask of any EAGLE verify input; FA3 / FA4 / TRT-LLM
# take top-k 1 for a chain and attend causally, which would accept wrong tokens without an error.
TREE_VERIFY_ATTENTION_BACKENDS = {"cuda": ("flashinfer", "triton"), "cpu": ("mfd_cpu", "triton")}


def plan_launch_memory(server_args) -> None:
    """At launch (SGLang's handle_server_args stage): the plan of the drafter at
    --speculative-draft-model-path, logged (every scheduler's worker logs the plan it computes from the same
    arguments: the two lines agree) and on an accelerator reserved through `reserve_in_mem_fraction`. With
    the default budget on CUDA, the schedule in force is logged too, and its windows planned
    (`budget.schedule`)."""
    from sglang.srt.utils.common import get_device_memory_capacity

    from mfd_sglang.checkpoint import load_drafter

    from mfd_sglang.serving.budget.playable import server_playable
    from mfd_sglang.serving.draft_stage import draft_graphs_captured
    from mfd_sglang.serving.budget.schedule import budget_schedule
    from mfd_sglang.serving.launch.memory import drafter_memory_plan, reserve_in_mem_fraction
    from mfd_sglang.serving.launch.options import budget_from_num_draft_tokens, read_options

    options = read_options(server_args)
    target = target_config(server_args)
    ckpt = load_drafter(server_args.speculative_draft_model_path)
    budget = budget_from_num_draft_tokens(server_args.speculative_num_draft_tokens)
    schedule = budget_schedule(server_args, options, ckpt.config, target, budget=budget,
                               algorithm=str(server_args.speculative_algorithm).upper())
    if schedule is not None:
        logger.info("MFD budget (no --speculative-num-draft-tokens, no --mfd-auto-budget): %s; pass "
                    "--speculative-num-draft-tokens N for a fixed budget", schedule.describe())
    algorithm = str(server_args.speculative_algorithm).upper()
    playable = server_playable(server_args, options, ckpt.config, budget=budget, algorithm=algorithm, schedule=schedule)
    plan = drafter_memory_plan(server_args, ckpt, budget=budget, vocab=target["vocab_size"],
                               tied_embeddings=bool(target.get("tie_word_embeddings")),
                               dtype_bytes=4 if str(server_args.dtype) in ("float32", "float") else 2,
                               num_modes=options.num_modes, playable=playable,
                               draft_graphs=draft_graphs_captured(server_args, options.kernels, ckpt.config))
    logger.info("MFD memory at launch: %s", plan.describe(int(server_args.max_running_requests)))
    if str(server_args.device) == "cpu":
        return  # CPU servers get an explicit --mem-fraction-static from the CPU launcher
    # The raw input tells whether the user set the fraction (the resolved value is always set).
    raw = getattr(server_args, "_raw_input", None) or {}
    reserve_in_mem_fraction(server_args, plan, get_device_memory_capacity(str(server_args.device)),
                            user_set=raw.get("mem_fraction_static") is not None)


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


def attention_dp_problems(server_args) -> list[str]:
    """What MFD cannot serve under attention data parallelism, as SGLang's DFLASH refuses it: each DP rank
    computes its own requests' full-vocabulary logits and the drafter reads whole embedding and head rows,
    so the head must be sharded inside the attention-TP group (--enable-dp-lm-head); no attention context
    parallelism; SGLang's DP prefill coordination (which mixes prefill and verify rows in one step) off."""
    attn_dp = attention_dp_size(server_args)
    if attn_dp == 1:
        return []
    spelled = (f"--attn-dp-size {attn_dp} (attention data parallelism; SGLang also accepts it as "
               f"--dp-size {attn_dp} --enable-dp-attention)")
    problems = []
    if not getattr(server_args, "enable_dp_lm_head", False):
        problems.append(f"{spelled} needs --enable-dp-lm-head, as SGLang's DFLASH does (each DP rank verifies "
                        "its own requests over the full vocabulary)")
    if int(getattr(server_args, "attn_cp_size", 1) or 1) != 1:
        problems.append(f"{spelled} with --attn-cp-size {server_args.attn_cp_size}: attention context "
                        "parallelism is not supported")
    if os.environ.get("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", "0").lower() not in ("0", "false", ""):
        problems.append(f"{spelled} with SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION set: MFD needs prefill and "
                        "verify rounds apart (unset it, as SGLang's DFLASH requires)")
    return problems


def disaggregation_problems(server_args) -> list[str]:
    """What MFD cannot serve under PD disaggregation. Served: MFD / MFD_D on the prefill server (its worker
    writes the prompt's drafter context and samples the first token by MFD's law) and on the decode server
    (the context arrives with the target's KV as the draft KV pool). Refused: with attention data
    parallelism (an idle rank's PD rounds are not built)."""
    mode = getattr(server_args, "disaggregation_mode", "null")
    if mode in (None, "null") or attention_dp_size(server_args) == 1:
        return []
    return [f"--disaggregation-mode {mode} with --attn-dp-size {attention_dp_size(server_args)}: PD "
            "disaggregation under attention data parallelism is not supported (use PD at --tp-size N, or "
            "attention DP without PD)"]


def unsupported_configuration(server_args) -> list[str]:
    """What in `server_args` MFD does not serve, one message per flag (empty when nothing)."""
    problems = []
    if int(server_args.pp_size or 1) > 1:
        problems.append(f"--pp-size {server_args.pp_size}: pipeline parallelism is not supported")
    problems += attention_dp_problems(server_args)
    problems += disaggregation_problems(server_args)
    if getattr(server_args, "enable_hierarchical_cache", False):
        problems.append("--enable-hierarchical-cache (HiCache) is not supported")
    if getattr(server_args, "speculative_draft_window_size", None) is not None:
        problems.append("--speculative-draft-window-size is not supported")
    if str(getattr(server_args, "device", "")) == "cpu" and getattr(server_args, "enable_torch_compile", False):
        problems.append("--enable-torch-compile on CPU: SGLang's CPU graph runner captures no tree mask "
                        "(drop the flag)")
    if getattr(server_args, "speculative_adaptive", False):
        problems.append("--speculative-adaptive is not supported")
    # The drafter's context pool is kept in the model dtype, while SGLang would plan its memory (and a DFlash
    # draft pool) in the 8- or 4-bit dtype these ask for: refused until the pool can hold it.
    for flag, field in (("--kv-cache-dtype", "kv_cache_dtype"),
                        ("--speculative-draft-kv-cache-dtype", "speculative_draft_kv_cache_dtype")):
        value = str(getattr(server_args, field, None) or "auto")
        if value not in ("auto", "bf16", "bfloat16"):
            problems.append(f"{flag} {value}: MFD keeps the drafter's context in the model dtype, not {value} "
                            f"(drop the flag or pass {flag} auto)")
    return problems


def validate_server_args(server_args) -> None:
    """Reject, at launch, every configuration MFD cannot serve; each message names the fix."""
    from mfd_sglang.backend import resolve_backend
    from mfd_sglang.checkpoint import CheckpointError, check_fits_target, load_drafter

    from mfd_sglang.serving.launch.options import budget_from_num_draft_tokens, draft_quantization, read_options
    from mfd_sglang.serving.launch.target_checks import target_refusal

    algo = str(server_args.speculative_algorithm).upper()
    problems = unsupported_configuration(server_args)
    if problems:
        raise ValueError(f"--speculative-algorithm {algo}: unsupported configuration: "
                         + "; ".join(problems) + ".")
    refusal = target_refusal(server_args.model_path, trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
                             revision=getattr(server_args, "revision", None))
    if refusal:
        raise ValueError(refusal)
    options = read_options(server_args)
    resolve_backend(options.kernels, server_args.device)  # --mfd-kernels triton without CUDA is refused here
    if options.auto_budget and int(server_args.tp_size or 1) > 1:
        # Each rank would choose from its own round times: the ranks could verify different trees.
        raise ValueError(f"{options.spelled['auto_budget']} with --tp-size {server_args.tp_size}: the automatic "
                         "budget runs with one rank only for now; use a fixed budget "
                         "(--speculative-num-draft-tokens) under tensor parallelism.")
    if server_args.speculative_num_draft_tokens is not None:
        budget_from_num_draft_tokens(server_args.speculative_num_draft_tokens)
    draft_quantization(server_args)  # a method the drafter cannot run is refused here

    path = drafter_dir(server_args)
    try:
        ckpt = load_drafter(path)
        target = target_config(server_args)
        check_fits_target(ckpt, target)
        check_capturable_layers(ckpt, target)
    except CheckpointError as e:
        raise ValueError(f"--speculative-draft-model-path {path} does not fit --model-path "
                         f"{server_args.model_path}: {e}") from None
    if options.num_modes is not None and options.num_modes > ckpt.config.num_modes:
        raise ValueError(f"{options.spelled['num_modes']} but the drafter at {path} has "
                         f"{ckpt.config.num_modes} mode(s); set at most {ckpt.config.num_modes} or drop it.")
    if options.mode_subsets and not (options.auto_budget and ckpt.config.mode_prior == "gate"):
        lacking = " and ".join(([] if options.auto_budget else ["--mfd-auto-budget"]) +
                               ([] if ckpt.config.mode_prior == "gate" else [f"a drafter with a mode gate (the one "
                                                                               f"at {path} weighs its modes uniformly)"]))
        raise ValueError(f"{options.spelled['mode_subsets']}: the automatic budget chooses per request modes by "
                         f"the drafter's mode gate; it needs {lacking}. Drop it.")


def drafter_dir(server_args) -> str:
    """`check_drafter_path` of the launch's drafter, at its revision and download directory."""
    return check_drafter_path(str(server_args.speculative_algorithm).upper(), server_args.speculative_draft_model_path,
                              revision=getattr(server_args, "speculative_draft_model_revision", None),
                              cache_dir=getattr(server_args, "download_dir", None))


def check_drafter_path(algo: str, path, *, revision: str | None = None, cache_dir: str | None = None,
                       files: tuple[str, ...] = ("*.json", "*.safetensors")) -> str:
    """The local drafter directory `path` names, or ValueError. A path that is not a local directory is read
    as a Hugging Face hub id and resolved as SGLang resolves a hub model (`snapshot_download` of `files` into
    the HF cache or `--download-dir`, only the cache under HF_HUB_OFFLINE=1). SGLang reads the drafter's
    config.json before any algorithm-specific check, see `mfd_sglang.patches.launch_checks`."""
    if not path:
        raise ValueError(f"--speculative-algorithm {algo} needs --speculative-draft-model-path DIR: a "
                         "DFlash or MFD drafter directory (config.json + safetensors) or its Hugging Face hub "
                         "id, trained for this target.")
    if Path(path).is_dir():
        return str(path)
    if Path(path).is_absolute() or str(path).startswith(".") or str(path).count("/") > 1:
        raise ValueError(f"--speculative-draft-model-path {path}: no such directory. Pass a drafter directory "
                         "(config.json + *.safetensors) or a Hugging Face hub id (org/name).")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    offline = constants.HF_HUB_OFFLINE
    try:
        return snapshot_download(path, revision=revision, cache_dir=cache_dir,
                                 allow_patterns=list(files), local_files_only=offline)
    except (HFValidationError, LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        where = (f"in the Hugging Face cache ({cache_dir or constants.HF_HUB_CACHE}; "
                 "HF_HUB_OFFLINE=1 allows no download)" if offline else "on the Hugging Face hub")
        raise ValueError(f"--speculative-draft-model-path {path}: no such directory, and no drafter "
                         f"{path!r} (revision {revision or 'main'}) {where}: {type(e).__name__}. Pass a "
                         "drafter directory (config.json + *.safetensors) or a hub id that holds one.") from None


def target_config(server_args) -> dict:
    """The target's text config: from `--model-path`'s config.json, or for a hub id as SGLang reads it
    (`get_config`: the HF cache, or the hub unless HF_HUB_OFFLINE=1)."""
    from mfd_sglang.checkpoint import target_text_config

    if Path(server_args.model_path).is_dir():
        return target_text_config(server_args.model_path)
    from sglang.srt.utils.hf_transformers_utils import get_config

    return target_text_config(get_config(server_args.model_path,
                                         trust_remote_code=bool(getattr(server_args, "trust_remote_code", False)),
                                         revision=getattr(server_args, "revision", None)))


def check_capturable_layers(ckpt, target) -> None:
    """SGLang captures a target layer's output as the input of the next layer, so the last layer's
    output (which HF reports after the final norm) cannot feed the drafter."""
    from mfd_sglang.checkpoint import field_error, target_text_config

    num_layers = target_text_config(target).get("num_hidden_layers")
    bad = [i for i in ckpt.config.target_layer_ids if i >= num_layers - 1]
    if bad:
        raise field_error("dflash_config.target_layer_ids", list(ckpt.config.target_layer_ids),
                          f"layer indices below {num_layers - 1} (the target's last layer cannot be captured "
                   f"in SGLang; offending: {bad})", "Train the drafter on earlier target layers.")
