"""The SGLang internals the plugin's hooks wrap, resolved in SGLang's source files without importing them.

`hook_targets(patches_dir)` reads every `register_once(TARGET, ...)` call in patches/*.py (TARGET a string,
or a module-level string constant of the same file). `unresolved(targets, read)` looks each target up in
SGLang's sources as `read(relative path)` returns them: the longest dotted prefix that is a module
(`a/b/c.py` or `a/b/c/__init__.py`), then the rest through that module's top-level names and its
classes' bodies. `scripts/kit.sh device build` runs it over the trimmed SGLang archive, before it installs a
new kit and on a kit it finds up to date (a hook added since the kit was built is checked too): a hook whose
target the prune removed would not apply on the device (SGLang only logs that). Standard library only: the
build runs it with the system Python.

    python3 scripts/hook_targets.py [SOURCES]   # the targets; with SOURCES (a folder holding sglang/, or a
                                                # .tar.gz of one), exit 1 naming those its sources lack
"""

from __future__ import annotations

import ast
import sys
import tarfile
from pathlib import Path
from typing import Callable


def _string(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The value of a string expression built from literals and earlier string constants (a literal, a
    name, an f-string or a sum of those); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.JoinedStr):
        parts = [_string(v.value if isinstance(v, ast.FormattedValue) and v.conversion == -1 and v.format_spec is None
                         else v, constants) for v in node.values]
        return None if None in parts else "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string(node.left, constants), _string(node.right, constants)
        return None if left is None or right is None else left + right
    return None


def hook_targets(patches_dir: Path) -> dict[str, str]:
    """{target: the patches file that registers a hook on it} for every register_once call."""
    found: dict[str, str] = {}
    for path in sorted(Path(patches_dir).glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        constants: dict[str, str] = {}  # the module's top-level string constants, in order
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                value = _string(node.value, constants)
                if value is not None:
                    constants[node.targets[0].id] = value
        for call in ast.walk(tree):
            func = getattr(call, "func", None)
            if not isinstance(call, ast.Call) or getattr(func, "id", getattr(func, "attr", None)) != "register_once":
                continue
            target = _string(call.args[0], constants) if call.args else None
            if target is None:
                raise ValueError(f"{path.name}:{call.lineno}: register_once's target is not a string built from "
                                 f"the module's constants: {ast.unparse(call.args[0]) if call.args else '(none)'}")
            found[target] = path.name
    return found


def _bindings(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Names a module or class body binds (also inside if / try / with blocks), to their statements."""
    names: dict[str, ast.AST] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for leaf in ast.walk(target):
                    # A class rebuilt under its own name keeps its definition's attributes (SGLang's
                    # `ServerArgs = msgspec.defstruct(..., namespace of ServerArgs)`).
                    if isinstance(leaf, ast.Name) and not isinstance(names.get(leaf.id), ast.ClassDef):
                        names[leaf.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                names.update(_bindings(getattr(node, block, [])))
            for handler in getattr(node, "handlers", []):
                names.update(_bindings(handler.body))
    return names


def resolve(target: str, read: Callable[[str], str | None]) -> str | None:
    """None when `target` resolves in the sources `read` returns, else why it does not."""
    parts = target.split(".")
    deepest = None  # why the deepest module found does not define the rest
    for split in range(len(parts) - 1, 0, -1):
        module = "/".join(parts[:split])
        path = next((p for p in (module + ".py", module + "/__init__.py") if read(p) is not None), None)
        if path is None:
            continue
        node: ast.AST = ast.parse(read(path), filename=path)
        for depth, name in enumerate(parts[split:]):
            bound = _bindings(node.body) if isinstance(node, (ast.Module, ast.ClassDef)) else {}
            if name not in bound:
                if depth > 0:  # the module is there, its class lacks the attribute
                    return f"{path}: {'.'.join(parts[split:split + depth])} does not define {name}"
                deepest = deepest or f"{path}, which does not define {name}"
                break
            node = bound[name]
        else:
            return None
    return f"not in the sources (the deepest module found: {deepest or 'none'})"


def unresolved(targets, read: Callable[[str], str | None]) -> list[str]:
    """'TARGET: why' for each target that does not resolve."""
    return [f"{target}: {why}" for target in sorted(targets) if (why := resolve(target, read)) is not None]


def source_reader(sources: Path) -> Callable[[str], str | None]:
    """`read(relative path)` over a folder holding sglang/, or over a .tar.gz whose members are such paths."""
    if sources.is_dir():
        return lambda path: (sources / path).read_text() if (sources / path).is_file() else None
    with tarfile.open(sources) as tar:
        texts = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                 if m.isfile() and m.name.endswith(".py")}
    return texts.get


def main() -> None:
    targets = hook_targets(Path(__file__).resolve().parents[1] / "patches")
    if len(sys.argv) < 2:
        print("\n".join(f"{t}  ({f})" for t, f in sorted(targets.items())))
        return
    sources = Path(sys.argv[1])
    missing = unresolved(targets, source_reader(sources))
    if missing:
        sys.exit("\n".join(missing))
    print(f"all {len(targets)} hook targets resolve in {sources}")


if __name__ == "__main__":
    main()
