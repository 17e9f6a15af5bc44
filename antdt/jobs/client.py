"""The Python client of AntDT's master: submit a job to a Dask cluster, follow it, ask its
status and logs, cancel it. The ``antdt`` commands and the Airflow DAG are built on it::

    with JobClient("tls://scheduler:8786", security=sec) as jobs:
        job = jobs.submit(spec, job_id="daily-2026-11-07")["job"]
        final = jobs.follow(job["job_id"], on_change=print_progress)

A job is a :class:`~antdt.jobs.spec.JobSpec`; a job's record is the plain dict of
:meth:`antdt.jobs.runner.JobRunner.record` (``state``, ``rows``, ``workers``, ``actions``,
``run``, ``summary``, ``error``...). Connecting registers the antdt plugins on the scheduler and
its workers (kept if they are there already, so other jobs go on), unless the client only reads
or cancels (``register=False``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import dask.config
from distributed import Client
from distributed.security import Security

from antdt import rpc
from antdt.errors import JobError
from antdt.jobs.spec import JobSpec
from antdt.sharding import JobState
from antdt.watch.urls import page_url

FINAL = {state.value for state in JobState if state.final}
WAIT_S = 10.0
"""How long one follow call waits on the scheduler for news."""


def ensure_plugins(client: Client) -> None:
    """The sharding service, the straggler controller, the sync and tables services and the job
    service on the scheduler (kept if already there, so other jobs' state survives) and the
    agent plugin on every worker, present and future."""
    # here, not above: their modules need torch, which reading or cancelling a job does not
    from antdt import agent
    from antdt.controller import ControllerService
    from antdt.jobs.service import JobService
    from antdt.sharding.service import ShardingService
    from antdt.sync.service import SyncService
    from antdt.tables.service import TablesService

    for plugin in (ShardingService(), ControllerService(), SyncService(), TablesService(),
                   JobService()):
        plugin.idempotent = True
        client.register_plugin(plugin)
    agent.register(client)


def _check_tls(address: str | None, security: Security | None) -> None:
    """Refuse at once to speak plain TCP to a TLS scheduler (Dask would retry until its
    connect timeout, then fail with a TypeError)."""
    if not str(address or "").startswith("tls://"):
        return
    context = (security or Security()).get_connection_args("client").get("ssl_context")
    if context is None:
        raise JobError(f"cannot reach the scheduler at {address}: it speaks TLS and no "
                       f"certificates were given (the --tls-ca-file, --tls-cert and --tls-key "
                       f"options, or Dask's distributed.comm.tls settings)")


class JobClient:
    """A connection to one Dask scheduler's job service (see the module docstring).

    ``address`` is a scheduler address or an existing :class:`~distributed.Client` (not closed
    here); ``security`` its TLS credentials (default: Dask's config, ``distributed.comm.tls``);
    ``timeout`` how long to try to connect (default: ``distributed.comm.timeouts.connect``).
    ``register=False`` leaves the scheduler as it is, for a client that only reads or cancels
    (no torch imported here): until a job has run on the cluster it finds none.
    """

    def __init__(self, address: str | Client | None = None, *,
                 security: Security | None = None, timeout: str | None = None,
                 register: bool = True) -> None:
        if isinstance(address, Client):
            self.client, self._owned = address, False
        else:
            _check_tls(address, security)
            self.client = Client(address, security=security, set_as_default=False,
                                 timeout=timeout or dask.config.get(
                                     "distributed.comm.timeouts.connect"))
            self._owned = True
        if register:
            ensure_plugins(self.client)
        self._serving = register

    def __enter__(self) -> JobClient:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self.client.close()

    # ---- calls ------------------------------------------------------------------------------

    def submit(self, spec: JobSpec, job_id: str | None = None) -> dict[str, Any]:
        """Start ``spec`` as ``job_id`` (default: a new id); when a job of that id exists,
        attach to it instead (``attached`` is True). Returns ``{"attached", "job"}``."""
        return self._call("antdt_job_submit", plan=spec.plan.to_dict(),
                          code=spec.code.to_dict(), job_id=job_id)

    def status(self, job_id: str | None = None) -> Any:
        """One job's record, or the records of every job the scheduler knows."""
        if job_id is None and not self._serves_jobs():
            return []
        reply = self._call("antdt_job_status", job_id=job_id)
        return reply["jobs"] if job_id is None else reply["job"]

    def wait(self, job_id: str, version: int, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The job's record once its version differs from ``version`` (or after
        ``timeout_s``)."""
        record: dict[str, Any] = self._call("antdt_job_wait", job_id=job_id, version=version,
                                            timeout_s=timeout_s)["job"]
        return record

    def follow(self, job_id: str,
               on_change: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Wait for the job's end, calling ``on_change(record)`` at every change; return the
        final record (its ``state`` says how it ended)."""
        record = self.status(job_id)
        while True:
            if on_change is not None:
                on_change(record)
            if record["state"] in FINAL:
                return record
            record = self.wait(job_id, record["version"])

    def logs(self, job_id: str, since: int = 0) -> list[dict[str, Any]]:
        """The job's log records with ``seq >= since``, oldest first."""
        records: list[dict[str, Any]] = self._call("antdt_job_logs", job_id=job_id,
                                                   since=since)["records"]
        return records

    def tail(self, job_id: str, since: int = 0) -> Iterator[dict[str, Any]]:
        """The job's log records as they come, until the job ended and all were read."""
        version = -1
        while True:
            reply = self._call("antdt_job_logs", job_id=job_id, since=since)
            for record in reply["records"]:
                since = record["seq"] + 1
                yield record
            if reply["final"]:
                return
            version = self.wait(job_id, version)["version"]

    def cancel(self, job_id: str, reason: str = "cancelled by a client") -> dict[str, Any]:
        """Stop the job: its agents stop at their next batch, its tracking run ends as
        killed. Returns ``{"cancelled", "job"}`` (``cancelled`` False once it is finishing or
        over)."""
        return self._call("antdt_job_cancel", job_id=job_id, reason=reason)

    def page(self, job_id: str | None = None) -> str | None:
        """The address of job ``job_id``'s live page on the scheduler's web server (None: of
        the list of jobs; :mod:`antdt.watch.pages`), from the dashboard's address Dask gives
        clients; None when the scheduler tells none."""
        link = self.client.dashboard_link
        return page_url(link, job_id) if link else None

    def _serves_jobs(self) -> bool:
        """Whether the scheduler has antdt's job service (asked until it has: a job another
        client submits meanwhile registers it)."""
        if not self._serving:
            self._serving = bool(self.client.run_on_scheduler(_has_job_service))
        return self._serving

    def _call(self, handler: str, **kwargs: Any) -> dict[str, Any]:
        if not self._serves_jobs():
            raise JobError(f"unknown job {kwargs.get('job_id')!r}: no antdt job has run on "
                           "this cluster")
        return rpc.ok(self.client.sync(getattr(self.client.scheduler, handler), **kwargs),
                      error=JobError)


def _has_job_service(dask_scheduler: Any) -> bool:
    """Whether the scheduler has antdt's job service (run on the scheduler)."""
    return "antdt_job_status" in dask_scheduler.handlers
