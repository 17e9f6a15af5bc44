"""The async mode with sharded tables (PERSIA's hybrid on AntDT-ND): the embedding tables live
in buckets over the job's workers (:mod:`antdt.tables`), trained asynchronously where they live,
at most ``K`` batches of a trainer's pushes unacknowledged; the dense layers are replicated and
synchronised in the background as in the async mode (:mod:`antdt.sync`, with no tables).

A trained row counts synced once its batch's push, and every push before it, is applied on the
primary and the backup of every bucket it touched (:meth:`TableClient.acked_rows`). A worker
that leaves has its changes past the rows the ledger counts synced for it taken out of every
bucket (:meth:`~antdt.tables.store.BucketStore.depart`); the ledger trains them again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Mapping
from typing import Any, Protocol

import torch
from distributed import Worker
from distributed.utils import sync

from antdt import config, rpc
from antdt.agent.contract import Outcome, SavedModel, Trainer
from antdt.agent.modes.asynchronous import BackgroundSynced
from antdt.agent.modes.mode import AgentParts, Declined
from antdt.errors import CheckpointError, SyncError
from antdt.sync import ReplicaSync, SyncPeriod
from antdt.sync.background import BackgroundSync
from antdt.sync.service import SyncService
from antdt.tables.client import TableClient
from antdt.tables.optim import RowOptimizer
from antdt.tables.serving import PLUGIN_NAME, TablesWorkerPlugin
from antdt.tables.service import TablesService, TablesSpec
from antdt.tables.store import Fenced, Stale

logger = logging.getLogger(__name__)

CHECKPOINT_ATTEMPTS = 3
"""A checkpoint copies the ledger and then the tables; confirmations that passed the copy make
it copy both again, at most this often."""

Tables = tuple[torch.Tensor, torch.Tensor]
"""The whole tables ``(rows, dim)`` end to end and their optimiser state ``(rows, width)``."""


class TableTrainer(Protocol):
    """What the hybrid mode needs of the application's trainer: the dense part as any trainer
    (:meth:`dense`), and the tables kept outside it.

    ``rows_of(batch)``: the sorted unique global row ids ``(U,)`` int64 the batch reads;
    ``step(batch, ids, rows)``: train on ``batch`` with ``rows`` ``(U, dim)``, their current
    weights; returns the loss and the gradients ``(U, dim)`` of those rows; ``initial_rows(start,
    stop)``: the weights global rows start from and their optimiser state (the seed's and None,
    or a restored checkpoint's);
    ``checkpoint_state(tables)``: the trainer's checkpoint form with these tables;
    ``restore_state(state)``; ``final(gather)``: the final model as a :class:`Trainer`, whose
    tables ``gather()`` returns when it needs them (on the worker that evaluates it);
    ``write_part(folder, index, count, parts)``: write buckets ``(first row, weights, state)``
    as one part of a model in parts, ``write_dense(folder)`` the rest (each the file's name and
    its size and checksum)."""

    def rows_of(self, batch: Any) -> torch.Tensor: ...

    def step(self, batch: Any, ids: torch.Tensor, rows: torch.Tensor
             ) -> tuple[float, torch.Tensor]: ...

    def dense(self) -> list[torch.Tensor]: ...

    def initial_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        ...

    def checkpoint_state(self, tables: Tables) -> Any: ...

    def restore_state(self, state: Any) -> None: ...

    def final(self, gather: Callable[[], Tables]) -> Trainer[Any]: ...

    def write_part(self, folder: str, index: int, count: int,
                   parts: list[tuple[int, torch.Tensor, torch.Tensor]]
                   ) -> tuple[str, dict[str, Any]]: ...

    def write_dense(self, folder: str) -> tuple[str, dict[str, Any]]: ...


def plugin_of(worker: Worker) -> TablesWorkerPlugin:
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, TablesWorkerPlugin):
        raise SyncError(f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: register the "
                        "antdt plugins first (antdt.jobs.JobClient does)")
    return plugin


class HybridMode(BackgroundSynced):
    """:class:`~antdt.agent.modes.WorkerMode` of the async mode with sharded tables."""

    group_rows = 0

    def __init__(self, trainer: TableTrainer, job: str, worker: Worker, period: SyncPeriod,
                 max_inflight: int, model_dir: str | None = None) -> None:
        self.trainer = trainer
        self.model_dir = model_dir
        self.job = job
        self.worker = worker
        self.replica = ReplicaSync(worker.address, trainer.dense(), {})
        self.sync = BackgroundSync(self.replica, job, worker=worker, period=period)
        self.tables = TableClient(job, worker, max_inflight)
        self.joined_from: str | None = None
        self._seq = 0
        self._member = False

    @property
    def waited_s(self) -> float:
        return self.sync.waited_s + self.tables.waited_s

    def tables_stats(self) -> dict[str, float]:
        return self.tables.stats()

    def start(self, join: bool) -> None:
        """Hold this worker's buckets (drawn from the trainer's initial rows; a joiner's are
        copied to it), then start the dense part's background sync. A job whose final model
        could not be gathered on this worker and that has nowhere to write it in parts is
        refused here, before anything trains."""
        plugin = plugin_of(self.worker)
        plugin.open(self.job, self.trainer.initial_rows, self.trainer.write_part)
        self._member = True
        try:
            if join:  # the scheduler copies it buckets to take over, then hands them over
                rpc.ok(sync(self.worker.loop, self.worker.scheduler.antdt_tables_join,
                            job=self.job, worker=self.worker.address), SyncError)
                self.tables.refresh()
            else:
                current = self.tables.refresh()
                if self.model_dir is None and not self._fits():
                    raise SyncError(
                        f"job {self.job}: its tables ({current.total_rows:,} rows) could not be "
                        f"gathered into one model on {self.worker.address} at its end; set "
                        "train.checkpoint_dir (storage every worker reaches): the hosts write "
                        "it there in parts")
                plugin.create(self.job, self.tables.spec, current, self.worker.address)
                self._await_hosts()
            self.joined_from = self.sync.start(join=join)
        except SyncError as exc:
            if not join:
                raise
            self._member = False
            raise Declined(str(exc)) from exc

    def _await_hosts(self) -> None:
        """Say this worker holds its buckets of the first map, then wait (at most
        ``antdt.sync.rpc-timeout``) until every host says so (``antdt_tables_held``: why)."""
        timeout = config.seconds("antdt.sync.rpc-timeout")
        reply = rpc.ok(sync(self.worker.loop, self.worker.scheduler.antdt_tables_held,
                            job=self.job, worker=self.worker.address, timeout_s=timeout),
                       SyncError)
        if not reply["all"]:
            logger.warning("job %s: not every host held its buckets within %gs; training on",
                           self.job, timeout)

    def train(self, agent: AgentParts) -> Outcome:
        """The lease loop; a worker the tables fenced off (it is closing: its buckets were
        drained and its changes past its synced rows taken out) stops as cancelled."""
        try:
            return agent.train_leases()
        except Fenced as exc:
            logger.warning("agent of job %s on %s: %s", self.job, self.worker.address, exc)
            return "cancelled"

    def step(self, batch: Any, rows_after: int) -> float:
        """Pull the batch's rows (once fewer than K pushes are in flight), train the dense part
        under the replica lock, push the rows' gradients without waiting."""
        ids = self.trainer.rows_of(batch)
        self.tables.room()
        rows = self.tables.pull(ids)
        self.sync.before_step()
        with self.replica.lock.training():
            loss, grads = self.trainer.step(batch, ids, rows)
        self.sync.batch_done()
        self._seq += 1
        self.tables.push(self._seq, rows_after, ids, grads)
        return loss

    def synced_rows(self, trained_rows: int, waiting: bool) -> int:
        self.sync.raise_if_failed()
        if waiting:
            self.sync.hurry()
        return self.tables.acked_rows(trained_rows)

    def confirm(self, rows: int) -> None:
        self.tables.confirmed = max(self.tables.confirmed, rows)

    def waiting(self) -> None:
        self.sync.hurry()

    def settle(self, cancelled: threading.Event) -> None:
        """Every push acknowledged (bounded by the pushes' own timeout)."""
        self.tables.drain()

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        """The ledger, then every primary writes its buckets' committed rows (exactly the rows
        that copy counts done) as its own part of a model in parts into the version ``folder``
        (nothing is gathered), and this worker the dense part as it is, under the replica lock.
        """
        for _ in range(CHECKPOINT_ATTEMPTS):
            ledger = copy_ledger()
            try:
                files = self.tables.write(folder, ledger["synced"])
            except Stale:
                continue
            with self.replica.lock:
                name, digest = self.trainer.write_dense(folder)
            return ledger, SavedModel(folder, {**files, name: digest})
        raise CheckpointError(f"job {self.job}: the tables moved past the ledger's copy "
                              f"{CHECKPOINT_ATTEMPTS} times")

    def finish(self) -> Trainer[Any] | SavedModel | None:
        """Every push applied, the dense part's final round. The final model gathers the tables
        from their hosts when it is evaluated; when it would not fit this worker (and the job
        has a ``model_dir``) the hosts write it in parts there instead, the first host's agent
        leading (the others hold nothing)."""
        self.tables.drain()
        self.sync.finish()
        worker, job, tables = self.worker, self.job, self.tables

        def synced() -> Mapping[str, int]:
            ledger = rpc.ok(sync(worker.loop, worker.scheduler.antdt_ledger_copy, job=job),
                            CheckpointError)
            return ledger["synced"]  # type: ignore[no-any-return]

        if self.model_dir is None or self._fits():
            return self.trainer.final(lambda: tables.committed(synced()))
        current = tables.refresh()
        if worker.address != min(current.workers()):
            return None
        files = tables.write(self.model_dir, synced())
        name, digest = self.trainer.write_dense(self.model_dir)
        return SavedModel(self.model_dir, {**files, name: digest})

    def _fits(self) -> bool:
        """Whether the whole tables, gathered and then loaded into a model (twice their bytes),
        fit this worker's memory limit beside what it holds."""
        limit = self.worker.memory_manager.memory_limit
        spec = self.tables.spec
        dim = int(spec["dim"])
        width = RowOptimizer(str(spec["optimizer"]), float(spec["lr"]),
                             float(spec["eps"])).state_width(dim)
        need = 2 * int(spec["total_rows"]) * (dim + width) * 4
        return not limit or need < limit / 2

    def stop(self) -> None:
        if self._member:
            self.sync.stop()

    def leave(self) -> None:
        """Leave the dense part's sync and the tables (the backups serve this worker's
        buckets; its changes past its synced rows are taken out)."""
        if not self._member:
            return
        self.sync.leave()
        try:
            rpc.ok(sync(self.worker.loop, self.worker.scheduler.antdt_tables_leave,
                        job=self.job, worker=self.worker.address), SyncError)
        except (OSError, SyncError) as exc:  # the scheduler removes it when it goes anyway
            logger.warning("job %s: could not leave the tables: %r", self.job, exc)

    def check(self) -> None:
        self.sync.raise_if_failed()


class HybridMaster:
    """:class:`~antdt.agent.modes.MasterMode` of the async mode with sharded tables: the dense
    part's :class:`SyncService` job and the tables' :class:`TablesService` map."""

    regroups = False
    tables_inflight: int | None

    def __init__(self, service: SyncService, tables: TablesService, spec: TablesSpec) -> None:
        self.service = service
        self.tables_service = tables
        self.spec = spec
        self.tables_inflight = spec.max_inflight

    def start(self, job: str, workers: Collection[str]) -> None:
        self.service.start_job(job, list(workers))
        self.tables_service.start_job(job, list(workers), self.spec)

    def restart(self, job: str, workers: Collection[str]) -> None:
        self.service.stop_job(job)
        self.tables_service.stop_job(job)
        self.start(job, workers)

    def accepts_joiners(self, job: str) -> bool:
        sync_job = self.service.jobs.get(job)
        return sync_job is None or sync_job.final is None

    def stale_refused(self, job: str) -> int:
        return self.service.stale_refused(job)

    def partitioned(self, job: str) -> dict[str, str]:
        return self.service.partitioned(job)

    def tables(self, job: str) -> dict[str, Any] | None:
        return self.tables_service.summary(job)

