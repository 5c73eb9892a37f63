"""No import circle among loomdata's modules: imports flow one way (see DESIGN.md's dependency rules).

Every `import` and `from ... import` of a loomdata module is an edge, wherever it stands (module top,
a function body, an `if TYPE_CHECKING:` block): a circle hidden behind a lazy import is still a circle
in the design. Parent packages imported implicitly by Python are not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

import loomdata

ROOT = Path(loomdata.__file__).parent


def _modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every module of the package (a package is its __init__)."""
    out: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The loomdata modules that module `name` imports (a `from X import y` names X.y when that is a module)."""
    is_package = path.name == "__init__.py"
    here = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                sub = f"{base}.{a.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the loomdata modules it imports."""
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted; sorted by first name."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_finder_sees_a_circle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_real_edges() -> None:
    graph = import_graph()
    assert "loomdata.schemas.errors" in graph["loomdata.execution._partition"]
    assert len(graph) > 40


def test_no_import_circle_among_loomdata_modules() -> None:
    cycles = find_cycles(import_graph())
    assert cycles == [], f"import circles (break each by passing plain data or moving the shared part): {cycles}"
