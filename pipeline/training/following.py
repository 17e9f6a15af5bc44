"""Following a job to its end from its records (:meth:`antdt.jobs.JobClient.follow`): the
progress bar's feed, each agent as the master recorded it, and the summary of a finished job.
Light on purpose: ``antdt follow`` imports neither torch nor MLflow."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from antdt.errors import JobCancelled, JobError, JobFailed
from pipeline.job.report import JobSummary, ProgressSink

if TYPE_CHECKING:
    from antdt.jobs import JobClient


class Progress:
    """Feeds a :class:`ProgressSink` (the CLI's bar) from a job's records: rows done or
    quarantined out of the rows the job expects."""

    def __init__(self, sink: ProgressSink | None) -> None:
        self.sink = sink
        self._total = 0
        self._done = 0

    def __call__(self, record: Mapping[str, Any]) -> None:
        rows = record.get("rows") or {}
        if self.sink is None or not rows:
            return
        if rows["expected"] != self._total:
            self._total = rows["expected"]
            self.sink.total(self._total)
        done = rows["done"] + rows["quarantined"]
        if done > self._done:
            self.sink.advance(done - self._done)
            self._done = done


@dataclass(frozen=True)
class AgentRecord:
    """One agent of a finished job as the master recorded it (seconds after training
    started; ``cpu_s``: its training thread's CPU seconds within ``busy_s``)."""

    worker: str
    index: int
    join: bool
    started: float
    ended: float | None
    rows: int
    busy_s: float
    dead: bool
    cpu_s: float = 0.0

    @classmethod
    def of(cls, agent: Mapping[str, Any]) -> AgentRecord:
        return cls(*(agent[name] for name in cls.__dataclass_fields__))


def outcome(record: Mapping[str, Any]) -> JobSummary:
    """The summary of a job that ended; :class:`JobFailed` or :class:`JobCancelled` when it
    did not finish."""
    state = record["state"]
    if state == "failed":
        raise JobFailed(f"job {record['job_id']} failed: {record['error']}")
    if state == "cancelled":
        raise JobCancelled(f"job {record['job_id']} was cancelled: {record['stopped']}")
    if state != "finished" or record["summary"] is None:
        raise JobError(f"job {record['job_id']} has not ended: {state}")
    return JobSummary.from_dict(record["summary"])


def follow(jobs: JobClient, job_id: str, progress: ProgressSink | None = None,
           on_change: Callable[[Mapping[str, Any]], None] | None = None) -> dict[str, Any]:
    """Follow ``job_id`` to its end, feeding ``progress``; the final record."""
    bar = Progress(progress)

    def changed(record: dict[str, Any]) -> None:
        bar(record)
        if on_change is not None:
            on_change(record)

    return jobs.follow(job_id, on_change=changed)
