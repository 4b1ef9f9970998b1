"""SGLang behaviour changes as HookRegistry hooks (installed as `mfd_sglang.patches`). Each module names
the SGLang internal it wraps, the SGLang version it was written for, and why."""

_registered: set[tuple[str, str]] = set()


def register_once(target: str, hook, hook_type: str) -> bool:
    """Register `hook` on the dotted SGLang `target` with HookRegistry (hook_type: "before", "after",
    "around" or "replace"), once per process; True when it was registered now. SGLang's
    load_plugins() applies registered hooks after the plugin entry points have run."""
    key = (target, f"{hook.__module__}.{hook.__qualname__}")
    if key in _registered:
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(target, hook, HookType(hook_type))
    _registered.add(key)
    return True


def is_registered(target: str, hook) -> bool:
    return (target, f"{hook.__module__}.{hook.__qualname__}") in _registered
