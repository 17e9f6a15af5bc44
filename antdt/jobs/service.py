"""AntDT's master on the Dask scheduler: :class:`JobService` runs every submitted job's control
(:class:`~antdt.jobs.runner.JobRunner`) next to the services that own the job's ledger, its
controller and its sync groups, so a job outlives the client that submitted it.

Handlers (all arguments by keyword; each answers ``{"status": "OK", ...}`` or ``{"status":
"error", "message": ...}``, never raises into the scheduler, never touches another job):

==========================================================  =====================================
``antdt_job_submit(plan, code, job_id=None)``               start a job, or attach to ``job_id``
                                                            if it exists (a retried submit)
``antdt_job_status(job_id=None)``                           one job's record, or every job's
``antdt_job_wait(job_id, version, timeout_s)``              the record once its version moved
``antdt_job_logs(job_id, since=0)``                         log records with ``seq >= since``
``antdt_job_cancel(job_id, reason)``                        stop the job at the agents' next batch
==========================================================  =====================================

Finished jobs stay listed (the newest ``antdt.jobs.history``) until the scheduler restarts.
While the service runs, the scheduler's ``/metrics`` serves its jobs' ``dask_antdt_*`` series
(:mod:`antdt.watch.metrics`).
Tasks reach workers through the service's own client of the scheduler (with the scheduler's TLS
credentials when it has any).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import uuid
from typing import Any

from distributed import Client, Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.security import Security

from antdt import config, fencing, rpc
from antdt.agent import event_topic
from antdt.agent.modes import AsyncMaster, HybridMaster, MasterMode, Rendezvous, SyncMaster
from antdt.controller import ControllerService
from antdt.controller import PLUGIN_NAME as CONTROLLER
from antdt.errors import JobError, SyncError
from antdt.jobs.checkpoints import job_folder
from antdt.jobs.runner import JobContext, JobRunner
from antdt.jobs.spec import PLUGIN_NAME, JobCode, JobPlan, JobSpec
from antdt.rpc import Reply
from antdt.sharding.service import PLUGIN_NAME as SHARDING
from antdt.sharding.service import ShardingService
from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME as SYNC
from antdt.tables.service import PLUGIN_NAME as TABLES
from antdt.tables.service import TablesService, TablesSpec
from antdt.watch import pages
from antdt.watch.metrics import JobsCollector

logger = logging.getLogger(__name__)

JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
"""A job id: it names Dask task keys and event topics, so it stays plain."""

AGENT_TOPIC = event_topic("")
MAX_WAIT_S = 60.0


class JobService(SchedulerPlugin):
    """Runs submitted jobs on the scheduler (see the module docstring)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.runners: dict[str, JobRunner] = {}
        self.scheduler: Scheduler | None = None
        self.rendezvous = Rendezvous()
        """Where the ranks of synchronous jobs meet (the scheduler hosts their store)."""
        self._client: Client | None = None
        self._metrics: JobsCollector | None = None

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "antdt_job_submit": self.submit,
            "antdt_job_status": self.status,
            "antdt_job_wait": self.wait,
            "antdt_job_logs": self.logs,
            "antdt_job_cancel": self.cancel,
            "antdt_sync_rank": self.rendezvous.rank,
        })
        self._metrics = JobsCollector(scheduler, self.runners.values)
        self._metrics.register()
        pages.add_routes(scheduler)  # /antdt/ on the scheduler's web server (kept after close)

    async def close(self) -> None:
        if self._metrics is not None:
            self._metrics.unregister()
        if self._client is not None:
            await self._client.close()

    def restart(self, scheduler: Scheduler) -> None:
        """Every worker process was restarted: no running job can go on."""
        for runner in self.runners.values():
            runner.fail("the cluster restarted")

    def log_event(self, topic: str, msg: Any) -> None:
        """Route an agent's event to its job's runner."""
        if isinstance(topic, str) and topic.startswith(AGENT_TOPIC) and isinstance(msg, dict):
            runner = self.runners.get(topic[len(AGENT_TOPIC):])
            if runner is not None and not runner.state.final:
                runner.journal.received(msg)

    # ---- the services a job uses ------------------------------------------------------------

    @property
    def sharding(self) -> ShardingService:
        return self._plugin(SHARDING, ShardingService)

    @property
    def controller(self) -> ControllerService:
        return self._plugin(CONTROLLER, ControllerService)

    @property
    def sync(self) -> SyncService:
        return self._plugin(SYNC, SyncService)

    @property
    def tables(self) -> TablesService:
        return self._plugin(TABLES, TablesService)

    def forget(self, job: str) -> None:
        """Drop ``job``'s ledger, controller switch and sync state (its runner keeps its
        record)."""
        self.sharding.forget(job)
        self.sync.stop_job(job)
        self.tables.stop_job(job)
        self.rendezvous.forget(job)
        self.controller.forget(job)

    # ---- handlers ----------------------------------------------------------------------------

    @rpc.handler
    async def submit(self, plan: object, code: object, job_id: object = None) -> Reply:
        """Start a job from ``plan`` (:meth:`JobPlan.to_dict`) and ``code``
        (:meth:`JobCode.to_dict`); with an existing ``job_id``, attach to that job instead
        (unless it ended and the plan resumes it from a checkpoint: that starts it again)."""
        # a million row groups take a second or two to check: not on the event loop
        checked = await asyncio.to_thread(JobPlan.from_dict, plan)
        spec = JobSpec(checked, JobCode.from_dict(code))
        if job_id is not None:
            job_id = _job_id(job_id)
            runner = self.runners.get(job_id)
            if runner is not None and not (spec.plan.resume and runner.state.final):
                return {"status": "OK", "attached": True, "job": runner.record()}
        self._plugins()
        assert self.scheduler is not None
        spec.plan.check_cluster({worker: state.memory_limit
                                 for worker, state in self.scheduler.workers.items()})
        if job_id is None:
            job_id = f"{spec.plan.name}-{uuid.uuid4().hex[:8]}"
            if not JOB_ID.fullmatch(job_id):
                job_id = f"job-{uuid.uuid4().hex[:8]}"
        runner = JobRunner(job_id, spec, self._context(job_id, spec.plan,
                                                        await self._own_client()))
        self.runners[job_id] = runner
        if spec.plan.checkpoint_dir is not None:
            self.sharding.folders[job_id] = job_folder(spec.plan.checkpoint_dir, job_id)
        self._trim_history()
        runner.start()
        logger.info("job %s submitted: %s, %d row groups", job_id, spec.plan.name,
                    len(spec.plan.row_groups))
        return {"status": "OK", "attached": False, "job": runner.record()}

    @rpc.handler
    async def status(self, job_id: object = None) -> Reply:
        if job_id is None:
            return {"status": "OK", "jobs": [r.record() for r in self.runners.values()]}
        return {"status": "OK", "job": self._runner(job_id).record()}

    @rpc.handler
    async def wait(self, job_id: object, version: object, timeout_s: object = 10.0) -> Reply:
        runner = self._runner(job_id)
        if isinstance(version, bool) or not isinstance(version, int):
            raise JobError(f"version must be an int, found {version!r}")
        wait_s = rpc.seconds("timeout_s", timeout_s, MAX_WAIT_S, error=JobError)
        await runner.changed(version, wait_s)
        return {"status": "OK", "job": runner.record()}

    @rpc.handler
    async def logs(self, job_id: object, since: object = 0) -> Reply:
        runner = self._runner(job_id)
        first = rpc.integer("since", since, error=JobError)
        return {"status": "OK", "records": runner.log_records(first),
                "final": runner.state.final}

    @rpc.handler
    async def cancel(self, job_id: object, reason: object = "cancelled by a client") -> Reply:
        runner = self._runner(job_id)
        if not isinstance(reason, str) or not 0 < len(reason) <= 1000:
            raise JobError(f"reason must be a str of 1 to 1000 characters, found "
                           f"{str(reason)[:80]!r}")
        cancelled = runner.cancel(reason)
        return {"status": "OK", "cancelled": cancelled, "job": runner.record()}

    # ---- internals ---------------------------------------------------------------------------

    def _runner(self, job_id: object) -> JobRunner:
        job_id = _job_id(job_id)
        runner = self.runners.get(job_id)
        if runner is None:
            raise JobError(f"unknown job {job_id!r}; jobs here: {sorted(self.runners)[-20:]}")
        return runner

    def _context(self, job_id: str, plan: JobPlan, client: Client) -> JobContext:
        """What job ``job_id``'s runner uses of the scheduler and its services."""
        assert self.scheduler is not None
        tables = plan.sharded_tables({w: state.memory_limit
                                      for w, state in self.scheduler.workers.items()})
        mode: MasterMode = SyncMaster(self.rendezvous) if plan.mode == "sync" \
            else AsyncMaster(self.sync) if tables is None \
            else HybridMaster(self.sync, self.tables, _tables_spec(tables))
        return JobContext(
            scheduler=self.scheduler, client=client, sharding=self.sharding,
            controller=self.controller, mode=mode,
            others=lambda: [runner.placement.placed for job, runner in self.runners.items()
                            if job != job_id and not runner.state.final],
            exclusive=lambda: set().union(*(
                runner.placement.placed for job, runner in self.runners.items()
                if job != job_id and not runner.state.final and runner.plan.mode == "sync"
                and plan.mode == "sync")),
            forget=self.forget)

    def _plugins(self) -> None:
        """Raise a :class:`JobError` naming a service a job needs that is not registered."""
        self._plugin(SHARDING, ShardingService)
        self._plugin(CONTROLLER, ControllerService)
        self._plugin(SYNC, SyncService)
        self._plugin(TABLES, TablesService)

    def _plugin(self, name: str, kind: type[Any]) -> Any:
        assert self.scheduler is not None
        plugin = self.scheduler.plugins.get(name)
        if not isinstance(plugin, kind):
            raise JobError(f"the scheduler has no {name!r} plugin: register the antdt plugins "
                           "first (antdt.jobs.JobClient does)")
        return plugin

    async def _own_client(self) -> Client:
        """The service's client of its own scheduler, made on first use."""
        if self._client is None:
            assert self.scheduler is not None
            own = self.scheduler.security  # its fields are set dynamically: read by name
            field = functools.partial(getattr, own)
            security = Security(
                tls_ca_file=field("tls_ca_file"),
                tls_client_cert=field("tls_client_cert") or field("tls_scheduler_cert"),
                tls_client_key=field("tls_client_key") or field("tls_scheduler_key"),
                require_encryption=field("require_encryption"))
            self._client = await Client(self.scheduler.address, asynchronous=True,
                                        security=security, set_as_default=False,
                                        name="antdt-master")
        return self._client

    def _trim_history(self) -> None:
        assert self.scheduler is not None
        keep = int(config.number("antdt.jobs.history", low=1, integer=True))
        ended = [job for job, runner in self.runners.items() if runner.state.final]
        for job in ended[:max(0, len(self.runners) - keep)]:
            del self.runners[job]
            self.sharding.folders.pop(job, None)
            fencing.fences(self.scheduler).forget(job)


def _job_id(value: object) -> str:
    if not isinstance(value, str) or not JOB_ID.fullmatch(value):
        raise JobError(f"job_id must be 1 to 128 letters, digits, '.', '_' or '-', starting "
                       f"with a letter or digit, found {str(value)[:80]!r}")
    return value


def _tables_spec(raw: dict[str, Any]) -> TablesSpec:
    try:
        return TablesSpec(**raw)
    except (TypeError, ValueError, SyncError) as exc:
        raise JobError(f"job plan tables: {exc}") from exc
