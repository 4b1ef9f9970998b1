"""The plugin imported from a source checkout refuses to register, saying why.

`python -m sglang.launch_server` started in the repository root puts the root first on sys.path, so SGLang's
plugin loader imports the repository's `mfd_sglang/`, which has no `patches/` or `kernels/` (only an install
maps them in). SGLang only logs a plugin's exception, and the launch then ends with "Unknown speculative
algorithm name: MFD"; the plugin prints the cause first. Python runs with -S here: no site-packages, so no
editable-install finder maps `mfd_sglang.patches` back in (as on the GPU machine, where nothing is installed
in editable mode).
"""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROBE = "import mfd_sglang.plugin as p; print(p.source_checkout_error()); p.register()"


def checkout(tmp_path: Path, installed: bool) -> Path:
    root = tmp_path / ("site" if installed else "checkout")
    shutil.copytree(REPO / "mfd_sglang", root / "mfd_sglang", ignore=shutil.ignore_patterns("__pycache__"))
    if installed:  # as setup.py installs it
        shutil.copytree(REPO / "patches", root / "mfd_sglang" / "patches", ignore=shutil.ignore_patterns("__pycache__"))
        shutil.copytree(REPO / "kernels", root / "mfd_sglang" / "kernels", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_a_source_checkout_is_refused_with_the_reason(tmp_path):
    root = checkout(tmp_path, installed=False)
    proc = subprocess.run([sys.executable, "-S", "-c", PROBE], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"mfd_sglang was imported from {root / 'mfd_sglang'}, a source checkout" in proc.stdout
    assert "ImportError" in proc.stderr and "Start the server from another directory" in proc.stderr


def test_the_installed_layout_passes_the_check(tmp_path):
    root = checkout(tmp_path, installed=True)
    code = "import mfd_sglang.plugin as p; print(p.source_checkout_error())"
    proc = subprocess.run([sys.executable, "-S", "-c", code], cwd=root, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "None", proc.stderr
