"""The sharding service on the Dask scheduler: one :class:`~antdt.sharding.ShardLedger` per job,
reached through named RPC handlers.

```
 driver:  antdt_register_job / antdt_job_state / antdt_checkpoint / antdt_restore / antdt_stop_job
 agents:  antdt_lease (+ piggybacked commits) / antdt_commit / antdt_release / antdt_quarantine
          antdt_ledger_copy (a checkpoint's ledger, copied while its model copy waits)
 control: antdt_revoke / antdt_split
                 │
                 ▼
 ShardingService (SchedulerPlugin) ── jobs: {name: ShardLedger} ── remove_worker / restart
```

Manual controls: no antdt code calls ``antdt_checkpoint``, ``antdt_restore``, ``antdt_quarantine``,
``antdt_revoke``, ``antdt_split`` or ``antdt_stop_job`` (the job master acts on its ledger in the
scheduler's process, and checkpoints travel through ``antdt_ledger_copy``); they are the ledger's
handles for an operator or a test (``client.scheduler.antdt_revoke(job=..., lease_id=...)``).

Every handler validates its arguments (types, sizes, known job, token) and answers a plain dict:
``{"status": "OK", ...}`` or ``{"status": "error", "message": ...}``; a malformed call changes
nothing and leaves other jobs alone. Jobs are isolated: each has its own ledger, and a worker that
leaves the cluster loses its leases in every job.

Wire form of the ledger's replies (``kind`` first)::

    lease:  {"kind": "lease", "lease_id", "token", "worker", "epoch", "path", "row_group",
             "start", "stop", "claim_stop", "batch_rows"} | {"kind": "wait", "unsynced"}
            | {"kind": "stop", "reason"}
    commit: {"kind": "claim", "lease_id", "stop"} | {"kind": "revoked" | "finished", "lease_id",
             "stop", "retired"} | {"kind": "stop", "reason"} | {"kind": "error", "message"}
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import posixpath
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import dask.config
from distributed import Client, Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time

from antdt import config, fencing, rpc
from antdt.errors import LedgerError
from antdt.rpc import MAX_NAME, Reply
from antdt.sharding.checkpoint import MAX_BYTES, read, write_atomic
from antdt.sharding.dealing import MAX_ROW_GROUPS
from antdt.sharding.leases import (Claim, CommitEvent, CommitReply, Finished, Lease, LeaseReply,
                                   QuarantineSpec, Revoked, RowGroup, Stop, Wait)
from antdt.sharding.ledger import ShardLedger

logger = logging.getLogger(__name__)

PLUGIN_NAME = "antdt-sharding"
"""``scheduler.plugins[PLUGIN_NAME]``."""

MAX_COMMITS = 1024
MAX_STATS = 32
MAX_REASON = 2000
CHECKPOINT_ROOT = "antdt.sharding.checkpoint-root"
"""Dask config: the folder under which ``antdt_checkpoint`` and ``antdt_restore`` may reach job
``j``'s ledger, ``<root>/j/`` (unset: only the folders of the jobs AntDT's master runs)."""


def _stats(value: object) -> dict[str, float] | None:
    """A commit's measurements (seconds, batches: never negative; a negative ``batches`` would
    keep a worker in the monitor's warm-up and out of its straggler detection)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) > MAX_STATS:
        raise LedgerError(f"stats must be a mapping of at most {MAX_STATS} entries, found "
                          f"{str(value)[:80]!r}")
    for key, number in value.items():
        if not isinstance(key, str) or len(key) > MAX_NAME or isinstance(number, bool) \
                or not isinstance(number, (int, float)) or not math.isfinite(number) \
                or number < 0:
            raise LedgerError(f"stats entries must be str -> finite number >= 0, found "
                              f"{str(key)[:80]!r}: {str(number)[:80]}")
    return dict(value)


def _inside(folder: str, path: str) -> bool:
    """Whether ``path`` names a file inside ``folder`` (both normalised: no way out by ``..``)."""
    root = posixpath.normpath(folder.replace(os.sep, "/"))
    return posixpath.normpath(path.replace(os.sep, "/")).startswith(root.rstrip("/") + "/")


