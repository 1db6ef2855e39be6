"""No import circles in the pipeserve package (pipeserve/bench and pipeserve/capacity included). An
AST walk of every module under Python's import semantics: every `import` counts, at module level or
inside a function or class (a lazy import is still a dependency); only the imports under
`if TYPE_CHECKING:` are exempt (they never run).

Importing `a.b.c` executes a/__init__.py, then a/b/__init__.py, then a/b/c.py, so it depends on each
of them: `import pkg.sub` and `from pkg import sub` depend on pkg's `__init__` as well as on sub, and
`from pkg import name` (a name, not a module) on the `__init__` that defines it. The packages that
contain the importing module are the exception: Python imports them before the module runs, so
reaching a sibling through them (`from . import sibling`, `from pkg.sibling import f`) adds no
dependency on their `__init__`; taking a name that `__init__` defines (`from . import name`) does."""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "pipeserve"

Edges = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


def module_files(root: pathlib.Path = ROOT, package: str = PACKAGE) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the package (a package by its __init__.py)."""
    modules = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
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


def _prefixes(module: str) -> list[str]:
    """a.b.c -> [a, a.b, a.b.c]: what importing a.b.c executes, in order."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def imports_of(name: str, path: pathlib.Path, modules: dict[str, pathlib.Path],
               package: str = PACKAGE) -> dict[str, int]:
    """The package's modules whose code module `name` runs (or needs to have run) when it executes
    its imports, with the line of the first such import."""
    is_package = path.name == "__init__.py"
    # Imported before this module runs: reaching through them costs nothing.
    enclosing = set(_prefixes(name))
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in modules and target != name:
            found.setdefault(target, line)

    def executes(module: str, line: int) -> None:
        """Importing `module`: each package on its way, then the module itself."""
        for prefix in _prefixes(module):
            if prefix not in enclosing:
                add(prefix, line)

    for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == package:
                    executes(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, `level - 1` packages up
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != package:
                continue
            executes(source, node.lineno)
            for alias in node.names:
                submodule = f"{source}.{alias.name}"
                if submodule in modules:  # a module: imported after its package
                    executes(submodule, node.lineno)
                else:  # a name the source's code defines (`*` too): it must have run
                    add(source, node.lineno)
    return found


def import_graph(root: pathlib.Path = ROOT, package: str = PACKAGE) -> Edges:
    modules = module_files(root, package)
    return {name: imports_of(name, path, modules, package) for name, path in modules.items()}


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


def describe(graph: Edges, component: list[str], files: dict[str, pathlib.Path] | None = None,
             root: pathlib.Path = ROOT) -> str:
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
        return str(files[module].relative_to(root)) if module in files else module

    steps = [f"{a} -> {b} ({where(a)}:{graph[a][b]})" for a, b in zip(path, path[1:], strict=False)]
    return f"{len(component)} modules {component}; e.g.\n    " + "\n    ".join(steps)


def cycles(root: pathlib.Path = ROOT, package: str = PACKAGE) -> list[str]:
    """Every import circle of the package, each described by one of its circles."""
    graph, files = import_graph(root, package), module_files(root, package)
    return [describe(graph, component, files, root) for component in strongly_connected(graph)]


def test_the_walk_sees_lazy_and_relative_imports_but_not_type_checking_ones() -> None:
    graph = import_graph()
    assert "pipeserve.engine.model.llama" in graph["pipeserve.engine.model.loader"]  # relative
    assert "pipeserve.engine.backend.native" in graph["pipeserve.bench.cpu_ops"]  # inside a function
    assert "pipeserve.engine.parallel.group" not in graph["pipeserve.engine.parallel.step_plan"]
    assert len(graph) > 100  # every module of the package was read
    assert "pipeserve.bench.step" in graph and "pipeserve.capacity" in graph  # bench and capacity too
    # A module that takes the engine package's exports runs its __init__ (and what that imports).
    assert "pipeserve.engine" in graph["pipeserve.bench.step"]


def circles_of(root: pathlib.Path, files: dict[str, str]) -> list[str]:
    """The circles of a synthetic package `top` under root: {path below top/: source}."""
    for rel, source in files.items():
        path = root / "top" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    (root / "top" / "__init__.py").touch()
    return cycles(root, "top")


# top/pkg/__init__.py runs top.pkg.other, which imports top.outside.user (each form below adds the
# import that may close the circle).
BASE = {"pkg/__init__.py": "from top.pkg.other import helper\n", "pkg/sub/__init__.py": "",
        "pkg/sub/leaf.py": "X = 1\n", "pkg/other.py": "from top.outside.user import helper\n",
        "outside/__init__.py": ""}


@pytest.mark.parametrize("form", [
    "from top.pkg import sub",  # a subpackage: top/pkg/__init__.py runs first
    "import top.pkg.sub.leaf",  # top/pkg/__init__.py and top/pkg/sub/__init__.py run first
    "from top.pkg.sub import leaf",
    "from top.pkg.sub.leaf import X",
    "from ..pkg import sub",
])
def test_an_import_through_a_package_init_closes_a_circle(tmp_path: pathlib.Path, form: str) -> None:
    found = circles_of(tmp_path, {**BASE, "outside/user.py": f"{form}\ndef helper(): ...\n"})
    assert len(found) == 1, found
    assert "top.pkg -> top.pkg.other" in found[0] and "top.outside.user -> top.pkg (" in found[0]


def test_a_name_from_the_enclosing_package_init_closes_a_circle(tmp_path: pathlib.Path) -> None:
    """`from . import name`: the name is defined by pkg/__init__.py, which imports this module."""
    files = {"pkg/__init__.py": "from .a import f\nNAME = 1\n",
             "pkg/a.py": "from . import NAME\ndef f(): ...\n"}
    found = circles_of(tmp_path, files)
    assert len(found) == 1 and "top.pkg.a -> top.pkg (top/pkg/a.py:1)" in found[0], found


def test_siblings_reached_through_the_enclosing_package_are_no_circle(tmp_path: pathlib.Path) -> None:
    """A package's __init__ re-exports its modules, which import each other through it: Python has
    imported the package before they run."""
    files = {"pkg/__init__.py": "from .a import f\nfrom .b import g\n",
             "pkg/a.py": "from . import b\nimport top.pkg.b\nfrom top.pkg.b import g\ndef f(): ...\n",
             "pkg/b.py": "def g(): ...\n"}
    assert circles_of(tmp_path, files) == []
    graph = import_graph(tmp_path, "top")
    assert graph["top.pkg.a"] == {"top.pkg.b": 1} and graph["top.pkg"] == {"top.pkg.a": 1, "top.pkg.b": 2}


def test_lazy_imports_count_and_type_checking_ones_do_not(tmp_path: pathlib.Path) -> None:
    lazy = {**BASE, "outside/user.py": "def helper():\n    import top.pkg.sub\n"}
    found = circles_of(tmp_path / "lazy", lazy)
    assert len(found) == 1 and "top.outside.user -> top.pkg (top/outside/user.py:2)" in found[0], found
    typed = {**BASE, "outside/user.py": "import typing\nif typing.TYPE_CHECKING:\n    import top.pkg.sub\n"
                                        "else:\n    import top.outside\ndef helper(): ...\n"}
    assert circles_of(tmp_path / "typed", typed) == []


def test_strongly_connected_finds_a_planted_circle() -> None:
    graph: Edges = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert "a -> b (a:1)" in describe(graph, ["a", "b", "c"])


def test_no_import_cycles() -> None:
    found = cycles()
    assert not found, "import circles:\n  " + "\n  ".join(found)
