"""Dask glue of the async mode's model sync: the scheduler plugin that forms groups, the worker
plugin that serves a replica to peers, and the background thread that exchanges.

```
 driver ── antdt_sync_start(job, workers) ──► SyncService (SchedulerPlugin, scheduler process)
                                                one SyncScheduler per job
 worker A: BackgroundSync thread
   every period: antdt_sync_group(job, A, progress, members_version) ──► {kind: group, ...}
   for each peer P in the group: worker_A.rpc(P).antdt_sync_pull(job, A, round, since_seq)
                                   ──► SyncWorkerPlugin on P: entries + dense snapshot
   apply under the replica lock (short); a peer that fails is skipped and logged
 end: antdt_sync_group(final=True) until the all-member round, exchange, then
      antdt_sync_complete until every member is through; each non-leader pulls the leader's
      whole state (antdt_sync_snapshot) and adopts it; stop serving once all adopted
```

Only small control messages go through the scheduler; tensors travel worker to worker as numpy
arrays. The protocol itself lives in :mod:`antdt.sync`.

Joining a running job (a replacement worker the nanny started, or an added one): the agent builds
its :class:`~antdt.sync.ReplicaSync` from a freshly built model as usual and, before its first
training step, calls::

    sync = BackgroundSync(replica, job)           # inside the agent's task on the new worker
    peer = sync.start(join=True)                  # blocks until the replica is current
    ...train as usual...

``start(join=True)`` asks the scheduler to add the worker (``antdt_sync_join``), waits until every
other member applied a member list naming it (so no source drops entries it still needs), then
pulls a whole :class:`~antdt.sync.ReplicaSnapshot` from a live member (``antdt_sync_snapshot``:
its tables and dense parameters and its cursor per source, taken under its replica lock), copies
it into the replica in place and starts syncing; newer entries are pulled as usual. It returns the
peer it bootstrapped from (None for a member listed in ``start_job``: those need no snapshot, so
``join=True`` is harmless there). It raises :class:`~antdt.sync.SyncError` when the job's final
round already formed, when no member acknowledged within ``antdt.sync.join-timeout``, or when no
live member could serve a snapshot (then the model only lives in a checkpoint); the worker has
left the job's sync again by then. The fused optimizer state (row-wise Adagrad momentum) is not
copied: the joiner's starts fresh, which only makes its first steps on a row larger.

Defaults (period, timeouts, group size...) come from ``antdt.sync`` in dask config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict

import numpy as np
import torch
from distributed import Client, Scheduler, Worker, get_worker
from distributed.diagnostics.plugin import SchedulerPlugin, WorkerPlugin
from distributed.metrics import time
from distributed.protocol import to_serialize
from distributed.protocol.pickle import dumps
from distributed.utils import sync

from antdt import config
from antdt.sync import (
    PEER_FAILURES,
    Answer,
    ExchangeReport,
    LogEntry,
    MemberState,
    PeerPayload,
    ReplicaSnapshot,
    ReplicaSync,
    SyncError,
    SyncPeriod,
    SyncScheduler,
)

logger = logging.getLogger(__name__)

MEMBER_CHECK_S = 1.0
"""A pull unanswered this long makes the puller check that the peer is still a member."""

LEADER_RETRY_S = 0.5
"""After a failed fetch of the final leader's state, wait this long before asking again."""

PLUGIN_NAME = "antdt-sync"
"""Name of both halves: ``scheduler.plugins[PLUGIN_NAME]`` and ``worker.plugins[PLUGIN_NAME]``."""


# ---- wire messages ----------------------------------------------------------------------------


class GroupMsg(TypedDict):
    """Reply of ``antdt_sync_group``: ``round``/``members`` are set when ``kind`` is "group"."""

    kind: Literal["group", "wait", "alone"]
    round: int | None
    members: list[str]
    final: bool
    members_version: int


class MembersMsg(TypedDict):
    """Reply of ``antdt_sync_members``."""

    members: list[str]
    members_version: int


