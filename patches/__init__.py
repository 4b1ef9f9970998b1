"""SGLang behaviour changes as HookRegistry hooks (installed as `mfd_sglang.patches`). Each module names
the SGLang internal it wraps, the SGLang version it was written for, and why.

Every hook goes through `register_once`, which keeps it. SGLang 0.5.23's `HookRegistry.apply_hooks`
only logs a target it cannot resolve or patch ("Failed to apply hooks to ...") and carries on without
the hook, so `missing_hooks` looks each kept hook up in the live SGLang afterwards, and
`installed_check` (itself a hook) makes every server process refuse to start while one is missing.
"""

from __future__ import annotations

import pkgutil
from typing import Callable

_registered: dict[tuple[str, str], Callable] = {}  # (target, hook's qualified name): hook


def _key(target: str, hook) -> tuple[str, str]:
    return target, f"{hook.__module__}.{hook.__qualname__}"


def register_once(target: str, hook, hook_type: str) -> bool:
    """Register `hook` on the dotted SGLang `target` with HookRegistry (hook_type: "before", "after",
    "around" or "replace"), once per process; True when it was registered now. SGLang's
    load_plugins() applies registered hooks after the plugin entry points have run."""
    key = _key(target, hook)
    if key in _registered:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType(hook_type))
    _registered[key] = hook
    return True


def is_registered(target: str, hook) -> bool:
    return _key(target, hook) in _registered


def registered_hooks() -> list[tuple[str, str]]:
    """(target, hook's qualified name) of every hook registered in this process."""
    return sorted(_registered)


def _live(target: str):
    """The object at `target` now, as `HookRegistry._apply_target` reads and replaces it (a class's own
    attribute, unwrapped from classmethod / staticmethod); None when it does not resolve."""
    owner_path, name = target.rsplit(".", 1)
    try:
        owner = pkgutil.resolve_name(owner_path)
    except (ImportError, AttributeError, ValueError):
        return None
    attr = vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name, None)
    return getattr(attr, "__func__", attr) if isinstance(attr, (classmethod, staticmethod)) else attr


def _wraps_hook(fn, hook) -> bool:
    """Whether `hook` is in the wrapper chain of `fn`: SGLang 0.5.23's `_wrap_fn` wrappers close over
    their hook and set `__wrapped__` to what they wrap."""
    seen = set()
    while fn is not None and id(fn) not in seen:
        seen.add(id(fn))
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # an empty cell
                continue
        fn = getattr(fn, "__wrapped__", None)
    return False


def missing_hooks() -> list[str]:
    """'TARGET (HOOK)' for each hook registered in this process that its target's live object does not
    run: the target does not resolve, or HookRegistry did not wrap it with the hook (a failed or
    skipped apply_hooks, or a hook registered after its target was patched)."""
    return [f"{target} ({name})" for (target, name), hook in sorted(_registered.items())
            if not _wraps_hook(_live(target), hook)]
