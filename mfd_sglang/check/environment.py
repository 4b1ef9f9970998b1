"""The `env` section: versions, the GPU and its driver, tools, and the plugin's registration in SGLang.

Its first row (no verdict) holds the versions of Python, torch, Triton, transformers, FlashInfer, SGLang and
this plugin (read from the installed distributions: nothing is imported that a broken install would stop),
CUDA, the driver, the GPU's name and compute capability, and `nvidia-smi` / nvcc / gcc. Its second row is the
registration probe: a subprocess started in the check's scratch folder (never a repository root, whose
source folder `mfd_sglang/` would shadow the installed plugin) imports SGLang's engine, loads its plugins and
resolves MFD and MFD_D, as a server process does; ok when that works and, where `check.source_root` is set
(the GPU check's copy of the repository), the plugin did not come from that checkout's source folder.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from typing import Iterator

from .run import Check

REGISTRATION_PROBE = """
import json, sys
out = {}
import sglang, sglang.srt.entrypoints.engine
out["sglang"] = sglang.__version__
from sglang.srt.plugins import load_plugins
load_plugins()
import mfd_sglang
out["mfd_sglang"] = mfd_sglang.__file__
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
out["MFD"] = str(SpeculativeAlgorithm.from_string("MFD"))
out["MFD_D"] = str(SpeculativeAlgorithm.from_string("MFD_D"))
print(json.dumps(out))
"""


def command_output(cmd: list[str], timeout: float = 30) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (proc.stdout + proc.stderr).strip()[:2000] or f"(exit {proc.returncode}, no output)"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"not available: {type(exc).__name__}: {exc}"


def distribution_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions(device: str) -> dict:
    """What a report names first: the software stack and the GPU (a failed import is recorded, not raised:
    the check runs on partial installs too)."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "device": device,
            "machine": platform.node(), "sglang": distribution_version("sglang"),
            "mfd_sglang": distribution_version("mfd-sglang"),
            "TRITON_F32_DEFAULT": os.environ.get("TRITON_F32_DEFAULT"),
            "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET"),
            "kit_install_status": os.environ.get("MFD_GPU_CHECK_KIT_STATUS")}
    for name in ("triton", "transformers", "flashinfer"):
        try:
            info[name] = importlib.import_module(name).__version__
        except Exception as exc:
            info[name] = f"not importable: {type(exc).__name__}: {exc}"
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                    compute_capability=".".join(map(str, torch.cuda.get_device_capability(device))),
                    driver=command_output(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]))
    return info


def check_environment(check: Check) -> Iterator[dict]:
    """Versions and tools (a row without a verdict), then the registration probe (module docstring)."""
    info = versions(check.device)
    info["nvidia_smi"] = command_output(["nvidia-smi"])
    info["nvcc"] = command_output(["nvcc", "--version"]).splitlines()[-1:]
    info["gcc"] = command_output(["gcc", "--version"]).splitlines()[:1]
    yield {"env": info}
    row = {"probe": "SGLang engine import + MFD / MFD_D registered (load_plugins)", "ok": False}
    try:
        proc = subprocess.run([sys.executable, "-c", REGISTRATION_PROBE], capture_output=True, text=True,
                              cwd=check.workdir, timeout=max(10.0, min(300.0, check.left())))
        if proc.returncode == 0:
            found = json.loads(proc.stdout.strip().splitlines()[-1])
            source = check.source_root
            row.update(found, ok=source is None or not found["mfd_sglang"].startswith(str(source / "mfd_sglang")))
        else:
            row["error"] = proc.stderr[-4000:]
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    yield row
