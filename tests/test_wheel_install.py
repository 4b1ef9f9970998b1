"""`pip wheel .` builds a wheel whose non-editable install registers the plugin, with no source checkout on
the path: the wheel installed into a fresh venv whose only other packages are this environment's
dependencies (a path view of its site-packages without the editable mfd_sglang install), and run from a
folder outside the repository."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SITE = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())

PROBE = """
import importlib.metadata as md, json, sys
import mfd_sglang, mfd_sglang.kernels.tree_mixture, mfd_sglang.patches.mfd_flags
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.speculative.spec_registry import get_spec
plugins = [(ep.name, ep.value, str(ep.dist.locate_file(""))) for ep in md.entry_points(group="sglang.srt.plugins")]
print(json.dumps({"module": mfd_sglang.__file__, "plugins": plugins,
                  "registered": [name for name in ("MFD", "MFD_D") if get_spec(name) is not None]}))
"""


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory):
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"  # what setup.py packages, so the build leaves nothing in the checkout
    for name in ("mfd_sglang", "kernels", "patches"):
        shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "setup.py", source)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", ".", "-w", str(root / "dist")], cwd=source,
                   check=True, timeout=300)
    wheel, = (root / "dist").glob("mfd_sglang-*.whl")
    venv = root / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    deps = root / "deps"  # this environment's packages, less the editable install of the checkout
    deps.mkdir()
    for entry in SITE.iterdir():
        if not entry.name.startswith(("mfd_sglang", "__editable__", "mfd-sglang")):
            (deps / entry.name).symlink_to(entry)
    venv_site, = venv.glob("lib/python*/site-packages")
    (venv_site / "dependencies.pth").write_text(f"{deps}\n")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)], check=True,
                   timeout=300)
    return venv, root / "elsewhere"


def run_in(venv_and_cwd, *argv):
    venv, cwd = venv_and_cwd
    cwd.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_installed_wheel_registers_the_plugin(wheel_venv):
    import json

    venv, _ = wheel_venv
    out = run_in(wheel_venv, "python", "-c", PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["module"].startswith(str(venv)), result  # the installed copy, not the checkout
    assert ["mfd_sglang", "mfd_sglang.plugin:register"] in [p[:2] for p in result["plugins"]], result
    assert all(p[2].startswith(str(venv)) for p in result["plugins"] if p[0] == "mfd_sglang"), result
    assert result["registered"] == ["MFD", "MFD_D"], result


def test_the_installed_console_script_and_the_demo_without_a_drafter(wheel_venv):
    out = run_in(wheel_venv, "mfd-sglang", "--help")
    assert out.returncode == 0 and "demo" in out.stdout, out.stderr[-2000:]
    out = run_in(wheel_venv, "mfd-sglang", "demo")
    assert out.returncode == 2
    assert "not in an installed wheel)" in out.stderr and "pass --drafter DIR" in out.stderr, out.stderr[-2000:]


def test_the_installed_ledger_runs_its_round_and_fits_its_log(wheel_venv):
    """The GPU cost ledger from the wheel alone: its measured round (`mfd_sglang.round_cost`, the serving stages
    on fake CUDA tensors) and the H200 log it is fitted to (package data) come with the install."""
    venv, _ = wheel_venv
    out = run_in(wheel_venv, "python", "-c", (
        "from mfd_sglang import gpu_ledger\n"
        "assert gpu_ledger.DEFAULT_LOG.is_file(), gpu_ledger.DEFAULT_LOG\n"
        "stages = gpu_ledger.by_stage(gpu_ledger.trace_round_cost('mfd', 1))\n"
        "print(gpu_ledger.DEFAULT_LOG, sorted(stages), 1e6 * gpu_ledger.plain_step_floor())"))
    assert out.returncode == 0, out.stderr[-3000:]
    log, *_ = out.stdout.splitlines()[-1].split()
    assert log.startswith(str(venv)), out.stdout  # the installed copy's package data
    assert "['ar_step', 'commit', 'draft', 'tree', 'verify'] " in out.stdout, out.stdout
