"""The house rules, read from the code: imports point down and never go round in a circle.

collective (the API and the core) -> transport -> algorithms, with collective.errors the one
module of the core that transport/ and algorithms/ may import. Every import counts, those under
``if TYPE_CHECKING`` and those inside functions too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"collective": ROOT / "collective", "collective.transport": ROOT / "transport",
            "collective.algorithms": ROOT / "algorithms", "collective.bench": ROOT / "bench"}  # fmt: skip


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.glob("*.py"):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            found[name] = path
    return found


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The project's modules that ``path`` imports (a package import counts as its __init__)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            candidates = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for candidate in candidates:
            while candidate and candidate not in known:
                candidate = candidate.rpartition(".")[0]
            if candidate:
                names.add(candidate)
                break
    return names


GRAPH = {name: imports_of(path, modules()) - {name} for name, path in modules().items()}


def test_transport_and_algorithms_know_nothing_of_the_core_but_its_errors() -> None:
    for name, imported in GRAPH.items():
        if name.startswith(("collective.transport", "collective.algorithms")):
            core = {
                m for m in imported if not m.startswith(("collective.transport", "collective.algorithms"))
            }
            assert core <= {"collective.errors"}, f"{name} imports {sorted(core)}"
        if name.startswith("collective.algorithms"):
            assert not any(m.startswith("collective.transport") for m in imported), name


def test_errors_is_a_leaf() -> None:
    assert GRAPH["collective.errors"] == set()


def test_no_import_circles() -> None:
    """Depth-first search over every module; a back edge is a circle, named with its path."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> None:
        if name in path:
            circle = [*path[path.index(name) :], name]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if name in done:
            return
        for imported in sorted(GRAPH[name]):
            # ``import collective.x`` runs collective/__init__.py first; that edge is Python's, not ours
            if imported != "collective":
                visit(imported, [*path, name])
        done.add(name)

    for name in sorted(GRAPH):
        visit(name, [])


def test_the_package_face_imports_only_what_it_exports() -> None:
    """Only the API modules depend on the package's __init__ (nothing in the core imports it)."""
    users = sorted(name for name, imported in GRAPH.items() if "collective" in imported)
    assert all(name.startswith("collective.bench") or name == "collective.cli" for name in users), users


def test_no_module_is_over_700_lines() -> None:
    long = {name: n for name, path in modules().items() if (n := len(path.read_text().splitlines())) > 700}
    assert not long, f"split these modules: {long}"
