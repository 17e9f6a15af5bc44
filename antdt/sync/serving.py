"""The worker's serving side of the async mode's model sync: :class:`SyncWorkerPlugin` answers
its peers' pulls (entries and a round's dense snapshot), a joiner's snapshot request and the
final round's rows request from the replicas attached on this worker
(:class:`~antdt.sync.background.BackgroundSync` attaches its replica when it starts and detaches
it when it stops)."""

from __future__ import annotations

import asyncio
import logging

from distributed import Worker
from distributed.diagnostics.plugin import WorkerPlugin

from antdt import rpc
from antdt.errors import SyncError
from antdt.rpc import Reply
from antdt.sync.replica import ReplicaSync
from antdt.sync.wire import (PLUGIN_NAME, bits_to_mask, payload_to_msg, rows_to_msg,
                             snapshot_to_msg)

logger = logging.getLogger(__name__)

REFUSED_JOBS_KEPT = 100
"""Detached jobs whose refusal count a worker keeps (:meth:`SyncWorkerPlugin.refused`)."""


class SyncWorkerPlugin(WorkerPlugin):
    """Serves this worker's replicas to peers through the ``antdt_sync_pull`` (entries and a
    round's dense snapshot), ``antdt_sync_snapshot`` (the whole state, for a joiner) and
    ``antdt_sync_rows`` (the final leader's rows a member may lack) handlers. A request from a
    worker that is no peer of the replica is refused (:meth:`ReplicaSync.admit`), and counted:
    :meth:`refused` (readable with ``client.run``)."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaSync] = {}
        self._refused: dict[str, int] = {}  # job -> what its detached replica refused

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers["antdt_sync_pull"] = self.pull_handler
        worker.handlers["antdt_sync_snapshot"] = self.snapshot_handler
        worker.handlers["antdt_sync_rows"] = self.rows_handler

    def teardown(self, worker: Worker) -> None:
        worker.handlers.pop("antdt_sync_pull", None)
        worker.handlers.pop("antdt_sync_snapshot", None)
        worker.handlers.pop("antdt_sync_rows", None)
        self.replicas.clear()

    def attach(self, job: str, replica: ReplicaSync) -> None:
        """Serve ``replica`` for ``job`` from now on."""
        if job in self.replicas:
            raise SyncError(f"a replica for sync job {job!r} is already attached on "
                            f"{self.worker.address}")
        self.replicas[job] = replica

    def detach(self, job: str) -> None:
        """Stop serving ``job`` (idempotent)."""
        replica = self.replicas.pop(job, None)
        if replica is not None:
            self._refused[job] = replica.refused
            while len(self._refused) > REFUSED_JOBS_KEPT:
                del self._refused[next(iter(self._refused))]

    def refused(self, job: str) -> int:
        """The stale sync messages (requests and payloads of workers that are no members)
        ``job``'s replica on this worker refused (:attr:`ReplicaSync.refused`), attached or
        detached; 0 for a job it never held. From a client::

            client.run(lambda dask_worker: dask_worker.plugins["antdt-sync"].refused(job))
        """
        replica = self.replicas.get(job)
        return replica.refused if replica is not None else self._refused.get(job, 0)

    @rpc.handler
    async def pull_handler(self, job: object, requester: object, round: object,
                           since_seq: object) -> Reply:
        """A peer's request: this replica's entries after ``since_seq`` and its snapshot of
        ``round`` (a :class:`PullMsg`). Preparing takes the replica lock, so it runs in a
        thread, not on the loop, and so does making the message of it."""
        name = rpc.name("requester", requester, error=SyncError)
        wanted = rpc.integer("round", round, error=SyncError)
        since = rpc.integer("since_seq", since_seq, error=SyncError)
        replica = self._replica(job)
        msg = await asyncio.to_thread(lambda: payload_to_msg(replica.serve(name, wanted, since)))
        return {"status": "OK", **msg}

    @rpc.handler
    async def snapshot_handler(self, job: object, requester: object) -> Reply:
        """A joiner's request: this replica's whole state (a :class:`SnapshotMsg`, taken under
        the replica lock, in a thread)."""
        requester = rpc.name("requester", requester, error=SyncError)
        replica = self._replica(job)
        replica.admit(requester, "a snapshot")
        snapshot = await asyncio.to_thread(replica.snapshot)
        logger.info("sync job %s: serving a snapshot to %s", job, requester)
        return {"status": "OK", **snapshot_to_msg(snapshot)}

    @rpc.handler
    async def rows_handler(self, job: object, requester: object, changed: object) -> Reply:
        """The final round's request to its leader: the rows in which this replica and the
        requester, whose changed rows are the bits ``changed``, may differ (a :class:`RowsMsg`,
        see :meth:`ReplicaSync.serve_rows`, taken under the replica lock, in a thread)."""
        requester = rpc.name("requester", requester, error=SyncError)
        replica = self._replica(job)
        replica.admit(requester, "the final rows")
        mask = bits_to_mask(changed, replica.log.space.rows)
        rows = await asyncio.to_thread(replica.serve_rows, mask)
        logger.info("sync job %s: serving %d of %d rows to %s", job, len(rows.ids),
                    replica.log.space.rows, requester)
        return {"status": "OK", **rows_to_msg(rows)}

    def _replica(self, job: object) -> ReplicaSync:
        replica = self.replicas.get(rpc.name("job", job, error=SyncError))
        if replica is None:
            raise SyncError(f"no replica of sync job {job!r} on {self.worker.address}")
        return replica
