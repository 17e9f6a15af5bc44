"""What the job pages and their JSON API show of a job: :func:`job_row` for the list of jobs,
:func:`job_view` for one job. Both start from the runner's record (what ``antdt status``
shows) and add what a person watching wants at a glance, read in place from the services the
job lives in:

* each worker's pace (rows/s, from its agent's progress events), its classification by the
  straggler monitor (``ok``, ``straggler``, ``hung``; the monitor's own verdict, ``transient``
  or ``persistent``, beside it, and of a straggler the share of its batch time it waits off
  the CPU, for its rows, its link or a core: a slow link, not a slow CPU), its backlog (rows
  leased to it and not trained yet), how often an agent of the job restarted on it and how
  long ago it last reported (its last commit);
* the lease timeline so far: the journal's closed lease spans (as in the tracking run's
  ``timeline.png``; the whole job in a bounded number of bars, neighbouring leases merged)
  and the leases still open, which end "now".

The dicts are plain (JSON-able). They are built on the scheduler's event loop, where the
services live, so nothing is copied across threads or locked; their cost is bounded however
long the job ran (the pages render them off the loop); a finished job's ledger and
monitor are gone (the services forgot it) and its view is its record and journal alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from antdt.jobs.journal import PAGE_SPANS

if TYPE_CHECKING:
    from antdt.jobs.placement import Slot
    from antdt.jobs.runner import JobRunner

MAX_SPANS = PAGE_SPANS
"""Controller actions a job's timeline marks at most (the newest); its lease spans are the
journal's page history (:meth:`~antdt.jobs.journal.Journal.page_spans`): the whole job in at
most about as many bars, neighbouring leases merged, plus the leases still open."""

CLASSIFICATION = {"ok": "ok", "transient": "straggler", "persistent": "straggler", "hung": "hung"}
"""The monitor's verdict (:class:`~antdt.monitor.WorkerState`) as the pages classify it."""


def job_row(runner: JobRunner, now: float) -> dict[str, Any]:
    """One job as the list of jobs shows it: id, name, state, progress, rows/s, elapsed time,
    its live and flagged workers and its tracking run."""
    record = runner.record()
    live = [w for w in record["workers"] if w["state"] == "running"]
    return {"job_id": record["job_id"], "name": record["name"], "state": record["state"],
            "final": runner.state.final, "mode": record["mode"],
            "submitted_at": record["submitted_at"], "elapsed_s": _elapsed(record, now),
            "progress": _progress(record["rows"]),
            "rows_per_s": sum(w["samples_per_s"] for w in live),
            "workers": len(live),
            "flagged": sum(w["health"] in ("straggler", "hung") for w in live),
            "error": record["error"], "run": record["run"]}


def job_view(runner: JobRunner, now: float) -> dict[str, Any]:
    """One job as its page shows it: :func:`job_row`, the runner's record (``record``), a
    row per worker (``workers``), the lease timeline (``timeline``) and the recent controller
    actions (``actions``, newest last, with ``actions_total``); with sharded tables, what each
    worker's trainer saw of them (``tables_seen``: pull and push ms, pushes in flight, waits)."""
    record = runner.record()
    t0 = runner.started_at
    labels = _labels(runner.placement.slots)
    ledger = runner.ctx.sharding.jobs.get(runner.job_id)
    control = runner.ctx.controller.jobs.get(runner.job_id)
    health: Mapping[str, Mapping[str, Any]] = {} if control is None \
        else control.monitor.summary()["workers"]
    leases = [] if ledger is None else ledger.leases()
    journal = runner.journal
    spans = journal.page_spans(runner.placement.slots)
    if t0 is not None:
        spans.extend({"worker": labels.get(lease.worker, lease.worker),
                      "lease_id": lease.lease_id, "start": lease.leased_at - t0,
                      "end": now - t0, "rows": lease.offset - lease.start, "outcome": "open"}
                     for lease in leases)
    spans.sort(key=lambda span: span["end"])
    backlog: dict[str, int] = {}
    for lease in leases:
        backlog[lease.worker] = backlog.get(lease.worker, 0) + lease.stop - lease.offset
    return {**job_row(runner, now), "record": record,
            "workers": _workers(runner.placement.slots, health, backlog),
            "timeline": {"now": 0.0 if t0 is None else (runner.ended_at or now) - t0,
                         "lanes": list(labels.values()),
                         "spans": spans, "spans_total": journal.leases_total + len(leases),
                         "marks": journal.marks(runner.placement.slots, MAX_SPANS)},
            "actions": record["actions"], "actions_total": record["actions_total"],
            "tables_seen": {w["worker"]: w["tables"] for w in record["workers"]
                            if w.get("tables")}}


def _workers(slots: Sequence[Slot], health: Mapping[str, Mapping[str, Any]],
             backlog: Mapping[str, int]) -> list[dict[str, Any]]:
    """A row per worker that ran an agent of the job, in the order their first agents started;
    the newest agent on a worker names it (``label``) and says how it stands (``agent``)."""
    by_worker: dict[str, list[Slot]] = {}
    for slot in slots:
        by_worker.setdefault(slot.worker, []).append(slot)
    rows = []
    for worker, mine in by_worker.items():
        newest = mine[-1]
        verdict = health.get(worker) if newest.live else None
        state = None if verdict is None else str(verdict["state"])
        rows.append({
            "worker": worker, "label": newest.label, "agent": newest.as_dict()["outcome"],
            "rows": sum(s.rows for s in mine),
            "rows_per_s": round(newest.rate, 1) if newest.live else 0.0,
            "classification": "-" if state is None else CLASSIFICATION.get(state, state),
            "verdict": state,
            "batch_time_s": None if verdict is None else verdict["bpt"],
            "median_batch_time_s": None if verdict is None else verdict["median"],
            "waiting": None if verdict is None else verdict.get("waiting"),
            "backlog_rows": backlog.get(worker, 0), "restarts": len(mine) - 1,
            "last_report_s": None if verdict is None else verdict["silent_s"]})
    return rows


def _labels(slots: Sequence[Slot]) -> dict[str, str]:
    """Each worker's label: its newest agent's, as the timeline's lanes name it."""
    return {slot.worker: slot.label for slot in slots}


def _progress(rows: Mapping[str, Any]) -> dict[str, Any]:
    """Rows done (quarantined rows count: they will never be trained) of the rows expected, and
    the epoch being dealt (1-based, never past the last)."""
    if not rows:
        return {"rows_done": 0, "rows_expected": 0, "fraction": 0.0, "epoch": 0, "epochs": 0}
    done, expected = rows["done"] + rows["quarantined"], rows["expected"]
    return {"rows_done": done, "rows_expected": expected,
            "fraction": done / expected if expected else 0.0,
            "epoch": min(rows["epoch"] + 1, rows["epochs"]), "epochs": rows["epochs"]}


def _elapsed(record: Mapping[str, Any], now: float) -> float:
    """Seconds since the job was submitted, until it ended."""
    return float((record["ended_at"] or now) - record["submitted_at"])

