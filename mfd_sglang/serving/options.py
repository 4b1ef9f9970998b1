"""Plugin options that SGLang 0.5.23 has no flag for.

SGLang's ServerArgs is a fixed struct, so these travel as environment variables, which the spawned
scheduler processes inherit. The tree budget uses SGLang's own flag:

    --speculative-num-draft-tokens N    tokens verified per request and round, root included,
                                        as for EAGLE: the tree budget is B = N - 1.
                                        Default: 65 (B = 64) on CUDA, 17 (B = 16) elsewhere.

    MFD_SGLANG_SWITCH_THRESHOLD=3       MFD_D drafts with its single-mode path while at least this
                                        many requests run in a decode batch, and with all K modes
                                        below it.
    MFD_SGLANG_NUM_MODES=K'             draft with the drafter's first K' modes only (default: all).
    MFD_SGLANG_AUTO_BUDGET=1            pick the budget (0: plain decoding, up to B) and, for MFD_D,
                                        the drafting path per decode batch from acceptance and round
                                        times measured while serving, costs calibrated at start-up
                                        (`budget`, `calibration`); B from the flag above
                                        is then the largest. Not with MFD_SGLANG_SWITCH_THRESHOLD.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SWITCH_THRESHOLD_ENV = "MFD_SGLANG_SWITCH_THRESHOLD"
NUM_MODES_ENV = "MFD_SGLANG_NUM_MODES"
AUTO_BUDGET_ENV = "MFD_SGLANG_AUTO_BUDGET"
DEFAULT_SWITCH_THRESHOLD = 3
MAX_BUDGET = 1024


def default_num_draft_tokens(device: str) -> int:
    return 65 if str(device).startswith("cuda") else 17


@dataclass(frozen=True)
class MFDOptions:
    switch_threshold: int = DEFAULT_SWITCH_THRESHOLD
    num_modes: int | None = None  # None: every mode of the drafter
    auto_budget: bool = False


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
    auto = env.get(AUTO_BUDGET_ENV, "")
    if auto not in ("", "0", "1"):
        raise ValueError(f"{AUTO_BUDGET_ENV}={auto!r}: set it to 1 (automatic budget) or 0 / unset (fixed).")
    if auto == "1" and threshold is not None:
        raise ValueError(f"{AUTO_BUDGET_ENV}=1 chooses MFD_D's drafting path itself; unset "
                         f"{SWITCH_THRESHOLD_ENV}={env[SWITCH_THRESHOLD_ENV]} (or the automatic budget).")
    return MFDOptions(
        switch_threshold=DEFAULT_SWITCH_THRESHOLD if threshold is None else threshold,
        num_modes=_positive_int(env, NUM_MODES_ENV),
        auto_budget=auto == "1",
    )


def budget_from_num_draft_tokens(num_draft_tokens: int) -> int:
    """The tree budget B for --speculative-num-draft-tokens N (N = B + 1); ValueError when out of range."""
    budget = int(num_draft_tokens) - 1
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"--speculative-num-draft-tokens {num_draft_tokens} gives MFD a tree budget of {budget} "
            f"nodes; it must be between 1 and {MAX_BUDGET} (N = budget + 1, the root included, as "
            f"for EAGLE). Use e.g. --speculative-num-draft-tokens 65 for a 64-node tree.")
    return budget
