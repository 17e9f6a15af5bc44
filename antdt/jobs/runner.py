"""One job's control on the scheduler (AntDT's master, per job): it reads top to bottom like the
job it runs::

    choose the workers; refuse the job when one's memory limit cannot hold the model's replica
      ─► register the job: the ledger (sharding service), its controller, its mode (the sync
         group)
      ─► the tracking run (hooks.start, a task on a worker)
      ─► one agent task per worker, and per worker that joins later
         (:mod:`~antdt.jobs.placement`)
      ─► every tick: collect finished agents, write off those whose worker died (the ledger has
         re-queued their rows), start joiners, read the agents' events and the controller's
         actions (:mod:`~antdt.jobs.journal`), buffer metrics (hooks.metrics, a task every few
         seconds: :mod:`~antdt.jobs.metrics`); stop at a deadline and take a checkpoint when
         one is due (:mod:`antdt.jobs.keeper`)
      ─► every worker gone: wait for new ones and restart from the last checkpoint (or fail,
         naming it, after ``antdt.sharding.no-workers-timeout``); in a mode whose model does
         not survive one worker (``mode.regroups``: the synchronous mode's shards), any agent
         lost: stop the others and restart from the last checkpoint on the workers left
      ─► the end: hooks.finish on a worker holding the consensus model (another one if that
         worker dies), or hooks.abort when the job failed or was cancelled
      ─► forget the job in the services and on the workers; keep its record for ``status``

It runs as a coroutine on the scheduler's event loop and never blocks it: tasks go to workers
through the :class:`~antdt.jobs.service.JobService`'s own client, and the services are read in
place. The runner never imports that service: the service hands each runner a
:class:`JobContext` of what it uses (the scheduler, the client, the three services a job lives
in, the other jobs' placements and a way to forget the job), as Ray's job supervisor is handed
its storage client. Nothing here runs the application's code: the hooks and the agents'
factories are pickles only workers open.

The runner holds the job's lifecycle (its :class:`~antdt.sharding.JobState`, the steps above);
the rest are plain parts with their own state, each tested without a cluster:
:class:`~antdt.jobs.placement.Placement` (which workers get agents),
:class:`~antdt.jobs.journal.Journal` (events and actions in; the log, record and report out),
:class:`~antdt.jobs.metrics.MetricsShipper` (metrics to the tracking run) and
:class:`~antdt.jobs.keeper.Checkpointer` (checkpoints). What it does when the job's model is
lost is :class:`~antdt.jobs.restarts.Restarts`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from distributed import Client, Future, Scheduler
from distributed.metrics import time
from distributed.scheduler import KilledWorker

from antdt import config, fencing
from antdt.agent import AgentReport, AgentSpec, Faults, cancel_here, forget_here
from antdt.agent.modes import GroupBroken, MasterMode
from antdt.controller import BalanceBatch, ControllerService, JobAgents
from antdt.device import FROZEN_HEAP
from antdt.errors import AntdtError, JobError
from antdt.jobs import calls, tasks
from antdt.jobs.checkpoints import Manifest
from antdt.jobs.journal import Journal
from antdt.jobs.keeper import Checkpointer
from antdt.watch.urls import redact_all
from antdt.jobs.metrics import MetricsShipper, Step
from antdt.jobs.placement import Placement, Slot
from antdt.jobs.recovery import Recovery, lost_job, restore_ledger
from antdt.jobs.restarts import Restarts
from antdt.jobs.spec import JobSpec
from antdt.monitor import MonitorSettings
from antdt.sharding import JobState
from antdt.sharding.service import ShardingService
from antdt.sync import SyncPeriod
from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME as SYNC

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobContext:
    """What a job's runner uses of the scheduler it runs on, built by the job service: the
    services that hold the job's ledger and controller (read in place), the master's side of
    the job's training mode (:class:`~antdt.agent.modes.MasterMode`: its model's groups), the
    service's client of the scheduler, the workers the scheduler's other unfinished jobs
    placed agents on (one collection per job: a job placed on fewer workers chooses the least
    busy), ``exclusive()``, the workers this job may not share (another synchronous job's,
    for a synchronous job), and ``forget(job)``, which drops the job from those services."""

    scheduler: Scheduler
    client: Client
    sharding: ShardingService
    controller: ControllerService
    mode: MasterMode
    others: Callable[[], Iterable[Collection[str]]]
    exclusive: Callable[[], set[str]]
    forget: Callable[[str], None]


class Cancelled(AntdtError):
    """The job was cancelled (raised inside the runner to unwind to its end)."""


class JobRunner(Restarts):
    """The control of job ``job_id`` (see the module docstring). :meth:`record` is its state
    as clients see it; :attr:`version` grows with every change they should see."""

    def __init__(self, job_id: str, spec: JobSpec, ctx: JobContext) -> None:
        self.ctx = ctx
        self.job_id = job_id
        self.plan = spec.plan
        self.code = spec.code
        self.client = ctx.client
        self.state = JobState.STARTING
        self.version = 0
        self.submitted_at = time()
        self.started_at: float | None = None
        self.ended_at: float | None = None
        self.marks: dict[str, float] = {}
        """When the job reached the steps a client's timing shows besides ``submitted_at``,
        ``started_at`` and ``ended_at``: ``workers_ready`` (the stack imported on every worker),
        ``training_ended`` (every agent returned; the final model is evaluated and logged)."""
        self.error: str | None = None
        self.run: dict[str, Any] | None = None
        self.summary: dict[str, Any] | None = None
        self._tables_seen: dict[str, Any] | None = None
        self.journal = Journal(
            job_id, time, self._bump,
            log_length=int(config.number("antdt.jobs.log-length", low=1, integer=True)))
        """The agents' events (handed to it by the service) and the controller's actions in;
        the job's log, record and report out."""
        self.log = self.journal.log
        self.placement = Placement(spec.plan, self.journal.elapsed, ctx.others, self._tasks_on)
        self._agents: dict[int, Future] = {}
        """The agents' tasks, by slot index."""
        self.stopped: str | None = None
        """Why the job was stopped before its end (a deadline, a cancellation), or None."""
        self.metrics = MetricsShipper(time, config.seconds("antdt.jobs.metrics-interval"),
                                      self._send_metrics, self._alive, self.log)
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._cancel: str | None = None
        self._tick_s = config.seconds("antdt.jobs.tick")
        self._task: asyncio.Task[None] | None = None
        self.checkpoints = Checkpointer(job_id, spec.plan, self._write_model, self.log,
                                        written=self._wake.set)
        self.recovery = Recovery()
        """The job's restarts: their count and the rows they trained again."""
        self._period = SyncPeriod.parse(self.plan.sync_period, where="job plan sync_period")
        self._trained_before = 0
        """The ledger's rows trained when this master started training (a resumed job's
        checkpoint has some), less the rows a restart in place rolled back."""
        self._regroup = None
        self._stopping: set[asyncio.Future[Any]] = set()  # cancellations of stopped agents

    # ---- what clients see -------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """The job as ``status`` and ``follow`` show it (plain, msgpack-able, passwords hidden)."""
        return redact_all({"job_id": self.job_id, "name": self.plan.name, "state": self.state.value,
                "version": self.version, "submitted_at": self.submitted_at,
                "started_at": self.started_at, "ended_at": self.ended_at, "error": self.error,
                "marks": dict(self.marks), "stopped": self.stopped, "run": self.run,
                "summary": self.summary, "tags": dict(self.plan.tags),
                "sharding": self.plan.sharding, "mode": self.plan.mode,
                "batch_rows": self.plan.batch_rows, **self.journal.record(self.placement.slots),
                "checkpoint": self.checkpoints.last_path, "checkpoints": self.checkpoints.summary(),
                "rows_replayed": self.recovery.rows_replayed, "resumes": self.recovery.resumes,
                "adapted": self.placement.adapted, "tables": self.tables(),
                "refused": fencing.refused(self.ctx.scheduler, self.job_id, self.ctx.mode)})

    def tables(self) -> dict[str, Any] | None:
        """Where the job's sharded tables are, as its master mode last said (kept once the job
        ended and its tables were forgotten)."""
        found = self.ctx.mode.tables(self.job_id)
        if found is not None:
            self._tables_seen = found
        return self._tables_seen

    def log_records(self, since: int) -> list[dict[str, Any]]:
        """The job's log records with ``seq >= since``, oldest first."""
        return self.journal.log_records(since)

    async def changed(self, version: int, timeout_s: float) -> None:
        """Return once :attr:`version` differs from ``version``, or after ``timeout_s``."""
        deadline = time() + timeout_s
        while self.version == version and (left := deadline - time()) > 0:
            event = self._changed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)

    # ---- control ----------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._main())

    def cancel(self, reason: str) -> bool:
        """Stop the job: agents stop at their next batch, the tracking run ends as killed.
        False (nothing done) once the job is finishing or has ended; idempotent."""
        if self.state not in (JobState.STARTING, JobState.RUNNING):
            return self.state is JobState.CANCELLING
        self._cancel = reason
        self._set_state(JobState.CANCELLING)
        self.log("warning", f"cancelling: {reason}")
        ledger = self.ctx.sharding.jobs.get(self.job_id)
        if ledger is not None:
            ledger.stop(reason)
            self.ctx.sharding.notify(self.job_id)
        self._wake.set()
        return True

    def fail(self, reason: str) -> None:
        """End the job as failed from outside (the cluster restarted): like :meth:`cancel`,
        but the job ends ``failed``."""
        if self.cancel(reason):
            self.error = reason

    async def wait(self) -> None:
        if self._task is not None:
            await asyncio.shield(self._task)

    # ---- the job, top to bottom ---------------------------------------------------------------

    async def _main(self) -> None:
        final = JobState.FAILED
        # The master's heap is left out of the collector's scans while the job runs: a full
        # collection over the scheduler's process (its imports, the cluster's state) holds the
        # event loop that answers every lease and sync group for a third of a second.
        with FROZEN_HEAP:
            try:
                await self._begin()
                finished = False
                while not finished:  # a mode that regroups may lose its final model's holder
                    self._check_cancel()
                    await self._watch()
                    self._check_cancel()
                    finished = await self._finish()
                final = JobState.FINISHED
            except Cancelled as exc:
                await self._abort("KILLED" if self.error is None else "FAILED", str(exc))
                final = JobState.CANCELLED if self.error is None else JobState.FAILED
            except AntdtError as exc:
                await self._failed(str(exc))
            except Exception as exc:  # a bug: the job fails with it, the scheduler goes on
                logger.exception("job %s: the master's control failed", self.job_id)
                await self._failed(f"{type(exc).__name__}: {exc}")
            finally:
                await self._clean_up(final)
                self.ended_at = time()
                self.log("info" if final is JobState.FINISHED else "warning", final.value)
                self._set_state(final)  # last: a follower sees the record complete

    async def _begin(self) -> None:
        plan = self.plan
        if plan.faults and not config.flag("antdt.jobs.allow-faults"):
            raise JobError("the job injects faults, which this cluster does not allow: drop them,"
                           " or set antdt.jobs.allow-faults: true in a test cluster's dask config"
                           " (DASK_ANTDT__JOBS__ALLOW_FAULTS=true)")
        initial = self.placement.initial(await self._free_workers())
        if self.placement.adapted is not None:
            self.log("info", f"adapted: {self.placement.adapted}")
        if not initial:
            raise JobError("the cluster has no workers; expected at least one")
        unknown = sorted(i for i in plan.faults if i >= len(initial))
        if unknown:
            raise JobError(f"faults name worker(s) {unknown}, but the job trains on only "
                           f"{len(initial)} worker(s) (indices 0..{len(initial) - 1})")
        limits = {w: self.ctx.scheduler.workers[w].memory_limit for w in initial}
        if self.ctx.mode.tables_inflight is None:
            plan.check_memory(limits)
        else:
            plan.check_sharded_memory(limits)
            self.log("info", "tables: sharded over the workers (model.tables: "
                             f"{plan.tables and plan.tables.get('placement')})")
        await self.client.run(tasks.prepare_worker, plan.preload, workers=initial)
        self.marks["workers_ready"] = time()
        if plan.sharding == "static" and (plan.checkpoint_dir or plan.resume):
            raise JobError("static sharding (the baseline) cannot be checkpointed or resumed; "
                           "drop train.checkpoint_dir or use the antdt sharding")
        self._enable_controller(len(initial))
        resume: dict[str, Any] | None = None
        if plan.resume is not None:
            resume = await self._resume(plan.resume)
        else:
            await self._register(len(initial))
        self.ctx.mode.start(self.job_id, initial)
        self._read_ledger()
        self.log("info", f"registered: {self.journal.rows['expected']:,} rows over {plan.epochs} "
                         f"epoch(s), {len(initial)} worker(s), sharding {plan.sharding}")
        self._check_cancel()
        self.run = await self._hook("start", self.job_id, len(initial), resume)
        if resume is not None:
            self.metrics.step = int(resume["step"])
        self._check_cancel()
        await self.checkpoints.open(self.journal.rows["trained"], base=plan.resume)
        self._trained_before = self.journal.rows["trained"]
        self.recovery.began(self._trained_before)
        self.started_at = time()
        self.journal.began(self.started_at)
        self._set_state(JobState.RUNNING)
        for worker in initial:
            self._start_agent(worker, restore=plan.resume)

    async def _resume(self, path: str) -> dict[str, Any]:
        """Start from the checkpoint version folder ``path`` (a job resubmitted with
        ``--resume``): its ledger, and the rows the lost job trained past it (its master's
        last progress note) counted as replayed. What the tracking hook gets to reopen the
        run."""
        manifest, lost = await lost_job(path)
        trained = int(lost.get("rows", {}).get("trained", manifest.rows["trained"]))
        replayed = max(0, trained - manifest.rows["trained"])
        self.recovery = Recovery(int(manifest.extra.get("rows_replayed", 0)) + replayed,
                                 int(manifest.extra.get("resumes", 0)) + 1)
        await restore_ledger(self.ctx.sharding, self.job_id, self.plan, manifest)
        self.log("warning", f"resumed from checkpoint {path}: {manifest.rows['done']:,} rows "
                            f"done; {replayed:,} rows the lost job had trained past it are "
                            "trained again")
        return self._resume_info(manifest, max(manifest.step, int(lost.get("step", 0))) + 1)

    def _resume_info(self, manifest: Manifest, step: int) -> dict[str, Any]:
        return {"run": manifest.run, "checkpoint": manifest.path, "step": step,
                "rows_replayed": self.recovery.rows_replayed, "resumes": self.recovery.resumes}

    async def _watch(self) -> None:
        """Until every agent returned or died: collect results, write off agents whose worker
        died, start joiners, read events and actions, buffer metrics; stop at the deadline."""
        while True:
            await self._sleep()
            workers = self.ctx.scheduler.workers
            for slot in self.placement.live:
                await self._check(slot, workers)
            if self._regroup is not None and self._cancel is None and self.stopped is None:
                await self._form_again()
                continue
            self._fence_stopped()
            if self._every_worker_lost():
                await self._restart()
                continue
            if self._cancel is None and self.stopped is None \
                    and self.ctx.mode.accepts_joiners(self.job_id):
                for worker in self.placement.joiners(workers):
                    self._start_agent(worker, join=True)
            self._tick()
            if not self.placement.live:
                break
            deadline = self.plan.deadline_s
            if deadline is not None and self.stopped is None and self._cancel is None \
                    and self.journal.elapsed() > deadline:
                self.stopped = f"the deadline of {deadline:.0f}s of training passed"
                self.log("warning", f"{self.stopped}; stopping the job")
                self.ctx.sharding.jobs[self.job_id].stop(self.stopped)
                self.ctx.sharding.notify(self.job_id)
                await self._cancel_agents()
            if self._cancel is not None and self.placement.live:
                await self._cancel_agents()
        self._tick()  # the agents' last events
        if not any(s.report is not None for s in self.placement.slots):
            rows = self.journal.rows
            raise JobError(f"every agent's worker died ({len(self.placement.slots)} agents); "
                           f"{rows.get('done', 0):,} of {rows.get('expected', 0):,} rows done")

    def _every_worker_lost(self) -> bool:
        """Every agent died before the job's end (none finished), and it was not stopped."""
        return self._cancel is None and self.stopped is None and self.placement.every_lost()

    async def _register(self, workers: int) -> None:
        """Register the job's ledger from the plan (``workers``: the static baseline's slots)."""
        plan = self.plan
        reply = await self.ctx.sharding.register_job(
            job=self.job_id, row_groups=plan.row_groups,
            shard_rows=plan.shard_rows, batch_rows=plan.batch_rows, epochs=plan.epochs,
            seed=plan.seed, quarantine=plan.quarantine,
            static=workers if plan.sharding == "static" else None)
        if reply["status"] != "OK":
            raise JobError(reply["message"])

    def _enable_controller(self, workers: int) -> None:
        """The async mode's controller runs the configured policies when the plan's sharding is
        antdt's; the sync mode's only sizes the ranks' local batches (``adaptive_batch``; their
        sum is ``batch_rows``). Before the ledger is registered or restored; it acts on this
        job's agents only, and hears which its model cannot reach (:class:`JobAgents`)."""
        plan, job, partitioned = self.plan, self.job_id, self.ctx.mode.partitioned
        self.ctx.controller.attach(self.job_id, JobAgents(self.placement.training, self._stop_agent,
                                                          functools.partial(partitioned, job)))
        if plan.mode == "sync":
            self.ctx.controller.enable(self.job_id, plan.adaptive_batch,
                                       [BalanceBatch(plan.batch_rows)],
                                       MonitorSettings.synchronous())
        else:
            self.ctx.controller.enable(self.job_id, plan.sharding == "antdt")

    async def _finish(self) -> bool:
        """The consensus model from a worker whose agent finished (identical on each after the
        final sync round; in the synchronous mode, rank 0 of the current group), evaluated and
        logged by the hooks; another worker if that one dies. A job stopped early is logged
        without a model. False when every worker holding the final model died and the mode
        regroups: the group has formed again from the last checkpoint, and the job trains on."""
        self.marks["training_ended"] = time()
        self._set_state(JobState.FINISHING)
        await self._flush_metrics()
        report = self._report()
        holders = [s.worker for s in self.placement.current
                   if s.finished and s.report is not None and s.report.holds_model] \
            if self.stopped is None else []
        failures = []
        for worker in holders:
            if worker not in self.ctx.scheduler.workers:
                failures.append(f"{worker}: gone")
                continue
            self.log("info", f"finishing: the final model is evaluated and logged on {worker}")
            future = self.client.submit(tasks.finish_task, self.job_id, self.code.hooks,
                                        self.run, report, True, workers=[worker],
                                        allow_other_workers=False, pure=False)
            outcome = await calls.result_on(self.client, self._alive, future, worker,
                                           "finishing the job")
            if outcome is not None:
                self.summary = outcome
                return True
            failures.append(f"{worker}: died while finishing")
            self.log("warning", f"the worker finishing the job ({worker}) died; trying another")
        if holders and self.ctx.mode.regroups and self._cancel is None:
            self._regroup = f"the final model was lost with its worker ({'; '.join(failures)})"
            self._set_state(JobState.RUNNING)
            await self._form_again()
            return False
        if holders:
            raise JobError(f"no worker holding the final model could finish the job: "
                           f"{failures}")
        self.summary = await self._hook_on_any(tasks.finish_task, self.job_id, self.code.hooks,
                                               self.run, report, False)
        return True

    # ---- agents -----------------------------------------------------------------------------

    def _tasks_on(self, worker: str) -> int:
        state = self.ctx.scheduler.workers.get(worker)
        return 0 if state is None else len(state.processing)

    def _start_agent(self, worker: str, join: bool = False,
                     restore: str | None = None) -> None:
        index = self.placement.add(worker, join).index
        faults = Faults(**self.plan.faults[index]) if index in self.plan.faults and not join \
            else Faults()
        spec = AgentSpec(job=self.job_id, batch_rows=self.plan.batch_rows, mode=self.plan.mode,
                         sync_period=self._period, join=join, threads=self.plan.threads,
                         faults=faults, model_dir=self.checkpoints.model_dir,
                         tables_inflight=self.ctx.mode.tables_inflight)
        self._agents[index] = self.client.submit(
            tasks.agent_task, spec, self.code.trainer, self.code.reader, restore,
            workers=[worker], allow_other_workers=False, pure=False,
            key=f"antdt-agent-{self.job_id}-{index}")
        self.log("info", f"agent {index} started on {worker}" + " (joining)" * join
                 + f" with faults {faults}" * faults.active)

    async def _sleep(self) -> None:
        """Until an agent returns, something wakes the runner (a cancellation), or a tick
        passed. The agents' futures are polled (every :data:`~antdt.jobs.calls.POLL_S`), not
        awaited: awaiting fetches a result, and a fetch abandoned half-way can cancel another
        one of the same client."""
        await calls.until(lambda: self._wake.is_set()
                          or any(self._agents[s.index].done() for s in self.placement.live),
                          self._tick_s)
        self._wake.clear()

    async def _check(self, slot: Slot, workers: Mapping[str, Any]) -> None:
        """Record a returned agent; write off one whose worker left the cluster; fail the job
        with the error of one that failed on a live worker (a bug or bad data, not a death)."""
        future = self._agents[slot.index]
        status = future.status
        current = slot.generation == self.placement.generation
        if status == "finished":
            report: AgentReport = await future
            self.placement.returned(slot, report)
            if current:
                self.recovery.reported(report.group_rows)
            if report.outcome == "declined":
                self.log("info", f"agent {slot.index} on {slot.worker} declined: the job's sync "
                                 "was over")
            else:
                self.log("info", f"agent {slot.index} on {slot.worker} {report.outcome}: "
                                 f"{slot.rows:,} rows in {report.batches} batches")
            return
        gone = slot.worker not in workers
        regroups = self.ctx.mode.regroups
        if status == "error":
            error = await future.exception()
            if gone or isinstance(error, KilledWorker) or slot.stopped is not None:
                why = "its worker died" if slot.stopped is None else "stopped by the controller"
                self._write_off(slot, f"{why} ({error!r})")  # a stopped one may be fenced
                return
            if regroups and isinstance(error, GroupBroken):
                if current:
                    self.recovery.reported(error.group_rows)
                self._write_off(slot, str(error))
                return
            raise JobError(f"the agent on {slot.worker} failed: {error!r}")
        if status in ("cancelled", "lost") or gone:
            self._write_off(slot, "its worker left the cluster")

    def _write_off(self, slot: Slot, why: str) -> None:
        if self.ctx.mode.regroups and self._regroup is None:
            self._regroup = f"agent {slot.index} on {slot.worker} is gone: {why}"
        self.placement.write_off(slot)
        self._agents[slot.index].release()
        self.journal.lost(slot.worker)
        self.log("warning", f"agent {slot.index} on {slot.worker} is gone: {why}; the ledger "
                            "re-queued its unsynced rows")

    def _stop_agent(self, worker: str, reason: str) -> None:
        """The controller would retire ``worker``, but another job trains there: cancel this
        job's agent on it instead (it gives its leases back and leaves the model's sync as it
        returns; :meth:`_fence_stopped` if it is stuck) and leave the worker up."""
        for slot in self.placement.stop(worker):
            self.log("warning", f"agent {slot.index} on {worker} stopped: {reason}")
            task = asyncio.ensure_future(self.client.run(cancel_here, self.job_id,
                                                         workers=[worker], on_error="ignore"))
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)

    def _fence_stopped(self) -> None:
        """Stopped agents still running (:meth:`Placement.overdue`) are fenced: their leases
        requeued from their synced offsets, they leave the model's sync, as if gone."""
        for slot in self.placement.overdue():
            requeued = self.ctx.sharding.jobs[self.job_id].remove_worker(slot.worker)
            self.ctx.sharding.notify(self.job_id)
            if isinstance(sync := self.ctx.scheduler.plugins.get(SYNC), SyncService):
                sync.leave(self.job_id, slot.worker)
            self.log("warning", f"agent {slot.index} stuck: fenced, {requeued:,} rows requeued")

    async def _cancel_agents(self) -> None:
        with contextlib.suppress(OSError):
            await self.client.run(cancel_here, self.job_id, on_error="ignore")

    # ---- events, metrics, the report --------------------------------------------------------

    def _tick(self) -> None:
        """Counters from the ledger, the controller's new actions, the agents' events; one step
        of metrics for the tracking run (sent every ``antdt.jobs.metrics-interval``)."""
        self._read_ledger()
        control = self.ctx.controller.jobs.get(self.job_id)
        counts = {} if control is None else self.journal.read_controller(
            control.controller.actions, control.monitor.summary()["workers"])
        metrics = self.journal.read_events(self.placement.slots, counts)
        if self.state is JobState.RUNNING or self.state is JobState.CANCELLING:
            self.metrics.add(metrics)
        self.metrics.tick(self.run)
        self._checkpoint()
        self._bump()

    def _checkpoint(self) -> None:
        """Note the job's progress; take a checkpoint when one is due, from a live agent that
        has trained (see :mod:`antdt.jobs.keeper`)."""
        if not self.checkpoints.enabled:
            return
        self.checkpoints.note(self._progress())
        ledger = self.ctx.sharding.jobs.get(self.job_id)
        if self.state is not JobState.RUNNING or self.stopped is not None or ledger is None:
            return
        rows = ledger.summary()
        rate = sum(s.rate for s in self.placement.slots if s.live)
        if not self.checkpoints.due(rows["rows_trained"], rate, self._tick_s):
            return
        if rows["rows_done"] + rows["rows_quarantined"] >= rows["rows_expected"]:
            return  # nothing left to train: the job's end comes first
        writer = next((s.worker for s in self.placement.slots if s.live and s.rows > 0
                       and s.worker in self.ctx.scheduler.workers), None)
        if writer is None:
            return
        self.checkpoints.take(writer, int(rows["rows_trained"]), self.metrics.step, self.run,
                              {"rows_replayed": self.recovery.rows_replayed,
                               "resumes": self.recovery.resumes})

    def _progress(self, state: JobState | None = None) -> dict[str, Any]:
        """What ``progress.json`` says of the job (see :mod:`antdt.jobs.keeper`)."""
        return {"job_id": self.job_id, "state": (state or self.state).value, "time": time(),
                "step": self.metrics.step, "error": self.error, "run": self.run,
                "checkpoint": self.checkpoints.last_path,
                "rows": {k: self.journal.rows.get(k) for k in ("done", "trained", "retrained",
                                                        "expected")}}

    async def _write_model(self, worker: str, path: str) -> dict[str, Any] | None:
        future = self.client.submit(tasks.checkpoint_task, self.job_id, path, workers=[worker],
                                    allow_other_workers=False, pure=False)
        result: dict[str, Any] | None = await calls.result_on(
            self.client, self._alive, future, worker, "writing a checkpoint")
        return result

    def _read_ledger(self) -> None:
        ledger = self.ctx.sharding.jobs.get(self.job_id)
        if ledger is None:
            return
        self.journal.read_ledger(ledger.summary())

    def _send_metrics(self, run: Mapping[str, Any], steps: list[Step],
                      worker: str | None) -> Future:
        return self.client.submit(tasks.hook_task, self.code.hooks, "metrics", run, steps,
                                  pure=False, workers=None if worker is None else [worker])

    def _alive(self, worker: str) -> bool:
        return worker in self.ctx.scheduler.workers

    async def _flush_metrics(self) -> None:
        """Send the buffered metrics after the one on its way and wait (a minute at most each)
        until they arrived: the run's history is complete before it is closed."""
        await self._metrics_arrived()
        self.metrics.send(self.run)
        await self._metrics_arrived()

    async def _metrics_arrived(self) -> None:
        await calls.until(self.metrics.settled, 60.0)
        self.metrics.check()

    def _report(self) -> dict[str, Any]:
        """The master's account of the job, for ``hooks.finish``: its counters (and the rows
        trained while this master trained, ``rows_trained_here``: a resumed job's ledger
        starts with its checkpoint's), timings, agents, controller actions, lease spans
        (seconds since training started) and ``saved_model``, the final model's files when its
        ranks wrote it in parts (``{"folder": ..., "files": {name: size and sha256}}``)."""
        self._read_ledger()
        saved = next((s.report.saved_model for s in self.placement.current
                      if s.report is not None and s.report.saved_model is not None), None)
        return {"job_id": self.job_id, "name": self.plan.name,
                **self.journal.report(self.placement.slots),
                "rows_trained_here": self.journal.rows["trained"] - self._trained_before,
                "wall_s": time() - self.submitted_at, "stopped": self.stopped,
                "sharding": self.plan.sharding, "rows_replayed": self.recovery.rows_replayed,
                "resumes": self.recovery.resumes, "checkpoints": self.checkpoints.summary(),
                "adapted": self.placement.adapted,
                "refused": fencing.refused(self.ctx.scheduler, self.job_id, self.ctx.mode),
                "saved_model": None if saved is None else {"folder": saved.folder,
                                                           "files": dict(saved.files)}}

    # ---- tasks on workers -------------------------------------------------------------------

    async def _hook(self, method: str, *args: Any) -> Any:
        """``hooks.<method>(*args)`` in a task on any worker (Dask retries it elsewhere if its
        worker dies)."""
        return await self._hook_on_any(tasks.hook_task, self.code.hooks, method, *args)

    async def _hook_on_any(self, function: Callable[..., Any], *args: Any) -> Any:
        """``function(*args)`` on any worker; the metrics tasks follow the worker it ran on."""
        result, holder = await calls.on_any_worker(self.client, self.ctx.scheduler, function,
                                                   *args)
        if holder is not None:
            self.metrics.hooks_on = holder
        return result

    async def _abort(self, status: str, reason: str) -> None:
        """Close the tracking run (if it was opened) as ``status``, after the metrics sent to
        it so far (a metrics task must not reach a closed run); an error doing so is logged,
        never hides the job's own outcome."""
        if self.run is None:
            return
        if not self.ctx.scheduler.workers:
            self.log("warning", f"the tracking run stays open: no worker left to close it as "
                                f"{status}")
            return
        try:
            await self._flush_metrics()
            await self._hook("abort", self.run, status, reason)
        except (AntdtError, OSError) as exc:
            self.log("error", f"could not close the tracking run as {status}: {exc}")

    async def _failed(self, message: str) -> None:
        self.error = message
        self.log("error", f"failed: {message}")
        await self._abort("FAILED", message)

    async def _clean_up(self, final: JobState) -> None:
        """Stop what still runs, keep the last counters, forget the job in the services and
        on the workers (other jobs are left alone)."""
        ledger = self.ctx.sharding.jobs.get(self.job_id)
        if ledger is not None and final is not JobState.FINISHED:
            ledger.stop(self.error or self._cancel or "the job ended")
            self.ctx.sharding.notify(self.job_id)
        if self.placement.live:
            await self._cancel_agents()
        self._read_ledger()
        for future in self._agents.values():
            future.release()
        with contextlib.suppress(OSError):
            await self.client.run(forget_here, self.job_id, on_error="ignore")
        self.ctx.forget(self.job_id)
        await self.checkpoints.close(self._progress(final))

    # ---- helpers ------------------------------------------------------------------------------

    def _check_cancel(self) -> None:
        if self._cancel is not None:
            raise Cancelled(self._cancel)

    def _set_state(self, state: JobState) -> None:
        self.state = state
        self._bump()

    def _bump(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()
