"""The worker extension that serves a job's buckets (:class:`TablesWorkerPlugin`), as Dask's
P2P shuffle serves its partitions: comm handlers of its own on every worker, the work in a
thread pool off the event loop, the state in the worker process (not in a task or an actor, so
``retire_workers`` and ``Adaptive`` treat the worker as any other).

Handlers (keyword arguments; every reply ``{"status": "OK", ...}`` or ``{"status": "error",
"message": ...}``, with ``"moved": True`` when the caller's map is stale):

* ``antdt_tables_pull(job, ids)``: the weights ``(n, dim)`` of global rows ``ids`` (int64,
  sorted), every one in a bucket this worker is primary of;
* ``antdt_tables_push(job, trainer, seq, offset, confirmed, ids, grads)``: apply a batch's row
  gradients once (:meth:`~antdt.tables.store.BucketStore.push`), forward the changes to each
  bucket's backup and answer once both hold them; ``"retry": True`` when a bucket has no
  backup yet (its copy is being made): the trainer pushes again (applied once) until it has;
  ``confirmed``: the trainer's rows the ledger confirmed (entries up to there are dropped);
* ``antdt_tables_forward(job, trainer, epoch, entries)``: a primary's changes, on its backup;
* ``antdt_tables_copy(job, bucket, target, epoch, promote)``: send a bucket to ``target`` as
  its backup under the bucket's lock (pushes to it wait), then forward to it; with
  ``promote``, hand the primary role to it (this worker stays its backup);
* ``antdt_tables_install(job, spec, epoch, bucket)``, ``antdt_tables_promote(job, buckets,
  epoch, awaiting)``, ``antdt_tables_drop(job, buckets)``, ``antdt_tables_depart(job, trainer,
  synced)``, ``antdt_tables_committed(job, bucket, synced)``, ``antdt_tables_forget(job)``:
  the scheduler's and the copies' side.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch
from distributed import Worker
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.protocol import to_serialize
from distributed.utils import sync

from antdt import config, rpc
from antdt.errors import SyncError
from antdt.rpc import Reply
from antdt.tables.buckets import BucketMap
from antdt.tables.optim import RowOptimizer
from antdt.tables.store import BucketState, BucketStore, Entry, Fenced, NotHeld, Stale

logger = logging.getLogger(__name__)

T = TypeVar("T")

WATCH_S = 0.5
"""How often a call to another host that has not answered asks the scheduler whether that host
still holds buckets of the job (:func:`unless_gone`)."""


async def unless_gone(worker: Worker, job: str, host: str, call: Awaitable[T]) -> T:
    """``call`` to ``host``; :class:`OSError` once the job's map no longer has ``host``, or
    when ``host`` answers nothing (a worker closing, retired, replies None). A dead worker's
    connect is retried for the whole connect timeout (30 s), as long as a pull or a push may
    take: its buckets were served by their backups long before."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=WATCH_S)
            if done:
                result = task.result()
                if result is None:
                    raise OSError(f"{host} answered nothing (closing)")
                return result
            reply = await worker.scheduler.antdt_tables_map(job=job)
            if reply.get("status") == "OK" \
                    and host not in BucketMap.from_wire(reply["map"]).workers():
                raise OSError(f"{host} holds no bucket of job {job} any more")
    finally:
        task.cancel()

PLUGIN_NAME = "antdt-tables"
HANDLERS = ("pull", "push", "forward", "copy", "write", "install", "promote", "drop",
            "depart", "committed", "forget")

Initial = Callable[[int, int], tuple[torch.Tensor, torch.Tensor | None]]
Writer = Callable[[str, int, int, list[tuple[int, torch.Tensor, torch.Tensor]]],
                  tuple[str, dict[str, Any]]]
"""Write buckets ``(first row, weights, state)`` as part ``index`` of ``count`` into a folder;
the file's name and its size and checksum (the trainer's :meth:`write_part`)."""
"""The initial weights of global rows ``[start, stop)`` and their optimiser state (the
trainer's seed and no state, or a restored checkpoint's)."""


def array(tensor: torch.Tensor) -> Any:
    return to_serialize(np.ascontiguousarray(tensor.detach().cpu().numpy()))


def tensor(value: Any, what: str, dtype: torch.dtype) -> torch.Tensor:
    """A received numpy array as a tensor of ``dtype`` (copied when it arrived read-only)."""
    if not isinstance(value, np.ndarray):
        raise SyncError(f"{what} must be a numpy array, found {type(value).__name__}")
    found = torch.from_numpy(value if value.flags.writeable and value.flags.c_contiguous
                             else np.array(value))
    if found.dtype != dtype:
        raise SyncError(f"{what} must be {dtype}, found {found.dtype}")
    return found