def lease_msg(reply: LeaseReply) -> Reply:
    """A ledger lease reply in wire form (see the module docstring)."""
    if isinstance(reply, Lease):
        return {"kind": "lease", "lease_id": reply.lease_id, "token": reply.token,
                "worker": reply.worker, "epoch": reply.epoch, "path": reply.path,
                "row_group": reply.row_group, "start": reply.start, "stop": reply.stop,
                "claim_stop": reply.claim_stop, "batch_rows": reply.batch_rows}
    if isinstance(reply, Wait):
        return {"kind": "wait", "unsynced": reply.unsynced}
    return {"kind": "stop", "reason": reply.reason}


def commit_msg(reply: CommitReply) -> Reply:
    """A ledger commit reply in wire form (see the module docstring)."""
    if isinstance(reply, Claim):
        return {"kind": "claim", "lease_id": reply.lease_id, "stop": reply.stop}
    if isinstance(reply, (Revoked, Finished)):
        kind = "revoked" if isinstance(reply, Revoked) else "finished"
        return {"kind": kind, "lease_id": reply.lease_id, "stop": reply.stop,
                "retired": reply.retired}
    return {"kind": "stop", "reason": reply.reason}


class ShardingService(SchedulerPlugin):
    """Owns one ledger per job and serves the ``antdt_*`` sharding handlers.

    ``antdt_lease`` first applies the commits it carries (so an agent finishing a lease and taking
    the next one sends one RPC), then leases; when nothing is leasable yet but the job is not over
    it waits up to ``wait_s`` (default ``antdt.sharding.lease-wait``) for rows to be requeued,
    or, when its worker's last reply said no rows awaited sync, until some do (the reply says
    so, and the worker asks again every ``antdt.sharding.drain-wait``, syncing each time: the job
    may be waiting only for its look at them; rows that came to await sync between its two
    requests end the second at once).
    Subscribe with :meth:`subscribe` to get every job's :class:`~antdt.sharding.CommitEvent`.
    """

    name = PLUGIN_NAME

    def __init__(self) -> None:
        self.jobs: dict[str, ShardLedger] = {}
        self._changed: dict[str, asyncio.Event] = {}
        self.waiting: dict[str, set[str]] = {}
        """Per job, the workers whose lease request waits for rows now."""
        self._listeners: list[Callable[[str, CommitEvent], None]] = []
        self.scheduler: Scheduler | None = None
        self._last_lease: dict[tuple[str, str], tuple[int, asyncio.Future[Reply]]] = {}
        """Per job and worker, its last lease request's ``seq`` and reply, done or to come (a
        retry's answer)."""
        self._told: dict[tuple[str, str], int] = {}
        """Per job and worker, the rows awaiting sync its last lease reply told it of (it chose
        its next request's wait by them)."""
        self.folders: dict[str, str] = {}
        """Per job, its checkpoint folder (set by AntDT's master; see :meth:`folder`)."""

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "antdt_register_job": self.register_job,
            "antdt_lease": self.lease,
            "antdt_commit": self.commit,
            "antdt_release": self.release,
            "antdt_quarantine": self.quarantine,
            "antdt_revoke": self.revoke,
            "antdt_split": self.split,
            "antdt_job_state": self.job_state,
            "antdt_checkpoint": self.checkpoint,
            "antdt_ledger_copy": self.ledger_copy,
            "antdt_restore": self.restore,
            "antdt_stop_job": self.stop_job,
            "antdt_forget_job": self.forget_job,
        })

    def subscribe(self, listener: Callable[[str, CommitEvent], None]) -> None:
        """Call ``listener(job, event)`` after every commit of every job (present and future)."""
        self._listeners.append(listener)
        for job, ledger in self.jobs.items():
            ledger.subscribe(functools.partial(listener, job))

    # ---- driver -------------------------------------------------------------------------------

    @rpc.handler
    async def register_job(self, job: str, row_groups: Sequence[RowGroup], shard_rows: int,
                           batch_rows: int, epochs: int = 1, seed: int = 0,
                           quarantine: Sequence[QuarantineSpec] | None = None,
                           max_claim_rows: int | None = None, static: int | None = None) -> Reply:
        """Create ``job``'s ledger (see :class:`~antdt.sharding.ShardLedger` for the fields)."""
        job = rpc.name("job", job)
        if job in self.jobs:
            raise LedgerError(f"job {job!r} is already registered; forget it first")
        if not isinstance(row_groups, (list, tuple)) or len(row_groups) > MAX_ROW_GROUPS:
            raise LedgerError(f"job {job!r}: row_groups must be a list of at most "
                              f"{MAX_ROW_GROUPS} (path, row_group, num_rows), found "
                              f"{type(row_groups).__name__}")
        if quarantine is not None and not isinstance(quarantine, (list, tuple)):
            raise LedgerError(f"job {job!r}: quarantine must be a list of (path, row_group | None,"
                              f" reason), found {type(quarantine).__name__}")
        # a million row groups take seconds to check and cut: not on the event loop
        ledger = await asyncio.to_thread(
            ShardLedger, row_groups, shard_rows=shard_rows, batch_rows=batch_rows, clock=time,
            epochs=epochs, seed=seed, quarantine=quarantine or (),
            max_claim_rows=max_claim_rows, job=job, static=static,
            guided_end=config.flag("antdt.sharding.guided-end"))
        if job in self.jobs:
            raise LedgerError(f"job {job!r} is already registered; forget it first")
        self._add(job, ledger)
        logger.info("job %s registered: %d shards, %d rows x %d epochs, %d quarantined", job,
                    ledger.num_shards, ledger.total_rows, ledger.epochs, ledger.rows_quarantined)
        return {"status": "OK", **ledger.summary()}

    @rpc.handler
    async def job_state(self, job: str, leases: bool = False) -> Reply:
        """Counters of ``job``; with ``leases`` also its live leases."""
        if not isinstance(leases, bool):
            raise LedgerError(f"leases must be a bool, found {str(leases)[:80]!r}")
        ledger = self._ledger(job)
        reply: Reply = {"status": "OK", **ledger.summary()}
        if leases:
            reply["live"] = [status._asdict() for status in ledger.leases()]
        return reply

    @rpc.handler
    async def checkpoint(self, job: str, path: str) -> Reply:
        """Save ``job``'s ledger to the fsspec ``path`` (atomic on local disks), a file in the
        job's checkpoint folder (:meth:`folder`)."""
        ledger = self._ledger(job)
        path = self._checkpoint_path(ledger.job, path)
        data = await asyncio.to_thread(ledger.to_bytes)
        try:
            await asyncio.to_thread(write_atomic, path, data)
        except OSError as e:
            raise LedgerError(f"job {job!r}: cannot write the checkpoint {path}: {e}") from e
        return {"status": "OK", "bytes": len(data), "path": path}

    @rpc.handler
    async def ledger_copy(self, job: str) -> Reply:
        """``job``'s ledger now, in the checkpoint format (``ledger``), with every worker's
        synced rows (``synced``, :meth:`~antdt.sharding.ShardLedger.synced_points`) and its
        counters. A checkpoint's model copy asks for it while it holds its replica, so the model
        holds exactly the rows this copy counts done (:mod:`antdt.jobs.keeper`)."""
        ledger = self._ledger(job)
        return {"status": "OK", "ledger": ledger.to_bytes(), "synced": ledger.synced_points(),
                **ledger.summary()}

    @rpc.handler
    async def restore(self, job: str, path: str) -> Reply:
        """Create ``job`` from a checkpoint in its checkpoint folder (:meth:`folder`), of at
        most :data:`~antdt.sharding.checkpoint.MAX_BYTES`; leases live at the checkpoint are
        queued again."""
        job = rpc.name("job", job)
        path = self._checkpoint_path(job, path)
        if job in self.jobs:
            raise LedgerError(f"job {job!r} is already registered; forget it before restoring")
        try:
            data = await asyncio.to_thread(read, path, MAX_BYTES)
        except FileNotFoundError as e:
            raise LedgerError(f"job {job!r}: checkpoint {path} does not exist") from e
        except OSError as e:
            raise LedgerError(f"job {job!r}: cannot read the checkpoint {path}: "
                              f"{type(e).__name__}") from e
        try:
            restored = await asyncio.to_thread(ShardLedger.from_bytes, data, clock=time)
            ledger = self.restore_ledger(job, restored)
        except LedgerError as e:
            raise LedgerError(f"job {job!r}: checkpoint {path}: {e}") from e
        logger.info("job %s restored from %s: %s", job, path, ledger.summary())
        return {"status": "OK", **ledger.summary()}

    def restore_bytes(self, job: str, data: bytes) -> ShardLedger:
        """Create ``job`` from a ledger checkpoint's bytes (AntDT's master resuming a job)."""
        if job in self.jobs:
            raise LedgerError(f"job {job!r} is already registered; forget it before restoring")
        return self.restore_ledger(job, ShardLedger.from_bytes(data, clock=time))

    def restore_ledger(self, job: str, ledger: ShardLedger) -> ShardLedger:
        """Register ``ledger`` (read from a checkpoint) as ``job``'s."""
        if job in self.jobs:
            raise LedgerError(f"job {job!r} is already registered; forget it before restoring")
        ledger.job = job
        ledger.guided_end = config.flag("antdt.sharding.guided-end")
        self._add(job, ledger)
        return ledger

    @rpc.handler
    async def stop_job(self, job: str, reason: str = "stopped by the driver") -> Reply:
        """Stop ``job`` early (its rows not done count as lost); agents get ``stop``."""
        ledger = self._ledger(job)
        ledger.stop(rpc.name("reason", reason))
        self.notify(job)
        return {"status": "OK", **ledger.summary()}

    @rpc.handler
    async def forget_job(self, job: str) -> Reply:
        """Drop ``job`` and return its final counters."""
        ledger = self._ledger(job)
        self.forget(job)
        return {"status": "OK", **ledger.summary()}

    def forget(self, job: str) -> None:
        """Drop ``job`` (idempotent); its waiting lease calls return."""
        if self.jobs.pop(job, None) is not None:
            self.notify(job)
            self._changed.pop(job, None)
            self.waiting.pop(job, None)
        self._last_lease = {key: last for key, last in self._last_lease.items()
                            if key[0] != job}
        self._told = {key: told for key, told in self._told.items() if key[0] != job}

    # ---- agents -------------------------------------------------------------------------------

    @rpc.handler
    async def lease(self, job: str, worker: str, claim_rows: int | None = None,
                    commits: Sequence[Mapping[str, Any]] | None = None,
                    wait_s: float | None = None, synced_rows: int | None = None,
                    max_rows: int | None = None, incarnation: str | None = None,
                    seq: int | None = None) -> Reply:
        """Apply ``commits`` and ``synced_rows`` (see :meth:`commit`), then lease the next rows
        for ``worker`` (at most ``max_rows``: :meth:`ShardLedger.lease`). A caller that is not
        a member (``incarnation``: its Dask worker id) is refused (:mod:`antdt.fencing`); a
        request whose ``seq`` is the caller's last one is a retry: it gets that one's reply."""
        ledger = self._ledger(job)
        worker = rpc.name("worker", worker)
        claim_rows = rpc.integer("claim_rows", claim_rows, optional=True)
        synced_rows = rpc.integer("synced_rows", synced_rows, optional=True)
        max_rows = rpc.integer("max_rows", max_rows, 1, optional=True)
        incarnation = None if incarnation is None else rpc.name("incarnation", incarnation)
        seq = rpc.integer("seq", seq, high=2**63 - 1, optional=True)
        wait = config.seconds("antdt.sharding.lease-wait") if wait_s is None else \
            rpc.seconds("wait_s", wait_s, 300.0)
        assert self.scheduler is not None
        fencing.check(self.scheduler, job, "leases", worker, incarnation)
        last = self._last_lease.get((job, worker))
        if seq is not None and last is not None and last[0] == seq:
            return await asyncio.shield(last[1])  # a retry: the same answer, done or to come
        served = asyncio.ensure_future(
            self._lease(ledger, job, worker, claim_rows, commits, wait, synced_rows, max_rows))
        if seq is not None:
            self._last_lease[(job, worker)] = (seq, served)
        return await asyncio.shield(served)

    async def _lease(self, ledger: ShardLedger, job: str, worker: str, claim_rows: int | None,
                     commits: Sequence[Mapping[str, Any]] | None, wait: float,
                     synced_rows: int | None, max_rows: int | None) -> Reply:
        assert self.scheduler is not None
        replies = self._commits(ledger, commits)
        self._report_synced(ledger, worker, synced_rows)
        deadline = time() + wait
        told = self._told.get((job, worker), 0)
        while True:
            # checked again after every wait: a worker removed meanwhile (retired, dead) must
            # not be handed rows, no one would ever give them back
            if worker not in self.scheduler.workers:
                return {"status": "OK", "replies": replies,
                        "lease": lease_msg(Stop(f"{worker} left the cluster"))}
            reply = ledger.lease(worker, claim_rows, max_rows)
            left = deadline - time()
            if not isinstance(reply, Wait) or left <= 0:
                break
            if reply.unsynced and not told:
                break  # rows await sync now, perhaps this worker's look: it must ask sooner
            event = self._changed[job]
            waiting = self.waiting.setdefault(job, set())
            waiting.add(worker)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), left)
            finally:
                waiting.discard(worker)
            ledger = self._ledger(job)
        self._told[(job, worker)] = reply.unsynced if isinstance(reply, Wait) else 0
        return {"status": "OK", "replies": replies, "lease": lease_msg(reply)}

    @rpc.handler
    async def commit(self, job: str, commits: Sequence[Mapping[str, Any]],
                     worker: str | None = None, synced_rows: int | None = None,
                     incarnation: str | None = None) -> Reply:
        """Apply each commit ``{"lease_id", "token", "offset", "synced_offset", "stats"?,
        "claim_rows"?}``; ``replies[i]`` answers ``commits[i]`` (an error for one commit changes
        nothing for that lease and does not stop the others). Then record ``synced_rows``, the
        rows of ``worker``'s stream its commits count synced
        (:meth:`~antdt.sharding.ShardLedger.report_synced`), unless the worker left the
        cluster: its leases are gone, and the model sync has taken its last report. A
        ``worker`` that is not a member (``incarnation``: its Dask worker id) has every commit
        refused (:mod:`antdt.fencing`)."""
        ledger = self._ledger(job)
        worker = None if worker is None else rpc.name("worker", worker)
        synced_rows = rpc.integer("synced_rows", synced_rows, optional=True)
        incarnation = None if incarnation is None else rpc.name("incarnation", incarnation)
        if worker is not None:
            assert self.scheduler is not None
            fencing.check(self.scheduler, job, "commits", worker, incarnation,
                          len(commits) if isinstance(commits, (list, tuple)) else 1)
        replies = self._commits(ledger, commits)
        self._report_synced(ledger, worker, synced_rows)
        return {"status": "OK", "replies": replies}

    @rpc.handler
    async def release(self, job: str, lease_id: int, token: str) -> Reply:
        """The holder gives its lease up; rows from its synced offset are queued again."""
        lease_id, token = rpc.integer("lease_id", lease_id), rpc.name("token", token)
        rows = self._ledger(job).release(lease_id, token)
        self.notify(job)
        return {"status": "OK", "rows": rows}

    @rpc.handler
    async def quarantine(self, job: str, lease_id: int, token: str, stop: int,
                         reason: str) -> Reply:
        """The holder could not read rows ``[offset, stop)`` of its lease."""
        lease_id, token = rpc.integer("lease_id", lease_id), rpc.name("token", token)
        stop = rpc.integer("stop", stop)
        if not isinstance(reason, str) or len(reason) > MAX_REASON:
            raise LedgerError(f"reason must be a str of at most {MAX_REASON} characters, found "
                              f"{str(reason)[:80]!r}")
        reply = self._ledger(job).quarantine(lease_id, token, stop, reason)
        self.notify(job)
        return {"status": "OK", "reply": commit_msg(reply)}

    # ---- controller ---------------------------------------------------------------------------

    @rpc.handler
    async def revoke(self, job: str, lease_id: int) -> Reply:
        piece = self._ledger(job).revoke(rpc.integer("lease_id", lease_id))
        self.notify(job)
        return {"status": "OK", "pieces": [list(piece)] if piece else []}

    @rpc.handler
    async def split(self, job: str, lease_id: int, parts: int) -> Reply:
        lease_id, parts = rpc.integer("lease_id", lease_id), rpc.integer("parts", parts, 2)
        pieces = self._ledger(job).split(lease_id, parts)
        self.notify(job)
        return {"status": "OK", "pieces": [list(piece) for piece in pieces]}

    # ---- cluster events -----------------------------------------------------------------------

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        for job, ledger in self.jobs.items():
            self._last_lease.pop((job, worker), None)
            self._told.pop((job, worker), None)
            if ledger.remove_worker(worker):
                self.notify(job)

    def restart(self, scheduler: Scheduler) -> None:
        """Every task is forgotten, so every agent is gone: queue all leases again."""
        for job, ledger in self.jobs.items():
            for worker in ledger.workers():
                ledger.remove_worker(worker)
            self.notify(job)

    # ---- internals ----------------------------------------------------------------------------

    def folder(self, job: str) -> str | None:
        """Where ``antdt_checkpoint`` and ``antdt_restore`` may reach ``job``'s ledger: the
        checkpoint folder of the job AntDT's master runs (:attr:`folders`), else
        ``<antdt.sharding.checkpoint-root>/<job>`` (None: nowhere)."""
        folder = self.folders.get(job)
        if folder is not None:
            return folder
        root = dask.config.get(CHECKPOINT_ROOT, default=None)
        return None if not isinstance(root, str) or not root else posixpath.join(root, job)

    def _checkpoint_path(self, job: str, path: object) -> str:
        path = rpc.name("path", path)
        folder = self.folder(job)
        if folder is None:
            raise LedgerError(f"job {job!r}: no checkpoint folder (set train.checkpoint_dir, or "
                              f"the dask config {CHECKPOINT_ROOT}); refusing {path!r}")
        if not _inside(folder, path):
            raise LedgerError(f"job {job!r}: checkpoint {path!r} is outside the job's "
                              f"checkpoint folder {folder!r}")
        return path

    def _report_synced(self, ledger: ShardLedger, worker: str | None,
                       synced_rows: int | None) -> None:
        assert self.scheduler is not None
        if worker is not None and synced_rows is not None and worker in self.scheduler.workers:
            ledger.report_synced(worker, synced_rows)

    def _add(self, job: str, ledger: ShardLedger) -> None:
        for listener in self._listeners:
            ledger.subscribe(functools.partial(listener, job))
        self.jobs[job] = ledger
        self._changed[job] = asyncio.Event()

    def _ledger(self, job: object) -> ShardLedger:
        ledger = self.jobs.get(rpc.name("job", job))
        if ledger is None:
            raise LedgerError(f"unknown job {job!r}; registered jobs: {sorted(self.jobs)[:20]}")
        return ledger

    def notify(self, job: str) -> None:
        """Wake the lease calls waiting on ``job`` (rows were queued, or its state changed)."""
        event = self._changed.get(job)
        if event is not None:
            event.set()
            self._changed[job] = asyncio.Event()

    def _commits(self, ledger: ShardLedger,
                 commits: Sequence[Mapping[str, Any]] | None) -> list[Reply]:
        if commits is None:
            return []
        if not isinstance(commits, (list, tuple)) or len(commits) > MAX_COMMITS:
            raise LedgerError(f"commits must be a list of at most {MAX_COMMITS} dicts, found "
                              f"{type(commits).__name__}")
        replies = []
        for item in commits:
            try:
                if not isinstance(item, Mapping) or not {"lease_id", "token", "offset",
                                                         "synced_offset"} <= item.keys():
                    raise LedgerError(f"a commit must be a dict with lease_id, token, offset and"
                                      f" synced_offset, found {str(item)[:120]!r}")
                claim_rows = rpc.integer("claim_rows", item.get("claim_rows"), optional=True)
                reply = ledger.commit(item["lease_id"], item["token"], item["offset"],
                                      item["synced_offset"], _stats(item.get("stats")),
                                      claim_rows)
                replies.append(commit_msg(reply))
            except LedgerError as e:
                replies.append({"kind": "error", "message": str(e)})
        if replies:
            self.notify(ledger.job)
        return replies


