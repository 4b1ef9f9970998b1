"""The plugin's HookRegistry hooks are all applied, or the server does not start.

SGLang 0.5.23's `HookRegistry.apply_hooks` only logs a hook target it cannot resolve and carries on, and
several hooks keep MFD exact. So: every `register_once` target in patches/ is registered by the plugin
(CPU hooks included) and resolves in the installed SGLang, where every hook is in its target's live
wrapper chain; a process in which one did not apply refuses at `publish` (the first thing every SGLang
server process does after loading plugins), naming it, and the real launcher stops; the static
resolution the device kit's build uses finds every target in SGLang's sources and names one that is
gone; the kit's trimmed SGLang holds every target; and `scripts/kit.sh device build` fails when its prune
list removes a hook target.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mfd_sglang.server_process import launch_command
from servers import HOOK_FAILURE, free_port, start

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from hook_targets import hook_targets, source_reader, unresolved  # noqa: E402

PATCHES = REPO / "patches"
SITE = Path(__import__("sglang").__file__).resolve().parents[1]  # the folder holding the installed sglang/
BOGUS = "sglang.srt.speculative.eagle_utils.no_such_function"  # a target no SGLang defines
REGISTER_BOGUS = f"""
from mfd_sglang.patches import register_once

def never_applied(*args, **kwargs):
    pass

register_once({BOGUS!r}, never_applied, "before")
"""

# A CPU server process's environment (what mfd_sglang.cpu.launch_server sets up before SGLang is imported).
CPU_PROCESS = """
from mfd_sglang.cpu import prepare_environment
prepare_environment()
"""
# Every SGLang process first runs load_plugins() (the entry points, then HookRegistry.apply_hooks()).
LIVE_HOOKS = CPU_PROCESS + """
import inspect, json, pkgutil
from sglang.srt.plugins import load_plugins
load_plugins()
from mfd_sglang.patches import missing_hooks, registered_hooks
files = {}
for target, _ in registered_hooks():
    owner, name = target.rsplit(".", 1)
    patched = getattr(pkgutil.resolve_name(owner), name)  # resolves in the installed SGLang, or raises
    files[target] = inspect.getsourcefile(inspect.unwrap(patched))  # where SGLang defines the original
print("LIVE", json.dumps({"registered": registered_hooks(), "missing": missing_hooks(), "files": files}))
"""


def run_python(code: str) -> subprocess.CompletedProcess:
    """`python -c code` outside the repository (whose root would shadow the installed package)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=REPO.parent,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def live_hooks() -> dict:
    """What a CPU server process holds after load_plugins(): the registered (target, hook) pairs, the hooks
    missing from their targets, and the file each target's original is defined in."""
    proc = run_python(LIVE_HOOKS)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("LIVE ")), None)
    assert proc.returncode == 0 and line, (proc.stdout + proc.stderr)[-4000:]
    assert HOOK_FAILURE not in proc.stderr, proc.stderr[-4000:]
    return json.loads(line[len("LIVE "):])


def test_every_target_in_patches_is_registered_and_applied(live_hooks):
    registered = {target for target, _ in live_hooks["registered"]}
    assert registered == set(hook_targets(PATCHES)), "register_once calls the plugin never makes, or the reverse"
    assert "sglang.srt.runtime_context.publish" in registered  # the check itself is one of them
    assert live_hooks["missing"] == []


def test_the_static_resolution_finds_every_target_and_names_a_lost_one(live_hooks):
    """What the device kit's build runs over the trimmed SGLang, here over the installed one: every target
    resolves; without the file that defines a target (as Python's import system found it), that target is
    named."""
    targets = hook_targets(PATCHES)

    def sources(without: str | None = None):
        def read(path: str) -> str | None:
            file = SITE / path
            return file.read_text() if file.is_file() and str(file) != without else None
        return read

    assert unresolved(targets, sources()) == []
    for target, file in live_hooks["files"].items():
        lost = unresolved([target], sources(without=str(Path(file).resolve())))
        assert len(lost) == 1 and lost[0].startswith(target + ": "), (target, file, lost)


ALGORITHMS = {"MFD": True, "mfd_d": True, "unreadable": True, None: False, "EAGLE": False, "DFLASH": False}


def test_a_hook_that_did_not_apply_stops_mfd_only():
    """A scheduler-like process: load_plugins(), then publish(server_args) per algorithm. With a hook whose target
    does not exist, SGLang logs the failure and carries on; the plugin's check raises at publish, naming the hook,
    when the process serves MFD / MFD_D or its arguments cannot be read; any other server gets a warning naming
    it and goes on (here into SGLang's publish, which the stand-in arguments then fail)."""
    proc = run_python(CPU_PROCESS + REGISTER_BOGUS + f"""
import sys
from types import SimpleNamespace
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.runtime_context import publish
for algorithm in {list(ALGORITHMS)!r}:
    print("CASE", algorithm, file=sys.stderr, flush=True)
    args = None if algorithm == "unreadable" else SimpleNamespace(speculative_algorithm=algorithm)
    try:
        publish(args, role="detokenizer")
        print("CASE", algorithm, "PUBLISHED")
    except Exception as e:
        print("CASE", algorithm, "RAISED", type(e).__name__, e)
""")
    assert f"{HOOK_FAILURE} to {BOGUS}" in proc.stderr, proc.stderr[-4000:]  # what the server fixtures look for
    outcomes = {ln.split()[1]: ln for ln in proc.stdout.splitlines() if ln.startswith("CASE ")}
    logs = dict(part.split("\n", 1) for part in proc.stderr.split("CASE ")[1:])
    for algorithm, refuses in ALGORITHMS.items():
        outcome = outcomes.get(str(algorithm), "")
        refused = "RAISED HooksNotInstalled" in outcome and f"{BOGUS} (__main__.never_applied)" in outcome
        assert refused == refuses, (algorithm, outcome, (proc.stdout + proc.stderr)[-4000:])
        if not refuses:
            log = logs[str(algorithm)]
            assert f"hooks not installed in this process: {BOGUS} (__main__.never_applied)" in log, (algorithm, log)
            assert f"This server (--speculative-algorithm {algorithm}) does not run MFD and starts" in log, log


