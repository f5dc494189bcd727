"""The import graph of ``src/``, read from the source (every ``import``, at module level or inside a function,
under ``if TYPE_CHECKING`` too): no package imports in a circle, only the kernel packages import Triton (so
that it loads lazily, when a kernel runs), and ``nvdlfw_inspect`` never imports ``lowprec``. Each check is
parameterised by package.

An edge is an import as written: ``import a.b.c`` and ``from a.b import c`` lead to ``a.b.c`` when it is a
module, else to the nearest package; the package ``__init__`` files Python runs on the way are not edges
(else a package that re-exports its modules would be a circle with each of them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
CYCLE_FREE = ["nvdlfw_inspect", "lowprec"]
TRITON_FREE = ["nvdlfw_inspect", "lowprec"]  # packages whose modules outside TRITON_PACKAGES must not import triton
TRITON_PACKAGES = ("nvdlfw_inspect.stats.kernels", "lowprec.kernels")


def module_files() -> dict[str, Path]:
    """Every module under ``src/`` by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imported_names(module: str, path: Path) -> set[str]:
    """The dotted names ``module`` imports anywhere in its file, relative imports resolved; ``from a import b``
    gives ``a.b`` (a module or a name in ``a``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(edges, imports)``: the modules of ``src/`` each module imports, and every dotted name it imports."""
    modules = module_files()
    edges, imports = {}, {}
    for module, path in modules.items():
        imports[module] = imported_names(module, path)
        targets = set()
        for name in imports[module]:
            parts = name.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        edges[module] = targets
    return edges, imports


def cycles(edges: dict[str, set[str]]) -> list[tuple[list[str], list[str]]]:
    """For each group of modules that import one another (a strongly connected component of more than one,
    found with Tarjan's algorithm): one cycle through it, ``[a, b, ..., a]``, and the whole group."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return [(_path_back(group[0], set(group), edges), group) for group in groups]


def _path_back(start: str, group: set[str], edges: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside ``group`` (breadth first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(edges[node] & group):
                if target == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if target not in previous:
                    previous[target] = node
                    following.append(target)
        frontier = following
    raise AssertionError(f"{start} is in no cycle of its group")


def in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_holds_every_module_and_its_function_level_imports():
    edges, imports = import_graph()
    assert "nvdlfw_inspect.stats.kernels" in edges and "nvdlfw_inspect.stats.kernels.triton" in edges
    assert "nvdlfw_inspect.stats.kernels.triton" in edges["nvdlfw_inspect.stats.kernels"]  # imported inside a function
    assert "triton.language" in imports["nvdlfw_inspect.stats.kernels.triton"]
    graph = {"a": {"b"}, "b": {"c", "e"}, "c": {"a", "d"}, "d": set(), "e": {"b"}}
    assert cycles(graph) == [(["a", "b", "c", "a"], ["a", "b", "c", "e"])]


@pytest.mark.parametrize("package", CYCLE_FREE)
def test_no_import_cycle(package):
    edges, _ = import_graph()
    inside = {
        module: {t for t in targets if in_package(t, package)} for module, targets in edges.items() if in_package(module, package)
    }
    found = cycles(inside)
    assert not found, "import cycles:\n" + "\n".join(
        f"{' -> '.join(cycle)} (in a group of {len(group)} modules that import one another: {group})" for cycle, group in found
    )


@pytest.mark.parametrize("package", TRITON_FREE)
def test_only_the_kernel_packages_import_triton(package):
    _, imports = import_graph()
    importers = sorted(
        module
        for module, names in imports.items()
        if in_package(module, package)
        and not any(in_package(module, allowed) for allowed in TRITON_PACKAGES)
        and any(in_package(name, "triton") for name in names)
    )
    assert not importers, f"modules outside {TRITON_PACKAGES} import triton: {importers}"


def test_nvdlfw_inspect_never_imports_lowprec():
    _, imports = import_graph()
    importers = {
        module: sorted(name for name in names if in_package(name, "lowprec"))
        for module, names in imports.items()
        if in_package(module, "nvdlfw_inspect")
    }
    assert not {module: names for module, names in importers.items() if names}


# lowprec's floors (ARCHITECTURE.md): each package may import only the lowprec packages listed for it (and
# itself). formats/ is the plain-torch reference; kernels/ takes numbers and tensors, never quantizers,
# modules or debug state; quant/ casts without knowing recipes or layers; the programs on top (cli, demo,
# compare/) are imported by nothing but one another.
LOWPREC_FLOORS = {
    "lowprec.errors": set(),
    "lowprec.formats": {"lowprec.errors"},
    "lowprec.kernels": {"lowprec.errors", "lowprec.formats"},
    "lowprec.quant": {"lowprec.errors", "lowprec.formats", "lowprec.kernels"},
    "lowprec.recipe": {"lowprec.errors", "lowprec.formats", "lowprec.quant"},
}
PROGRAMS = ("lowprec.cli", "lowprec.demo", "lowprec.compare", "lowprec.planner")


def lowprec_imports() -> dict[str, set[str]]:
    edges, _ = import_graph()
    return {
        module: {t for t in targets if in_package(t, "lowprec")}
        for module, targets in edges.items()
        if in_package(module, "lowprec")
    }


@pytest.mark.parametrize("floor", sorted(LOWPREC_FLOORS))
def test_each_lowprec_package_imports_only_its_lower_floors(floor):
    allowed = (floor, *LOWPREC_FLOORS[floor])
    wrong = {
        module: sorted(t for t in targets if not any(in_package(t, a) for a in allowed))
        for module, targets in lowprec_imports().items()
        if in_package(module, floor)
    }
    assert not {m: t for m, t in wrong.items() if t}, f"{floor} may import only {sorted(allowed)}"


def test_nothing_imports_the_programs_on_top():
    importers = {
        module: sorted(t for t in targets if any(in_package(t, p) for p in PROGRAMS))
        for module, targets in lowprec_imports().items()
        if not any(in_package(module, p) for p in PROGRAMS)
    }
    assert not {m: t for m, t in importers.items() if t}


# The training frameworks: each is imported by its own integration module only (and transformers by compare's zoo,
# a program nothing imports, which builds its models from transformers configs), and no module of src/ outside
# lowprec.integrations imports an integration, so that importing lowprec (or nvdlfw_inspect) imports none of them.
FRAMEWORK_INTEGRATIONS = {
    "transformers": ["lowprec.compare.zoo", "lowprec.integrations.hf"],
    "lightning": ["lowprec.integrations.lightning"],
    "pytorch_lightning": [],
    "accelerate": ["lowprec.integrations.accelerate"],
    "peft": [],
}


def test_only_its_integration_imports_each_training_framework():
    _, imports = import_graph()
    importers = {
        framework: sorted(module for module, names in imports.items() if any(in_package(name, framework) for name in names))
        for framework in FRAMEWORK_INTEGRATIONS
    }
    assert importers == FRAMEWORK_INTEGRATIONS


def test_nothing_outside_the_integrations_imports_them():
    importers = {
        module: sorted(t for t in targets if in_package(t, "lowprec.integrations"))
        for module, targets in lowprec_imports().items()
        if not in_package(module, "lowprec.integrations")
    }
    assert not {m: t for m, t in importers.items() if t}
