"""Running a test module's Triton cases under the interpreter on CPU. TRITON_INTERPRET is read when triton
decorates a kernel (at import) and other tests may import triton first, so the cases run in one subprocess:
the module itself as a script (`main`), every case in turn, its stdout naming the cases that ran to their end
and its traceback the one that failed."""

import os
import subprocess
import sys
from pathlib import Path


def run_cases(module_file: str, cases: dict, timeout: float = 600) -> None:
    """Assert that every case of `cases` (name -> function) passes when `module_file` runs them interpreted."""
    result = subprocess.run([sys.executable, module_file, *cases], cwd=Path(__file__).resolve().parents[1],
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert result.stdout.split() == list(cases)  # each case ran to its end


def main(cases: dict) -> None:
    """A module's `__main__`: run the cases named on the command line, printing each name as it passes."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (set before triton is imported)")
    for name in sys.argv[1:]:
        cases[name]()
        print(name, flush=True)
