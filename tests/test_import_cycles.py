"""No import circles in the pipeserve package. An AST walk of every module: every `import` counts,
at module level or inside a function or class (a lazy import is still a dependency); only the
imports under `if TYPE_CHECKING:` are exempt (they never run)."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "pipeserve"

Edges = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package."""
    modules = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node below `node`, minus the bodies of `if TYPE_CHECKING:` (their `else` still runs)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.orelse:
                yield stmt
                yield from _runtime_nodes(stmt)
            continue
        yield child
        yield from _runtime_nodes(child)


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> dict[str, int]:
    """The package's modules that module `name` imports at run time, with the line of each."""
    is_package = path.name == "__init__.py"
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        # `import a.b.c` or `from a.b import c` (c a module or a name in a.b): the deepest module.
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)

    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE:
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                add(f"{source}.{alias.name}", node.lineno)
    return found


def import_graph() -> Edges:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def strongly_connected(graph: Edges) -> list[list[str]]:
    """Tarjan's components of more than one module (each a set of modules importing each other)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(root: str) -> None:
        # Iterative, so that a deep chain of imports cannot hit the recursion limit.
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph[target])))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
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
                        components.append(sorted(component))

    for name in graph:
        if name not in index:
            visit(name)
    return sorted(components)


def describe(graph: Edges, component: list[str], files: dict[str, pathlib.Path] | None = None) -> str:
    """The shortest circle through the component's first module, each import with its file and line."""
    members = set(component)
    start = component[0]
    parents: dict[str, str] = {}
    frontier, closing = [start], None
    while closing is None:  # breadth-first until a module that imports the start is reached
        nxt = []
        for node in frontier:
            if start in graph[node]:
                closing = node
                break
            for target in graph[node]:
                if target in members and target not in parents and target != start:
                    parents[target] = node
                    nxt.append(target)
        frontier = nxt
    path = [closing]
    while path[-1] != start:
        path.append(parents[path[-1]])
    path = [*reversed(path), start]
    files = files or {}

    def where(module: str) -> str:
        return str(files[module].relative_to(ROOT)) if module in files else module

    steps = [f"{a} -> {b} ({where(a)}:{graph[a][b]})" for a, b in zip(path, path[1:], strict=False)]
    return f"{len(component)} modules {component}; e.g.\n    " + "\n    ".join(steps)


def cycles() -> list[str]:
    """Every import circle of the package, each described by one of its circles."""
    graph, files = import_graph(), module_files()
    return [describe(graph, component, files) for component in strongly_connected(graph)]


def test_the_walk_sees_lazy_and_relative_imports_but_not_type_checking_ones() -> None:
    graph = import_graph()
    assert "pipeserve.engine.model.llama" in graph["pipeserve.engine.model.loader"]  # relative
    assert "pipeserve.engine.backend.native" in graph["pipeserve.bench.cpu_ops"]  # inside a function
    assert "pipeserve.engine.parallel.group" not in graph["pipeserve.engine.parallel.step_plan"]
    assert len(graph) > 100  # every module of the package was read


def test_strongly_connected_finds_a_planted_circle() -> None:
    graph: Edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert "a -> b (a:1)" in describe(graph, ["a", "b", "c"])


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, "import circles:\n  " + "\n  ".join(found)
