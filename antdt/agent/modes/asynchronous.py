"""The async mode (AntDT-ND, for shared clusters): every worker trains a full replica of the
model and merges its peers' progress in the background (ShadowSync), in groups the scheduler
chooses (:mod:`antdt.sync`).

A worker's trained row counts as synced once every live peer applied its delta entry: then it is
in the ``base`` a joiner's snapshot copies and in what a checkpoint writes
(:meth:`~antdt.sync.ReplicaSync.ledger_offset`, :meth:`~antdt.sync.ReplicaSync.committed_tables`).
When a worker leaves or dies, its peers take its entries past the rows the ledger counts synced
out again: those rows are queued again, and the model holds each done row once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from distributed import Worker

from antdt import config
from antdt.agent.contract import Outcome, Trainer
from antdt.agent.modes.mode import AgentParts, Declined, OwnTables
from antdt.errors import SyncError
from antdt.sync import ReplicaSync, SyncPeriod
from antdt.sync.background import BackgroundSync
from antdt.sync.service import SyncService

SETTLE_POLL_S = 0.02
"""While settling, the agent hurries its sync this often."""


class BackgroundSynced:
    """The part of a :class:`~antdt.agent.modes.WorkerMode` whose model syncs in the background
    (``self.sync``): its exchanges, waits, bytes and thread for the agent's report."""

    sync: BackgroundSync

    @property
    def exchanges(self) -> int:
        return self.sync.exchanges

    @property
    def waited_s(self) -> float:
        return self.sync.waited_s

    @property
    def exchanged_bytes(self) -> int:
        return self.sync.bytes_received

    @property
    def threads(self) -> Collection[int]:
        thread = self.sync.thread_id
        return () if thread is None else (thread,)


class AsyncMode(BackgroundSynced, OwnTables):
    """:class:`~antdt.agent.modes.WorkerMode` of the async mode: the trainer's tables and dense
    parameters become a :class:`~antdt.sync.ReplicaSync`, exchanged by a
    :class:`~antdt.sync.background.BackgroundSync` thread every ``period``."""

    group_rows = 0

    def __init__(self, trainer: Trainer[Any], job: str, worker: Worker,
                 period: SyncPeriod) -> None:
        self.trainer = trainer
        self.replica = ReplicaSync(worker.address, trainer.dense(), trainer.tables())
        self.sync = BackgroundSync(self.replica, job, worker=worker, period=period)
        self.joined_from: str | None = None
        self._member = False  # took part in the job's sync (and so leaves it at the end)

    def start(self, join: bool) -> None:
        """Start the background sync; a joiner first copies a live member's model."""
        self._member = True
        try:
            self.joined_from = self.sync.start(join=join)
        except SyncError as exc:
            if not join:
                raise
            self._member = False  # a joiner that cannot join has left the sync again
            raise Declined(str(exc)) from exc

    def train(self, agent: AgentParts) -> Outcome:
        return agent.train_leases()

    def step(self, batch: Any, rows_after: int) -> float:
        """One step once the replica is not too far ahead of its sync rounds, under the replica
        lock (waits count as busy time: the monitor judges a worker by its pace), marking the
        touched rows with ``rows_after`` before the lock is released: a round's entry then holds
        whole batches, each counted in its offset."""
        touched = self.trainer.touched(batch)
        self.sync.before_step()
        with self.replica.lock.training():
            loss = self.trainer.step(batch)
            self.replica.touch(touched, rows_after)
        self.sync.batch_done()
        return loss

    def synced_rows(self, trained_rows: int, waiting: bool) -> int:
        """:meth:`ReplicaSync.ledger_offset` (a worker without live peers publishes first).

        While ``waiting`` (the ledger said "wait": every trained row is in the ledger) the
        worker publishes its newest deltas itself, instead of only in group exchanges, and
        hurries the background sync: the job may be waiting only for these rows, and the next
        periodic round can be a second away. A dead sync thread raises here: it would leave the
        leases draining forever."""
        self.sync.raise_if_failed()
        synced = self.replica.ledger_offset(publish=waiting)
        if waiting:
            self.sync.hurry()
        return synced

    def confirm(self, rows: int) -> None:
        self.replica.confirm(rows)

    def waiting(self) -> None:
        self.sync.hurry()

    def settle(self, cancelled: threading.Event) -> None:
        """Wait (at most ``antdt.sync.rpc-timeout``) until the peers have this worker's rows, so
        a paused job's ledger counts them done (a test's state is settled). The paused worker's
        sync keeps exchanging meanwhile: a peer's rows count as synced only once every member
        pulled them. A worker without live peers publishes its own rows, which syncs them
        (:meth:`~antdt.sync.ReplicaSync.ledger_offset`): no round would."""
        deadline = time.perf_counter() + config.seconds("antdt.sync.rpc-timeout")
        while self.replica.ledger_offset() < self.replica.rows_offset \
                and time.perf_counter() < deadline and not cancelled.is_set():
            self.sync.hurry()
            cancelled.wait(SETTLE_POLL_S)

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        """Under the replica lock, the ledger copied after it was taken: the tables written are
        exactly the rows that copy counts done (:meth:`ReplicaSync.committed_tables`); the dense
        part and the optimisers' state are this replica's as they are."""
        with self.replica.lock:
            ledger = copy_ledger()
            tables = self.replica.committed_tables(ledger["synced"])
            return ledger, self.trainer.checkpoint_state(tables)

    def finish(self) -> Trainer[Any]:
        """The final all-member round: every replica ends identical (each holds the final
        model)."""
        self.sync.finish()
        return self.trainer

    def stop(self) -> None:
        if self._member:
            self.sync.stop()

    def leave(self) -> None:
        if self._member:
            self.sync.leave()

    def check(self) -> None:
        self.sync.raise_if_failed()


class AsyncMaster:
    """:class:`~antdt.agent.modes.MasterMode` of the async mode, over the scheduler's
    :class:`~antdt.sync.service.SyncService` (the job master runs beside it on the scheduler);
    a lost worker's peers go on (they take its unsynced effect out)."""

    regroups = False
    tables_inflight: int | None = None

    def tables(self, job: str) -> dict[str, Any] | None:
        return None

    def __init__(self, service: SyncService) -> None:
        self.service = service

    def start(self, job: str, workers: Collection[str]) -> None:
        self.service.start_job(job, list(workers))

    def restart(self, job: str, workers: Collection[str]) -> None:
        self.service.stop_job(job)
        self.service.start_job(job, list(workers))

    def accepts_joiners(self, job: str) -> bool:
        sync = self.service.jobs.get(job)
        return sync is None or sync.final is None

    def stale_refused(self, job: str) -> int:
        return self.service.stale_refused(job)

    def partitioned(self, job: str) -> dict[str, str]:
        return self.service.partitioned(job)
