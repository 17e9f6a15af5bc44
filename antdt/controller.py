"""The straggler controller (AntDT's Controller): a mechanism plus small policies, in the manner of
:mod:`distributed.active_memory_manager`.

```
 every tick:  Monitor.update ──► Tick (ledger, verdicts, leases) ──► policy.run(tick) yields actions
                                                                            │
    ledger.revoke / ledger.split / retire(worker) / batch size  ◄── resolve conflicts, apply
                                                                            │
                                    log + Dask event (topic "antdt") + record (count, records)
```

Actions are typed (:class:`Reassign`, :class:`Split`, :class:`Revoke`, :class:`Retire`,
:class:`AdjustBatch`), each with its :class:`Evidence`. The mechanism resolves conflicts before
applying anything:

* one action per lease per tick; the strongest wins (``Revoke`` > ``Reassign`` > ``Split``, then
  the first yielded), so a lease being revoked is never split;
* no lease action for a worker retired in the same tick (retirement requeues its rows anyway);
* retirement never leaves fewer than ``min_workers`` workers (``workers()`` must not count the
  workers whose retirement is under way);
* an action with nothing to move (the lease ended, was revoked, or has no unclaimed rows) is
  dropped, not recorded.

Only unclaimed rows move (the ledger's exactly-once rule), so every action is safe to apply at any
time. Built-in policies (the defaults under ``antdt.controller.policies``, in this order):
:class:`RevokeHung`, :class:`RetireHung`, :class:`ReassignStragglers`, :class:`SplitTail`.
Opt-in: :class:`RetirePersistent` (in the asynchronous mode retiring a persistent straggler only
gives up its share unless a cluster manager replaces it) and :class:`BalanceBatch` (synchronous
mode). A user policy is a :class:`ControllerPolicy` subclass named by dotted path in dask
config::

    antdt:
      controller:
        policies:
          - class: mypackage.policies.MyPolicy
            threshold: 3

:class:`Controller` is a plain class (injected clock, no Dask) driven by the simulator and the
tests; :class:`ControllerPlugin` runs one per job on the scheduler, next to the
:class:`~antdt.service.ShardingService`.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import logging
import math
from collections import Counter, deque
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeAlias, TypedDict

from distributed import Client, Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time
from distributed.utils import log_errors
from tornado.ioloop import PeriodicCallback

from antdt import config, service
from antdt.errors import ConfigError, LedgerError
from antdt.monitor import Health, Monitor, WorkerState
from antdt.sharding import Clock, CommitEvent, JobState, LeaseStatus, ShardLedger

logger = logging.getLogger(__name__)

PLUGIN_NAME = "antdt-controller"
"""``scheduler.plugins[PLUGIN_NAME]``."""
EVENT_TOPIC = "antdt"
"""Dask event topic of applied actions (``client.get_events(EVENT_TOPIC)``)."""


# ---- actions ----------------------------------------------------------------------------------


class Evidence(NamedTuple):
    """Why a policy proposed an action: its reason in words and the monitor's numbers."""

    reason: str
    bpt: float | None = None
    median: float | None = None
    window: int | None = None
    silent_s: float | None = None

    @classmethod
    def of(cls, health: Health | None, reason: str) -> Evidence:
        if health is None:
            return cls(reason)
        return cls(reason, health.bpt, health.median, health.window, health.silent_s)


class Reassign(NamedTuple):
    """Move a straggler's unclaimed rows to the queue front, for faster workers to pull."""

    lease: LeaseStatus
    evidence: Evidence


class Split(NamedTuple):
    """Cut a lease's rows into ``parts``; the holder keeps the first, the rest are queued."""

    lease: LeaseStatus
    parts: int
    evidence: Evidence


class Revoke(NamedTuple):
    """Take a (hung) lease's unclaimed rows back to the queue front."""

    lease: LeaseStatus
    evidence: Evidence


class Retire(NamedTuple):
    """Retire the worker (its leases' rows are queued again when it leaves)."""

    worker: str
    evidence: Evidence


class AdjustBatch(NamedTuple):
    """Set the worker's batch size (synchronous mode)."""

    worker: str
    size: int
    evidence: Evidence


Action: TypeAlias = Reassign | Split | Revoke | Retire | AdjustBatch
LeaseAction: TypeAlias = Reassign | Split | Revoke

