"""The package's layers: a module imports only from its own layer or below, never in a cycle, and
the artifact format and the device runner stay light (docs/development.md#layout)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import kvexport

PACKAGE = Path(kvexport.__file__).resolve().parent

# Lowest first. A module may import from its own package or from a package of a lower rank.
LAYERS = [
    ["kvexport.errors", "kvexport.logs", "kvexport.version", "kvexport.allocator"],
    ["kvexport.choices"],
    ["kvexport.outputs"],
    ["kvexport.profile"],
    ["kvexport.progress"],
    ["kvexport.artifact"],
    ["kvexport.kernels"],
    ["kvexport.models"],
    ["kvexport.runtime"],
    ["kvexport.exporter"],
    ["kvexport.checker"],
    ["kvexport.bench", "kvexport.matrix"],
    ["kvexport.api"],
    ["kvexport.cli", "kvexport.device", "kvexport"],
]
# Inside the exporter, each target's subpackage builds on the generic modules, not on another target.
TARGET_PACKAGES = ["kvexport.exporter.executorch", "kvexport.exporter.onnx"]
# The torch-free device runner reads artifacts and runs them, nothing more.
DEVICE_IMPORTS = ["kvexport.artifact", "kvexport.runtime", "kvexport.errors", "kvexport.logs", "kvexport.choices",
                  "kvexport.kernels"]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """kvexport modules that ``name`` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            # `from pkg import module` imports the module; `from module import name` the module.
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return {m for m in found if m == "kvexport" or m.startswith("kvexport.")}


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) - {name} for name, path in mods.items()}


def owner(module: str, packages: list[str]) -> str | None:
    """The longest package of ``packages`` that holds ``module``."""
    holders = [p for p in packages if module == p or module.startswith(p + ".")]
    return max(holders, key=len, default=None)


def rank(module: str) -> int:
    packages = [p for layer in LAYERS for p in layer]
    package = owner(module, packages)
    assert package is not None, f"{module} is in no layer of tests/test_layout.py: add its package"
    return next(i for i, layer in enumerate(LAYERS) if package in layer)


def test_every_module_is_in_a_layer():
    for name in modules():
        rank(name)


def test_no_module_imports_from_a_higher_layer():
    packages = [p for layer in LAYERS for p in layer]
    upward = []
    for name, targets in import_graph().items():
        for target in targets:
            same_package = owner(name, packages) == owner(target, packages)
            if rank(target) > rank(name) or (rank(target) == rank(name) and not same_package):
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_a_target_imports_no_other_target_and_generic_export_code_no_target():
    crossing = []
    for name, targets in import_graph().items():
        if not name.startswith("kvexport.exporter"):
            continue
        mine = owner(name, TARGET_PACKAGES)
        for target in targets:
            theirs = owner(target, TARGET_PACKAGES)
            if theirs is not None and theirs != mine:
                crossing.append(f"{name} -> {target}")
    assert crossing == []


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(path[path.index(nxt):] + [node, nxt]) if nxt in path else f"{node} -> {nxt}")
            elif nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert cycles == []


def test_the_device_runner_imports_only_the_runtime_and_the_artifact_format():
    graph = import_graph()
    reached, todo = set(), ["kvexport.device"]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in reached:
                reached.add(target)
                todo.append(target)
    outside = sorted(m for m in reached if owner(m, DEVICE_IMPORTS) is None and m != "kvexport")
    assert outside == []


def test_the_artifact_format_needs_only_the_standard_library():
    third_party = []
    for name, path in modules().items():
        if owner(name, ["kvexport.artifact"]) is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            third_party += [f"{name}: {n}" for n in names
                            if n.split(".")[0] not in sys.stdlib_module_names and n.split(".")[0] != "kvexport"]
    assert third_party == []


def test_the_checks_see_a_planted_upward_import(tmp_path, monkeypatch):
    """The graph reader finds relative imports inside functions (as most of kvexport's are)."""
    planted = tmp_path / "kvexport" / "artifact" / "planted.py"
    planted.parent.mkdir(parents=True)
    planted.write_text("def f():\n    from ..exporter import pipeline\n")
    assert imports("kvexport.artifact.planted", planted, set(modules())) == {"kvexport.exporter.pipeline"}
    assert rank("kvexport.exporter.pipeline") > rank("kvexport.artifact.planted")
