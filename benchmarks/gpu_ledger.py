"""GPU cost ledger on a CPU: the CUDA kernels of MFD's own round stages (draft, tree, verify layout, verify
input, accept, commit) at Qwen3-4B / Qwen3-8B drafter shapes, their bytes, FLOPs and predicted H200 time
from a model whose one constant (the launch floor) is fitted to the committed H200 log, and the sm_90a /
sm_80 compiles of every Triton kernel. No GPU needed (fake CUDA tensors, Triton's bundled ptxas). The same
as `python -m mfd_sglang gpu-ledger` (its --help lists the options):

    python benchmarks/gpu_ledger.py --out benchmarks/results/gpu-ledger-baseline-DATE

What is counted and how: `mfd_sglang.gpu_cost` (module docstring); the scenarios: `mfd_sglang.gpu_ledger`.
"""

from __future__ import annotations

import sys

from mfd_sglang.cli import main

if __name__ == "__main__":
    sys.exit(main(["gpu-ledger", *sys.argv[1:]]))
