"""Refuse, per request, the features the MFD worker does not implement (SGLang 0.5.23).

Wraps ``sglang.srt.speculative.dflash_utils.validate_dflash_request`` (AROUND). The scheduler calls
it for every new request of a DFlash-family algorithm (``Scheduler.handle_generate_request``) and,
when it returns a message, finishes that request with the message as a 400 error instead of
scheduling it. MFD is DFlash-family (see ``mfd_sglang.serving.launch.algorithms``), so this is the one
place where an unsupported request can be refused before it reaches the worker: the worker's
verification applies the sampling law (temperature / top-k / top-p / min-p, sampling_seed), penalties,
min_new_tokens, logit_bias and grammar masks at every tree node, and returns logprobs and sampling
masks; a feature that changes the target's distribution otherwise (custom logit processors) would be
ignored silently.
The wrapper only adds checks when the server runs MFD or MFD_D; other algorithms see the original.
HookRegistry rebinds the scheduler's by-name import. Re-check the call site on SGLang upgrades.
"""

from __future__ import annotations

SGLANG_VERSION = "0.5.23"
VALIDATE_DFLASH_REQUEST = "sglang.srt.speculative.dflash_utils.validate_dflash_request"


def unsupported_request_features(req) -> list[str]:
    """The names of the features `req` asks for that MFD does not support (empty when none)."""
    checks = [
        ("return_hidden_states", bool(getattr(req, "return_hidden_states", False))),
        ("custom_logit_processor", bool(getattr(req, "custom_logit_processor", None))),
        ("lora_path", getattr(req, "lora_id", None) is not None),
    ]
    return [name for name, used in checks if used]


def running_mfd() -> bool:
    from sglang.srt.runtime_context import get_spec

    from mfd_sglang.serving.launch.algorithms import is_mfd

    return is_mfd(get_spec().speculative_algorithm)


def validate_request_around(original, req, *args, **kwargs):
    """AROUND hook: MFD's verdict first (the original names DFLASH in its messages, e.g. for hidden
    states under overlap scheduling), then the original's."""
    unsupported = unsupported_request_features(req) if running_mfd() else []
    if unsupported:
        return ("MFD speculative decoding does not support " + ", ".join(unsupported)
                + " in a request. Remove it from the request, or serve this model without "
                  "--speculative-algorithm MFD for such requests.")
    return original(req, *args, **kwargs)


def install() -> None:
    """Register the hook (once per process); SGLang's load_plugins() applies it."""
    from mfd_sglang.patches import register_once

    register_once(VALIDATE_DFLASH_REQUEST, validate_request_around, "around")