class JoinMsg(TypedDict):
    """Reply of ``antdt_sync_join``: ``settled`` once every other member applied a member list
    naming the joiner (else ``waiting`` names them: ask again); ``bootstrap`` when the worker
    joined mid-job and must adopt a member's snapshot."""

    settled: bool
    bootstrap: bool
    waiting: list[str]
    members: list[str]
    members_version: int


class FinalMsg(TypedDict):
    """Reply of ``antdt_sync_complete``: ``leader`` (None until every member completed its final
    exchange) is whose state the others adopt; ``done`` once all of them did."""

    done: bool
    leader: str | None


class EntryMsg(TypedDict):
    """One :class:`~antdt.sync.LogEntry`: ``ids`` (k,) int64 and ``deltas`` (k, dim) as numpy
    arrays (wrapped in ``to_serialize`` on the way out)."""

    seq: int
    rows_offset: int
    ids: Any
    deltas: Any


class PullMsg(TypedDict):
    """Reply of a worker's ``antdt_sync_pull``: a :class:`~antdt.sync.PeerPayload`."""

    source: str
    entries: list[EntryMsg]
    dense: list[Any] | None
    layout: str


class SnapshotMsg(TypedDict):
    """Reply of a worker's ``antdt_sync_snapshot``: a :class:`~antdt.sync.ReplicaSnapshot`, the
    tensors as numpy arrays."""

    source: str
    dense: list[Any]
    tables: dict[str, Any]
    applied: dict[str, int]


def _tensor(value: Any) -> torch.Tensor:
    """A received array as a tensor, copied only when its frame is a read-only buffer."""
    array = np.asarray(value)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def payload_to_msg(payload: PeerPayload) -> PullMsg:
    """Tensors become numpy arrays, each sent as its own serialized frame."""
    entries: list[EntryMsg] = [
        {"seq": e.seq, "rows_offset": e.rows_offset, "ids": to_serialize(e.ids.cpu().numpy()),
         "deltas": to_serialize(e.deltas.detach().cpu().numpy())}
        for e in payload.entries]
    dense = (None if payload.dense is None
             else [to_serialize(t.detach().cpu().numpy()) for t in payload.dense])
    return {"source": payload.source, "entries": entries, "dense": dense,
            "layout": payload.layout}


def msg_to_payload(msg: PullMsg) -> PeerPayload:
    """Inverse of :func:`payload_to_msg` on the receiving side."""
    entries = [LogEntry(int(e["seq"]), _tensor(e["ids"]), _tensor(e["deltas"]),
                        int(e["rows_offset"]))
               for e in msg["entries"]]
    dense = None if msg["dense"] is None else [_tensor(t) for t in msg["dense"]]
    return PeerPayload(msg["source"], entries, dense, msg["layout"])


def snapshot_to_msg(snapshot: ReplicaSnapshot) -> SnapshotMsg:
    """Tensors become numpy arrays, each sent as its own serialized frame."""
    return {"source": snapshot.source,
            "dense": [to_serialize(t.detach().cpu().numpy()) for t in snapshot.dense],
            "tables": {name: to_serialize(t.detach().cpu().numpy())
                       for name, t in snapshot.tables.items()},
            "applied": dict(snapshot.applied)}


def msg_to_snapshot(msg: SnapshotMsg) -> ReplicaSnapshot:
    """Inverse of :func:`snapshot_to_msg` on the receiving side."""
    return ReplicaSnapshot(msg["source"], [_tensor(t) for t in msg["dense"]],
                           {name: _tensor(t) for name, t in msg["tables"].items()},
                           {source: int(seq) for source, seq in msg["applied"].items()})


def _group_msg(answer: Answer, members_version: int) -> GroupMsg:
    group = answer.group
    return {"kind": answer.kind, "round": None if group is None else group.round,
            "members": [] if group is None else list(group.members),
            "final": False if group is None else group.final,
            "members_version": members_version}


# ---- scheduler side ---------------------------------------------------------------------------


