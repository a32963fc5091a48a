"""The house rules, read from the code: packages in layers, imports pointing down, no circles, and
small packages of modules of a readable size.

The layers, bottom up (a module imports its own package and the layers below, never a layer
above nor a package beside it in its layer)::

    collective.errors                       the one module of the core every layer may import
    collective.algorithms                   schedules over the Link protocol
    collective.transport                    moving bytes; knows nothing of calls
    basics (arrays, tensors, pool, config, groups, work)
    collective.tuning                       what "auto" runs: the cost model, profiles, the probe
    collective.trace                        the flight recorder, its dumps and what reads them
    collective.calls                        one class per collective, signatures, movement families
    collective.shm                          shared memory among a host's processes
    collective.node                         a process's membership of a multi-node job
    collective.executors                    the ways a step runs, and choose()
    core (job, p2p, runtime, api)
    collective.launch                       who this process is, init(), collective launch
    collective.torch | ddp | ray            the frameworks' faces (none imports another)
    collective (the package face)           the API, re-exported
    collective.bench                        benchmarks
    collective.cli, collective.__main__     the command

Every import counts, those under ``if TYPE_CHECKING`` and those inside functions too, but for
one that loads a layer above on demand by design (``api.init`` loads launch's bootstrap), named
in ``ON_DEMAND``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "collective": ROOT / "collective",
    "collective.transport": ROOT / "transport",
    "collective.algorithms": ROOT / "algorithms",
    "collective.bench": ROOT / "bench",
}
LINKED = {"algorithms", "transport", "bench"}  # collective/'s links to the folders beside it
BASICS = ("arrays", "tensors", "pool", "config", "groups", "work")
CORE = ("job", "p2p", "runtime", "api")
# (the modules of a layer, whether they may import each other: the top level's modules may)
LAYERS: list[tuple[tuple[str, ...], bool]] = [
    (("collective.errors",), False),
    (("collective.algorithms",), False),
    (("collective.transport",), False),
    (tuple(f"collective.{name}" for name in BASICS), True),
    (("collective.tuning",), False),
    (("collective.trace",), False),
    (("collective.calls",), False),
    (("collective.shm",), False),
    (("collective.node",), False),
    (("collective.executors",), False),
    (("collective.persistent",), False),
    (tuple(f"collective.{name}" for name in CORE), True),
    (("collective.launch",), False),
    (("collective.torch", "collective.ddp", "collective.ray"), False),
    (("collective",), False),  # the package face: the API, re-exported
    (("collective.bench",), False),
    (("collective.cli", "collective.__main__"), True),
]
ON_DEMAND = {("collective.api", "collective.launch.bootstrap")}  # init() loads what init needs
MODULE_LINES = 700  # a module may be this long at most
PACKAGE_LINES = 3_500  # and a package's own modules (not its subpackages') this long in all


def modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            relative = path.relative_to(folder).with_suffix("")
            if package == "collective" and relative.parts[0] in LINKED:
                continue  # (the same files, found through the folder itself)
            parts = [part for part in relative.parts if part != "__init__"]
            found[".".join([package, *parts])] = path
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


KNOWN = modules()
GRAPH = {name: imports_of(path, KNOWN) - {name} for name, path in KNOWN.items()}


def layer_of(module: str) -> tuple[int, str]:
    """(the layer, the package the rules see) of ``module``: its longest listed prefix."""
    best = (-1, "")
    for index, (names, _) in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > len(best[1]):
                best = (index, name)
    assert best[0] >= 0, f"{module} is in no layer: add it to LAYERS"
    return best


def test_every_module_is_in_a_layer() -> None:
    for name in GRAPH:
        layer_of(name)


def test_imports_point_down_and_never_sideways() -> None:
    wrong = []
    for name, imported in GRAPH.items():
        layer, package = layer_of(name)
        for other in imported:
            their_layer, theirs = layer_of(other)
            down = their_layer < layer or theirs == package or (their_layer == layer and LAYERS[layer][1])
            if not down and (name, other) not in ON_DEMAND:
                wrong.append(f"{name} -> {other}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(sorted(wrong))


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
            if imported != "collective" and not name.startswith(imported + "."):
                visit(imported, [*path, name])
        done.add(name)

    for name in sorted(GRAPH):
        visit(name, [])


def test_the_package_face_imports_only_what_it_exports() -> None:
    """Only the API modules depend on the package's __init__ (nothing in the core imports it)."""
    users = sorted(name for name, imported in GRAPH.items() if "collective" in imported)
    assert all(name.startswith("collective.bench") or name == "collective.cli" for name in users), users


def test_modules_and_packages_are_small() -> None:
    lines = {name: len(path.read_text().splitlines()) for name, path in KNOWN.items()}
    long = {name: n for name, n in lines.items() if n > MODULE_LINES}
    assert not long, f"split these modules (at most {MODULE_LINES} lines): {long}"
    packages: dict[str, int] = {}
    for name, path in KNOWN.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        packages[package] = packages.get(package, 0) + lines[name]
    big = {name: n for name, n in packages.items() if n > PACKAGE_LINES}
    assert not big, f"split these packages (at most {PACKAGE_LINES} lines of their own): {big}"


def test_every_package_is_installed() -> None:
    """pyproject.toml names every package, so `pip install .` (not only -e) installs all of it."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set()
    for package, folder in PACKAGES.items():
        for init in folder.rglob("__init__.py"):
            relative = init.parent.relative_to(folder)
            if package == "collective" and relative.parts and relative.parts[0] in LINKED:
                continue
            found.add(".".join([package, *relative.parts]))
    missing, stale = sorted(found - listed), sorted(listed - found)
    assert found == listed, f"packages not in pyproject.toml: {missing}; listed, not found: {stale}"
