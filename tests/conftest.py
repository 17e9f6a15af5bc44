"""The two tiers of the suite (see ``tests/README.md``): the default tier holds every guarantee
at a small size; tests marked ``slow`` (the second and third size of the same thing, the
benchmarks' smoke runs, the suites that start many clusters) run only with ``--runslow``, as
dask/distributed's own suite does. ``make test`` runs the first, ``make test-full`` both."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the tests marked slow (the full tier: make test-full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--runslow") or config.getoption("-m"):
        return  # the full tier, or a selection by marker that says what it wants
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
        config.hook.pytest_deselected(items=slow)


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption("--runslow"):
        return "antdt tier: full (the slow tests too)"
    return "antdt tier: default (tests marked slow are left out: --runslow or make test-full)"