ACTION_NAMES: dict[type, str] = {Reassign: "reassign", Split: "split", Revoke: "revoke",
                                 Retire: "retire", AdjustBatch: "adjust_batch"}
_STRENGTH: dict[type, int] = {Revoke: 3, Reassign: 2, Split: 1}


class ActionRecord(TypedDict):
    """An applied action as logged, emitted and kept (plain, msgpack-able). ``rows``: rows moved
    to the queue (lease actions); ``seq``: its index among the job's applied actions."""

    seq: int
    tick: int
    time: float
    job: str
    stimulus_id: str
    action: str
    policy: str
    worker: str
    lease_id: int | None
    parts: int | None
    size: int | None
    rows: int | None
    reason: str
    bpt: float | None
    median: float | None
    window: int | None
    silent_s: float | None


# ---- what a policy sees -----------------------------------------------------------------------


class Tick:
    """The state one tick's policies see: ``ledger``, ``monitor`` (updated for this tick),
    ``flagged`` (verdicts other than ok, worst first), ``workers`` (the cluster's workers that
    count toward ``min_workers``) and the live leases (read once per tick, lazily)."""

    def __init__(self, number: int, now: float, ledger: ShardLedger, monitor: Monitor,
                 workers: Collection[str], batch_sizes: dict[str, int]) -> None:
        self.number = number
        self.now = now
        self.ledger = ledger
        self.monitor = monitor
        self.workers = workers
        self.batch_sizes = batch_sizes
        self.flagged = monitor.flagged()
        self._leases: list[LeaseStatus] | None = None

    @property
    def tail(self) -> bool:
        """Nothing is left to lease but rows are still leased: idle workers wait for the last
        leases to finish."""
        return self.ledger.rows_todo == 0 and self.ledger.rows_leased > 0

    def leases(self, worker: str | None = None) -> list[LeaseStatus]:
        """Live leases, of ``worker`` only if given."""
        if worker is not None:
            return self.ledger.leases(worker)
        if self._leases is None:
            self._leases = self.ledger.leases()
        return self._leases

    def rate(self, worker: str) -> float | None:
        """The worker's rows/s, the cluster median for a worker with no evidence yet."""
        rate = self.monitor.rate(worker)
        return rate if rate is not None else self.monitor.median_rate


