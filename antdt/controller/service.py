"""The controller on the Dask scheduler: :class:`ControllerService` runs a monitor and a controller
per job of the sharding service, ticks them, carries out retirements, and publishes every applied
action as a Dask event (topic :data:`EVENT_TOPIC`).

Jobs share a cluster: a job's controller acts on its own agents only. Its ``min_workers`` budget
counts the job's own workers (those its master says its agents train on: :class:`JobAgents`),
and a worker another job also trains on is never closed: retiring it becomes stopping this job's
agent there (:attr:`JobAgents.stop`), and the worker stays for the others."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distributed import Client, Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time
from distributed.utils import log_errors
from tornado.ioloop import PeriodicCallback

from antdt import config, rpc
from antdt.controller.actions import ActionRecord
from antdt.controller.mechanism import Controller
from antdt.controller.policies import ControllerPolicy
from antdt.errors import ConfigError, LedgerError
from antdt.monitor import Monitor, MonitorSettings
from antdt.sharding import CommitEvent, ShardLedger, service

logger = logging.getLogger(__name__)

PLUGIN_NAME = "antdt-controller"
"""``scheduler.plugins[PLUGIN_NAME]``."""
EVENT_TOPIC = "antdt"
"""Dask event topic of applied actions (``client.get_events(EVENT_TOPIC)``)."""


@dataclass(frozen=True)
class JobAgents:
    """What a job's master tells the controller of its agents (:meth:`ControllerService.attach`):
    ``workers()``, the workers its agents train on now (or are about to),
    ``stop(worker, reason)``, which stops its agent on ``worker`` and deals that agent's rows to
    the others (its leases back to the queue, as for a hung agent), leaving the worker up, and
    ``partitioned()``, the workers its model sync cannot reach, with why (each tick hands them
    to the job's monitor: :meth:`~antdt.monitor.Monitor.partitions`)."""

    workers: Callable[[], Collection[str]]
    stop: Callable[[str, str], None]
    partitioned: Callable[[], Mapping[str, str]] = dict


@dataclass
class _JobControl:
    ledger: ShardLedger
    monitor: Monitor
    controller: Controller


class ControllerService(SchedulerPlugin):
    """Runs a :class:`Monitor` and a :class:`Controller` per job of the
    :class:`~antdt.sharding.service.ShardingService` (register that plugin first).

    The monitors are fed by the service's commit events; every ``antdt.controller.interval``
    each enabled job's controller ticks. A job's controller counts and acts on its own workers:
    those of its :class:`JobAgents` (:meth:`attach`; a job no master attached counts every worker
    of the cluster). Retirements never leave the job fewer than ``min_workers`` of them, and go
    through ``scheduler.retire_workers`` only where no other job trains (another job's
    :class:`JobAgents`, or a job's live leases): on a shared worker the job stops its own agent
    instead (:attr:`JobAgents.stop`) and the worker stays. Handlers:

    ``antdt_controller_actions(job, since=0)``  applied actions: count, counts, records, batch sizes
    ``antdt_controller_enable(job, enabled)``   switch one job's controller (before or after it is
                                                registered); its monitor keeps running
    ``antdt_controller_tick(job=None)``         tick now (one job or all enabled jobs)
    ``antdt_worker_health(job)``                the monitor's verdicts and medians

    The job master reads the controllers in place (it runs in this process); the handlers but
    ``antdt_controller_enable`` serve an operator's or a test's look and nudge.
    """

    name = PLUGIN_NAME

    def __init__(self, *, interval_s: float | None = None, min_workers: int | None = None
                 ) -> None:
        self.interval_s = interval_s
        self.min_workers = min_workers
        self.jobs: dict[str, _JobControl] = {}
        self._enabled: dict[str, bool] = {}
        """Per-job switch; jobs not named follow ``antdt.controller.enabled``."""
        self._policies: dict[str, list[ControllerPolicy]] = {}
        """Per-job policies; jobs not named run ``antdt.controller.policies``."""
        self._monitors: dict[str, MonitorSettings] = {}
        """Per-job monitor settings; jobs not named follow ``antdt.monitor``."""
        self.scheduler: Scheduler | None = None
        self._sharding: service.ShardingService | None = None
        self._retiring: set[str] = set()
        self._agents: dict[str, JobAgents] = {}
        """Per job, what its master said of its agents (:meth:`attach`)."""
        self._stopped: dict[str, set[str]] = {}
        """Per job, the shared workers its agent was stopped on (no longer its own)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, scheduler: Scheduler) -> None:
        sharding = scheduler.plugins.get(service.PLUGIN_NAME)
        if not isinstance(sharding, service.ShardingService):
            raise ConfigError(f"ControllerService needs the ShardingService: register it first "
                              f"(found plugins {sorted(scheduler.plugins)})")
        self.scheduler = scheduler
        self._sharding = sharding
        sharding.subscribe(self._observe)
        scheduler.handlers.update({
            "antdt_controller_actions": self.actions_handler,
            "antdt_controller_enable": self.enable_handler,
            "antdt_controller_tick": self.tick_handler,
            "antdt_worker_health": self.health_handler,
        })
        interval = config.seconds("antdt.controller.interval") if self.interval_s is None \
            else self.interval_s
        callback = PeriodicCallback(self._tick_enabled, interval * 1000.0)
        scheduler.periodic_callbacks[PLUGIN_NAME] = callback
        callback.start()

    async def close(self) -> None:
        if self.scheduler is not None:
            callback = self.scheduler.periodic_callbacks.pop(PLUGIN_NAME, None)
            if callback is not None:
                callback.stop()

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        self._retiring.discard(worker)
        for stopped in self._stopped.values():
            stopped.discard(worker)
        for control in self.jobs.values():
            control.monitor.forget(worker)

    def restart(self, scheduler: Scheduler) -> None:
        """Every agent is gone: start every job's monitoring afresh."""
        self.jobs.clear()
        self._stopped.clear()

    def attach(self, job: str, agents: JobAgents) -> None:
        """``job``'s master says where its agents train and how to stop one (see
        :class:`JobAgents`); kept until :meth:`forget`."""
        self._agents[job] = agents
        self._stopped.pop(job, None)

    def own_workers(self, job: str) -> list[str]:
        """The live workers ``job``'s controller counts toward ``min_workers`` and may act on:
        its agents' (every worker of the cluster for a job no master attached), less those being
        retired and those its agent was stopped on."""
        assert self.scheduler is not None
        live = self.scheduler.workers
        agents = self._agents.get(job)
        stopped = self._stopped.get(job, set())
        found = live if agents is None else agents.workers()
        return [w for w in found if w in live and w not in self._retiring and w not in stopped]

    def users(self, worker: str, but: str) -> list[str]:
        """The jobs other than ``but`` that train on ``worker``: their masters' agents there
        (:class:`JobAgents`), or their live leases there."""
        assert self._sharding is not None
        found = []
        for job in sorted(set(self._sharding.jobs) | set(self._agents)):
            if job == but:
                continue
            agents = self._agents.get(job)
            ledger = self._sharding.jobs.get(job)
            if (agents is not None and worker in agents.workers()) or (
                    ledger is not None and worker in ledger.workers()):
                found.append(job)
        return found

    def enable(self, job: str, on: bool = True,
               policies: Sequence[ControllerPolicy] | None = None,
               monitor: MonitorSettings | None = None) -> None:
        """Switch ``job``'s controller on or off (before or after the job is registered); its
        monitor keeps running either way. ``policies`` and ``monitor``: the job's own (default:
        ``antdt.controller.policies``, ``antdt.monitor``), from its controller's next forming on
        (the job registered or restored after this call)."""
        self._enabled[job] = on
        if policies is not None:
            self._policies[job] = list(policies)
        if monitor is not None:
            self._monitors[job] = monitor
        if policies is not None or monitor is not None:
            self.jobs.pop(job, None)  # formed again with them on its next use

    def forget(self, job: str) -> None:
        """Drop ``job``'s switch: a job registered again under its name follows
        ``antdt.controller.enabled`` until it is switched."""
        self._enabled.pop(job, None)
        self._policies.pop(job, None)
        self._monitors.pop(job, None)
        self._agents.pop(job, None)
        self._stopped.pop(job, None)

    def tick(self, job: str | None = None) -> list[ActionRecord]:
        """Tick ``job`` (even if disabled), or every enabled job (a disabled one only updates its
        monitor); returns the applied actions."""
        assert self._sharding is not None
        for gone in set(self.jobs) - set(self._sharding.jobs):
            del self.jobs[gone]
        applied: list[ActionRecord] = []
        for name in ([job] if job is not None else list(self._sharding.jobs)):
            control = self._control(name)
            if control is None:
                continue
            agents = self._agents.get(name)
            if agents is not None:
                control.monitor.partitions(agents.partitioned())
            if job is None and not self._is_enabled(name):
                control.controller.update_monitor()
            else:
                applied.extend(control.controller.tick())
        return applied

    # ---- handlers -----------------------------------------------------------------------------

    @rpc.handler
    async def actions_handler(self, job: str, since: int = 0) -> dict[str, Any]:
        since = rpc.integer("since", since)
        control = self._known(job)
        return {"status": "OK", "job": job, "enabled": self._is_enabled(job),
                **control.controller.actions(since)}

    @rpc.handler
    async def enable_handler(self, job: str, enabled: bool = True) -> dict[str, Any]:
        job = rpc.name("job", job)
        if not isinstance(enabled, bool):
            raise LedgerError(f"enabled must be a bool, found {enabled!r}")
        self.enable(job, enabled)
        logger.info("job %s: controller %s", job, "enabled" if enabled else "disabled")
        return {"status": "OK", "job": job, "enabled": enabled}

    @rpc.handler
    async def tick_handler(self, job: str | None = None) -> dict[str, Any]:
        if job is not None:
            self._known(job)
        return {"status": "OK", "applied": self.tick(job)}

    @rpc.handler
    async def health_handler(self, job: str) -> dict[str, Any]:
        return {"status": "OK", "job": job, **self._known(job).monitor.summary()}

    # ---- internals ----------------------------------------------------------------------------

    @log_errors
    def _tick_enabled(self) -> None:
        self.tick()

    def _is_enabled(self, job: str) -> bool:
        default = config.get("antdt.controller.enabled")
        return self._enabled.get(job, bool(default))

    def _known(self, job: object) -> _JobControl:
        name = rpc.name("job", job)
        control = self._control(name)
        if control is None:
            raise LedgerError(f"unknown job {name!r}; registered jobs: "
                              f"{sorted(self._sharding.jobs if self._sharding else ())[:20]}")
        return control

    def _control(self, job: str) -> _JobControl | None:
        """The job's monitor and controller, made on first use (again if the job was forgotten
        and registered anew)."""
        assert self._sharding is not None and self.scheduler is not None
        ledger = self._sharding.jobs.get(job)
        if ledger is None:
            return None
        control = self.jobs.get(job)
        if control is None or control.ledger is not ledger:
            monitor = Monitor(time, batch_rows=ledger.batch_rows,
                              settings=self._monitors.get(job))
            controller = Controller(ledger, monitor, clock=time,
                                    retire=functools.partial(self._retire, job),
                                    policies=self._policies.get(job),
                                    workers=functools.partial(self.own_workers, job),
                                    min_workers=self.min_workers, emit=self._emit,
                                    unheard=self._unheard)
            control = self.jobs[job] = _JobControl(ledger, monitor, controller)
        return control

    def _observe(self, job: str, event: CommitEvent) -> None:
        control = self._control(job)
        if control is not None:
            control.monitor.observe(event)

    def _unheard(self, worker: str) -> float:
        """Seconds since the scheduler last heard from ``worker`` (a heartbeat; inf: gone)."""
        assert self.scheduler is not None
        state = self.scheduler.workers.get(worker)
        return math.inf if state is None else max(0.0, time() - state.last_seen)

    def _emit(self, record: ActionRecord) -> None:
        assert self.scheduler is not None
        self.scheduler.log_event(EVENT_TOPIC, dict(record))

    def _retire(self, job: str, worker: str, stimulus_id: str) -> str | None:
        """Retire ``worker`` for ``job``: close it, unless another job trains there; then stop
        ``job``'s agent on it (its master's :attr:`JobAgents.stop`, or for a job no master
        attached, its leases there requeued) and keep the worker. Returns what was done instead
        of closing the worker (None: it is being retired)."""
        assert self.scheduler is not None and self._sharding is not None
        others = self.users(worker, but=job)
        if others:
            self._stopped.setdefault(job, set()).add(worker)
            control = self.jobs.get(job)
            if control is not None:
                control.monitor.forget(worker)
            note = (f"{worker} also trains job(s) {', '.join(others[:5])}: stopped this job's "
                    f"agent there, the worker stays")
            agents = self._agents.get(job)
            if agents is not None:
                agents.stop(worker, note)
            else:
                ledger = self._sharding.jobs.get(job)
                if ledger is not None and ledger.remove_worker(worker):
                    self._sharding.notify(job)
            logger.warning("job %s: not closing %s [%s]: %s", job, worker, stimulus_id, note)
            return note
        self._retiring.add(worker)
        task = asyncio.ensure_future(self.scheduler.retire_workers(
            workers=[worker], close_workers=True, remove=True, stimulus_id=stimulus_id))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._retired(worker, done))
        return None

    def _retired(self, worker: str, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            self._retiring.discard(worker)
            return
        error = task.exception()
        if error is not None:
            self._retiring.discard(worker)
            logger.error("retiring %s failed: %r", worker, error)
        elif worker not in task.result():
            self._retiring.discard(worker)
            logger.warning("the scheduler did not retire %s", worker)


# ---- driver helpers ---------------------------------------------------------------------------


def enable_controller(client: Client, job: str, enabled: bool = True) -> dict[str, Any]:
    """From the driver: switch ``job``'s controller on or off (e.g. off for a ``pull`` run)."""
    return rpc.ok(client.sync(client.scheduler.antdt_controller_enable, job=job,
                              enabled=enabled))