def test_the_launcher_stops_when_a_hook_did_not_apply(tiny_pair, tmp_path):
    """The real CPU launcher with MFD, a hook on a missing target registered in its process: the server
    exits before it answers, naming the hook (the launcher publishes before it spawns a scheduler)."""
    script = tmp_path / "launch_with_bogus_hook.py"
    script.write_text(REGISTER_BOGUS + "\nimport sys\nfrom mfd_sglang.cpu.launch_server import main\nmain(sys.argv[1:])\n")
    port = free_port()
    cmd = launch_command(tiny_pair / "target", port=port, algorithm="MFD", drafter=tiny_pair / "drafter", budget=8,
                         dtype="float32")
    cmd = [sys.executable, str(script), *cmd[3:]]  # in place of `python -m mfd_sglang.cpu.launch_server`
    with pytest.raises(RuntimeError, match="before answering /health") as refused:
        start(cmd, tmp_path / "server.log", port=port, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    log = (tmp_path / "server.log").read_text()
    assert f"{HOOK_FAILURE} to {BOGUS}" in log, log[-4000:]
    assert f"HooksNotInstalled: mfd_sglang: SGLang hooks not installed in this process: {BOGUS}" in str(refused.value)


@pytest.fixture(scope="module")
def offline_wheels(tmp_path_factory) -> Path:
    """A pip find-links folder with what `kit.sh device build` downloads, so that it runs offline: the
    kit's own wheels (the kit is built first, as tests/test_device_kit.py does) and an sglang 0.5.23
    wheel made of the installed sglang's files and metadata (compiled ones empty: the prune removes them)."""
    subprocess.run(["bash", str(REPO / "scripts" / "kit.sh"), "device", "build"], cwd=REPO, check=True,
                   capture_output=True, timeout=1800)
    folder = tmp_path_factory.mktemp("wheels")
    for wheel in (REPO / ".device-kit" / "wheels").glob("*.whl"):
        os.symlink(wheel, folder / wheel.name)
    with zipfile.ZipFile(folder / "sglang-0.5.23-py3-none-any.whl", "w") as wheel:
        for file in sorted([*(SITE / "sglang").rglob("*"), *(SITE / "sglang-0.5.23.dist-info").rglob("*")]):
            if file.is_file() and "__pycache__" not in file.parts:
                wheel.writestr(str(file.relative_to(SITE)), b"" if file.suffix == ".so" else file.read_bytes())
    return folder


def test_the_device_kits_sglang_holds_every_hook_target(offline_wheels):
    """The kit as built (and cached: a hook added since is checked here) resolves every target."""
    archive = next((REPO / ".device-kit").glob("sglang-*-trimmed.tar.gz"))
    assert unresolved(hook_targets(PATCHES), source_reader(archive)) == []


def repository_copy(folder: Path) -> Path:
    """What `kit.sh device build` reads of the repository (the script, the prune list, hook_targets.py,
    patches/), copied into `folder`."""
    (folder / "scripts").mkdir()
    for name in ("kit.sh", "kit_pack.py", "hook_targets.py", "device_kit_prune.txt"):
        shutil.copy(REPO / "scripts" / name, folder / "scripts" / name)
    shutil.copytree(PATCHES, folder / "patches")
    return folder


def test_device_kit_build_fails_on_an_up_to_date_kit_when_a_hook_target_is_missing(offline_wheels, tmp_path):
    """A hook added after the kit was built: the build finds the kit up to date (same prune list and pins)
    and still resolves every hook target in it, naming the one it lacks; the kit is left as it was."""
    repo = repository_copy(tmp_path)
    (repo / "patches" / "bogus_hook.py").write_text(REGISTER_BOGUS)
    kit = REPO / ".device-kit"
    before = (kit / "kit.json").read_text()
    proc = subprocess.run(["bash", str(repo / "scripts" / "kit.sh"), "device", "build"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MFD_DEVICE_KIT": str(kit),
                                                        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(offline_wheels)})
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "hook targets missing from the trimmed sglang" in proc.stderr and BOGUS in proc.stderr, proc.stderr[-3000:]
    assert "up to date" not in proc.stdout and (kit / "kit.json").read_text() == before


def test_device_kit_build_fails_when_the_prune_list_removes_a_hook_target(offline_wheels, tmp_path):
    """The build, in a copy of the repository whose prune list also removes the module of the NGRAM
    FULL_MASK hook's target, stops before it packs the kit, naming the target."""
    repository_copy(tmp_path)
    prune = (REPO / "scripts" / "device_kit_prune.txt").read_text()
    (tmp_path / "scripts" / "device_kit_prune.txt").write_text(prune + "sglang/srt/speculative/ngram_worker.py\n")
    proc = subprocess.run(["bash", str(tmp_path / "scripts" / "kit.sh"), "device", "build"], capture_output=True,
                          text=True, timeout=900, env={**os.environ, "MFD_DEVICE_KIT": str(tmp_path / "kit"),
                                                        "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(offline_wheels)})
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "hook targets missing from the trimmed sglang" in proc.stderr, proc.stderr[-3000:]
    assert "sglang.srt.speculative.ngram_worker.NGRAMWorker._prepare_for_speculative_decoding" in proc.stderr
    assert not (tmp_path / "kit").exists()
