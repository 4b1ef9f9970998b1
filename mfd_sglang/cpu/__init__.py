"""Running SGLang 0.5.23 servers on CPU-only machines.

- ``python -m mfd_sglang.cpu.launch_server ARGS...``: ``sglang.launch_server`` with the CPU engine,
  the ``sgl_kernel`` stand-in, CPU defaults and the FULL_MASK fix (see ``launch_server.py``).
- ``STANDIN_DIR``: the directory that holds the pure-torch ``sgl_kernel`` stand-in package; it goes
  on ``sys.path`` and ``PYTHONPATH`` (so spawned scheduler / detokenizer processes see it too).
- ``install()``: registers the CPU HookRegistry hooks (``mfd_sglang.patches.full_mask``, ``cpu_tp``,
  ``cpu_gated_norm``, ``cpu_mamba_scatter``, ``cpu_dflash``, ``cpu_disaggregation``) in this
  process. ``install_if_requested()`` does so only when ``MFD_SGLANG_CPU=1`` (set by the launcher);
  ``mfd_sglang.plugin.register()`` must call it, because SGLang applies hooks per process from the
  plugin entry points (spawned children start with an empty HookRegistry).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

STANDIN_DIR = Path(__file__).resolve().parent / "sgl_kernel_standin"
ENV_FLAG = "MFD_SGLANG_CPU"


def install() -> None:
    """Register the hooks SGLang's CPU engine needs (idempotent)."""
    from mfd_sglang.patches import (cpu_dflash, cpu_disaggregation, cpu_gated_norm, cpu_mamba_scatter, cpu_tp,
                                    full_mask)

    full_mask.install()
    cpu_tp.install()
    cpu_gated_norm.install()
    cpu_mamba_scatter.install()
    cpu_dflash.install()
    cpu_disaggregation.install()


def install_if_requested() -> bool:
    """``install()`` when ``MFD_SGLANG_CPU=1``; returns whether it did. Called from the plugin
    entry point in every SGLang process."""
    if os.environ.get(ENV_FLAG) == "1":
        install()
        return True
    return False


def prepare_environment(environ=None) -> None:
    """Everything the CPU engine needs in the environment of this process and its children:
    ``SGLANG_USE_CPU_ENGINE=1``, ``MFD_SGLANG_CPU=1``, the stand-in on ``sys.path`` and
    ``PYTHONPATH``. Call before anything imports sglang."""
    env = os.environ if environ is None else environ
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    env[ENV_FLAG] = "1"
    standin = str(STANDIN_DIR)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if standin not in parts:
        env["PYTHONPATH"] = os.pathsep.join([standin, *parts])
    if environ is None and standin not in sys.path:
        sys.path.insert(0, standin)
