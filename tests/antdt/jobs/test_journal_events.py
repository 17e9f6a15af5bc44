"""What a job's master does with events it cannot read (they are dropped, counted, logged, and
never fail the job) and how it keeps a long job's lease spans (bounded, the totals exact)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from antdt.agent.contract import event_topic
from antdt.jobs import JobClient
from antdt.jobs.journal import LOGGED_DROPS, Journal, SpanHistory
from antdt.jobs.placement import Slot
from fakes import GATES, TOTAL, job_service, spec
from waits import bounded

GOOD = "tcp://a"
LEDGER = {**{f"rows_{k}": 0 for k in ("expected", "done", "trained", "todo", "leased", "lost",
                                      "retrained", "quarantined")},
          "epoch": 0, "epochs": 1, "rows_done_by_epoch": [0], "leases_granted": 0,
          "leases_revoked": 0, "leases_split": 0}


class Rig:
    """A journal at a fixed time (1001 s) with two agents' slots, on ``tcp://a`` and ``b``."""

    def __init__(self) -> None:
        self.journal = Journal("job-1", lambda: 1001.0, lambda: None, log_length=100)
        self.slots = [Slot("tcp://a", 0, join=False, started=0.0),
                      Slot("tcp://b", 1, join=False, started=0.0)]
        self.journal.read_ledger(LEDGER)


def lease(phase: str, worker: str, lease_id: int, at: float, **end: Any) -> dict[str, Any]:
    return {"kind": "lease", "phase": phase, "worker": worker, "lease_id": lease_id,
            "time": at, **end}


def malformed(worker: str) -> list[Any]:
    """Events a broken or foreign sender could put on a job's topic, each with ``worker`` as
    the agent's address where it names one."""
    progress = {"kind": "progress", "worker": worker, "samples_per_s": 1.0, "rows": 5,
                "busy_s": 1.0, "cpu_s": 1.0}
    end = {"kind": "lease", "phase": "end", "worker": worker, "lease_id": 1, "time": 1001.0,
           "start": 1000.5, "rows": 3, "outcome": "finished"}
    return [
        "not a mapping", 42, None, ["kind", "lease"], {}, {"kind": "progress"},
        {"kind": "surprise", "worker": worker}, {"kind": "lease", "worker": worker},
        {**progress, "worker": "tcp://foreign:1"}, {**progress, "worker": 7},
        {**end, "worker": "antdt-agent-other-job"},
        {**progress, "rows": "12"}, {**progress, "rows": -1}, {**progress, "rows": 10**400},
        {**progress, "rows": 2**70}, {**progress, "samples_per_s": float("nan")},
        {**progress, "busy_s": -3.0}, {**progress, "cpu_s": float("inf")},
        {**progress, "loss": "low"}, {**progress, "loss": 1e400 * 0},
        {**progress, "exchanges": None}, {**progress, "exchanged_bytes": -5},
        {**progress, "rows": True}, {key: v for key, v in progress.items() if key != "busy_s"},
        {**end, "lease_id": "1"}, {**end, "lease_id": -4}, {**end, "rows": 1.5},
        {**end, "time": 1e300}, {**end, "start": 1002.0}, {**end, "outcome": 3},
        {**end, "phase": "middle"}, {**end, "time": -1.0},
        {"kind": "lease", "phase": "start", "worker": worker, "lease_id": 10**30,
         "time": 1000.0},
    ]


