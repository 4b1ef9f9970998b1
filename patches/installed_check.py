"""Refuse to run an SGLang process in which one of MFD's hooks did not apply (SGLang 0.5.23).

Wraps ``sglang.srt.runtime_context.publish`` (BEFORE). Every SGLang server process calls
``load_plugins()`` first (entry points, then ``HookRegistry.apply_hooks()``) and ``publish(server_args,
role=...)`` soon after, before it serves anything: the launcher's tokenizer side
(``Engine._launch_subprocesses``, before any child is spawned), each scheduler
(``run_scheduler_process``), the detokenizer and the data-parallel controller. ``apply_hooks`` only
logs a target that does not resolve ("Failed to apply hooks to ...") and carries on; several hooks
are what keeps MFD exact (FULL_MASK, the hybrid tree verify, penalties, the launch checks), so a
renamed SGLang internal or one pruned from the device kit would otherwise go unnoticed. The hook
raises, naming each missing hook, and the launch stops. This hook is registered like every other
one, so ``tests/test_hook_targets.py`` and the device kit's build resolve its target too.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
PUBLISH = "sglang.srt.runtime_context.publish"


class HooksNotInstalled(RuntimeError):
    pass


def require_installed_before(*args, **kwargs):
    """BEFORE hook: raise when a hook registered in this process is not in its target's live object."""
    from mfd_sglang.patches import missing_hooks

    missing = missing_hooks()
    if missing:
        raise HooksNotInstalled(
            f"mfd_sglang: SGLang hooks not installed in this process: {'; '.join(missing)}. SGLang "
            f"{SGLANG_VERSION}'s HookRegistry could not apply them (see 'Failed to apply hooks' above) and MFD "
            "would run without them, possibly emitting wrong tokens. The SGLang version or the installed "
            "SGLang files differ from what mfd_sglang/patches was written for.")


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(PUBLISH, require_installed_before, "before")
