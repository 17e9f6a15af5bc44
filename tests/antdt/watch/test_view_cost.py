"""A job page's view costs the scheduler a bounded amount however long the job ran: a real job
on a LocalCluster (the trivial model of ``fakes``, held by a gate) whose journal is fed a million
leases as its agents would send them, then its page and JSON read over HTTP and its view timed
on the scheduler's event loop."""

from __future__ import annotations

import json
import re
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from distributed import Scheduler

from antdt.jobs import JobClient
from antdt.jobs.journal import PAGE_SPANS
from antdt.jobs.spec import PLUGIN_NAME
from antdt.watch.view import job_view
from fakes import GATES, job_service, spec
from waits import bounded

LEASES = 1_000_000
ROWS = 64
"""Rows of each fed lease."""

VIEW_MS = 50.0
"""The most a view may take on the event loop here (``antdt bench sharding`` measures about
1 ms for the journal's part; the view used to rebuild every span: 600 ms at a million)."""


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobClient]:
    with job_service() as job_client:
        yield job_client


def feed(dask_scheduler: Scheduler, job_id: str, leases: int) -> int:
    """On the event loop: ``leases`` leases of :data:`ROWS` rows, 1 ms apart and 4 ms long,
    taking turns over the job's agents, into its journal as their start and end events, read
    every 10,000 events as the master's ticks read them; the leases its page counts now."""
    runner = dask_scheduler.plugins[PLUGIN_NAME].runners[job_id]
    slots = runner.placement.slots
    first = time.time() - leases * 0.001
    for lease in range(leases):
        worker = slots[lease % len(slots)].worker
        start = first + lease * 0.001
        runner.journal.received({"kind": "lease", "phase": "start", "worker": worker,
                                 "lease_id": 10**9 + lease, "time": start})
        runner.journal.received({"kind": "lease", "phase": "end", "worker": worker,
                                 "lease_id": 10**9 + lease, "time": start + 0.004,
                                 "start": start, "rows": ROWS, "outcome": "finished"})
        if lease % 5000 == 4999:
            runner.journal.read_events(slots, {})
    runner.journal.read_events(slots, {})
    return int(runner.journal.leases_total)


def view_ms(dask_scheduler: Scheduler, job_id: str) -> float:
    """The median milliseconds of 11 views of the job, on the event loop."""
    runner = dask_scheduler.plugins[PLUGIN_NAME].runners[job_id]
    took = []
    for _ in range(11):
        start = time.perf_counter()
        job_view(runner, time.time())
        took.append(1000 * (time.perf_counter() - start))
    return statistics.median(took)


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=60) as answer:
        return str(answer.read().decode())


@pytest.mark.slow
def test_a_view_of_a_job_of_a_million_leases_is_bounded_and_shows_the_whole_job(
        jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=3, gate=gate))["job"]["job_id"]
    try:
        bounded.until(lambda: jobs.status(job_id)["state"] == "running"
                      and len(jobs.status(job_id)["agents"]) == 2, "both agents started")
        counted = jobs.client.run_on_scheduler(feed, job_id=job_id, leases=LEASES)
        assert counted == LEASES
        took = jobs.client.run_on_scheduler(view_ms, job_id=job_id)
        page = jobs.page(job_id)
        assert page is not None
        html = get(page)
        view: dict[str, Any] = json.loads(get(page.replace("/antdt/jobs/",
                                                           "/antdt/api/jobs/")))["job"]
    finally:
        GATES[gate].set()
    bounded.call(jobs.follow, job_id)

    assert took < VIEW_MS, f"a view took {took:.1f} ms on the event loop"
    timeline = view["timeline"]
    closed = [s for s in timeline["spans"] if s["outcome"] != "open"]
    assert len(closed) <= PAGE_SPANS and timeline["spans_total"] >= LEASES
    assert sum(s["rows"] for s in closed) == LEASES * ROWS  # the gate held every real lease
    first, last = min(s["start"] for s in closed), max(s["end"] for s in closed)
    assert last - first == pytest.approx(LEASES * 0.001 + 0.003, rel=1e-3)  # the whole job
    told = re.search(r'id="merged">([\d,]+) leases in\s+([\d,]+) bars', html)
    assert told and int(told[1].replace(",", "")) >= LEASES
    assert int(told[2].replace(",", "")) <= PAGE_SPANS + 2
    assert html.count("<rect") <= PAGE_SPANS + 50  # lanes' stripes, open leases
