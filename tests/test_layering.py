"""The project's layering, read from the imports of every module (at module level and inside
functions): ``pipeline -> antdt, models, data``, ``models -> data`` (its schema only), and the
framework knows nothing of the application."""

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
