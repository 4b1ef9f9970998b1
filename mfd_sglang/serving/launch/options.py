"""MFD's own launch options, and the SGLang flags MFD reads.

SGLang 0.5.23 has no plugin-argument API, but it loads plugins before it parses arguments. MFD's options
are flags of SGLang's own parser (`patches/mfd_flags.py` adds them to `ServerArgs.add_cli_args` as the
group "MFD speculative decoding", so `python -m sglang.launch_server --help` lists them and a `--config`
YAML may set them), and `ServerArgs.from_cli_args`'s result carries what was given as `mfd_options`, a
plain dict that rides along to every scheduler process (TP, DP, PD) with the record, as SGLang's
`_launch_command` does. A flag on a server that does not run MFD / MFD_D is refused at parsing.

    --mfd-switch-threshold N            MFD_D drafts with its single-mode path while at least this
                                        many requests run in a decode batch, and with all K modes
                                        below it (default 3).
    --mfd-num-modes K'                  draft K' modes only (default: all): each request's K' best
                                        under the drafter's mode gate, or without a gate the
                                        drafter's first K'.
    --mfd-auto-budget                   pick the budget (0: plain decoding, up to B) and, for MFD_D,
                                        the drafting path per decode batch from acceptance and round
                                        times measured while serving, costs calibrated at start-up
                                        (`budget.rule`, `budget.calibration`); B from --speculative-num-draft-tokens
                                        is then the largest. Not with --mfd-switch-threshold.
    --mfd-mode-subsets {on,off}         with the automatic budget and a drafter with a mode gate, offer
                                        (default) or not the paths that draft each request's K/2 and 1
                                        best modes beside all K (`budget.mode_paths`); on: refused at
                                        launch without both.
    --mfd-kernels {auto,triton,torch}   which implementation runs every step of the round
                                        (`mfd_sglang.backend`): auto (default) Triton on CUDA, torch
                                        elsewhere; torch: the torch references on CUDA too (the way
                                        around a Triton kernel that fails on a GPU; draft CUDA graphs
                                        off); triton: refused on a device that is not CUDA.
    --mfd-warmup {auto,on,off}          the start-up warm-up (`mfd_sglang.serving.warmup`): a
                                        placeholder round at every batch size and arm before the
                                        server is ready; auto (default) on CUDA, where kernels compile.

Deprecated, for one release: the environment variables MFD_SGLANG_SWITCH_THRESHOLD=N, MFD_SGLANG_NUM_MODES=K',
MFD_SGLANG_AUTO_BUDGET=1 and MFD_SGLANG_MODE_SUBSETS=0/1 still set the same options where no flag does, with
a warning. Where SGLang has a flag, MFD uses it:

    --speculative-num-draft-tokens N    tokens verified per request and round, root included,
                                        as for EAGLE: the tree budget is B = N - 1.
                                        Default: 65 (B = 64) on CUDA, 17 (B = 16) elsewhere.
    --speculative-draft-model-quantization fp8
                                        the drafter's attention and MLP linears in FP8 e4m3
                                        (`mfd_sglang.fp8`: per-channel weights, dynamic per-token
                                        activations); see `draft_quantization`. Default: SGLang's,
                                        the target's --quantization. Needs a GPU of compute capability
                                        8.9 or more (Ada, Hopper): below, refused when set, and an
                                        inherited fp8 leaves the drafter unquantized, with a warning.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass, field

from mfd_sglang.backend import KERNEL_CHOICES

logger = logging.getLogger(__name__)

SWITCH_THRESHOLD_ENV = "MFD_SGLANG_SWITCH_THRESHOLD"
NUM_MODES_ENV = "MFD_SGLANG_NUM_MODES"
AUTO_BUDGET_ENV = "MFD_SGLANG_AUTO_BUDGET"
MODE_SUBSETS_ENV = "MFD_SGLANG_MODE_SUBSETS"
DEFAULT_SWITCH_THRESHOLD = 3
WARMUP_CHOICES = ("auto", "on", "off")
# The largest tree budget: every Triton kernel compiles for sm_90a and sm_80 within shared memory and without
# spills up to B = 256 (tests/test_gpu_ledger.py); at B = 512 the beam kernel alone compiles for minutes.
MAX_BUDGET = 256


def default_num_draft_tokens(device: str) -> int:
    """--speculative-num-draft-tokens when not given: on CUDA 65, the largest budget (64) of the default
    schedule, which picks each round's budget by its batch size (`budget.schedule`); elsewhere 17, every round."""
    return 65 if str(device).startswith("cuda") else 17


@dataclass(frozen=True)
class MFDOptions:
    switch_threshold: int = DEFAULT_SWITCH_THRESHOLD
    num_modes: int | None = None  # None: every mode of the drafter
    auto_budget: bool = False
    mode_subsets: bool | None = None  # None: offered where they can be (a mode gate, the automatic budget)
    kernels: str = "auto"  # --mfd-kernels: `mfd_sglang.backend.resolve_backend` makes it "triton" or "torch"
    warmup: str = "auto"  # --mfd-warmup: `mfd_sglang.serving.warmup.warmup_runs`
    # How each option was given, for messages: its flag, or its environment variable and value.
    spelled: dict = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Option:
    """One MFD option: its field of MFDOptions, its flag and its deprecated environment variable (None: a
    flag only)."""

    field: str
    flag: str
    env: str | None


