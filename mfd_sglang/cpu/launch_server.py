"""``python -m mfd_sglang.cpu.launch_server ARGS...``: SGLang 0.5.23's ``sglang.launch_server``
(same flags) on a CPU-only machine.

Before SGLang is imported it
1. sets ``SGLANG_USE_CPU_ENGINE=1`` (without it RoPE falls back to vllm and start-up fails) and
   ``MFD_SGLANG_CPU=1`` (tells the plugin entry point in every SGLang process to install the CPU
   hooks), and ``TRITON_INTERPRET=1`` unless set (the ``triton`` attention backend and any Triton
   kernel SGLang reaches on CPU need the interpreter; nothing else is affected);
2. puts the pure-torch ``sgl_kernel`` stand-in on ``sys.path`` and ``PYTHONPATH`` (spawned
   scheduler / detokenizer processes inherit it);
3. adds CPU defaults for the flags the user did not give (printed on stdout):
   ``--device cpu``, ``--max-total-tokens 8192`` (else the KV pool is sized from host RAM),
   ``--mem-fraction-static 0.5``, ``--attention-backend mfd_cpu`` (this plugin's plain-torch
   backend, which also serves speculative tree verify; SGLang's CPU default ``intel_amx`` needs
   the unpublished AMX build of sgl-kernel), ``--disable-cuda-graph`` (no graphs on CPU),
   ``--sleep-on-idle`` (an idle SGLang scheduler otherwise spins a whole core polling for requests:
   on a few cores, a second server or anything else running beside it would get half the machine);
   for a hybrid linear-attention target (a local ``--model-path`` whose config.json names recurrent
   layers: Qwen3.5 / Qwen3.6 Gated DeltaNet) also ``--mamba-radix-cache-strategy no_buffer`` (SGLang's
   default ``extra_buffer`` needs state snapshots its CPU platform lacks), ``--disable-overlap-schedule``
   (``no_buffer`` requires it) and ``--max-mamba-cache-size 256`` (else the recurrent-state pool is
   sized from host RAM: gigabytes even for a tiny model, and tens of seconds to allocate); for a PD
   decode server also ``--disaggregation-decode-retraction-backup cpu_tensor`` (the default host pool is
   CUDA-pinned), and for either PD server ``SGLANG_HOST_IP=127.0.0.1`` and
   ``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=0`` in the environment unless set;
4. registers the CPU hooks (``mfd_sglang.cpu.install``): among them the FULL_MASK hooks
   (``mfd_sglang.patches.full_mask``), the one that lets ``--tp-size`` run on CPU
   (``mfd_sglang.patches.cpu_tp``: gloo instead of PyNccl) and those that let SGLang's own
   ``--speculative-algorithm DFLASH`` serve on CPU (``mfd_sglang.patches.cpu_dflash``), and the Mooncake
   sender's CPU path for PD disaggregation (``mfd_sglang.patches.cpu_disaggregation``);
then runs ``sglang.launch_server`` as ``__main__`` with the completed argument list.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

# (flag, value); None for a switch that takes no value.
CPU_DEFAULTS: list[tuple[str, str | None]] = [
    ("--device", "cpu"),
    ("--max-total-tokens", "8192"),
    ("--mem-fraction-static", "0.5"),
    ("--attention-backend", "mfd_cpu"),
    ("--disable-cuda-graph", None),
    ("--sleep-on-idle", None),
]

# Added for a PD decode server (`--disaggregation-mode decode`): SGLang's default retraction backup on a
# decode server is a host pool, pinned with CUDA; `cpu_tensor` copies a retracted request's KV to tensors.
DECODE_CPU_DEFAULTS: list[tuple[str, str | None]] = [
    ("--disaggregation-decode-retraction-backup", "cpu_tensor"),
]

# Set for PD disaggregation unless given: the transfer engine's address (loopback: else it advertises the
# machine's first private address), and no early send of a prefill's cached prefix (it records a CUDA event).
DISAGGREGATION_CPU_ENV = {"SGLANG_HOST_IP": "127.0.0.1", "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "0"}

# Added for hybrid linear-attention targets.
HYBRID_CPU_DEFAULTS: list[tuple[str, str | None]] = [
    ("--mamba-radix-cache-strategy", "no_buffer"),
    ("--disable-overlap-schedule", None),
    ("--max-mamba-cache-size", "256"),
]

PREFIX = "[mfd_sglang.cpu.launch_server]"


def _given(argv: list[str], flag: str) -> bool:
    spellings = {flag, "--" + flag[2:].replace("-", "_")}
    return any(a in spellings or a.split("=", 1)[0] in spellings for a in argv)


def _flag_value(argv: list[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def hybrid_target(argv: list[str]) -> bool:
    """Whether --model-path (or --model) is a local model directory whose config.json names recurrent
    layers (a hybrid linear-attention target)."""
    from mfd_sglang.serving.launch.target_checks import hybrid_markers

    path = _flag_value(argv, "--model-path") or _flag_value(argv, "--model")
    config = Path(path) / "config.json" if path else None
    if config is None or not config.is_file():
        return False
    recurrent, keys = hybrid_markers(json.loads(config.read_text()))
    return bool(recurrent or keys)


def apply_cpu_defaults(argv: list[str]) -> tuple[list[str], list[tuple[str, str | None]]]:
    """(argv with the CPU defaults the user did not give appended, the defaults added)."""
    if any(a in ("-h", "--help") for a in argv):
        return list(argv), []
    defaults = (CPU_DEFAULTS + (HYBRID_CPU_DEFAULTS if hybrid_target(argv) else [])
                + (DECODE_CPU_DEFAULTS if _flag_value(argv, "--disaggregation-mode") == "decode" else []))
    added = [(flag, value) for flag, value in defaults if not _given(argv, flag)]
    out = list(argv)
    for flag, value in added:
        out += [flag] if value is None else [flag, value]
    return out, added


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, added = apply_cpu_defaults(argv)
    if added:
        shown = " ".join(f if v is None else f"{f} {v}" for f, v in added)
        print(f"{PREFIX} CPU defaults added: {shown}", flush=True)
    else:
        print(f"{PREFIX} CPU defaults added: none (all given)", flush=True)

    from mfd_sglang.cpu import install, prepare_environment

    prepare_environment()
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if _flag_value(argv, "--disaggregation-mode") in ("prefill", "decode"):
        for name, value in DISAGGREGATION_CPU_ENV.items():
            if name not in os.environ:
                os.environ[name] = value
                print(f"{PREFIX} PD disaggregation: {name}={value}", flush=True)
    install()  # applied by sglang's load_plugins() inside sglang.launch_server

    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