def test_malformed_and_foreign_events_are_dropped_counted_and_the_first_ones_logged() -> None:
    rig = Rig()
    rig.journal.began(1000.0)
    bad = malformed(GOOD)
    rig.journal.received(lease("start", GOOD, 1, 1000.5))
    for msg in bad:
        rig.journal.received(msg)
    rig.journal.received(lease("end", GOOD, 1, 1001.0, start=1000.5, rows=3,
                               outcome="finished"))
    rig.journal.received({"kind": "progress", "worker": GOOD, "samples_per_s": 9.0,
                          "rows": 3, "busy_s": 0.5, "cpu_s": 0.4, "loss": None,
                          "exchanges": 2, "exchanged_bytes": None})
    metrics = rig.journal.read_events(rig.slots, {})

    assert rig.journal.events_dropped == len(bad)
    assert rig.journal.record(rig.slots)["events_dropped"] == len(bad)
    dropped = [r["message"] for r in rig.journal.logs if r["message"].startswith("dropped")]
    assert len(dropped) == LOGGED_DROPS and "only counted" in dropped[-1]
    assert all(len(message) < 400 for message in dropped)
    a = rig.slots[0]  # the good events alone count
    assert (a.rows, a.busy_s, a.cpu_s, a.rate, a.exchanges) == (3, 0.5, 0.4, 9.0, 2)
    assert metrics["train.samples_per_s.worker0"] == 9.0
    assert [(s["lease_id"], s["rows"]) for s in rig.journal.page_spans(rig.slots)] == [(1, 3)]
    assert rig.journal.leases_total == 1


def test_a_span_history_stays_bounded_and_keeps_the_whole_job_and_its_totals() -> None:
    history = SpanHistory(200)
    workers, outcomes = ["w0", "w1", "w2"], ["finished"] * 9 + ["revoked"]
    rows = 0
    for i in range(30_000):
        rows += i % 7
        history.add((workers[i % 3], i, 10.0 + i, 10.0 + i + 0.9, i % 7, outcomes[i % 10]))
        assert len(history.spans) < 200
    assert history.leases == 30_000 and history.width > 0
    assert sum(s[4] for s in history.spans) == rows
    assert min(s[2] for s in history.spans) == 10.0  # the whole job, start to end
    assert max(s[3] for s in history.spans) == 10.0 + 29_999 + 0.9
    for worker in workers:  # a worker's bars of one outcome never overlap
        for outcome in ("finished", "revoked"):
            bars = sorted(s for s in history.spans if s[0] == worker and s[5] == outcome)
            assert bars and all(b[2] >= a[3] for a, b in zip(bars, bars[1:]))
    revoked = sum(i % 7 for i in range(30_000) if i % 10 == 9)
    assert sum(s[4] for s in history.spans if s[5] == "revoked") == revoked


def test_a_history_of_more_lanes_than_its_bound_grows_instead_of_merging_forever() -> None:
    history = SpanHistory(20)
    for i in range(400):
        history.add((f"w{i % 50}", i, float(i), i + 0.5, 1, "finished"))
    assert 50 <= len(history.spans) <= history.bound and history.leases == 400
    assert sum(s[4] for s in history.spans) == 400


@pytest.fixture(scope="module")
def jobs() -> Iterator[JobClient]:
    with job_service() as job_client:
        yield job_client


def test_a_job_fed_malformed_events_while_it_trains_finishes_with_exact_accounting(
        jobs: JobClient) -> None:
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    GATES[gate] = threading.Event()
    job_id = jobs.submit(spec(epochs=2, gate=gate))["job"]["job_id"]
    bounded.until(lambda: jobs.status(job_id)["state"] == "running", "training started")
    worker = sorted(jobs.client.scheduler_info()["workers"])[0]
    bad = malformed(worker)
    for msg in bad:
        jobs.client.log_event(event_topic(job_id), msg)
    bad = [msg for msg in bad if isinstance(msg, dict)]  # the service routes only mappings
    bounded.until(lambda: jobs.status(job_id)["events_dropped"] == len(bad),
                  "every malformed event read")
    GATES[gate].set()
    record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished" and record["error"] is None
    rows = record["rows"]
    assert (rows["done"], rows["trained"], rows["lost"], rows["retrained"]) == \
        (2 * TOTAL, 2 * TOTAL, 0, 0)
    assert sum(a["rows"] for a in record["agents"]) == 2 * TOTAL
    assert record["events_dropped"] == len(bad)
    messages = [r["message"] for r in jobs.logs(job_id)]
    assert sum(m.startswith("dropped an agent's event") for m in messages) == LOGGED_DROPS
