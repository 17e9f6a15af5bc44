"""The scheduler half of the sharded tables: :class:`TablesService` keeps each job's
:class:`~antdt.tables.BucketMap` and changes it as workers come and go.

```
 master ── start_job(job, workers, spec) ──► TablesService (SchedulerPlugin): one map a job
 worker: HybridMode.start
   antdt_tables_map(job, worker) ──► the map and the spec; the worker draws its own buckets
 a worker leaves (dies, is retired, its agent stops): ``without`` ──►
   new primaries ── antdt_tables_promote ──►   every host ── antdt_tables_depart ──►
   each bucket left without a backup: its primary ── antdt_tables_copy(target) ──►
       the primary ── antdt_tables_install ──► the target (the bucket's lock held meanwhile)
 a worker joins: antdt_tables_join(job, worker) ── ``with_worker`` ──► copies (+ hand-overs),
   then the old holders drop what they no longer hold
 a primary cannot forward: antdt_tables_backup_lost(job, worker, buckets) ──► new backups
 trainers: antdt_tables_latency(job, worker, pulls_ms) ── a slow host ── ``off_host`` ──►
   its primaries handed over to their backups
```

Changes of one job run one at a time (a lock a job), each from the map the previous one left.
A copy that fails because a worker died is left to that worker's removal, which makes the map
right again; a bucket whose primary and backup both died is lost, and the job cannot go on
(:meth:`TablesService.lost`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from distributed import Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time
from distributed.protocol.pickle import dumps

from antdt import config, rpc
from antdt.errors import SyncError
from antdt.rpc import Reply
from antdt.sharding.service import PLUGIN_NAME as SHARDING_PLUGIN
from antdt.sharding.service import ShardingService
from antdt.tables.buckets import (BucketMap, Copy, off_host, place, with_worker, without,
                                  without_backups)
from antdt.tables.serving import PLUGIN_NAME as WORKER_PLUGIN
from antdt.tables.serving import TablesWorkerPlugin
from antdt.tables.slow import SlowHosts

logger = logging.getLogger(__name__)

PLUGIN_NAME = "antdt-tables-service"
COPY_ATTEMPTS = 3
HELD_POLL_S = 1.0
"""A worker waiting for the others to hold their buckets looks again at least this often (a
worker of the map may leave meanwhile)."""


@dataclass(frozen=True)
class TablesSpec:
    """A job's sharded tables: ``total_rows`` rows of ``dim`` floats in ``buckets_per_worker``
    buckets a worker (:func:`~antdt.tables.buckets.place`),
    trained by the sparse ``optimizer`` (``lr``, ``eps``) on their hosts, each bucket at least
    ``bucket_rows`` rows where there are enough (:func:`~antdt.tables.buckets.place`);
    ``max_inflight``:
    the staleness bound K, batches a trainer may have pushed and not yet had acknowledged."""

    total_rows: int
    dim: int
    optimizer: str
    lr: float
    eps: float
    buckets_per_worker: int = 4
    max_inflight: int = 2
    bucket_rows: int = 65536

    def __post_init__(self) -> None:
        for name in ("total_rows", "dim", "buckets_per_worker", "max_inflight", "bucket_rows"):
            rpc.integer(f"tables {name}", getattr(self, name), 1, error=SyncError)

    def to_wire(self, size: int) -> dict[str, Any]:
        """What a host's store needs (``size``: rows a bucket, from the map)."""
        return {**asdict(self), "size": size}


