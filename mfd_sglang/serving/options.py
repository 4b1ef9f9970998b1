"""Plugin options that SGLang 0.5.23 has no flag for, and the SGLang flags MFD reads.

SGLang's ServerArgs is a fixed struct, so MFD's own options travel as environment variables, which the
spawned scheduler processes inherit. Where SGLang has a flag, MFD uses it:

    --speculative-num-draft-tokens N    tokens verified per request and round, root included,
                                        as for EAGLE: the tree budget is B = N - 1.
                                        Default: 65 (B = 64) on CUDA, 17 (B = 16) elsewhere.
    --speculative-draft-model-quantization fp8
                                        the drafter's attention and MLP linears in FP8 e4m3
                                        (`mfd_sglang.fp8`: per-channel weights, dynamic per-token
                                        activations); see `draft_quantization`. Default: SGLang's,
                                        the target's --quantization.

    MFD_SGLANG_SWITCH_THRESHOLD=3       MFD_D drafts with its single-mode path while at least this
                                        many requests run in a decode batch, and with all K modes
                                        below it.
    MFD_SGLANG_NUM_MODES=K'             draft K' modes only (default: all): each request's K' best
                                        under the drafter's mode gate, or without a gate the
                                        drafter's first K'.
    MFD_SGLANG_AUTO_BUDGET=1            pick the budget (0: plain decoding, up to B) and, for MFD_D,
                                        the drafting path per decode batch from acceptance and round
                                        times measured while serving, costs calibrated at start-up
                                        (`budget`, `calibration`); B from the flag above
                                        is then the largest. Not with MFD_SGLANG_SWITCH_THRESHOLD.
    MFD_SGLANG_MODE_SUBSETS=0           with the automatic budget and a drafter with a mode gate, do
                                        not offer the paths that draft each request's K/2 and 1 best
                                        modes beside all K (`budget.mode_paths`; default: offered).
                                        1 asks for them: refused at launch without both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SWITCH_THRESHOLD_ENV = "MFD_SGLANG_SWITCH_THRESHOLD"
NUM_MODES_ENV = "MFD_SGLANG_NUM_MODES"
AUTO_BUDGET_ENV = "MFD_SGLANG_AUTO_BUDGET"
MODE_SUBSETS_ENV = "MFD_SGLANG_MODE_SUBSETS"
DEFAULT_SWITCH_THRESHOLD = 3
MAX_BUDGET = 1024


def default_num_draft_tokens(device: str) -> int:
    return 65 if str(device).startswith("cuda") else 17


@dataclass(frozen=True)
class MFDOptions:
    switch_threshold: int = DEFAULT_SWITCH_THRESHOLD
    num_modes: int | None = None  # None: every mode of the drafter
    auto_budget: bool = False
    mode_subsets: bool | None = None  # None: offered where they can be (a mode gate, the automatic budget)


def _flag(environ, name: str, meaning: str) -> bool | None:
    raw = environ.get(name, "")
    if raw not in ("", "0", "1"):
        raise ValueError(f"{name}={raw!r}: set it to 1 ({meaning}) or 0, or unset it.")
    return None if raw == "" else raw == "1"


def _positive_int(environ, name: str) -> int | None:
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


def read_options(environ=None) -> MFDOptions:
    """The options from the environment; ValueError naming the variable when one is malformed."""
    env = os.environ if environ is None else environ
    threshold = _positive_int(env, SWITCH_THRESHOLD_ENV)
    auto = _flag(env, AUTO_BUDGET_ENV, "automatic budget")
    if auto and threshold is not None:
        raise ValueError(f"{AUTO_BUDGET_ENV}=1 chooses MFD_D's drafting path itself; unset "
                         f"{SWITCH_THRESHOLD_ENV}={env[SWITCH_THRESHOLD_ENV]} (or the automatic budget).")
    return MFDOptions(
        switch_threshold=DEFAULT_SWITCH_THRESHOLD if threshold is None else threshold,
        num_modes=_positive_int(env, NUM_MODES_ENV),
        auto_budget=bool(auto),
        mode_subsets=_flag(env, MODE_SUBSETS_ENV, "paths that draft fewer modes per request"),
    )


# --speculative-draft-model-quantization values MFD's drafter runs (None: the serving dtype).
DRAFT_QUANTIZATIONS = (None, "fp8")


def draft_quantization(server_args) -> str | None:
    """What MFD's drafter runs its attention and MLP linears in, from SGLang's resolved
    --speculative-draft-model-quantization: "fp8" or None (the serving dtype). Unset, SGLang gives the
    draft model the target's --quantization ("unquant" resolves to None); MFD follows it where it can, so
    an inherited method other than fp8 leaves the drafter in the serving dtype (its checkpoint is not in
    that method's format). Set on the command line to another method: ValueError naming the flag."""
    method = getattr(server_args, "speculative_draft_model_quantization", None)
    if method in DRAFT_QUANTIZATIONS:
        return method
    if getattr(server_args, "_speculative_draft_quantization_explicitly_set", False):
        raise ValueError(f"--speculative-draft-model-quantization {method}: MFD's drafter runs its linears in "
                         "fp8 (online, from its bf16 / fp32 checkpoint) or unquantized; pass fp8 or unquant.")
    return None


def budget_from_num_draft_tokens(num_draft_tokens: int) -> int:
    """The tree budget B for --speculative-num-draft-tokens N (N = B + 1); ValueError when out of range."""
    budget = int(num_draft_tokens) - 1
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} gives MFD a tree budget of {budget} "
            f"nodes; it must be between 1 and {MAX_BUDGET} (N = budget + 1, the root included, as "
            f"for EAGLE). Use e.g. --speculative-num-draft-tokens 65 for a 64-node tree.")
    return budget