# ---- driver helpers ---------------------------------------------------------------------------


def register_job(client: Client, job: str, row_groups: Sequence[RowGroup], *, shard_rows: int,
                 batch_rows: int, epochs: int = 1, seed: int = 0,
                 quarantine: Sequence[QuarantineSpec] = (),
                 max_claim_rows: int | None = None, static: int | None = None) -> Reply:
    """From the driver: register ``job`` (the plugin must be registered; ``static=N``: the static
    baseline of N slots, see :mod:`antdt.sharding.dealing`). Returns its counters."""
    return rpc.ok(client.sync(client.scheduler.antdt_register_job, job=job,
                              row_groups=[list(rg) for rg in row_groups], shard_rows=shard_rows,
                              batch_rows=batch_rows, epochs=epochs, seed=seed,
                              quarantine=[list(q) for q in quarantine],
                              max_claim_rows=max_claim_rows, static=static))


def job_state(client: Client, job: str, *, leases: bool = False) -> Reply:
    """From the driver: ``job``'s counters (and live leases)."""
    return rpc.ok(client.sync(client.scheduler.antdt_job_state, job=job, leases=leases))


def stop_job(client: Client, job: str, reason: str = "stopped by the driver") -> Reply:
    """From the driver: stop ``job`` early."""
    return rpc.ok(client.sync(client.scheduler.antdt_stop_job, job=job, reason=reason))