def new_store(job: str, spec: Mapping[str, Any]) -> BucketStore:
    """An empty store of ``job`` from its tables spec (the scheduler's
    :meth:`~antdt.tables.service.TablesSpec.to_wire`)."""
    try:
        optimizer = RowOptimizer(str(spec["optimizer"]), float(spec["lr"]), float(spec["eps"]))
        return BucketStore(job, optimizer, int(spec["dim"]), int(spec["size"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise SyncError(f"a tables spec needs optimizer, lr, eps, dim and size; found "
                        f"{dict(spec)}") from exc


def entries_msg(items: list[tuple[int, Entry]]) -> dict[str, Any]:
    """Entries of buckets as one message: their fields as lists and their tensors end to end
    (three frames on the comm whatever the number of buckets)."""
    if not items:
        return {"buckets": [], "seqs": [], "offsets": [], "counts": []}
    entries = [e for _, e in items]
    return {"buckets": [b for b, _ in items], "seqs": [e.seq for e in entries],
            "offsets": [e.offset for e in entries],
            "counts": [e.rows.shape[0] for e in entries],
            "rows": array(torch.cat([e.rows for e in entries])),
            "weights": array(torch.cat([e.weights for e in entries])),
            "state": array(torch.cat([e.state for e in entries]))}


def msg_entries(msg: Mapping[str, Any]) -> list[tuple[int, Entry]]:
    """:func:`entries_msg`'s entries back."""
    try:
        buckets, seqs, offsets, counts = (list(msg[k]) for k in
                                          ("buckets", "seqs", "offsets", "counts"))
    except (KeyError, TypeError) as exc:
        raise SyncError(f"entries need buckets, seqs, offsets and counts: {exc!r}") from exc
    if not buckets:
        return []
    if not len(buckets) == len(seqs) == len(offsets) == len(counts):
        raise SyncError("entries' buckets, seqs, offsets and counts differ in length")
    parts = [torch.split(tensor(msg[k], k, dtype), [int(c) for c in counts])
             for k, dtype in (("rows", torch.int64), ("weights", torch.float32),
                              ("state", torch.float32))]
    return [(int(b), Entry(int(seq), int(offset), rows, weights, state))
            for b, seq, offset, rows, weights, state
            in zip(buckets, seqs, offsets, *parts)]


class TablesWorkerPlugin(WorkerPlugin):
    """Per worker: each job's :class:`BucketStore`, its initial-row drawing, and the handlers
    of the module docstring over a small thread pool (``antdt.tables.threads``)."""

    name = PLUGIN_NAME
    idempotent = True

    def __init__(self) -> None:
        self.stores: dict[str, BucketStore] = {}
        self.initial: dict[str, Initial] = {}
        self.writers: dict[str, Writer] = {}

    def __reduce__(self) -> tuple[type[TablesWorkerPlugin], tuple[()]]:
        return TablesWorkerPlugin, ()

    def setup(self, worker: Worker) -> None:
        self.worker = worker
        self.pool = ThreadPoolExecutor(int(config.number("antdt.tables.threads", low=1, integer=True)),
                                       thread_name_prefix="antdt-tables")
        for name in HANDLERS:
            worker.handlers[f"antdt_tables_{name}"] = getattr(self, f"{name}_handler")

    async def teardown(self, worker: Worker) -> None:
        """The worker closes (retired by Dask, ``Adaptive``, or shut down): its buckets are
        drained first, while it still serves them: the scheduler promotes their backups and
        makes new ones before the worker goes (``antdt_tables_drain``; bounded by
        ``antdt.sync.rpc-timeout``)."""
        for job in [job for job, store in self.stores.items() if store.buckets]:
            try:
                await asyncio.wait_for(worker.scheduler.antdt_tables_drain(
                    job=job, worker=worker.address), config.seconds("antdt.sync.rpc-timeout"))
            except (OSError, asyncio.TimeoutError) as exc:
                logger.warning("job %s: could not drain the buckets of %s: %r", job,
                               worker.address, exc)
        for name in HANDLERS:
            worker.handlers.pop(f"antdt_tables_{name}", None)
        self.stores.clear()
        self.pool.shutdown(wait=False)

    def open(self, job: str, initial: Initial, writer: Writer) -> None:
        """This worker's trainer of ``job`` draws initial rows with ``initial`` and writes a
        model's part with ``writer``."""
        self.initial[job] = initial
        self.writers[job] = writer

    def create(self, job: str, spec: Mapping[str, Any], current: BucketMap, worker: str
               ) -> None:
        """Hold ``worker``'s buckets of ``job``'s first map, drawn from its trainer's initial
        rows (:meth:`open`)."""
        store = self._ensure(job, spec)
        store.departed.update(current.departed)
        _create(store, current, worker, self.initial[job])

    def store(self, job: object) -> BucketStore:
        found = self.stores.get(rpc.name("job", job, SyncError))
        if found is None:
            raise NotHeld(f"job {job}: no buckets on {self.worker.address}")
        return found

    def _ensure(self, job: str, spec: Mapping[str, Any]) -> BucketStore:
        found = self.stores.get(job)
        if found is None:
            found = self.stores[job] = new_store(job, spec)
        return found

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            future = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except RuntimeError as exc:  # the pool is shut down: this worker is closing (retired)
            raise OSError(f"{self.worker.address} is closing: {exc}") from exc
        return await future

    # ---- trainers ---------------------------------------------------------------------------

    @rpc.handler
    async def pull_handler(self, job: object, ids: object) -> Reply:
        store = self.store(job)
        wanted = tensor(ids, "ids", torch.int64)
        try:
            rows = await self._run(_pull, store, wanted)
        except NotHeld as exc:
            return {"status": "error", "message": str(exc), "moved": True}
        return {"status": "OK", "rows": array(rows)}

    @rpc.handler
    async def push_handler(self, job: object, trainer: object, seq: object, offset: object,
                           confirmed: object, ids: object, grads: object) -> Reply:
        store = self.store(job)
        who = rpc.name("trainer", trainer, SyncError)
        seq_ = rpc.integer("seq", seq, error=SyncError)
        offset_ = rpc.integer("offset", offset, error=SyncError)
        confirmed_ = rpc.integer("confirmed", confirmed, error=SyncError)
        try:
            forwards, retry = await self._run(
                _push, store, who, seq_, offset_, tensor(ids, "ids", torch.int64),
                tensor(grads, "grads", torch.float32))
        except Fenced as exc:
            return {"status": "error", "message": str(exc), "fenced": True}
        except NotHeld as exc:
            return {"status": "error", "message": str(exc), "moved": True}
        failed = await self._forward(store, who, forwards)
        await self._run(store.confirm, who, confirmed_, None)
        return {"status": "OK", "retry": retry or bool(failed)}

    async def _forward(self, store: BucketStore, trainer: str,
                       forwards: Mapping[str, list[tuple[int, Entry, int]]]) -> list[int]:
        """Send each backup its changes; the buckets whose backup failed (it loses the role:
        the scheduler makes a new one from this primary, entries included)."""
        async def send(backup: str, items: list[tuple[int, Entry, int]]) -> list[int]:
            epoch = max(e for _, _, e in items)
            try:
                rpc.ok(await unless_gone(
                    self.worker, store.job, backup, self.worker.rpc(backup).antdt_tables_forward(
                        job=store.job, trainer=trainer, epoch=epoch,
                        entries=entries_msg([(b, entry) for b, entry, _ in items]))), SyncError)
                return []
            except (OSError, SyncError, asyncio.TimeoutError) as exc:
                logger.warning("job %s: forwarding to backup %s failed: %r", store.job,
                               backup, exc)
                return [b for b, _, _ in items]
        lost = [b for found in await asyncio.gather(*(send(k, v) for k, v in forwards.items()))
                for b in found]
        for bucket in lost:
            await self._run(_lose_backup, store, bucket)
        if lost:
            await self._tell_scheduler(store.job, lost)
        return lost

    async def _tell_scheduler(self, job: str, buckets: list[int]) -> None:
        try:
            await self.worker.scheduler.antdt_tables_backup_lost(
                job=job, worker=self.worker.address, buckets=buckets)
        except OSError as exc:
            logger.warning("job %s: could not report lost backups %s: %r", job, buckets, exc)

    @rpc.handler
    async def forward_handler(self, job: object, trainer: object, epoch: object,
                              entries: object) -> Reply:
        store = self.store(job)
        who = rpc.name("trainer", trainer, SyncError)
        epoch_ = rpc.integer("epoch", epoch, error=SyncError)
        if not isinstance(entries, Mapping):
            raise SyncError(f"entries must be a mapping, found {type(entries).__name__}")
        items = msg_entries(entries)
        await self._run(_add, store, who, items, epoch_)
        return {"status": "OK"}

    # ---- the scheduler's side ---------------------------------------------------------------

    @rpc.handler
    async def copy_handler(self, job: object, bucket: object, target: object, epoch: object,
                           promote: object = False, spec: object = None) -> Reply:
        store = self.store(job)
        b = rpc.integer("bucket", bucket, error=SyncError)
        to = rpc.name("target", target, SyncError)
        epoch_ = rpc.integer("epoch", epoch, error=SyncError)
        await self._run(self._copy, store, b, to, epoch_, bool(promote), spec)
        return {"status": "OK"}

    def _copy(self, store: BucketStore, bucket: int, target: str, epoch: int, promote: bool,
              spec: Any) -> None:
        """In a pool thread: under the bucket's lock (its pushes wait), export it, install it
        on ``target`` and forward to it from then on (or hand it the primary role)."""
        held = store.held(bucket, "primary")
        with held.lock:
            store.still_held(held, "primary")
            state = held.export()
            rpc.ok(sync(self.worker.loop, self._install_on, target, store.job, spec, epoch,
                        state), SyncError)
            if promote:
                rpc.ok(sync(self.worker.loop, self._promote_on, target, store.job, bucket,
                            epoch, self.worker.address), SyncError)
                held.role, held.epoch, held.backup = "backup", epoch, None
            else:
                held.backup, held.awaiting, held.epoch = target, False, epoch

    async def _install_on(self, target: str, job: str, spec: Any, epoch: int,
                          state: BucketState) -> Reply:
        return await self.worker.rpc(target).antdt_tables_install(
            job=job, spec=spec, epoch=epoch, bucket=_state_msg(state))

    async def _promote_on(self, target: str, job: str, bucket: int, epoch: int,
                          backup: str) -> Reply:
        return await self.worker.rpc(target).antdt_tables_promote(
            job=job, buckets=[bucket], epoch=epoch, awaiting=False, backup=backup)

    @rpc.handler
    async def install_handler(self, job: object, spec: object, epoch: object,
                              bucket: object) -> Reply:
        name = rpc.name("job", job, SyncError)
        if not isinstance(spec, Mapping) or not isinstance(bucket, Mapping):
            raise SyncError("install needs a spec and a bucket")
        store = self._ensure(name, spec)
        await self._run(store.install, _msg_state(bucket),
                        rpc.integer("epoch", epoch, error=SyncError))
        return {"status": "OK"}

    @rpc.handler
    async def promote_handler(self, job: object, buckets: object, epoch: object,
                              awaiting: object = False, backup: object = None) -> Reply:
        store = self.store(job)
        epoch_ = rpc.integer("epoch", epoch, error=SyncError)
        for b in _buckets(buckets):
            store.promote(b, epoch_, None if backup is None else str(backup), bool(awaiting))
        return {"status": "OK"}

    @rpc.handler
    async def drop_handler(self, job: object, buckets: object) -> Reply:
        store = self.store(job)
        for b in _buckets(buckets):
            store.drop(b)
        return {"status": "OK"}

    @rpc.handler
    async def depart_handler(self, job: object, trainer: object, synced: object) -> Reply:
        name = rpc.name("job", job, SyncError)
        store = self.stores.get(name)
        out = 0 if store is None else await self._run(
            store.depart, rpc.name("trainer", trainer, SyncError),
            rpc.integer("synced", synced, error=SyncError))
        return {"status": "OK", "taken_out": out}

    @rpc.handler
    async def committed_handler(self, job: object, bucket: object, synced: object) -> Reply:
        store = self.store(job)
        if not isinstance(synced, Mapping):
            raise SyncError(f"synced must be a mapping, found {type(synced).__name__}")
        try:
            start, weights, state = await self._run(
                store.committed, rpc.integer("bucket", bucket, error=SyncError),
                {str(k): int(v) for k, v in synced.items()})
        except Stale as exc:
            return {"status": "error", "message": str(exc), "stale": True}
        except NotHeld as exc:
            return {"status": "error", "message": str(exc), "moved": True}
        return {"status": "OK", "start": start, "weights": array(weights),
                "state": array(state)}

    @rpc.handler
    async def write_handler(self, job: object, folder: object, count: object,
                            buckets: object, synced: object) -> Reply:
        """Write the committed rows of each of ``buckets`` (held here) as its own part (index:
        the bucket, of ``count``) of a model in parts into ``folder``, one bucket at a time (a
        copy of one bucket at most beside the tables)."""
        store = self.store(job)
        where = rpc.name("folder", folder, SyncError)
        parts = rpc.integer("count", count, 1, error=SyncError)
        if not isinstance(synced, Mapping):
            raise SyncError(f"synced must be a mapping, found {type(synced).__name__}")
        writer = self.writers.get(store.job)
        if writer is None:
            raise SyncError(f"job {store.job}: no trainer here writes its parts")
        rows = {str(k): int(v) for k, v in synced.items()}
        try:
            files = await self._run(_write, store, writer, where, parts, _buckets(buckets), rows)
        except Stale as exc:
            return {"status": "error", "message": str(exc), "stale": True}
        except NotHeld as exc:
            return {"status": "error", "message": str(exc), "moved": True}
        return {"status": "OK", "files": files}

    @rpc.handler
    async def forget_handler(self, job: object) -> Reply:
        name = rpc.name("job", job, SyncError)
        self.stores.pop(name, None)
        self.initial.pop(name, None)
        self.writers.pop(name, None)
        return {"status": "OK"}


def _pull(store: BucketStore, ids: torch.Tensor) -> torch.Tensor:
    out = torch.empty(ids.shape[0], store.dim)
    for bucket, index in _by_bucket(store, ids):
        out[index] = store.pull(bucket, ids[index] - store.held(bucket).start)
    return out


def _push(store: BucketStore, trainer: str, seq: int, offset: int, ids: torch.Tensor,
          grads: torch.Tensor) -> tuple[dict[str, list[tuple[int, Entry, int]]], bool]:
    forwards: dict[str, list[tuple[int, Entry, int]]] = {}
    retry = False
    for bucket, index in _by_bucket(store, ids):
        held = store.held(bucket, "primary")
        entry, backup, awaiting = store.push(trainer, seq, offset, bucket,
                                             ids[index] - held.start, grads[index])
        retry = retry or awaiting
        if entry is not None and backup is not None:
            forwards.setdefault(backup, []).append((bucket, entry, held.epoch))
    return forwards, retry


def _write(store: BucketStore, writer: Writer, folder: str, count: int, buckets: list[int],
           synced: dict[str, int]) -> dict[str, dict[str, Any]]:
    files = {}
    for b in buckets:
        name, digest = writer(folder, b, count, [store.committed(b, synced)])
        files[name] = digest
    return files


def _add(store: BucketStore, trainer: str, items: list[tuple[int, Entry]], epoch: int) -> None:
    for bucket, entry in items:
        store.forward(trainer, bucket, entry, epoch)


def _lose_backup(store: BucketStore, bucket: int) -> None:
    held = store.buckets.get(bucket)
    if held is not None and held.role == "primary":
        with held.lock:
            held.backup, held.awaiting = None, True


def _create(store: BucketStore, current: BucketMap, worker: str, initial: Initial) -> None:
    primaries, backups = current.held(worker)
    for role, buckets in (("primary", primaries), ("backup", backups)):
        for b in buckets:
            start, stop = current.rows(b)
            weights, state = initial(start, stop)
            store.create(b, start, weights, role, current.epoch,  # type: ignore[arg-type]
                         backup=current.backup[b] if role == "primary" else None, state=state)


def _by_bucket(store: BucketStore, ids: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """``ids`` (sorted) grouped by bucket: ``(bucket, index into ids)``."""
    if ids.numel() == 0:
        return []
    size = store.bucket_size
    buckets = torch.div(ids, size, rounding_mode="floor")
    values, counts = torch.unique_consecutive(buckets, return_counts=True)
    index = torch.arange(ids.shape[0])
    return [(int(b), part) for b, part in zip(values.tolist(), torch.split(index, counts.tolist()))]


def _buckets(value: object) -> list[int]:
    if not isinstance(value, (list, tuple)):
        raise SyncError(f"buckets must be a list, found {type(value).__name__}")
    return [rpc.integer("bucket", b, error=SyncError) for b in value]


def _state_msg(state: BucketState) -> dict[str, Any]:
    return {"bucket": state.bucket, "start": state.start, "weights": array(state.weights),
            "state": array(state.state),
            "entries": {t: entries_msg([(state.bucket, e) for e in es])
                        for t, es in state.entries.items()},
            "confirmed": {t: list(v) for t, v in state.confirmed.items()}}


def _msg_state(msg: Mapping[str, Any]) -> BucketState:
    return BucketState(int(msg["bucket"]), int(msg["start"]),
                       tensor(msg["weights"], "weights", torch.float32),
                       tensor(msg["state"], "state", torch.float32),
                       {str(t): [e for _, e in msg_entries(es)]
                        for t, es in msg["entries"].items()},
                       {str(t): (int(v[0]), int(v[1])) for t, v in msg["confirmed"].items()})