OPTIONS = (Option("switch_threshold", "--mfd-switch-threshold", SWITCH_THRESHOLD_ENV),
           Option("num_modes", "--mfd-num-modes", NUM_MODES_ENV),
           Option("auto_budget", "--mfd-auto-budget", AUTO_BUDGET_ENV),
           Option("mode_subsets", "--mfd-mode-subsets", MODE_SUBSETS_ENV),
           Option("kernels", "--mfd-kernels", None),
           Option("warmup", "--mfd-warmup", None))
SWITCHES = {"on": True, "off": False, "true": True, "false": False}  # YAML reads on / off as booleans


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1")
    return value


def _switch(text: str) -> bool:
    if text.lower() not in SWITCHES:
        raise argparse.ArgumentTypeError(f"{text!r}: pass on or off")
    return SWITCHES[text.lower()]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    """MFD's options as a group of SGLang's own argument parser (defaults None: not given)."""
    group = parser.add_argument_group("MFD speculative decoding (mfd_sglang plugin; --speculative-algorithm "
                                      "MFD or MFD_D only)")
    group.add_argument("--mfd-switch-threshold", type=_positive, default=None, metavar="N",
                       help="MFD_D: draft with the single-mode path from N running requests in a decode batch, "
                            "with all K modes below (default 3)")
    group.add_argument("--mfd-num-modes", type=_positive, default=None, metavar="K",
                       help="draft K modes only: each request's K best under the drafter's mode gate, without a "
                            "gate its first K (default: all)")
    group.add_argument("--mfd-auto-budget", action="store_true", default=None,
                       help="choose the tree budget (0 = plain decoding, up to --speculative-num-draft-tokens - 1) "
                            "and MFD_D's path per decode batch from measured acceptance and round times")
    group.add_argument("--mfd-mode-subsets", type=_switch, default=None, metavar="{on,off}",
                       help="with --mfd-auto-budget and a gated drafter: offer the paths drafting each request's "
                            "K/2 and 1 best modes (default on where they can be; on: refused without both)")
    group.add_argument("--mfd-kernels", choices=KERNEL_CHOICES, default=None,
                       help="which implementation runs every step of MFD's round: auto (default) = Triton kernels on "
                            "CUDA, torch elsewhere; torch = the pure-torch path on CUDA too, the way around a Triton "
                            "kernel that fails on your GPU (slower: no draft CUDA graphs); triton = Triton, refused "
                            "without CUDA")
    group.add_argument("--mfd-warmup", choices=WARMUP_CHOICES, default=None,
                       help="before the server reports ready, run a placeholder round at every batch size and arm it "
                            "can play, so that no request waits for a kernel compile: auto (default) = on CUDA, "
                            "where kernels compile; on = on any device; off = skip it (the first rounds of each "
                            "batch size then compile, 0.4-1.2 s each on a GPU)")


def given_options(namespace: argparse.Namespace) -> dict:
    """{field: value} of the MFD flags set in a parsed namespace (what `mfd_options` carries)."""
    values = {o.field: getattr(namespace, o.flag[2:].replace("-", "_"), None) for o in OPTIONS}
    return {field: value for field, value in values.items() if value is not None}


def _env_flag(environ, name: str, meaning: str) -> bool | None:
    raw = environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: set it to 1 ({meaning}) or 0, or unset it.")
    return None if raw == "" else raw == "1"


def _env_positive_int(environ, name: str) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < 1:
        raise ValueError(f"{name}={raw!r} is not a positive integer. Set it to a whole number >= 1 "
                         f"or unset it.")
    return value


def _from_environment(env) -> dict:
    values = {"switch_threshold": _env_positive_int(env, SWITCH_THRESHOLD_ENV),
              "num_modes": _env_positive_int(env, NUM_MODES_ENV),
              "auto_budget": _env_flag(env, AUTO_BUDGET_ENV, "automatic budget"),
              "mode_subsets": _env_flag(env, MODE_SUBSETS_ENV, "paths that draft fewer modes per request")}
    return {field: value for field, value in values.items() if value is not None}


def _spelled_flag(option: Option, value) -> str:
    if option.field == "auto_budget":
        return option.flag
    if option.field == "mode_subsets":
        return f"{option.flag} {'on' if value else 'off'}"
    return f"{option.flag} {value}"


