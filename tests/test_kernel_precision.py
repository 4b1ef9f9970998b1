"""Every `tl.dot` in the project's Triton kernels names its input precision.

Triton multiplies fp32 operands of `tl.dot` in TF32 by default on NVIDIA GPUs, while the interpreter
(every CPU test) computes them in IEEE fp32: a dot without `input_precision` would pass every CPU test
and part the fp32 path from its torch reference on a GPU only. The GPU check also sets
`TRITON_F32_DEFAULT=ieee` for the whole call; this test keeps the kernels right without it.
"""

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[1] / "kernels"


def dot_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute) and node.func.attr == "dot"
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "tl"]


def test_every_tl_dot_names_its_input_precision():
    calls = {path.name: dot_calls(path) for path in sorted(KERNELS.glob("*.py"))}
    assert sum(map(len, calls.values())) >= 3, calls  # mode attention (2) and the vocabulary head (1)
    missing = [f"{name}:{call.lineno}" for name, found in calls.items() for call in found
               if "input_precision" not in {kw.arg for kw in call.keywords}]
    assert not missing, f"tl.dot without input_precision (TF32 on NVIDIA GPUs): {missing}"
