"""SGLang plugin entry point (`sglang.srt.plugins` group, see setup.py).

SGLang calls `register()` once per process (launcher, scheduler, detokenizer) before it parses
arguments, so what is registered here is known everywhere:
  - the `mfd_cpu` attention backend (plain torch, for CPU-only machines; `mfd_sglang.cpu.attention`);
  - the CPU HookRegistry hooks, when `python -m mfd_sglang.cpu.launch_server` started the process
    tree (`MFD_SGLANG_CPU=1`); SGLang applies hooks per process, so they are registered again in
    every spawned child.
The MFD / MFD_D speculative algorithms are not registered yet (the SGLang worker is not built).
"""

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    from . import __version__
    from .cpu import install_if_requested
    from .cpu.attention import register_cpu_attention_backend

    backend = register_cpu_attention_backend()
    cpu_hooks = install_if_requested()
    logger.debug("mfd_sglang %s plugin: attention backend %r, CPU hooks %s", __version__, backend,
                 "installed" if cpu_hooks else "not requested")
