"""Running a test module's Triton cases under the interpreter on CPU. TRITON_INTERPRET is read when triton
decorates a kernel (at import) and other tests may import triton first, so the cases run in subprocesses:
the module itself as a script (`main`), its cases in turn, its stdout naming the cases that ran to their end
and its traceback the one that failed."""

import os
import subprocess
import sys
from pathlib import Path


def run_cases(module_file: str, cases: dict, timeout: float = 600) -> None:
    """Assert that every case of `cases` (name -> function) passes when `module_file` runs them interpreted:
    the cases dealt round-robin to one subprocess per CPU core (the interpreter runs on one), run at once."""
    names = list(cases)
    workers = min(len(names), os.cpu_count() or 1)
    groups = [names[i::workers] for i in range(workers)]
    procs = [subprocess.Popen([sys.executable, module_file, *group], cwd=Path(__file__).resolve().parents[1],
                              env={**os.environ, "TRITON_INTERPRET": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for group in groups]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    for group, proc, (stdout, stderr) in zip(groups, procs, outputs):
        assert proc.returncode == 0, stdout[-4000:] + stderr[-8000:]
        assert stdout.split() == group  # each case ran to its end


def main(cases: dict) -> None:
    """A module's `__main__`: run the cases named on the command line, printing each name as it passes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    for name in sys.argv[1:]:
        cases[name]()
        print(name, flush=True)
