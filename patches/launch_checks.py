"""Check the MFD drafter path before SGLang reads it (SGLang 0.5.23).

Wraps ``sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias`` (BEFORE).
During argument resolution SGLang calls it with the algorithm name and the draft model path, and
it loads the drafter's config.json through the Hugging Face hub helpers before any
algorithm-specific check runs. A missing local directory then fails with "Repo id must be in the
form 'repo_name'...", which does not say what is wrong. For MFD / MFD_D the hook first checks the
path itself (``mfd_sglang.serving.algorithms.check_drafter_path``) and raises a message that names
the flag and the fix. Other algorithms are untouched. Re-check the function on SGLang upgrades.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
RESOLVE_ALGORITHM_ALIAS = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"


def check_mfd_drafter_before(speculative_algorithm=None, speculative_draft_model_path=None, *args, **kwargs):
    """BEFORE hook: raise for MFD / MFD_D without a local drafter directory."""
    from mfd_sglang.serving.algorithms import ALGORITHMS, check_drafter_path

    algo = str(speculative_algorithm or "").upper()
    if algo in ALGORITHMS:
        check_drafter_path(algo, speculative_draft_model_path)


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(RESOLVE_ALGORITHM_ALIAS, check_mfd_drafter_before, "before")
