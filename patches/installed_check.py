"""Refuse to run an SGLang process in which one of MFD's hooks did not apply (SGLang 0.5.23).

Wraps ``sglang.srt.runtime_context.publish`` (BEFORE). Every SGLang server process calls
``load_plugins()`` first (entry points, then ``HookRegistry.apply_hooks()``) and ``publish(server_args,
role=...)`` soon after, before it serves anything: the launcher's tokenizer side
(``Engine._launch_subprocesses``, before any child is spawned), each scheduler
(``run_scheduler_process``), the detokenizer and the data-parallel controller. ``apply_hooks`` only
logs a target that does not resolve ("Failed to apply hooks to ...") and carries on; several hooks
are what keeps MFD exact (FULL_MASK, the hybrid tree verify, penalties, the launch checks), so a
renamed SGLang internal or one pruned from the device kit would otherwise go unnoticed. In a process
that serves MFD or MFD_D (or whose arguments it cannot read) the hook raises, naming each missing hook,
and the launch stops; in any other SGLang server of the environment (plain decoding, EAGLE, DFLASH,
which do not run through these hooks) it logs a warning naming them and the server starts. This hook
is registered like every other one, so ``tests/test_hook_targets.py`` and the device kit's build
resolve its target too.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
PUBLISH = "sglang.srt.runtime_context.publish"


class HooksNotInstalled(RuntimeError):
    pass


def require_installed_before(*args, **kwargs):
    """BEFORE hook of publish(server_args, ...): when a hook registered in this process is not in its
    target's live object, raise if the process may serve MFD / MFD_D, else warn."""
    from mfd_sglang.patches import missing_hooks
    from mfd_sglang.serving.launch.algorithms import is_mfd

    missing = missing_hooks()
    if not missing:
        return
    server_args = args[0] if args else kwargs.get("server_args")
    unknown = server_args is None or not hasattr(server_args, "speculative_algorithm")
    what = (f"mfd_sglang: SGLang hooks not installed in this process: {'; '.join(missing)}. SGLang "
            f"{SGLANG_VERSION}'s HookRegistry could not apply them (see 'Failed to apply hooks' above); the "
            "SGLang version or the installed SGLang files differ from what mfd_sglang/patches was written for.")
    if unknown or is_mfd(server_args.speculative_algorithm):
        raise HooksNotInstalled(f"{what} MFD would run without them, possibly emitting wrong tokens.")
    logger.warning("%s This server (--speculative-algorithm %s) does not run MFD and starts; an MFD or MFD_D "
                   "server in this environment would refuse to.", what, server_args.speculative_algorithm)


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(PUBLISH, require_installed_before, "before")