class ControllerPolicy(abc.ABC):
    """A policy: :meth:`run` looks at a :class:`Tick` and yields actions. It must not change
    the ledger itself; the controller resolves conflicts and applies what it accepts."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abc.abstractmethod
    def run(self, tick: Tick) -> Iterator[Action]:
        """Yield the actions this policy wants now (possibly none)."""


def _unclaimed(lease: LeaseStatus) -> int:
    return lease.stop - lease.claim_stop


class RevokeHung(ControllerPolicy):
    """Revoke every lease of a hung worker: its unclaimed rows go to faster workers now; its claim
    stays (exactly-once) until it commits or leaves."""

    def run(self, tick: Tick) -> Iterator[Action]:
        for health in tick.flagged:
            if health.state is not WorkerState.HUNG:
                continue
            for lease in tick.leases(health.worker):
                if not lease.revoked and _unclaimed(lease) > 0:
                    yield Revoke(lease, Evidence.of(health, (
                        f"hung: no commit for {health.silent_s:.1f}s, timeout "
                        f"{health.timeout_s:.1f}s")))


@dataclass(repr=False)
class RetireHung(ControllerPolicy):
    """Retire a worker hung for ``after_s`` seconds, or hung in the tail of the job: only its
    leaving frees its claimed rows, and in the tail every idle worker waits for them."""

    after_s: float = 30.0

    def run(self, tick: Tick) -> Iterator[Action]:
        for health in tick.flagged:
            if health.state is WorkerState.HUNG and (health.silent_s >= self.after_s
                                                     or tick.tail):
                when = "in the tail" if health.silent_s < self.after_s else \
                    f"for more than {self.after_s:g}s"
                yield Retire(health.worker, Evidence.of(health, (
                    f"hung {when}: no commit for {health.silent_s:.1f}s")))


@dataclass(repr=False)
class ReassignStragglers(ControllerPolicy):
    """Reassign the unclaimed rows of a transient or persistent straggler's leases (at least
    ``min_batches`` batches) to the queue front: a faster worker pulls them at once, the
    straggler finishes its claim and leases again."""

    min_batches: int = 1

    def run(self, tick: Tick) -> Iterator[Action]:
        least = self.min_batches * tick.ledger.batch_rows
        for health in tick.flagged:
            if health.state not in (WorkerState.TRANSIENT, WorkerState.PERSISTENT):
                continue
            for lease in tick.leases(health.worker):
                if not lease.revoked and _unclaimed(lease) >= least:
                    yield Reassign(lease, Evidence.of(health, (
                        f"{health.state.value} straggler: BPT {health.bpt:.3g}s vs median "
                        f"{health.median:.3g}s")))


@dataclass(repr=False)
class SplitTail(ControllerPolicy):
    """In the tail of the job, split every lease that would finish late so the last leases end
    together.

    The cluster would finish the leased rows in ``target = max(min_piece_s, rows left / sum of
    the workers' rates)`` seconds if they could be shared perfectly; a lease whose holder needs
    ``t > slack x target`` for its rows left is split into ``ceil(t / target)`` parts (at most
    ``max_parts``; the ledger keeps the holder's claim and whole batches)."""

    max_parts: int = 8
    min_piece_s: float = 2.0
    slack: float = 1.5

    def run(self, tick: Tick) -> Iterator[Action]:
        if not tick.tail or tick.monitor.median_rate is None:
            return
        leases = tick.leases()
        capacity = sum(rate for w in tick.workers if (rate := tick.rate(w)) is not None)
        left = sum(lease.stop - lease.offset for lease in leases)
        if capacity <= 0 or left <= 0:
            return
        target = max(self.min_piece_s, left / capacity)
        least = 2 * tick.ledger.batch_rows
        for lease in leases:
            if lease.revoked or _unclaimed(lease) < least:
                continue
            rate = tick.rate(lease.worker)
            assert rate is not None  # the median exists
            needs = (lease.stop - lease.offset) / rate
            if needs > self.slack * target:
                parts = min(self.max_parts, math.ceil(needs / target))
                yield Split(lease, parts, Evidence.of(tick.monitor.health(lease.worker), (
                    f"tail: {needs:.1f}s left at {rate:.4g} rows/s, target {target:.1f}s")))


@dataclass(repr=False)
class RetirePersistent(ControllerPolicy):
    """Retire persistent stragglers, slowest first, at most ``max_fraction`` of the workers per
    tick; the cluster manager (or an adaptive deployment) brings fresh workers."""

    max_fraction: float = 0.05

    def run(self, tick: Tick) -> Iterator[Action]:
        budget = max(1, int(self.max_fraction * len(tick.workers)))
        for health in tick.flagged:
            if budget == 0:
                return
            if health.state is WorkerState.PERSISTENT:
                budget -= 1
                yield Retire(health.worker, Evidence.of(health, (
                    f"persistent straggler: slow for {health.streak} windows, BPT "
                    f"{health.bpt:.3g}s vs median {health.median:.3g}s")))


@dataclass(repr=False)
class BalanceBatch(ControllerPolicy):
    """Synchronous mode: per-worker batch sizes proportional to the workers' rates, summing to
    ``global_batch`` (so every worker takes about as long per step); a size changes only when it
    moves by more than ``tolerance`` (relative)."""

    global_batch: int
    tolerance: float = 0.1

    def run(self, tick: Tick) -> Iterator[Action]:
        workers = sorted(tick.workers)
        rates = [tick.rate(w) for w in workers]
        if not workers or any(rate is None for rate in rates):
            return
        total = sum(rate for rate in rates if rate is not None)
        even = self.global_batch / len(workers)
        for worker, rate in zip(workers, rates):
            assert rate is not None
            size = max(1, round(self.global_batch * rate / total))
            current = tick.batch_sizes.get(worker, even)
            if abs(size - current) > self.tolerance * current:
                yield AdjustBatch(worker, size, Evidence.of(tick.monitor.health(worker), (
                    f"rate {rate:.4g} rows/s of {total:.4g} in all")))


def load_policies(specs: object = None) -> list[ControllerPolicy]:
    """Policies from ``[{class: dotted.path, **kwargs}, ...]`` (default: the dask config
    ``antdt.controller.policies``)."""
    if specs is None:
        specs = config.get("antdt.controller.policies")
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"antdt.controller.policies must be a list of {{class: dotted.path, "
                          f"...}}, found {specs!r}")
    policies = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
            raise ConfigError(f"antdt.controller.policies[{i}] must be a mapping with a 'class' "
                              f"dotted path, found {spec!r}")
        kwargs = dict(spec)
        path = kwargs.pop("class")
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"antdt.controller.policies[{i}]: cannot import {path!r}: {e}") \
                from e
        if not (isinstance(cls, type) and issubclass(cls, ControllerPolicy)):
            raise ConfigError(f"antdt.controller.policies[{i}]: {path!r} is not a "
                              f"ControllerPolicy subclass, found {cls!r}")
        try:
            policies.append(cls(**kwargs))
        except TypeError as e:
            raise ConfigError(f"antdt.controller.policies[{i}]: {path}({kwargs}) failed: {e}") \
                from e
    return policies


