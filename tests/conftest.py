"""The two tiers of the suite (see ``tests/README.md``): the default tier holds every guarantee
at a small size; tests marked ``slow`` (the second and third size of the same thing, the
benchmarks' smoke runs, the suites that start many clusters) run only with ``--runslow``, as
dask/distributed's own suite does. ``make test`` runs the first, ``make test-full`` both."""

from __future__ import annotations

import os
from collections.abc import Iterator

import dask
import pytest

from antdt.agent.modes.synchronous import GLOO_INTERFACE
from pipeline.bench.processes import DaskProcesses, wait_for_workers
from waits import bounded

# The suite injects faults (hangs, crashes, slowdowns, pauses): its clusters allow them, the
# in-process ones through dask config, the `dask scheduler` processes it starts through the
# environment they inherit. A test of the refusal sets the setting false itself.
os.environ["DASK_ANTDT__JOBS__ALLOW_FAULTS"] = "true"
dask.config.set({"antdt.jobs.allow-faults": True})


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


@pytest.fixture(autouse=True)
def _forget_started_calls() -> Iterator[None]:
    yield
    bounded.forget()


@pytest.fixture(autouse=True)
def _own_gloo_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """A sync rank run in this process (an in-process worker's) sets gloo's interface for the
    process, to ``lo``; each test starts without it and ends with it taken away again, so no
    later test's processes inherit it."""
    monkeypatch.delenv(GLOO_INTERFACE, raising=False)


@pytest.fixture(scope="session")
def process_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaskProcesses]:
    """A long-lived cluster of real ``dask scheduler`` and ``dask worker`` processes (three
    workers of one thread, Dask's and antdt's default settings), shared by every test that only
    submits jobs to a cluster, as a deployment's DAG or CLI does. A test that kills a process,
    adds or removes workers or needs other settings starts a cluster of its own."""
    with DaskProcesses(tmp_path_factory.mktemp("process-cluster")) as processes:
        processes.add_workers(3)
        wait_for_workers(processes.address, 3)
        yield processes
