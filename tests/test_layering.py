"""The project's layering, read from the imports of every module (at module level and inside
functions): ``pipeline -> antdt, models, data``, ``models -> data`` (its schema only), the
framework knows nothing of the application; inside it the services (sharding, sync, controller)
know nothing of the job master and the agent, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("antdt", "data", "models", "pipeline", "dags")

ALLOWED: dict[str, set[str]] = {
    # package: the project modules it may import (a name allows the module and its submodules)
    "antdt": {"antdt"},
    "data": {"data", "antdt.errors", "antdt.device"},
    "models": {"models", "data.schema", "antdt.errors", "antdt.device"},
    "pipeline": {"pipeline", "antdt", "data", "models"},
    "dags": {"dags", "pipeline"},
}


def project_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import of a project package in the file at ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # "from antdt import config" imports antdt.config: name the submodule if it is one
            names = [f"{node.module}.{alias.name}"
                     if (ROOT / node.module.replace(".", "/") / alias.name).exists()
                     or (ROOT / node.module.replace(".", "/") / f"{alias.name}.py").exists()
                     else node.module for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path}:{node.lineno}: relative import; use absolute imports")
        else:
            continue
        found.extend((node.lineno, name) for name in names
                     if name.split(".")[0] in (*PACKAGES, "tests"))
    return found


def allowed(package: str, module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".")
               for prefix in ALLOWED[package])


def modules() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_packages_have_modules() -> None:
    found = {path.relative_to(ROOT).parts[0] for path in modules()}
    assert {"antdt", "data", "models", "pipeline"} <= found


@pytest.mark.parametrize("path", modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layering(path: Path) -> None:
    package = path.relative_to(ROOT).parts[0]
    wrong = [f"line {line}: {module}" for line, module in project_imports(path)
             if not allowed(package, module)]
    assert not wrong, (f"{path.relative_to(ROOT)} ({package}/) may import only "
                       f"{sorted(ALLOWED[package])}, found {wrong}")


def test_the_checker_sees_a_forbidden_import(tmp_path: Path) -> None:
    module = tmp_path / "bad.py"
    module.write_text("import os\n\n\ndef f():\n    from pipeline.driver import AsyncRun\n"
                      "    from data import schema\n")
    assert project_imports(module) == [(5, "pipeline.driver"), (6, "data.schema")]
    assert not allowed("antdt", "pipeline.driver") and not allowed("models", "data.reader")
    assert allowed("models", "data.schema") and allowed("data", "antdt.errors")


INSIDE_ANTDT: dict[str, set[str]] = {
    # a part of antdt: the parts it never imports (the job master and the agent build on the
    # services, not the other way round; the services do not know each other's insides)
    "antdt.sharding": {"antdt.sync", "antdt.controller", "antdt.jobs", "antdt.agent"},
    "antdt.sync": {"antdt.controller", "antdt.jobs", "antdt.agent"},
    "antdt.controller": {"antdt.sync", "antdt.jobs", "antdt.agent"},
    "antdt.agent": {"antdt.controller", "antdt.jobs"},
}


def module_name(path: Path) -> str:
    """``antdt/sync/wire.py`` -> ``antdt.sync.wire``; a package's ``__init__`` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("part", sorted(INSIDE_ANTDT))
def test_the_parts_of_antdt_keep_their_layers(part: str) -> None:
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for path in modules() if (module_name(path) + ".").startswith(part + ".")
             for line, module in project_imports(path)
             if any(module == banned or module.startswith(banned + ".")
                    for banned in INSIDE_ANTDT[part])]
    assert not wrong, f"{part} may not import {sorted(INSIDE_ANTDT[part])}, found {wrong}"


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (anywhere in the file), among ``paths``."""
    names = {module_name(path) for path in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        targets = set()
        for _, module in project_imports(path):
            while module and module not in names:  # "from antdt.sync import X": the package
                module = module.rpartition(".")[0]
            if module and module != module_name(path):
                targets.add(module)
        graph[module_name(path)] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_antdt_has_no_import_circle() -> None:
    paths = [path for path in modules() if path.relative_to(ROOT).parts[0] == "antdt"]
    assert circles(import_graph(paths)) == []


def test_the_circle_finder_finds_a_circle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert circles(graph) == [["a", "b", "c"]]


INSIDE_PIPELINE: dict[str, set[str]] = {
    # a part of pipeline: the other parts it may import (docs/architecture.md draws the order)
    "pipeline.job": set(),
    "pipeline.terminal": set(),
    "pipeline.serving": {"pipeline.job"},
    "pipeline.tracking": {"pipeline.job", "pipeline.serving"},
    "pipeline.training": {"pipeline.job", "pipeline.serving", "pipeline.tracking"},
    "pipeline.workflows": {"pipeline.job", "pipeline.serving", "pipeline.tracking",
                           "pipeline.training", "pipeline.terminal"},
    "pipeline.bench": {"pipeline.job", "pipeline.training", "pipeline.workflows"},
    "pipeline.cli": {"pipeline.job", "pipeline.serving", "pipeline.tracking", "pipeline.training",
                     "pipeline.workflows", "pipeline.bench", "pipeline.terminal"},
}


@pytest.mark.parametrize("part", sorted(INSIDE_PIPELINE))
def test_the_parts_of_pipeline_keep_their_order(part: str) -> None:
    may = INSIDE_PIPELINE[part] | {part}
    wrong = [f"{path.relative_to(ROOT)}:{line}: {module}"
             for path in modules() if (module_name(path) + ".").startswith(part + ".")
             for line, module in project_imports(path)
             if module.startswith("pipeline.") and not any(
                 module == name or module.startswith(name + ".") for name in may)]
    assert not wrong, f"{part} may import only {sorted(may)} of pipeline, found {wrong}"


def test_every_part_of_pipeline_has_its_rule() -> None:
    top = ROOT / "pipeline"
    parts = {f"pipeline.{path.relative_to(top).parts[0].removesuffix('.py')}"
             for path in top.rglob("*.py") if path != top / "__init__.py"}
    assert parts == set(INSIDE_PIPELINE)