# ---- the mechanism ----------------------------------------------------------------------------


class Controller:
    """Runs the policies of one job every :meth:`tick` and applies what it accepts.

    ``retire(worker, stimulus_id)`` carries out a retirement (on the scheduler:
    ``retire_workers``); ``workers()`` returns the workers that count toward ``min_workers``
    (live, not already being retired); ``emit(record)`` publishes each applied action (on the
    scheduler: a Dask event). Defaults come from ``antdt.controller`` in dask config.
    """

    def __init__(self, ledger: ShardLedger, monitor: Monitor, *, clock: Clock,
                 retire: Callable[[str, str], None], workers: Callable[[], Collection[str]],
                 policies: Sequence[ControllerPolicy] | None = None,
                 min_workers: int | None = None,
                 emit: Callable[[ActionRecord], None] | None = None,
                 max_records: int | None = None) -> None:
        self.ledger = ledger
        self.monitor = monitor
        self.policies = list(load_policies() if policies is None else policies)
        self.min_workers = int(config.number("antdt.controller.min-workers", integer=True)) \
            if min_workers is None else min_workers
        if max_records is None:
            max_records = int(config.number("antdt.controller.max-records", low=1,
                                            integer=True))
        self.records: deque[ActionRecord] = deque(maxlen=max_records)
        """The latest applied actions (at most ``max_records``)."""
        self.counts: Counter[str] = Counter()
        """Applied actions per kind, never truncated."""
        self.count = 0
        self.ticks = 0
        self.batch_sizes: dict[str, int] = {}
        """Batch sizes set by :class:`AdjustBatch`, per worker."""
        self._clock = clock
        self._retire = retire
        self._workers = workers
        self._emit = emit

    def tick(self) -> list[ActionRecord]:
        """Update the monitor, run the policies, apply the accepted actions; returns the records
        of the actions applied. A job that is not running only updates the monitor."""
        now = self._clock()
        self.ticks += 1
        ledger = self.ledger
        self.update_monitor()
        if ledger.state is not JobState.RUNNING:
            return []
        workers = self._workers()
        tick = Tick(self.ticks, now, ledger, self.monitor, workers, self.batch_sizes)
        proposed = [(type(policy).__name__, action)
                    for policy in self.policies for action in policy.run(tick)]
        if not proposed:
            return []
        stimulus_id = f"antdt-controller-{ledger.job}-{self.ticks}-{now}"
        applied = []
        for policy, action in self._resolve(proposed, workers):
            record = self._apply(policy, action, stimulus_id, now)
            if record is not None:
                applied.append(record)
        return applied

    def update_monitor(self) -> None:
        """Close the monitor's elapsed windows and re-check hangs against the live leases
        (what a tick does before its policies; a disabled job's plugin does only this)."""
        self.monitor.update(self.ledger.workers(), self._training)

    def actions(self, since: int = 0) -> dict[str, Any]:
        """``count``, ``counts`` per kind, ``batch_sizes`` and the kept records with
        ``seq >= since`` (plain, for a handler reply)."""
        return {"count": self.count, "counts": dict(self.counts),
                "batch_sizes": dict(self.batch_sizes),
                "records": [record for record in self.records if record["seq"] >= since]}

    # ---- internals ----------------------------------------------------------------------------

    def _training(self, worker: str) -> bool:
        return any(lease.offset < lease.stop for lease in self.ledger.leases(worker))

    def _resolve(self, proposed: list[tuple[str, Action]],
                 workers: Collection[str]) -> list[tuple[str, Action]]:
        """The accepted actions: retirements first, then lease actions, then batch sizes."""
        budget = len(workers) - self.min_workers
        retiring: dict[str, tuple[str, Action]] = {}
        for policy, action in proposed:
            if isinstance(action, Retire) and action.worker not in retiring \
                    and action.worker in workers:
                if len(retiring) >= budget:
                    logger.info("job %s: not retiring %s (%s): %d workers, min_workers %d",
                                self.ledger.job, action.worker, action.evidence.reason,
                                len(workers), self.min_workers)
                    continue
                retiring[action.worker] = (policy, action)
        by_lease: dict[int, tuple[str, LeaseAction]] = {}
        batches: dict[str, tuple[str, Action]] = {}
        for policy, action in proposed:
            if isinstance(action, (Reassign, Split, Revoke)):
                if action.lease.worker in retiring:
                    continue
                held = by_lease.get(action.lease.lease_id)
                if held is None or _STRENGTH[type(action)] > _STRENGTH[type(held[1])]:
                    by_lease[action.lease.lease_id] = (policy, action)
            elif isinstance(action, AdjustBatch):
                if action.worker not in retiring:
                    batches.setdefault(action.worker, (policy, action))
        return [*retiring.values(), *by_lease.values(), *batches.values()]

    def _apply(self, policy: str, action: Action, stimulus_id: str,
               now: float) -> ActionRecord | None:
        lease_id = parts = size = rows = None
        if isinstance(action, Retire):
            worker = action.worker
            self._retire(worker, stimulus_id)
        elif isinstance(action, AdjustBatch):
            worker, size = action.worker, action.size
            self.batch_sizes[worker] = size
        else:
            worker, lease_id = action.lease.worker, action.lease.lease_id
            status = self.ledger.lease_status(lease_id)
            if status is None or status.revoked or _unclaimed(status) <= 0:
                return None
            if isinstance(action, Split):
                parts = action.parts
                pieces = self.ledger.split(lease_id, parts)
            else:
                piece = self.ledger.revoke(lease_id)
                pieces = [piece] if piece is not None else []
            rows = sum(stop - start for _, _, start, stop in pieces)
            if not rows:
                return None
        evidence = action.evidence
        record: ActionRecord = {
            "seq": self.count, "tick": self.ticks, "time": now, "job": self.ledger.job,
            "stimulus_id": stimulus_id, "action": ACTION_NAMES[type(action)], "policy": policy,
            "worker": worker, "lease_id": lease_id, "parts": parts, "size": size, "rows": rows,
            "reason": evidence.reason, "bpt": evidence.bpt, "median": evidence.median,
            "window": evidence.window, "silent_s": evidence.silent_s}
        self.count += 1
        self.counts[record["action"]] += 1
        self.records.append(record)
        logger.info("job %s: %s %s%s by %s (%s; BPT %s, median %s, window %s) [%s]",
                    self.ledger.job, record["action"], worker,
                    f" lease {lease_id}" if lease_id is not None else "", policy,
                    evidence.reason, evidence.bpt, evidence.median, evidence.window, stimulus_id)
        if self._emit is not None:
            self._emit(record)
        return record