def read_options(server_args=None, environ=None) -> MFDOptions:
    """The options given as flags (`server_args.mfd_options`), else by the deprecated environment
    variables (a warning names each); ValueError naming the flag or variable when they do not fit."""
    env = os.environ if environ is None else environ
    flags = dict(getattr(server_args, "mfd_options", None) or {})
    from_env = {field: value for field, value in _from_environment(env).items() if field not in flags}
    for o in OPTIONS:
        if o.field in from_env:
            logger.warning("%s is deprecated and goes in the next release: pass %s instead.", o.env, o.flag)
    values = {**from_env, **flags}
    spelled = {o.field: _spelled_flag(o, flags[o.field]) if o.field in flags
               else f"{o.env}={env.get(o.env)}" if o.env else o.flag for o in OPTIONS}
    if values.get("auto_budget") and values.get("switch_threshold") is not None:
        raise ValueError(f"{spelled['auto_budget']} chooses MFD_D's drafting path itself; drop "
                         f"{spelled['switch_threshold']} (or the automatic budget).")
    return MFDOptions(
        switch_threshold=values.get("switch_threshold", DEFAULT_SWITCH_THRESHOLD),
        num_modes=values.get("num_modes"),
        auto_budget=bool(values.get("auto_budget")),
        mode_subsets=values.get("mode_subsets"),
        kernels=values.get("kernels", "auto"),
        warmup=values.get("warmup", "auto"),
        spelled=spelled,
    )


def attention_dp_size(server_args) -> int:
    """The attention data-parallel width of `server_args`, in either spelling: SGLang 0.5.23's first
    resolution hook (`arg_groups/parallel_hook.py::handle_deprecated_dp_attention`) rewrites
    `--dp-size N --enable-dp-attention` into `attn_dp_size=N, dp_size=1` long before an algorithm's
    check runs; arguments that did not go through it still carry the old spelling."""
    attn_dp = int(getattr(server_args, "attn_dp_size", 1) or 1)
    if getattr(server_args, "enable_dp_attention", False) and attn_dp == 1:
        return int(getattr(server_args, "dp_size", 1) or 1)
    return attn_dp


# --speculative-draft-model-quantization values MFD's drafter runs (None: the serving dtype).
DRAFT_QUANTIZATIONS = (None, "fp8")
# GPUs this process has warned about keeping the drafter unquantized on: the launch and every rank ask again.
_WARNED_NO_FP8: set[str] = set()


def draft_quantization(server_args) -> str | None:
    """What MFD's drafter runs its attention and MLP linears in, from SGLang's resolved
    --speculative-draft-model-quantization: "fp8" or None (the serving dtype). Unset, SGLang gives the
    draft model the target's --quantization ("unquant" resolves to None); MFD follows it where it can, so
    an inherited method other than fp8 leaves the drafter in the serving dtype (its checkpoint is not in
    that method's format). Set on the command line to another method: ValueError naming the flag.
    fp8 on a CUDA GPU without FP8 (`mfd_sglang.fp8.fp8_drafting_supported`: below compute capability 8.9; the
    launch's first GPU, --base-gpu-id, is read): set on the command line, ValueError naming the flag;
    inherited from the target's --quantization fp8, None, with a warning (once per process and GPU)."""
    method = getattr(server_args, "speculative_draft_model_quantization", None)
    explicit = getattr(server_args, "_speculative_draft_quantization_explicitly_set", False)
    if method == "fp8" and getattr(server_args, "device", None) == "cuda":
        from mfd_sglang.fp8 import cuda_capability, fp8_drafting_supported  # torch only where fp8 meets CUDA

        gpu = f"cuda:{getattr(server_args, 'base_gpu_id', 0) or 0}"
        if not fp8_drafting_supported(gpu):
            why = (f"this GPU ({gpu}) has compute capability {'.'.join(map(str, cuda_capability(gpu)))}, and FP8 "
                   "drafting needs 8.9 or more (Ada, Hopper and newer), the first with FP8 tensor cores and e4m3 "
                   "conversions")
            if explicit:
                raise ValueError(f"--speculative-draft-model-quantization fp8: {why}. Drop the flag, or pass "
                                 "unquant, to draft in the serving dtype.")
            if gpu not in _WARNED_NO_FP8:
                _WARNED_NO_FP8.add(gpu)
                logger.warning("MFD: the drafter does not follow the target's --quantization fp8 and drafts in the "
                               "serving dtype: %s.", why)
            return None
    if method in DRAFT_QUANTIZATIONS:
        return method
    if explicit:
        raise ValueError(f"--speculative-draft-model-quantization {method}: MFD's drafter runs its linears in "
                         "fp8 (online, from its bf16 / fp32 checkpoint) or unquantized; pass fp8 or unquant.")
    return None


def budget_from_num_draft_tokens(num_draft_tokens: int) -> int:
    """The tree budget B for --speculative-num-draft-tokens N (N = B + 1); ValueError when out of range."""
    budget = int(num_draft_tokens) - 1
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} gives MFD a tree budget of {budget} "
            f"nodes; it must be between 1 and {MAX_BUDGET}, the largest budget MFD's GPU kernels are built for "
            f"(N = budget + 1, the root included, as for EAGLE: at most --speculative-num-draft-tokens "
            f"{MAX_BUDGET + 1}). Use e.g. --speculative-num-draft-tokens 65 for a 64-node tree.")
    return budget