class SyncService(SchedulerPlugin):
    """Scheduler plugin owning one :class:`~antdt.sync.SyncScheduler` per job.

    Handlers (all arguments by keyword; None means the ``antdt.sync`` dask-config default):

    - ``antdt_sync_start(job, workers, group_size=None, max_wait_s=None, max_progress_gap=None)``
    - ``antdt_sync_group(job, worker, progress, final=False, members_version=None) -> GroupMsg``:
      records that the worker applied the member list of ``members_version``, then waits (on
      the scheduler's loop, not a thread) until the worker is grouped, told to go on alone, or
      ``poll_s`` passed (then ``kind == "wait"``: ask again)
    - ``antdt_sync_members(job) -> MembersMsg``
    - ``antdt_sync_join(job, worker) -> JoinMsg``: adds a worker to a running job; waits up to
      ``poll_s`` for every other member to acknowledge it
    - ``antdt_sync_leave(job, worker)``: the worker stops syncing (idempotent, any job state)
    - ``antdt_sync_complete(job, worker, adopted_from=None) -> FinalMsg``: the worker finished
      its final exchange (and adopted ``adopted_from``'s state); waits up to ``poll_s`` until
      all are done or the worker has a leader to adopt from
    - ``antdt_sync_stop(job)``

    A worker that leaves the cluster leaves every job's group scheduling. Registering this plugin
    also registers :class:`SyncWorkerPlugin` on every worker.
    """

    name = PLUGIN_NAME

    def __init__(self, poll_s: float | None = None) -> None:
        if poll_s is None:
            poll_s = config.seconds("antdt.sync.poll")
        if poll_s <= 0:
            raise SyncError(f"poll_s must be > 0, found {poll_s}")
        self.poll_s = poll_s
        self.jobs: dict[str, SyncScheduler] = {}
        self._events: dict[tuple[str, str], asyncio.Event] = {}  # (job, worker): grouped
        self._changes: dict[str, asyncio.Event] = {}  # job: a join settled or the final moved

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "antdt_sync_start": self.start_job,
            "antdt_sync_group": self.group,
            "antdt_sync_members": self.members,
            "antdt_sync_join": self.join,
            "antdt_sync_leave": self.leave,
            "antdt_sync_complete": self.complete,
            "antdt_sync_stop": self.stop_job,
        })
        await scheduler.register_worker_plugin(None, dumps(SyncWorkerPlugin()), name=PLUGIN_NAME,
                                               idempotent=True)

    def start_job(self, job: str, workers: list[str], group_size: int | None = None,
                  max_wait_s: float | None = None, max_progress_gap: int | None = None) -> None:
        """Create the job's scheduler with ``workers`` (addresses) as its members."""
        if job in self.jobs:
            raise SyncError(f"sync job {job!r} already started")
        unknown = sorted(set(workers) - self.scheduler.workers.keys())
        if unknown:
            raise SyncError(f"sync job {job!r}: workers {unknown} are not in the cluster")
        if not workers:
            raise SyncError(f"sync job {job!r}: expected at least one worker, found none")
        scheduler = SyncScheduler(group_size, max_wait_s, max_progress_gap)
        for worker in workers:
            scheduler.join(worker)
        self.jobs[job] = scheduler
        logger.info("sync job %s started: %d workers, group_size %d", job, len(workers),
                    scheduler.group_size)

    def stop_job(self, job: str) -> None:
        """Forget the job (idempotent)."""
        self.jobs.pop(job, None)
        self._notify(job)
        for key in [k for k in self._events if k[0] == job]:
            del self._events[key]

    def members(self, job: str) -> MembersMsg:
        scheduler = self._job(job)
        return {"members": scheduler.members(), "members_version": scheduler.members_version}

    async def group(self, job: str, worker: str, progress: int, final: bool = False,
                    members_version: int | None = None) -> GroupMsg:
        """See the class docstring."""
        if not isinstance(progress, int) or progress < 0:
            raise SyncError(f"antdt_sync_group: progress must be an int >= 0, found {progress!r}")
        if members_version is not None and self._job(job).acknowledge(worker, members_version):
            self._notify(job)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            event = self._event(job, worker)
            event.clear()
            answer = scheduler.ready(worker, progress, time(), final=bool(final))
            if answer.group is not None:
                self._wake(job, answer.group.members)
            if answer.kind != "wait":
                return _group_msg(answer, scheduler.members_version)
            now = time()
            left = deadline - now
            if scheduler.state(worker) is MemberState.READY:
                left = min(left, scheduler.wait_left(worker, now))
            if left <= 0:
                return _group_msg(answer, scheduler.members_version)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)

    async def join(self, job: str, worker: str) -> JoinMsg:
        """See the class docstring."""
        if worker not in self.scheduler.workers:
            raise SyncError(f"sync job {job!r}: worker {worker!r} is not in the cluster")
        self._job(job).join_running(worker)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            settled = scheduler.settled(worker)
            left = deadline - time()
            if settled or left <= 0:
                return {"settled": settled, "bootstrap": scheduler.joined_running(worker),
                        "waiting": scheduler.waiting_for(worker),
                        "members": scheduler.members(),
                        "members_version": scheduler.members_version}
            await self._changed(job, left)

    def leave(self, job: str, worker: str) -> None:
        """See the class docstring."""
        scheduler = self.jobs.get(job)
        if scheduler is None:
            return
        final = scheduler.leave(worker)
        if final is not None:
            self._wake(job, final.members)
        self._events.pop((job, worker), None)
        self._notify(job)

    async def complete(self, job: str, worker: str,
                       adopted_from: str | None = None) -> FinalMsg:
        """See the class docstring."""
        scheduler = self._job(job)
        scheduler.complete(worker)
        if adopted_from is not None:
            scheduler.adopted(worker, adopted_from)
        self._notify(job)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            leader, done = scheduler.final_leader(), scheduler.final_done()
            to_adopt = leader not in (None, worker, scheduler.adopted_from(worker))
            left = deadline - time()
            if done or to_adopt or left <= 0:
                return {"done": done, "leader": leader}
            await self._changed(job, left)

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        for job in list(self.jobs):
            self.leave(job, worker)

    def restart(self, scheduler: Scheduler) -> None:
        self.jobs.clear()
        self._events.clear()
        for job in list(self._changes):
            self._notify(job)

    def _job(self, job: str) -> SyncScheduler:
        scheduler = self.jobs.get(job)
        if scheduler is None:
            raise SyncError(f"unknown sync job {job!r}; started jobs: {sorted(self.jobs)}")
        return scheduler

    def _event(self, job: str, worker: str) -> asyncio.Event:
        return self._events.setdefault((job, worker), asyncio.Event())

    def _wake(self, job: str, workers: Sequence[str]) -> None:
        for worker in workers:
            self._event(job, worker).set()

    async def _changed(self, job: str, timeout_s: float) -> None:
        """Wait until :meth:`_notify` is called for ``job`` or ``timeout_s`` passed."""
        event = self._changes.setdefault(job, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def _notify(self, job: str) -> None:
        """Wake every call waiting in :meth:`_changed` for ``job`` (they check again)."""
        event = self._changes.pop(job, None)
        if event is not None:
            event.set()


def start_job(client: Client, job: str, workers: Sequence[str], *, group_size: int | None = None,
              max_wait_s: float | None = None, max_progress_gap: int | None = None) -> None:
    """From the driver: make ``workers`` the members of ``job``'s sync (before training). None
    takes the ``antdt.sync`` default of the driver's dask config."""
    if group_size is None:
        group_size = int(config.number("antdt.sync.group-size", low=2, integer=True))
    if max_wait_s is None:
        max_wait_s = config.seconds("antdt.sync.max-wait")
    client.sync(client.scheduler.antdt_sync_start, job=job, workers=list(workers),
                group_size=group_size, max_wait_s=max_wait_s, max_progress_gap=max_progress_gap)


def stop_job(client: Client, job: str) -> None:
    """From the driver, after every agent returned: forget ``job``'s sync state."""
    client.sync(client.scheduler.antdt_sync_stop, job=job)


# ---- worker side ------------------------------------------------------------------------------


class SyncWorkerPlugin(WorkerPlugin):
    """Serves this worker's replicas to peers through the ``antdt_sync_pull`` (entries and a
    round's dense snapshot) and ``antdt_sync_snapshot`` (the whole state) handlers."""

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.replicas: dict[str, ReplicaSync] = {}

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        worker.handlers["antdt_sync_pull"] = self.pull
        worker.handlers["antdt_sync_snapshot"] = self.snapshot

    def teardown(self, worker: Worker) -> None:
        worker.handlers.pop("antdt_sync_pull", None)
        worker.handlers.pop("antdt_sync_snapshot", None)
        self.replicas.clear()

    def attach(self, job: str, replica: ReplicaSync) -> None:
        """Serve ``replica`` for ``job`` from now on."""
        if job in self.replicas:
            raise SyncError(f"a replica for sync job {job!r} is already attached on "
                            f"{self.worker.address}")
        self.replicas[job] = replica

    def detach(self, job: str) -> None:
        """Stop serving ``job`` (idempotent)."""
        self.replicas.pop(job, None)

    async def pull(self, job: str, requester: str, round: int, since_seq: int) -> PullMsg:
        """A peer's request: this replica's entries after ``since_seq`` and its snapshot of
        ``round``. Preparing takes the replica lock, so it runs in a thread, not on the loop."""
        payload = await asyncio.to_thread(self._replica(job).serve, requester, int(round),
                                          int(since_seq))
        return payload_to_msg(payload)

    async def snapshot(self, job: str, requester: str) -> SnapshotMsg:
        """A joiner's or the final round's request: this replica's whole state (taken under the
        replica lock, in a thread)."""
        snapshot = await asyncio.to_thread(self._replica(job).snapshot)
        logger.info("sync job %s: serving a snapshot to %s", job, requester)
        return snapshot_to_msg(snapshot)

    def _replica(self, job: str) -> ReplicaSync:
        replica = self.replicas.get(job)
        if replica is None:
            raise SyncError(f"no replica of sync job {job!r} on {self.worker.address}")
        return replica


class BackgroundSync:
    """ShadowSync's background thread on one worker: every ``period`` (seconds, or batches the
    training thread reports with :meth:`batch_done`) ask the scheduler for a group and exchange
    with it, while the training thread goes on.

    The agent builds the :class:`~antdt.sync.ReplicaSync`, calls :meth:`start` (``join=True``
    on a worker that joins a running job; see the module docstring) before its first training
    step, trains while holding ``replica.lock`` per step and calls ``replica.touch``; it reads
    :attr:`synced_offset` for its commits. At the end it calls :meth:`finish` (the final
    all-member round), or :meth:`stop` to abandon the job. An error in the thread that is not a
    peer's or the scheduler's failure is re-raised there.

    ``worker`` defaults to the worker running the calling task; ``period`` and
    ``rpc_timeout_s`` to ``antdt.sync.period`` and ``antdt.sync.rpc-timeout``.
    """

    def __init__(self, replica: ReplicaSync, job: str, *, worker: Worker | None = None,
                 period: SyncPeriod | None = None, rpc_timeout_s: float | None = None) -> None:
        if period is None:
            period = SyncPeriod.parse(config.get("antdt.sync.period"),
                                      where="dask config antdt.sync.period")
        if rpc_timeout_s is None:
            rpc_timeout_s = config.seconds("antdt.sync.rpc-timeout")
        if rpc_timeout_s <= 0:
            raise SyncError(f"rpc_timeout_s must be > 0, found {rpc_timeout_s}")
        self.worker = worker if worker is not None else get_worker()
        plugin = self.worker.plugins.get(PLUGIN_NAME)
        if not isinstance(plugin, SyncWorkerPlugin):
            raise SyncError(f"worker {self.worker.address} has no {PLUGIN_NAME!r} plugin: "
                            "register antdt.sync_service.SyncService on the scheduler first")
        if replica.worker != self.worker.address:
            raise SyncError(f"replica belongs to {replica.worker!r}, this worker is "
                            f"{self.worker.address!r}")
        self.replica = replica
        self.job = job
        self.period = period
        self.rpc_timeout_s = rpc_timeout_s
        self.exchanges = 0  # exchanges done (regular and final)
        self.peers_merged = 0  # peers merged over all exchanges
        self.peers_failed = 0  # peers skipped over all exchanges
        self.last_report: ExchangeReport | None = None
        self.bootstrapped_from: str | None = None  # the member a joiner adopted the state of
        self.final_leader: str | None = None  # whose state this replica ended with
        self._plugin = plugin
        self._members_version = -1
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._batches = 0  # batches trained since the last round began (a period in batches)
        self._batches_lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"antdt-sync-{job}", daemon=True)

    @property
    def synced_offset(self) -> int:
        """See :meth:`antdt.sync.EmbeddingDeltaLog.synced_offset`."""
        return self.replica.synced_offset()

    def start(self, *, join: bool = False, timeout_s: float | None = None) -> str | None:
        """Learn the members, start serving peers and start the background thread.

        With ``join``, first join the running job and adopt a live member's snapshot (within
        ``timeout_s``, default ``antdt.sync.join-timeout``); return that member, or None when
        this worker was listed in ``start_job`` (no snapshot needed). See the module docstring.
        """
        if join:
            self.bootstrapped_from = self._join(
                config.seconds("antdt.sync.join-timeout") if timeout_s is None else timeout_s)
        else:
            msg: MembersMsg = self._call(self.worker.scheduler.antdt_sync_members, job=self.job)
            self._set_members(msg["members"], msg["members_version"])
        self._plugin.attach(self.job, self.replica)
        self._thread.start()
        return self.bootstrapped_from

    def stop(self) -> None:
        """Stop exchanging and serving without a final round, and leave the job's sync (so the
        others' final round does not wait for this worker); re-raise a thread error."""
        self._halt()
        self._plugin.detach(self.job)
        try:
            self._call(self.worker.scheduler.antdt_sync_leave, job=self.job,
                       worker=self.worker.address)
        except (OSError, TimeoutError) as exc:  # the scheduler drops us when we go anyway
            logger.warning("sync job %s: could not leave (scheduler unreachable): %r", self.job,
                           exc)
        self.raise_if_failed()

    def finish(self, timeout_s: float | None = None) -> ExchangeReport:
        """Stop the periodic exchanges and take part in the final all-member round.

        After the final exchange, adopt the leader's whole state unless this worker is the leader
        (:meth:`antdt.sync.SyncScheduler.final_leader`), so the replicas end bit-identical; keep
        serving peers until every member did (or ``timeout_s``, default
        ``antdt.sync.final-timeout``, passed: logged). Returns this worker's final exchange.
        """
        if timeout_s is None:
            timeout_s = config.seconds("antdt.sync.final-timeout")
        self._halt()
        self.raise_if_failed()
        deadline = time() + timeout_s
        report: ExchangeReport | None = None
        try:
            while report is None:
                if time() > deadline:
                    raise TimeoutError(f"sync job {self.job}: no final round within {timeout_s}s")
                report = self._round(final=True)
            self._adopt_leader(deadline)
        finally:
            self._plugin.detach(self.job)
        return report

    # -- joining and the end -------------------------------------------------------------------
    def _join(self, timeout_s: float) -> str | None:
        """Join the running job and adopt a live member's snapshot (see the module docstring);
        on failure leave the job again, so nobody's final round waits for this worker."""
        deadline = time() + timeout_s
        try:
            msg: JoinMsg = self._call(self.worker.scheduler.antdt_sync_join, job=self.job,
                                      worker=self.worker.address)
            while not msg["settled"]:
                if time() > deadline:
                    raise SyncError(f"sync job {self.job}: members {msg['waiting'][:10]} did not "
                                    f"acknowledge {self.worker.address} within {timeout_s}s")
                msg = self._call(self.worker.scheduler.antdt_sync_join, job=self.job,
                                 worker=self.worker.address)
            self._set_members(msg["members"], msg["members_version"])
            if not msg["bootstrap"]:
                return None
            peers = [m for m in msg["members"] if m != self.worker.address]
            for peer in peers:
                try:
                    snapshot = self._snapshot_of(peer, max(deadline - time(),
                                                           self.rpc_timeout_s))
                except PEER_FAILURES as exc:
                    logger.warning("sync job %s: no snapshot from %s: %r", self.job, peer, exc)
                    continue
                self.replica.adopt(snapshot)
                logger.info("sync job %s: %s joined from %s's snapshot", self.job,
                            self.worker.address, peer)
                return peer
            raise SyncError(f"sync job {self.job}: no live member of {peers} could serve a "
                            f"snapshot to {self.worker.address}; the model only lives in a "
                            "checkpoint now")
        except BaseException:
            with contextlib.suppress(OSError, TimeoutError):
                self._call(self.worker.scheduler.antdt_sync_leave, job=self.job,
                           worker=self.worker.address)
            raise

    def _adopt_leader(self, deadline: float) -> None:
        """After the final exchange: adopt the leader's state (unless leader), then wait until
        every member did, serving meanwhile; a leader that dies is replaced and adopted again."""
        adopted: str | None = None
        while True:
            msg: FinalMsg = self._call(self.worker.scheduler.antdt_sync_complete, job=self.job,
                                       worker=self.worker.address, adopted_from=adopted)
            if msg["done"]:
                self.final_leader = msg["leader"]
                return
            leader = msg["leader"]
            if leader is not None and leader not in (self.worker.address, adopted):
                try:
                    self.replica.adopt(self._snapshot_of(leader, max(deadline - time(),
                                                                     self.rpc_timeout_s)))
                    adopted = leader
                except PEER_FAILURES as exc:
                    logger.warning("sync job %s: no final state from leader %s: %r", self.job,
                                   leader, exc)
                    # back off: the scheduler names a new leader once it notices the death
                    threading.Event().wait(LEADER_RETRY_S)
            if time() > deadline:
                logger.warning("sync job %s: members still finishing after the final timeout; "
                               "stop serving anyway", self.job)
                return

    def _snapshot_of(self, peer: str, timeout_s: float) -> ReplicaSnapshot:
        async def fetch() -> SnapshotMsg:
            msg: SnapshotMsg = await asyncio.wait_for(
                self.worker.rpc(peer).antdt_sync_snapshot(job=self.job,
                                                          requester=self.worker.address),
                timeout_s)
            return msg

        return msg_to_snapshot(self._call(fetch, callback_timeout=timeout_s + self.rpc_timeout_s))

    # -- the thread ----------------------------------------------------------------------------
    def hurry(self) -> None:
        """Start the next round now rather than at the end of the period (e.g. the worker is
        idle, waiting for its rows to be synced)."""
        self._hurry.set()

    def batch_done(self) -> None:
        """The training thread finished a batch. With a period in batches, the period's last
        batch starts the next round (at once if the thread is idle, else when its round ends)."""
        if self.period.batches is None:
            return
        with self._batches_lock:
            self._batches += 1
            due = self._batches >= self.period.batches
        if due:
            self._hurry.set()

    def _run(self) -> None:
        try:
            while True:
                self._hurry.wait(self.period.seconds)  # None (batches): until batch_done
                self._hurry.clear()
                if self._stop.is_set():
                    break
                with self._batches_lock:
                    self._batches = 0
                try:
                    self._round(final=False)
                except PEER_FAILURES as exc:  # a background round is only retried later
                    logger.warning("sync job %s: round failed, next one in %s: %r", self.job,
                                   self.period, exc)
        except BaseException as exc:  # handed to the agent (raise_if_failed, stop, finish)
            logger.error("sync thread of job %s failed", self.job, exc_info=True)
            self._error = exc

    def _halt(self) -> None:
        self._stop.set()
        self._hurry.set()
        if self._thread.is_alive():
            self._thread.join()

    def raise_if_failed(self) -> None:
        """Raise :class:`SyncError` if the background thread died (its error is the cause)."""
        if self._error is not None:
            raise SyncError(f"sync thread of job {self.job} failed") from self._error

    def _round(self, final: bool) -> ExchangeReport | None:
        """Ask for a group and exchange with it; None when there was nothing to do."""
        try:
            msg: GroupMsg = self._call(self.worker.scheduler.antdt_sync_group, job=self.job,
                                       worker=self.worker.address,
                                       progress=self.replica.rows_offset, final=final,
                                       members_version=self._members_version)
        except (OSError, TimeoutError) as exc:
            logger.warning("sync job %s: scheduler unreachable, retrying: %r", self.job, exc)
            return None
        if msg["members_version"] != self._members_version:
            members: MembersMsg = self._call(self.worker.scheduler.antdt_sync_members,
                                             job=self.job)
            self._set_members(members["members"], members["members_version"])
        if msg["kind"] != "group":
            return None
        assert msg["round"] is not None
        report = self._exchange(msg["round"], msg["members"])
        self.exchanges += 1
        self.peers_merged += len(report.merged)
        self.peers_failed += len(report.failed)
        self.last_report = report
        if report.failed:
            logger.warning("sync job %s round %d: skipped peers %s", self.job, report.round,
                           report.failed)
        return report if msg["final"] == final else None

    def _exchange(self, round: int, members: Sequence[str]) -> ExchangeReport:
        own = self.replica.prepare(round)
        peers = [m for m in members if m != self.worker.address]
        since = {peer: self.replica.log.applied_seq(peer) for peer in peers}
        results = self._call(self._fetch_all, round, since)
        payloads = [r for r in results.values() if isinstance(r, PeerPayload)]
        failed = [peer for peer, r in results.items() if not isinstance(r, PeerPayload)]
        report = self.replica.merge(round, own, payloads)
        report.failed[:0] = failed
        return report

    async def _fetch_all(self, round: int,
                         since: Mapping[str, int]) -> dict[str, PeerPayload | BaseException]:
        """Pull every peer at once; a peer's failure is its result, not the exchange's. A pull
        that is slow to answer is given up as soon as the peer is no longer a member (its worker
        left the cluster, e.g. retired while hung), not only after ``rpc_timeout_s``."""
        async def fetch(peer: str) -> PeerPayload:
            pull = asyncio.ensure_future(self.worker.rpc(peer).antdt_sync_pull(
                job=self.job, requester=self.worker.address, round=round,
                since_seq=since[peer]))
            deadline = time() + self.rpc_timeout_s
            try:
                while True:
                    left = deadline - time()
                    if left <= 0:
                        raise TimeoutError(f"{peer} did not answer in {self.rpc_timeout_s:g}s")
                    done, _ = await asyncio.wait([pull], timeout=min(left, MEMBER_CHECK_S))
                    if done:
                        return msg_to_payload(pull.result())
                    members: MembersMsg = await self.worker.scheduler.antdt_sync_members(
                        job=self.job)
                    if peer not in members["members"]:
                        raise SyncError(f"{peer} left the job's members while we pulled")
            finally:
                pull.cancel()

        results = await asyncio.gather(*(fetch(peer) for peer in since), return_exceptions=True)
        out: dict[str, PeerPayload | BaseException] = {}
        for peer, result in zip(since, results):
            if isinstance(result, BaseException) and not isinstance(result, PEER_FAILURES):
                raise result
            if isinstance(result, BaseException):
                logger.warning("sync job %s round %d: peer %s skipped: %r", self.job, round,
                               peer, result)
            out[peer] = result
        return out

    def _set_members(self, members: Sequence[str], members_version: int) -> None:
        """Apply a member list; the next group call acknowledges ``members_version``."""
        self.replica.set_peers(members)
        self._members_version = members_version

    def _call(self, func: Callable[..., Awaitable[Any]], *args: Any,
              callback_timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``func`` on the worker's event loop from this (non-loop) thread."""
        return sync(self.worker.loop, func, *args,
                    callback_timeout=self.rpc_timeout_s * 2 if callback_timeout is None
                    else callback_timeout, **kwargs)
