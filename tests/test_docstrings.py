"""The examples in docstrings run, in every module that has one."""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def modules_with_examples() -> list[str]:
    paths = sorted(p for package in ("antdt", "data", "models", "pipeline")
                   for p in (ROOT / package).rglob("*.py") if ">>> " in p.read_text())
    return [".".join(p.relative_to(ROOT).with_suffix("").parts) for p in paths]


def test_examples_are_found() -> None:
    assert {"antdt.sharding.ledger", "antdt.sync.embeddings", "data.hashing",
            "models.evaluate"} <= set(modules_with_examples())


@pytest.mark.parametrize("name", modules_with_examples())
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0
