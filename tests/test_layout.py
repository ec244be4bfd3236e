"""The package's shape: a one-way import graph (no cycles, also through imports inside functions), and
the test harness (harness/) outside the installed package."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "asyncload"


def import_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Module → the package's modules it imports anywhere in its body (``from . import x`` included)."""
    mods: dict[str, Path] = {}
    for p in root.rglob("*.py"):
        rel = p.relative_to(root.parent).with_suffix("").parts
        mods[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = p
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        here = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                target = ".".join(base + (node.module.split(".") if node.module else []))
                names = [target] + [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {n for n in names if n in graph and n != m}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            comp.append(v)
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycles() -> None:
    graph = import_graph()
    assert "asyncload.processes.fanout" in graph and "asyncload.loader" in graph["asyncload"]  # the graph sees imports
    assert cycles(graph) == []


#: The package's floors, lowest first: a module imports only from its own floor or the ones below. The
#: front door (``asyncload/__init__``, which names the public API lazily) and the two command entry points
#: stand outside the floors.
FLOORS: list[tuple[str, ...]] = [
    ("asyncload.errors", "asyncload._version"),
    ("asyncload.runtime",),
    ("asyncload.image",),
    ("asyncload.sources", "asyncload.nodestore"),
    ("asyncload.engine",),
    ("asyncload.processes",),
    ("asyncload.loader", "asyncload.dataset", "asyncload.device", "asyncload.lightning"),
    ("asyncload.tools",),
]
ENTRY_POINTS = {"asyncload", "asyncload.__main__", "asyncload.train"}


def floor_of(module: str) -> int | None:
    for i, names in enumerate(FLOORS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    return None


def imports_up(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the import runs up a floor."""
    out = []
    for module, deps in graph.items():
        if module in ENTRY_POINTS:
            continue
        for dep in deps:
            if dep not in ENTRY_POINTS and floor_of(dep) > floor_of(module):  # type: ignore[operator]
                out.append((module, dep))
    return sorted(out)


def test_every_module_sits_on_a_floor_and_no_import_runs_back_up() -> None:
    graph = import_graph()
    assert [m for m in graph if m not in ENTRY_POINTS and floor_of(m) is None] == []
    assert imports_up(graph) == []


def test_the_floor_check_sees_an_import_that_runs_up() -> None:
    graph = {"asyncload.image.decode": {"asyncload.engine.collate"}, "asyncload.engine.collate": set()}
    assert imports_up(graph) == [("asyncload.image.decode", "asyncload.engine.collate")]


def test_the_top_level_shows_the_surface_and_the_folders() -> None:
    entries = sorted(p.name for p in PKG.iterdir() if p.name != "__pycache__")
    assert len(entries) <= 18, entries
    modules = [e for e in entries if e.endswith(".py")]
    assert modules == [
        "__init__.py", "__main__.py", "_version.py", "dataset.py", "device.py", "errors.py", "lightning.py",
        "loader.py", "train.py",
    ]  # fmt: skip


def test_the_cycle_check_sees_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_harness_is_outside_the_installed_package_and_the_package_never_imports_it() -> None:
    """The SeaweedFS launcher, the delay line and the fault proxy are for tests and benchmarks: a user's
    install does not carry them, and nothing the loader runs depends on them."""
    root = PKG.parent
    assert not (PKG / "testing").exists() and (root / "harness" / "__init__.py").exists()
    text = (root / "pyproject.toml").read_text()
    assert 'include = ["asyncload*"]' in text  # setuptools' package list: harness/ is not in it
    for p in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            assert not any(n.split(".")[0] == "harness" for n in names), f"{p} imports the harness"