# ---- on the scheduler -------------------------------------------------------------------------


@dataclass
class _JobControl:
    ledger: ShardLedger
    monitor: Monitor
    controller: Controller


class ControllerPlugin(SchedulerPlugin):
    """Runs a :class:`Monitor` and a :class:`Controller` per job of the
    :class:`~antdt.service.ShardingService` (register that plugin first).

    The monitors are fed by the service's commit events; every ``antdt.controller.interval``
    each enabled job's controller ticks. Retirements go through ``scheduler.retire_workers`` and
    never leave fewer than ``min_workers`` workers. Handlers:

    ``antdt_controller_actions(job, since=0)``  applied actions: count, counts, records, batch sizes
    ``antdt_controller_enable(job, enabled)``   switch one job's controller (before or after it is
                                                registered); its monitor keeps running
    ``antdt_controller_tick(job=None)``         tick now (one job or all enabled jobs)
    ``antdt_worker_health(job)``                the monitor's verdicts and medians
    """

    name = PLUGIN_NAME

    def __init__(self, *, interval_s: float | None = None, min_workers: int | None = None
                 ) -> None:
        self.interval_s = interval_s
        self.min_workers = min_workers
        self.jobs: dict[str, _JobControl] = {}
        self.enabled: dict[str, bool] = {}
        """Per-job switch; jobs not named follow ``antdt.controller.enabled``."""
        self.scheduler: Scheduler | None = None
        self._sharding: service.ShardingService | None = None
        self._retiring: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, scheduler: Scheduler) -> None:
        sharding = scheduler.plugins.get(service.PLUGIN_NAME)
        if not isinstance(sharding, service.ShardingService):
            raise ConfigError(f"ControllerPlugin needs the ShardingService: register it first "
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
        for control in self.jobs.values():
            control.monitor.forget(worker)

    def restart(self, scheduler: Scheduler) -> None:
        """Every agent is gone: start every job's monitoring afresh."""
        self.jobs.clear()

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
            if job is None and not self._is_enabled(name):
                control.controller.update_monitor()
            else:
                applied.extend(control.controller.tick())
        return applied

    # ---- handlers -----------------------------------------------------------------------------

    @service._handler
    async def actions_handler(self, job: str, since: int = 0) -> dict[str, Any]:
        control = self._known(job)
        return {"status": "OK", "job": job, "enabled": self._is_enabled(job),
                **control.controller.actions(since)}

    @service._handler
    async def enable_handler(self, job: str, enabled: bool = True) -> dict[str, Any]:
        job = service._name("job", job)
        if not isinstance(enabled, bool):
            raise LedgerError(f"enabled must be a bool, found {enabled!r}")
        self.enabled[job] = enabled
        logger.info("job %s: controller %s", job, "enabled" if enabled else "disabled")
        return {"status": "OK", "job": job, "enabled": enabled}

    @service._handler
    async def tick_handler(self, job: str | None = None) -> dict[str, Any]:
        if job is not None:
            self._known(job)
        return {"status": "OK", "applied": self.tick(job)}

    @service._handler
    async def health_handler(self, job: str) -> dict[str, Any]:
        return {"status": "OK", "job": job, **self._known(job).monitor.summary()}

    # ---- internals ----------------------------------------------------------------------------

    @log_errors
    def _tick_enabled(self) -> None:
        self.tick()

    def _is_enabled(self, job: str) -> bool:
        default = config.get("antdt.controller.enabled")
        return self.enabled.get(job, bool(default))

    def _known(self, job: object) -> _JobControl:
        name = service._name("job", job)
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
            monitor = Monitor(time, batch_rows=ledger.batch_rows)
            controller = Controller(ledger, monitor, clock=time, retire=self._retire,
                                    workers=self._live_workers, min_workers=self.min_workers,
                                    emit=self._emit)
            control = self.jobs[job] = _JobControl(ledger, monitor, controller)
        return control

    def _observe(self, job: str, event: CommitEvent) -> None:
        control = self._control(job)
        if control is not None:
            control.monitor.observe(event)

    def _live_workers(self) -> list[str]:
        assert self.scheduler is not None
        return [w for w in self.scheduler.workers if w not in self._retiring]

    def _emit(self, record: ActionRecord) -> None:
        assert self.scheduler is not None
        self.scheduler.log_event(EVENT_TOPIC, dict(record))

    def _retire(self, worker: str, stimulus_id: str) -> None:
        assert self.scheduler is not None
        self._retiring.add(worker)
        task = asyncio.ensure_future(self.scheduler.retire_workers(
            workers=[worker], close_workers=True, remove=True, stimulus_id=stimulus_id))
        self._tasks.add(task)
        task.add_done_callback(lambda done: self._retired(worker, done))

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


def controller_actions(client: Client, job: str, since: int = 0) -> dict[str, Any]:
    """From the driver: ``job``'s applied actions with ``seq >= since`` and their counts."""
    return service._ok(client.sync(client.scheduler.antdt_controller_actions, job=job,
                                   since=since))


def enable_controller(client: Client, job: str, enabled: bool = True) -> dict[str, Any]:
    """From the driver: switch ``job``'s controller on or off (e.g. off for a ``pull`` run)."""
    return service._ok(client.sync(client.scheduler.antdt_controller_enable, job=job,
                                   enabled=enabled))
