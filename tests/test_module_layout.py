"""The serving package's design rule: the algorithms (spec class, registration) and the worker never
import each other; `mfd_sglang.plugin` composes them (it hands the worker factory to
`register_algorithms`). Read from the sources with `ast`, so every import statement counts: absolute,
relative, `from . import x`, and imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SERVING = Path(__file__).resolve().parents[1] / "mfd_sglang" / "serving"
PACKAGE = "mfd_sglang.serving"


def imported_modules(source: str, package: str) -> list[tuple[str, str]]:
    """(absolute module name, the statement) for every module an import statement anywhere in
    `source` (a module of `package`) may load: `from a import b` counts both a and a.b."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, ast.unparse(node)) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] if node.level else [])
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((module, ast.unparse(node)))
            found += [(f"{module}.{alias.name}", ast.unparse(node)) for alias in node.names]
    return found


def imports_of(source: str, package: str, target: str) -> list[str]:
    """The statements in `source` that import the module `target` or one of its submodules."""
    return sorted({stmt for module, stmt in imported_modules(source, package)
                   if module == target or module.startswith(target + ".")})


def test_every_import_form_is_seen():
    source = """
import mfd_sglang.serving.worker
from mfd_sglang.serving.worker import MFDWorkerV2
from mfd_sglang.serving import worker
from .worker import MFDWorkerV2
from . import worker as w
from ..serving.worker import MFDWorkerV2
def factory():
    from .worker import MFDWorkerV2
    return MFDWorkerV2
import mfd_sglang.serving.workers
from .budget import worker
"""
    found = imports_of(source, PACKAGE, "mfd_sglang.serving.worker")
    assert found == sorted({"import mfd_sglang.serving.worker", "from mfd_sglang.serving.worker import MFDWorkerV2",
                            "from mfd_sglang.serving import worker", "from .worker import MFDWorkerV2",
                            "from . import worker as w", "from ..serving.worker import MFDWorkerV2"})


@pytest.mark.parametrize("importer, imported", [("algorithms", "worker"), ("worker", "algorithms")])
def test_algorithms_and_worker_do_not_import_each_other(importer, imported):
    source = (SERVING / f"{importer}.py").read_text()
    found = imports_of(source, PACKAGE, f"{PACKAGE}.{imported}")
    assert not found, (f"serving/{importer}.py imports serving/{imported}.py ({'; '.join(found)}): the two must not "
                       "import each other; mfd_sglang/plugin.py composes them")
