"""The package's design rules, read from the sources with `ast`, so every import statement counts: absolute,
relative, `from . import x`, and imports inside functions:

- no import cycle between the package's modules (`mfd_sglang`, with `kernels/` and `patches/` as installed:
  `mfd_sglang.kernels`, `mfd_sglang.patches`): a kernel never imports the module that dispatches to it (the
  stages' hand-offs live below both, `mfd_sglang.handoffs`; shared numbers in `kernels/params.py`), the launch
  plans memory through `serving.launch.memory` and not the other way round;
- the algorithms (spec class, registration) and the worker never import each other; `mfd_sglang.plugin`
  composes them (it hands the worker factory to `register_algorithms`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERVING = REPO / "mfd_sglang" / "serving"
PACKAGE = "mfd_sglang.serving"
# The installed package's folders (setup.py's package_dir); the CPU `sgl_kernel` stand-in is not a module of it.
ROOTS = {"mfd_sglang": REPO / "mfd_sglang", "mfd_sglang.kernels": REPO / "kernels",
         "mfd_sglang.patches": REPO / "patches"}


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


@pytest.mark.parametrize("importer, imported", [("launch.algorithms", "worker"), ("worker", "launch.algorithms")])
def test_algorithms_and_worker_do_not_import_each_other(importer, imported):
    module = f"{PACKAGE}.{importer}"
    source = (SERVING / f"{importer.replace('.', '/')}.py").read_text()
    found = imports_of(source, module.rsplit(".", 1)[0], f"{PACKAGE}.{imported}")
    assert not found, (f"{module} imports {PACKAGE}.{imported} ({'; '.join(found)}): the two must not "
                       "import each other; mfd_sglang/plugin.py composes them")


def module_graph() -> dict[str, set[str]]:
    """Every module of the installed package -> the package's modules its import statements may load."""
    files = {}
    for package, root in ROOTS.items():
        for path in root.rglob("*.py"):
            if "sgl_kernel_standin" in path.parts:
                continue
            parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
            name = ".".join([package, *parts])
            files[name] = (path, name if path.name == "__init__.py" else name.rsplit(".", 1)[0])
    graph = {}
    for name, (path, package) in files.items():
        deps = set()
        for module, _ in imported_modules(path.read_text(), package):
            while module and module not in files:  # `from a import b` where b is a name, not a module
                module = module.rpartition(".")[0]
            if module and module != name:
                deps.add(module)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_cycle_through_an_import_inside_a_function():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_has_no_import_cycle():
    graph = module_graph()
    assert {"mfd_sglang.tree", "mfd_sglang.kernels.tree_mixture", "mfd_sglang.serving.worker",
            "mfd_sglang.patches.mfd_flags"} <= set(graph)
    assert not cycles(graph), cycles(graph)
