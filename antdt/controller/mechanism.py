"""The controller's mechanism: every tick it runs the policies of one job, resolves conflicts
between their actions and applies the accepted ones through the ledger or a retire callback.

``Controller`` is a plain class (injected clock, no Dask) driven by the simulator and the tests;
:mod:`antdt.controller.service` runs one per job on the scheduler.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Collection, Sequence
from typing import Any

from antdt import config
from antdt.controller.actions import (ACTION_NAMES, Action, ActionRecord, AdjustBatch,
                                      LeaseAction, Pace, Reassign, Retire, Revoke, Split)
from antdt.controller.policies import ControllerPolicy, Tick, load_policies
from antdt.monitor import Monitor
from antdt.sharding import Clock, JobState, ShardLedger

logger = logging.getLogger(__name__)

_STRENGTH: dict[type, int] = {Revoke: 3, Reassign: 2, Split: 1}
"""Which lease action wins when several policies target one lease in a tick."""


class Controller:
    """Runs the policies of one job every :meth:`tick` and applies what it accepts.

    ``retire(worker, stimulus_id)`` carries out a retirement (on the scheduler:
    ``retire_workers``, or where another job trains on the worker, stopping this job's agent
    there) and returns what it did instead of closing the worker, added to the record's reason
    (None: closing it); ``workers()`` returns the job's workers, those that count toward
    ``min_workers`` and that a retirement may name (live, not already being retired);
    ``emit(record)`` publishes each applied action (on the scheduler: a Dask event);
    ``unheard(worker)``: seconds since the scheduler last heard from the worker (its
    heartbeats: a holder cut off is not hung, :meth:`Monitor.update`). Defaults come from
    ``antdt.controller`` in dask config.
    """

    def __init__(self, ledger: ShardLedger, monitor: Monitor, *, clock: Clock,
                 retire: Callable[[str, str], str | None],
                 workers: Callable[[], Collection[str]],
                 policies: Sequence[ControllerPolicy] | None = None,
                 min_workers: int | None = None,
                 emit: Callable[[ActionRecord], None] | None = None,
                 max_records: int | None = None,
                 unheard: Callable[[str], float] | None = None) -> None:
        self.ledger = ledger
        self._unheard = unheard or (lambda worker: 0.0)
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
        tick = Tick(self.ticks, now, ledger, self.monitor, workers, ledger.batch_sizes)
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

    @property
    def batch_sizes(self) -> dict[str, int]:
        """Batch sizes set by :class:`AdjustBatch`, per worker: the ledger hands each worker's
        with its leases, and the agent trains in batches of that size."""
        return self.ledger.batch_sizes

    def update_monitor(self) -> None:
        """Close the monitor's elapsed windows and re-check hangs against the live leases
        (what a tick does before its policies; a disabled job's plugin does only this)."""
        self.monitor.update(self.ledger.workers(), self._training, self._unheard)

    def actions(self, since: int = 0) -> dict[str, Any]:
        """``count``, ``counts`` per kind, ``batch_sizes`` and the kept records with
        ``seq >= since`` (plain, for a handler reply)."""
        return {"count": self.count, "counts": dict(self.counts),
                "batch_sizes": self.batch_sizes,
                "records": [record for record in self.records if record["seq"] >= since]}

    # ---- internals ----------------------------------------------------------------------------

    def _training(self, worker: str) -> bool:
        return any(lease.offset < lease.stop for lease in self.ledger.leases(worker))

    def _resolve(self, proposed: list[tuple[str, Action]],
                 workers: Collection[str]) -> list[tuple[str, Action]]:
        """The accepted actions: retirements first, then lease actions, then paces and batch
        sizes (one per worker)."""
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
        per_worker: dict[tuple[type, str], tuple[str, Action]] = {}
        for policy, action in proposed:
            if isinstance(action, (Reassign, Split, Revoke)):
                if action.lease.worker in retiring:
                    continue
                held = by_lease.get(action.lease.lease_id)
                if held is None or _STRENGTH[type(action)] > _STRENGTH[type(held[1])]:
                    by_lease[action.lease.lease_id] = (policy, action)
            elif isinstance(action, (AdjustBatch, Pace)):
                if action.worker not in retiring:
                    per_worker.setdefault((type(action), action.worker), (policy, action))
        return [*retiring.values(), *by_lease.values(), *per_worker.values()]

    def _apply(self, policy: str, action: Action, stimulus_id: str,
               now: float) -> ActionRecord | None:
        lease_id = parts = size = rows = None
        note = None
        if isinstance(action, Retire):
            worker = action.worker
            note = self._retire(worker, stimulus_id)
        elif isinstance(action, AdjustBatch):
            worker, size = action.worker, action.size
            self.ledger.set_batch_rows(worker, size)
        elif isinstance(action, Pace):
            worker, size = action.worker, action.rows
            self.ledger.pace(worker, size)
        else:
            worker, lease_id = action.lease.worker, action.lease.lease_id
            status = self.ledger.lease_status(lease_id)
            if status is None or status.revoked or status.unclaimed <= 0:
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
        if note is not None:
            evidence = evidence._replace(reason=f"{evidence.reason}; {note}")
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
