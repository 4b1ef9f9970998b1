"""Launch checks that must run before SGLang's own argument resolution reaches them (SGLang 0.5.23).

1. The target. Wraps ``sglang.srt.arg_groups.pipeline.run_resolution_pipeline`` (BEFORE), which
``ServerArgs`` runs first thing at launch. Its model-specific steps already act on hybrid targets
(e.g. the mamba radix cache hook asserts on CPUs) long before an algorithm's own check, so a target on
which MFD's tree verify would be silently wrong (``mfd_sglang.serving.launch.target_checks``) is refused here,
with its architecture and the reason, before any of them. Other algorithms are untouched.

2. The drafter path. Wraps ``sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias`` (BEFORE).
During argument resolution SGLang calls it with the algorithm name and the draft model path, and
it loads the drafter's config.json through the Hugging Face hub helpers before any
algorithm-specific check runs. A missing local directory then fails with "Repo id must be in the
form 'repo_name'...", which does not say what is wrong. For MFD / MFD_D the hook first checks the
path itself (``mfd_sglang.serving.launch.resolve.check_drafter_path``) and raises a message that names
the flag and the fix. Other algorithms are untouched. Re-check the function on SGLang upgrades.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
RESOLVE_ALGORITHM_ALIAS = "sglang.srt.arg_groups.speculative_hook._resolve_speculative_algorithm_alias"
RESOLUTION_PIPELINE = "sglang.srt.arg_groups.pipeline.run_resolution_pipeline"


def refuse_unsupported_target_before(server_args=None, *args, **kwargs):
    """BEFORE hook: raise for MFD / MFD_D on a target whose tree verify SGLang would get wrong."""
    from mfd_sglang.serving.launch.algorithms import is_mfd
    from mfd_sglang.serving.launch.target_checks import target_refusal

    if not is_mfd(getattr(server_args, "speculative_algorithm", None)):
        return
    refusal = target_refusal(server_args.model_path, trust_remote_code=bool(server_args.trust_remote_code),
                             revision=getattr(server_args, "revision", None))
    if refusal:
        raise ValueError(refusal)


def check_mfd_drafter_before(speculative_algorithm=None, speculative_draft_model_path=None, *args, **kwargs):
    """BEFORE hook: raise for MFD / MFD_D without a drafter directory (local, or a hub id's snapshot)."""
    from mfd_sglang.serving.launch.algorithms import is_mfd
    from mfd_sglang.serving.launch.resolve import check_drafter_path

    if is_mfd(speculative_algorithm):
        # The config only: SGLang's get_config reads it next from the default HF cache; the weights are fetched
        # once, by the launch's own check, at --speculative-draft-model-revision into --download-dir.
        check_drafter_path(str(speculative_algorithm).upper(), speculative_draft_model_path, files=("*.json",))


def install() -> None:
    """Register the hooks (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(RESOLUTION_PIPELINE, refuse_unsupported_target_before, "before")
    register_once(RESOLVE_ALGORITHM_ALIAS, check_mfd_drafter_before, "before")
