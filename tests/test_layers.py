"""Imports point one way: `tts` core -> `streaming` (+ `kernels` beside it) -> `serving` -> the entry points
(`server.py`, `tts/api.py`, `tts/cli.py`, `tts/__init__.py`), which alone may import upward; and no two modules
import each other, directly or round a circle. Read from the source with `ast`: imports inside functions count
too (a lazy import is still an edge of the design)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("tts", "streaming", "serving", "kernels")
ENTRY = {"server", "tts", "tts.api", "tts.cli"}
LAYER = {"tts": 0, "streaming": 1, "kernels": 1, "serving": 2}
TOP = 9  # the entry points' layer


def layer(module: str) -> int:
    return TOP if module in ENTRY else LAYER[module.split(".")[0]]


def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the packages and server.py (a package by its own name)."""
    found = {"server": ROOT / "server.py"}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules ``module`` imports. Example: in streaming/engine.py, ``from streaming.slots import
    Slots`` -> streaming.slots; ``from tts import SAMPLE_RATE`` -> tts (the package: an entry point)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 more
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {module: imports(module, path, known) for module, path in known.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges[child]))))
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


def test_no_import_points_up():
    upward = [
        f"{m} imports {d}"
        for m, deps in sorted(graph().items())
        for d in sorted(deps)
        if layer(m) < TOP and layer(d) > layer(m)
    ]
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def test_no_import_circle():
    found = circles(graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_see_what_they_check():
    """The checker itself: a circle and an upward import are found where they are."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("serving.session") > layer("streaming.engine") > layer("tts.model")
    edges = graph()
    assert "streaming.slots" in edges["streaming.engine"] and "tts.api" in edges["tts"]