class TablesService(SchedulerPlugin):
    """Scheduler plugin: one bucket map a job (see the module docstring). Handlers:
    ``antdt_tables_map(job)``, ``antdt_tables_join(job, worker)``,
    ``antdt_tables_leave(job, worker)``, ``antdt_tables_held(job, worker, timeout_s)``,
    ``antdt_tables_latency(job, worker, pulls_ms)``, ``antdt_tables_drain(job, worker)`` (a closing
    worker's, answered once its buckets moved), ``antdt_tables_backup_lost(job, worker,
    buckets)``.
    Registering it registers :class:`~antdt.tables.serving.TablesWorkerPlugin` on every
    worker."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.maps: dict[str, BucketMap] = {}
        self.specs: dict[str, TablesSpec] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.moves: dict[str, int] = {}
        """Buckets copied a job (backups made again, joiners' buckets)."""
        self.slow: dict[str, SlowHosts] = {}
        self.holding: dict[str, set[str]] = {}
        """A job's workers that hold their buckets of its first map (drawn)."""
        self._holding_changed: dict[str, asyncio.Event] = {}
        self.moved_off: dict[str, list[dict[str, Any]]] = {}
        """A job's slow hosts whose primaries were handed over: when, the host, its pulls' and
        the others' milliseconds, the buckets."""

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "antdt_tables_map": self.map_handler,
            "antdt_tables_join": self.join_handler,
            "antdt_tables_leave": self.leave_handler,
            "antdt_tables_backup_lost": self.backup_lost_handler,
            "antdt_tables_drain": self.drain_handler,
            "antdt_tables_latency": self.latency_handler,
            "antdt_tables_held": self.held_handler,
        })
        await scheduler.register_worker_plugin(None, dumps(TablesWorkerPlugin()),
                                               name=WORKER_PLUGIN, idempotent=True)

    # ---- the master's side ------------------------------------------------------------------

    def start_job(self, job: str, workers: Sequence[str], spec: TablesSpec) -> BucketMap:
        """Place ``job``'s buckets on ``workers``; each draws its own when its agent starts."""
        placed = place(job, spec.total_rows, spec.buckets_per_worker, workers, spec.bucket_rows)
        self.maps[job] = placed
        self.specs[job] = spec
        self.moves[job] = 0
        self.moved_off[job] = []
        self.slow[job] = SlowHosts(config.number("antdt.tables.slow-factor", low=1.0),
                                   int(config.number("antdt.tables.slow-reports", integer=True)),
                                   1000 * config.seconds("antdt.tables.slow-floor"))
        logger.info("tables of job %s: %d rows in %d buckets on %d workers", job,
                    spec.total_rows, placed.buckets, len(set(workers)))
        return placed

    def stop_job(self, job: str) -> None:
        """Forget ``job`` here and on its hosts (idempotent)."""
        current = self.maps.pop(job, None)
        self.specs.pop(job, None)
        self.slow.pop(job, None)
        self.holding.pop(job, None)
        self._holding_changed.pop(job, asyncio.Event()).set()
        if current is not None:
            for worker in current.workers() | set(current.departed):
                self._spawn(self._call(worker, "antdt_tables_forget", job=job))

    def summary(self, job: str) -> dict[str, Any] | None:
        """``job``'s tables as its record shows them: buckets, the map's epoch, the buckets
        copied, lost ones, the workers that left, and per worker the buckets it is primary and
        backup of (None: no tables here)."""
        current = self.maps.get(job)
        if current is None:
            return None
        return {"buckets": current.buckets, "rows": current.total_rows, "epoch": current.epoch,
                "moves": self.moves.get(job, 0), "lost": list(current.lost),
                "departed": sorted(current.departed),
                "held": {w: {"primary": len(p), "backup": len(b)}
                         for w in sorted(current.workers())
                         for p, b in [current.held(w)]},
                "moved_off": list(self.moved_off.get(job, []))}

    def lost(self, job: str) -> str | None:
        """Why ``job``'s tables cannot go on (buckets lost with both holders), or None."""
        current = self.maps.get(job)
        if current is None or not current.lost:
            return None
        return (f"{len(current.lost)} bucket(s) of the sharded tables lost their primary and "
                f"backup (buckets {list(current.lost[:8])}); resume from the last checkpoint")

    def remove(self, job: str, worker: str) -> None:
        """``worker`` left ``job``: its buckets are served by their backups, new backups made,
        and its changes past the rows the ledger counts synced for it taken out."""
        self._spawn(self._remove(job, worker))

    async def _remove(self, job: str, worker: str) -> None:
        current = self.maps.get(job)
        if current is None or worker in current.departed:
            return
        synced = self._synced_rows(job, worker)
        def leave(current: BucketMap) -> tuple[BucketMap, list[Copy]]:
            return (current, []) if worker in current.departed \
                else without(current, worker, synced)

        await self._change(job, leave)

    # ---- handlers ---------------------------------------------------------------------------

    @rpc.handler
    async def map_handler(self, job: object) -> Reply:
        current = self._map(job)
        return {"status": "OK", "map": current.to_wire(),
                "spec": self.specs[current.job].to_wire(current.size)}

    @rpc.handler
    async def join_handler(self, job: object, worker: object) -> Reply:
        who = rpc.name("worker", worker, SyncError)
        current = self._map(job)
        if who in current.departed:
            raise SyncError(f"job {current.job}: worker {who} left it and cannot join again")
        await self._change(current.job, lambda m: with_worker(m, who))
        return {"status": "OK", "map": self.maps[current.job].to_wire()}

    @rpc.handler
    async def leave_handler(self, job: object, worker: object) -> Reply:
        who = rpc.name("worker", worker, SyncError)
        self.remove(self._map(job).job, who)
        return {"status": "OK"}

    @rpc.handler
    async def drain_handler(self, job: object, worker: object) -> Reply:
        """``worker`` is closing: :meth:`remove` it now, and answer once its buckets are served
        by others and have their backups again."""
        who = rpc.name("worker", worker, SyncError)
        await self._remove(self._map(job).job, who)
        return {"status": "OK"}

    @rpc.handler
    async def held_handler(self, job: object, worker: object, timeout_s: object) -> Reply:
        """``worker`` holds its buckets of the job's first map; answers once every worker of
        the map does (``all``: True), or after ``timeout_s`` (False). A push forwarded to a
        backup still drawing its buckets would find none there: its primary would drop that
        backup and copy the bucket elsewhere, a third copy that can take a worker near its
        memory limit over it."""
        who = rpc.name("worker", worker, SyncError)
        wait_s = rpc.seconds("timeout_s", timeout_s, 3600.0, error=SyncError)
        name = self._map(job).job
        holding = self.holding.setdefault(name, set())
        holding.add(who)
        self._holding_changed.pop(name, asyncio.Event()).set()
        deadline = time() + wait_s
        while (current := self.maps.get(name)) is not None \
                and not current.workers() <= holding and (left := deadline - time()) > 0:
            changed = self._holding_changed.setdefault(name, asyncio.Event())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(left, HELD_POLL_S))
        current = self.maps.get(name)
        return {"status": "OK", "all": current is not None and current.workers() <= holding}

    @rpc.handler
    async def latency_handler(self, job: object, worker: object, pulls_ms: object) -> Reply:
        """``worker``'s trainer's mean pull milliseconds per other host since its last report:
        a host judged slow (:class:`~antdt.tables.slow.SlowHosts`) hands its primaries over
        to their backups."""
        who = rpc.name("worker", worker, SyncError)
        if not isinstance(pulls_ms, Mapping) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
                for v in pulls_ms.values()):
            raise SyncError(f"pulls_ms must map hosts to milliseconds >= 0, found "
                            f"{str(pulls_ms)[:120]}")
        current = self._map(job)
        judge = self.slow.get(current.job)
        if judge is None or judge.reports <= 0:
            return {"status": "OK"}
        moved = {m["host"] for m in self.moved_off[current.job]}
        for host in judge.report(who, {str(h): float(v) for h, v in pulls_ms.items()
                                       if h in current.workers() and h not in moved}):
            others = [judge.latency(h) for h in judge.seen if h != host]
            primaries = current.held(host)[0]
            self.moved_off[current.job].append({
                "time": time(), "host": host, "pull_ms": round(judge.latency(host), 2),
                "others_ms": round(statistics.median(others), 2), "buckets": len(primaries)})
            logger.warning("job %s: host %s serves its buckets slowly (pulls %.1f ms, the "
                           "others' %.1f ms): its %d primaries go to their backups (once a "
                           "job)", current.job, host, judge.latency(host),
                           statistics.median(others), len(primaries))
            judge.forget(host)
            self._spawn(self._change(current.job, functools.partial(off_host, host=host)))
        return {"status": "OK"}

    @rpc.handler
    async def backup_lost_handler(self, job: object, worker: object, buckets: object) -> Reply:
        who = rpc.name("worker", worker, SyncError)
        if not isinstance(buckets, (list, tuple)):
            raise SyncError(f"buckets must be a list, found {type(buckets).__name__}")
        ids = [rpc.integer("buckets[]", b, error=SyncError) for b in buckets]
        current = self._map(job)
        self._spawn(self._change(current.job, lambda m: without_backups(m, who, ids)))
        return {"status": "OK"}

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        for job, current in list(self.maps.items()):
            if worker in current.workers():
                self.remove(job, worker)

    # ---- changing a map ---------------------------------------------------------------------

    async def _change(self, job: str,
                      change: Callable[[BucketMap], tuple[BucketMap, list[Copy]]]) -> None:
        lock = self._locks.setdefault(job, asyncio.Lock())
        async with lock:
            old = self.maps.get(job)
            if old is None:
                return
            new, copies = change(old)
            if new is old:
                return
            handed = {c.bucket for c in copies if c.promote}
            # trainers keep the old primaries of buckets handed over until their copy is there
            self.maps[job] = dataclasses.replace(new, primary=tuple(
                old.primary[b] if b in handed else p for b, p in enumerate(new.primary)))
            spec = self.specs[job].to_wire(new.size)
            await self._promote(job, old, new, copies)
            for trainer in new.departed.keys() - old.departed.keys():
                await asyncio.gather(*(
                    self._call(w, "antdt_tables_depart", job=job, trainer=trainer,
                               synced=new.departed[trainer]) for w in new.workers()))
            failed = [c for c in copies if not await self._copy(job, c, new.epoch, spec)]
            new = await self._without_failed(job, old, new, failed)
            self.maps[job] = new
            await self._drop(job, old, new)
            if new.lost:
                logger.error("job %s: %s", job, self.lost(job))

    async def _promote(self, job: str, old: BucketMap, new: BucketMap,
                       copies: Sequence[Copy]) -> None:
        """Tell the new primaries of buckets whose primary left (not hand-overs: those happen
        in their copy)."""
        handed = {c.bucket for c in copies if c.promote}
        promoted: dict[str, list[int]] = {}
        for b in range(new.buckets):
            if new.primary[b] != old.primary[b] and b not in handed and b not in new.lost:
                promoted.setdefault(new.primary[b], []).append(b)
        pending = {c.bucket for c in copies}
        for worker, buckets in promoted.items():
            for awaiting in (True, False):
                part = [b for b in buckets if (b in pending) == awaiting]
                if part:
                    await self._call(worker, "antdt_tables_promote", job=job, buckets=part,
                                     epoch=new.epoch, awaiting=awaiting)

    async def _copy(self, job: str, copy: Copy, epoch: int, spec: dict[str, Any]) -> bool:
        """Whether ``copy`` was made (a few attempts while both workers are there)."""
        for attempt in range(COPY_ATTEMPTS):
            if copy.source not in self.scheduler.workers \
                    or copy.target not in self.scheduler.workers:
                return False
            reply = await self._call(copy.source, "antdt_tables_copy", job=job,
                                     bucket=copy.bucket, target=copy.target, epoch=epoch,
                                     promote=copy.promote, spec=spec)
            if reply.get("status") == "OK":
                self.moves[job] = self.moves.get(job, 0) + 1
                return True
            logger.warning("job %s: copying bucket %d from %s to %s failed (attempt %d): %s",
                           job, copy.bucket, copy.source, copy.target, attempt + 1,
                           reply.get("message"))
        return False

    async def _without_failed(self, job: str, old: BucketMap, new: BucketMap,
                              failed: Sequence[Copy]) -> BucketMap:
        """The map once ``failed`` copies are given up: a hand-over keeps its old primary and
        backup; a new backup is dropped. The primary of every bucket left without a backup (no
        other worker, or its copy failed) acknowledges pushes alone until a change makes one
        (it would otherwise wait for it)."""
        primary, backup = list(new.primary), list(new.backup)
        for copy in failed:
            b = copy.bucket
            if copy.promote:
                primary[b], backup[b] = old.primary[b], old.backup[b]
            else:
                backup[b] = None
        alone: dict[str, list[int]] = {}
        for b, (p, q) in enumerate(zip(primary, backup)):
            if q is None and b not in new.lost:
                alone.setdefault(p, []).append(b)
        for worker, buckets in alone.items():
            await self._call(worker, "antdt_tables_promote", job=job, buckets=buckets,
                             epoch=new.epoch, awaiting=False)
        return dataclasses.replace(new, primary=tuple(primary), backup=tuple(backup))

    async def _drop(self, job: str, old: BucketMap, new: BucketMap) -> None:
        """Hosts of the old map that hold a bucket the new one does not give them drop it."""
        drops: dict[str, list[int]] = {}
        for b in range(new.buckets):
            keep = {new.primary[b], new.backup[b]}
            for holder in (old.primary[b], old.backup[b]):
                if holder is not None and holder not in keep and holder not in new.departed:
                    drops.setdefault(holder, []).append(b)
        await asyncio.gather(*(self._call(w, "antdt_tables_drop", job=job, buckets=bs)
                               for w, bs in drops.items()))

    async def _call(self, worker: str, handler: str, **kwargs: Any) -> Reply:
        if worker not in self.scheduler.workers:
            return {"status": "error", "message": f"{worker} left the cluster"}
        try:
            reply: Reply = await getattr(self.scheduler.rpc(worker), handler)(**kwargs)
            return reply
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("%s on %s failed: %r", handler, worker, exc)
            return {"status": "error", "message": repr(exc)}

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _map(self, job: object) -> BucketMap:
        name = rpc.name("job", job, SyncError)
        current = self.maps.get(name)
        if current is None:
            raise SyncError(f"job {name!r} has no sharded tables here; jobs with tables: "
                            f"{sorted(self.maps)[:20]}")
        return current

    def _synced_rows(self, job: str, worker: str) -> int:
        sharding = self.scheduler.plugins.get(SHARDING_PLUGIN)
        ledger = sharding.jobs.get(job) if isinstance(sharding, ShardingService) else None
        return 0 if ledger is None else ledger.synced_rows(worker)

    async def settled(self, job: str) -> None:
        """Wait for the changes of ``job`` under way (tests, the end of a job)."""
        lock = self._locks.get(job)
        while self._tasks:
            await asyncio.wait(list(self._tasks))
        if lock is not None:
            async with lock:
                pass
