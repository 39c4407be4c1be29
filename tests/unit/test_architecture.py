"""The import structure is checked, not a convention (docs/architecture.md, "Layers").

* pyproject.toml's import contracts (import-linter, also run by .ci/run): worker-side code imports
  no driver module, the driver's layers import only downwards, no cycle between sibling packages.
* No import cycle between any two trainforge modules, counting the imports inside functions as
  well as those at the top of a module: a function-level import that only dodges a circle is a
  circle all the same. Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.timing import scaled

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "src"
PACKAGE = "trainforge"


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "in a function" if self.in_function else "at module level"
        return f"{self.importer} -> {self.imported} (line {self.line}, {where})"


def modules() -> dict[str, Path]:
    """Every trainforge module by dotted name (a package by its own name)."""
    found = {}
    for path in sorted((SOURCE / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SOURCE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(tree: ast.AST, in_function: bool = False) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement, with whether it sits inside a function; TYPE_CHECKING blocks skipped."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and is_type_checking(node):
            for other in node.orelse:
                yield from imports_of(ast.Module(body=[other], type_ignores=[]), in_function)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, in_function
        yield from imports_of(node, in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)))


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The trainforge module an imported name lives in (its longest known prefix)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def edges(known: dict[str, Path]) -> list[Edge]:
    found = []
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node, in_function in imports_of(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    parent = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join([*parent, *([node.module] if node.module else [])])
                # `from package import module` imports the module; `from module import name` the module.
                targets = [f"{base}.{alias.name}" for alias in node.names]
            for target in targets:
                imported = resolve(target, known)
                if imported is not None and imported != module:
                    found.append(Edge(module, imported, node.lineno, in_function))
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_no_import_cycle_between_trainforge_modules() -> None:
    known = modules()
    found = edges(known)
    graph: dict[str, set[str]] = {}
    for edge in found:
        graph.setdefault(edge.importer, set()).add(edge.imported)
    circles = cycles(graph)
    described = []
    for members in circles:
        inside = [str(e) for e in found if e.importer in members and e.imported in members]
        described.append("  " + " <-> ".join(members) + "\n" + "\n".join(f"    {line}" for line in sorted(set(inside))))
    assert not circles, "import cycles (move the piece both sides need to a module of its own):\n" + "\n".join(
        described
    )


def test_the_cycle_finder_sees_function_level_imports_and_skips_type_checking_ones(tmp_path: Path) -> None:
    code = (
        "from typing import TYPE_CHECKING\n"
        "import trainforge.b\n"
        "if TYPE_CHECKING:\n"
        "    import trainforge.c\n"
        "else:\n"
        "    import trainforge.d\n"
        "def f():\n"
        "    from trainforge import e\n"
    )
    known = {f"trainforge.{name}": tmp_path / f"{name}.py" for name in "abcde"}
    for path in known.values():
        path.write_text("")
    known["trainforge.a"].write_text(code)
    found = {(e.imported, e.in_function) for e in edges(known) if e.importer == "trainforge.a"}
    assert found == {("trainforge.b", False), ("trainforge.d", False), ("trainforge.e", True)}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_contracts_hold() -> None:
    """pyproject.toml's [tool.importlinter] contracts, as .ci/run checks them (``lint-imports``); in a
    process of its own, as import-linter reconfigures logging for the process it runs in."""
    check = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(ROOT / 'pyproject.toml')!r}, no_cache=True, no_logo=True))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=scaled(300)
    )
    assert result.returncode == 0, result.stdout[-8000:] + result.stderr[-2000:]
