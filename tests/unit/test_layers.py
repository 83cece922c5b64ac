"""The Python package's layers: no import cycles between moecache's modules, and the product (the API,
the launcher, plan, tune) does not reach into the developer tools (bench, the build orchestrator).

Every import counts, at module level or inside a function: a lazy import hides a cycle from Python,
not from a reader.
"""

from __future__ import annotations

import ast
from pathlib import Path

import moecache

PACKAGE = Path(moecache.__file__).parent  # the sources (an editable install puts the built parts first in __path__)

PRODUCT = {"moecache.api", "moecache.options", "moecache.process", "moecache.server", "moecache.plan",
           "moecache.tune"}
DEV_TOOLS = ("moecache.bench", "moecache.orchestrator")


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """moecache modules that `name` imports (a name imported from a package counts as its submodule
    where one exists)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name and t.startswith("moecache"):
                out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    g = {n: imports_of(n, p, known) for n, p in mods.items()}
    # a package's __init__ importing its own submodules is how packages are made: not an edge back
    return {n: {t for t in ts if not (t.startswith(n + ".") and mods[n].name == "__init__.py")}
            for n, ts in g.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_the_graph_sees_lazy_imports():
    g = graph()
    assert "moecache.plan" in g["moecache.server"]  # imported inside main(): still an edge
    assert "moecache.synth.model" in g["moecache.synth.archs"] and "moecache.synth" in g["moecache.synth.calibration"]


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_product_does_not_import_the_developer_tools():
    g = graph()
    bad = {(m, t) for m in PRODUCT for t in g[m] if t.startswith(DEV_TOOLS)}
    assert bad == set()
