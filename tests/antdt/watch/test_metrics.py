"""The jobs' ``dask_antdt_*`` series on the scheduler's ``/metrics``: jobs of the trivial model of
``fakes`` on a LocalCluster whose workers run in this process, scraped over HTTP and parsed with
``prometheus_client``'s parser (the straggler on real processes: tests/pipeline/watch)."""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterator

import dask.config
import prometheus_client
import pytest
from distributed import Client, LocalCluster
from prometheus_client.registry import CollectorRegistry

from antdt.jobs import JobClient
from antdt.jobs.runner import JobRunner
from antdt.jobs.service import JobService
from antdt.watch.metrics import FAMILIES, JobsCollector
from fakes import GATES, TOTAL, job_service, spec
from scrapes import scrape, value
from waits import bounded

def served() -> bool:
    """Whether this process's default registry (the one ``/metrics`` serves) has the series."""
    return b"dask_antdt_job_state" in prometheus_client.generate_latest()


def test_registering_describes_and_closing_unregisters_even_with_two_schedulers(
        caplog: pytest.LogCaptureFixture) -> None:
    """A second scheduler in the process cannot serve the names too: it says so and goes on,
    and its close leaves the first one's series served."""
    def jobs() -> list[JobRunner]:
        raise AssertionError("registering collected")

    CollectorRegistry(auto_describe=True).register(JobsCollector(None, jobs))
    with LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as first, \
            Client(first) as client:
        client.register_plugin(JobService())
        assert served()
        with caplog.at_level(logging.WARNING, logger="antdt.watch.metrics"), \
                LocalCluster(n_workers=0, processes=False, dashboard_address=":0") as second, \
                Client(second) as other:
            other.register_plugin(JobService())
        assert "this scheduler's jobs are not among them" in caplog.text
        assert served()
    assert not served()


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobClient]:
    """Two single-thread workers in this process and the job service."""
    with job_service() as job_client:
        yield job_client


def test_a_running_jobs_agents_have_their_series(jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=2, gate=gate))["job"]["job_id"]
    try:
        bounded.until(lambda: len(jobs.status(job_id)["workers"]) == 2, "both agents started")
        samples = scrape(jobs.client.dashboard_link)
    finally:
        GATES[gate].set()
    assert value(samples, "job_state", job_id=job_id, state="running") == 1
    assert value(samples, "job_state", job_id=job_id, state="finished") == 0
    assert value(samples, "job_workers", job_id=job_id) == 2
    assert value(samples, "job_info", job_id=job_id, name="fake", mode="async") == 1
    agents = {s.labels["agent"] for s in samples
              if s.name == "dask_antdt_worker_rows_total" and s.labels["job_id"] == job_id}
    assert agents == {"worker0", "worker1"}
    for agent in agents:  # no verdict yet: ok
        assert value(samples, "worker_state", job_id=job_id, agent=agent, state="ok") == 1
        assert value(samples, "worker_state", job_id=job_id, agent=agent, state="hung") == 0
    assert bounded.call(jobs.follow, job_id)["state"] == "finished"


def test_a_finished_jobs_series_stay_until_forget_after(jobs: JobClient) -> None:
    job_id = jobs.submit(spec(epochs=2))["job"]["job_id"]
    record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "finished"

    samples = scrape(jobs.client.dashboard_link)
    assert value(samples, "job_state", job_id=job_id, state="finished") == 1
    assert value(samples, "job_rows_done", job_id=job_id) == 2 * TOTAL
    assert value(samples, "job_rows_trained", job_id=job_id) == 2 * TOTAL
    assert value(samples, "job_rows_per_epoch", job_id=job_id) == TOTAL
    assert value(samples, "job_rows_expected", job_id=job_id) == 2 * TOTAL
    assert value(samples, "job_epoch_rows_done", job_id=job_id, epoch="1") == TOTAL
    assert value(samples, "job_rows_lost", job_id=job_id) == 0
    assert value(samples, "job_rows_retrained", job_id=job_id) == 0
    granted = value(samples, "job_leases_total", job_id=job_id, kind="granted")
    assert granted is not None and granted >= 2
    assert value(samples, "job_workers", job_id=job_id) == 0
    assert value(samples, "worker_rows_total", job_id=job_id) is None  # no agent trains
    with dask.config.set({"antdt.watch.forget-after": "0s"}):
        assert not [s for s in scrape(jobs.client.dashboard_link)
                    if s.labels.get("job_id") == job_id]


def test_every_family_is_described_with_the_prefix() -> None:
    described = {family.name: family.type for family in JobsCollector(None, list).describe()}
    assert described == {f"dask_antdt_{name}": kind for name, (kind, _, _) in FAMILIES.items()}
