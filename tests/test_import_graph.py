"""The import graph of the installed package has no circle: every module can be read (and
changed) knowing only what it imports. Read from the source with ``ast`` as the package-dir mapping
of pyproject.toml lays it out; imports under ``if TYPE_CHECKING:`` are not edges (they never run),
imports inside functions are (a lazy import still ties the two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """{dotted module name: file} for every module of the installed package."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = sorted(config["package-dir"].items(), key=lambda kv: -len(kv[0]))
    out: dict[str, Path] = {}
    for package in config["packages"]:
        base = next((pkg, Path(d)) for pkg, d in roots if package == pkg or package.startswith(pkg + "."))
        folder = ROOT / base[1] / package[len(base[0]) :].lstrip(".").replace(".", "/")
        for file in folder.glob("*.py"):
            out[package if file.stem == "__init__" else f"{package}.{file.stem}"] = file
    return out


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _edges(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(file.read_text())
    skip = _type_checking_lines(tree)
    package = name if file.stem == "__init__" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            targets = [
                f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
            ]
        else:
            continue
        out.update(t for t in targets if t in modules and t != name)
    return out


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    modules = _modules()
    assert "muxworker.client.stores.local" in modules and "muxworker.serve.app" in modules
    graph = {name: _edges(name, file, modules) for name, file in modules.items()}
    assert _circles(graph) == []


def test_the_checker_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
