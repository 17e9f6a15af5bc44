"""A trainer's side of the sharded tables (:class:`TableClient`): pull the rows a batch reads
from their primaries, push the batch's row gradients back, at most ``max_inflight`` batches
unacknowledged (the staleness bound K: a step waits for the oldest push while K are in flight).

A batch's push is one message a primary holding its rows, sent on the worker's event loop while
the training thread goes on; it is acknowledged once every part is applied on the bucket's
primary and its backup. A part whose host moved the bucket (``moved``) or left (a comm error)
is sent again, to the primary of the current map, with the same ``seq``: a host that already
applied it does not apply it again. :meth:`TableClient.acked_rows` is what the trainer may
report to the ledger as synced: the rows of every batch whose push, and every push before it,
was acknowledged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
from distributed import Worker
from distributed.protocol.serialize import Serialize
from distributed.utils import sync

from antdt import config, rpc
from antdt.errors import SyncError
from antdt.tables.buckets import BucketMap
from antdt.tables.serving import array, tensor, unless_gone
from antdt.tables.store import Fenced, Stale

logger = logging.getLogger(__name__)

RETRY_S = 0.02
"""A part refused for now (a bucket moving, a backup being made) is sent again after this."""


def _plain(value: Any) -> Any:
    """A value as it arrives over the comm (``to_serialize`` unwrapped)."""
    return value.data if isinstance(value, Serialize) else value


@dataclass
class _Push:
    seq: int
    offset: int
    future: Future[None]


class TableClient:
    """One trainer's pulls and pushes of ``job``'s tables (see the module docstring);
    ``trainer``: its name in the hosts' entries (the worker's address, as the ledger names it).
    """

    def __init__(self, job: str, worker: Worker, max_inflight: int,
                 timeout_s: float | None = None) -> None:
        self.job = job
        self.worker = worker
        self.trainer = worker.address
        self.max_inflight = max_inflight
        self.timeout_s = config.seconds("antdt.sync.rpc-timeout") if timeout_s is None \
            else timeout_s
        self.map: BucketMap | None = None
        self.spec: dict[str, Any] = {}
        self._inflight: collections.deque[_Push] = collections.deque()
        self._acked = 0
        self.confirmed = 0
        self.waited_s = 0.0
        self.pull_s = 0.0
        self.push_s = 0.0  # sent to acknowledged, summed over the acknowledged pushes
        self.pulls = self.pushes = self.acked = self.retries = 0
        self._host_pulls: dict[str, list[float]] = {}  # since the last report: [seconds, n]
        self._report_every = config.seconds("antdt.tables.report-interval")
        self._reported = time.monotonic()
        self._reports: set[asyncio.Task[None]] = set()

    # ---- the map ------------------------------------------------------------------------------

    def refresh(self) -> BucketMap:
        """Fetch the job's current map from the scheduler."""
        return sync(self.worker.loop, self._refresh)

    async def _refresh(self) -> BucketMap:
        reply = rpc.ok(await self.worker.scheduler.antdt_tables_map(job=self.job), SyncError)
        self.map = BucketMap.from_wire(reply["map"])
        self.spec = dict(reply["spec"])
        return self.map

    def _hosts(self, current: BucketMap, ids: torch.Tensor, local: bool = False
               ) -> dict[str, torch.Tensor]:
        """Index into ``ids`` (sorted) per primary; with ``local``, per this worker for the
        buckets it holds as primary or backup (a read: :meth:`BucketStore.pull`)."""
        me = self.worker.address
        primaries = [me if local and me in (p, q) else p
                     for p, q in zip(current.primary, current.backup)]
        buckets = current.bucket_of(ids)
        lost = set(current.lost)
        if lost and any(int(b) in lost for b in torch.unique(buckets)):
            raise SyncError(f"job {self.job}: rows of lost buckets {sorted(lost)[:8]} asked")
        by: dict[str, list[torch.Tensor]] = {}
        values, counts = torch.unique_consecutive(buckets, return_counts=True)
        index = torch.arange(ids.shape[0])
        for b, part in zip(values.tolist(), torch.split(index, counts.tolist())):
            by.setdefault(primaries[b], []).append(part)
        return {host: torch.cat(parts) for host, parts in by.items()}

    # ---- pulls --------------------------------------------------------------------------------

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        """The current weights ``(len(ids), dim)`` of global rows ``ids`` (int64, sorted)."""
        started = time.perf_counter()
        rows = sync(self.worker.loop, self._pull, ids)
        self.pull_s += time.perf_counter() - started
        self.pulls += 1
        return rows

    async def _pull(self, ids: torch.Tensor) -> torch.Tensor:
        deadline = time.monotonic() + self.timeout_s
        current = self.map if self.map is not None else await self._refresh()
        out = torch.empty(ids.shape[0], int(self.spec["dim"]))
        todo = torch.arange(ids.shape[0])
        local = True  # the first try reads this worker's own buckets, backups included
        while todo.numel():
            parts = self._hosts(current, ids[todo], local)
            local = False
            replies = await asyncio.gather(*(self._pull_from(host, ids[todo[index]])
                                             for host, index in parts.items()))
            left = []
            for (host, index), rows in zip(parts.items(), replies):
                if rows is None:
                    left.append(todo[index])
                else:
                    out[todo[index]] = rows
            todo = torch.cat(left) if left else todo[:0]
            if todo.numel():
                current = await self._again(deadline, "pulling rows")
        if self._host_pulls and time.monotonic() - self._reported >= self._report_every:
            self._report_latency()
        return out

    def _report_latency(self) -> None:
        """Tell the scheduler the mean pull milliseconds from each other host since the last
        report (it judges slow hosts: :class:`~antdt.tables.slow.SlowHosts`); not waited for."""
        pulls_ms = {host: 1000 * s / n for host, (s, n) in self._host_pulls.items()}
        self._host_pulls = {}
        self._reported = time.monotonic()

        async def send() -> None:
            with contextlib.suppress(OSError, asyncio.TimeoutError):
                await self.worker.scheduler.antdt_tables_latency(
                    job=self.job, worker=self.trainer, pulls_ms=pulls_ms)
        task = asyncio.ensure_future(send())
        self._reports.add(task)
        task.add_done_callback(self._reports.discard)

    async def _call(self, host: str, handler: str, **kwargs: Any) -> Any:
        """``handler`` on ``host``; on this worker itself, without the comm (no copy)."""
        if host == self.worker.address:
            own = self.worker.handlers[handler]
            return await own(**{k: _plain(v) for k, v in kwargs.items()})
        return await unless_gone(self.worker, self.job, host,
                                 getattr(self.worker.rpc(host), handler)(**kwargs))

    async def _pull_from(self, host: str, ids: torch.Tensor) -> torch.Tensor | None:
        started = time.monotonic()
        try:
            reply = await self._call(host, "antdt_tables_pull", job=self.job, ids=array(ids))
        except (OSError, asyncio.TimeoutError):
            return None
        if host != self.worker.address:
            seen = self._host_pulls.setdefault(host, [0.0, 0])
            seen[0] += time.monotonic() - started
            seen[1] += 1
        if reply.get("status") != "OK":
            if reply.get("moved"):
                return None
            raise SyncError(f"pulling rows from {host}: {reply.get('message')}")
        return tensor(_plain(reply["rows"]), "rows", torch.float32)

    async def _again(self, deadline: float, what: str) -> BucketMap:
        """Wait a little and fetch the map again before sending what was refused."""
        self.retries += 1
        if time.monotonic() > deadline:
            raise SyncError(f"job {self.job}: {what} did not succeed within "
                            f"{self.timeout_s:g}s (buckets moving or their hosts gone)")
        await asyncio.sleep(RETRY_S)
        return await self._refresh()

    # ---- pushes -------------------------------------------------------------------------------

    def room(self) -> None:
        """Wait while ``max_inflight`` pushes are unacknowledged (the staleness bound)."""
        if len(self._inflight) < self.max_inflight:
            self._collect()
            return
        started = time.perf_counter()
        while len(self._inflight) >= self.max_inflight:
            self._inflight[0].future.result(timeout=self.timeout_s * 2)
            self._collect()
        self.waited_s += time.perf_counter() - started

    def push(self, seq: int, offset: int, ids: torch.Tensor, grads: torch.Tensor) -> None:
        """Send batch ``seq``'s row gradients (``offset``: the trained rows once it counts),
        without waiting for them to be applied."""
        loop = self.worker.loop.asyncio_loop  # type: ignore[attr-defined]
        future = asyncio.run_coroutine_threadsafe(self._push(seq, offset, ids, grads), loop)
        self._inflight.append(_Push(seq, offset, future))
        self.pushes += 1

    async def _push(self, seq: int, offset: int, ids: torch.Tensor, grads: torch.Tensor
                    ) -> None:
        sent = time.monotonic()
        deadline = sent + self.timeout_s
        current = self.map if self.map is not None else await self._refresh()
        todo = torch.arange(ids.shape[0])
        while todo.numel():
            parts = self._hosts(current, ids[todo])
            done = await asyncio.gather(*(
                self._push_to(host, seq, offset, ids[todo[index]], grads[todo[index]])
                for host, index in parts.items()))
            left = [todo[index] for (host, index), ok in zip(parts.items(), done) if not ok]
            todo = torch.cat(left) if left else todo[:0]
            if todo.numel():
                current = await self._again(deadline, f"pushing batch {seq}")
        self.push_s += time.monotonic() - sent
        self.acked += 1

    async def _push_to(self, host: str, seq: int, offset: int, ids: torch.Tensor,
                       grads: torch.Tensor) -> bool:
        try:
            reply = await self._call(
                host, "antdt_tables_push", job=self.job, trainer=self.trainer, seq=seq,
                offset=offset, confirmed=self.confirmed, ids=array(ids), grads=array(grads))
        except (OSError, asyncio.TimeoutError):
            return False
        if reply.get("status") != "OK":
            if reply.get("fenced"):
                raise Fenced(str(reply.get("message")))
            if reply.get("moved"):
                return False
            raise SyncError(f"pushing batch {seq} to {host}: {reply.get('message')}")
        return not reply.get("retry")

    def _collect(self) -> None:
        """Count the acknowledged pushes at the front (raising the failure of one)."""
        while self._inflight and self._inflight[0].future.done():
            done = self._inflight.popleft()
            done.future.result()
            self._acked = done.offset

    def stats(self) -> dict[str, float]:
        """What the trainer saw of the tables so far: mean pull and push (to acknowledged)
        milliseconds, pushes in flight now, seconds steps waited for the staleness bound, and
        the pulls, pushes and retries made."""
        return {"pull_ms": round(1000 * self.pull_s / max(self.pulls, 1), 2),
                "push_ms": round(1000 * self.push_s / max(self.acked, 1), 2),
                "inflight": len(self._inflight), "waited_s": round(self.waited_s, 3),
                "pulls": self.pulls, "pushes": self.pushes, "retries": self.retries}

    def acked_rows(self, trained_rows: int) -> int:
        """The trained rows whose pushes, and every push before, are acknowledged."""
        self._collect()
        return trained_rows if not self._inflight else self._acked

    def drain(self) -> None:
        """Wait until every push is acknowledged."""
        while self._inflight:
            self._inflight[0].future.result(timeout=self.timeout_s * 2)
            self._collect()

    def committed(self, synced: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables ``(total_rows, dim)`` and their optimiser state, holding exactly the
        rows ``synced`` (the ledger's synced rows per worker) counts, gathered from the
        primaries."""
        return sync(self.worker.loop, self._committed, dict(synced))

    async def _committed(self, synced: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        current = await self._refresh()
        width = None
        weights = torch.empty(current.total_rows, int(self.spec["dim"]))
        states: list[torch.Tensor] = []

        async def one(b: int) -> None:
            nonlocal width
            deadline = time.monotonic() + self.timeout_s
            while True:
                host = (self.map or current).primary[b]
                try:
                    reply = await unless_gone(
                        self.worker, self.job, host, self.worker.rpc(host).antdt_tables_committed(
                            job=self.job, bucket=b, synced=synced))
                except (OSError, asyncio.TimeoutError):
                    reply = {"status": "error", "moved": True}
                if reply.get("status") == "OK":
                    break
                message = str(reply.get("message"))
                if reply.get("stale"):
                    raise Stale(message)
                if not reply.get("moved"):
                    raise SyncError(f"bucket {b} from {host}: {message}")
                await self._again(deadline, f"copying bucket {b}")
            start = int(reply["start"])
            part = tensor(reply["weights"], "weights", torch.float32)
            weights[start:start + part.shape[0]] = part
            state = tensor(reply["state"], "state", torch.float32)
            width = state.shape[1]
            states.append((start, state))  # type: ignore[arg-type]

        await asyncio.gather(*(one(b) for b in range(current.buckets)))
        state_all = torch.zeros(current.total_rows, width or 0)
        for start, part in states:  # type: ignore[misc]
            state_all[start:start + part.shape[0]] = part
        return weights, state_all

    def write(self, folder: str, synced: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Every primary writes its buckets' committed rows (exactly the rows ``synced``
        counts) into ``folder``, a part a bucket, of a model in parts; each file's name with
        its size and checksum. :class:`Stale` when confirmations passed ``synced``."""
        return sync(self.worker.loop, self._write, folder, dict(synced))

    async def _write(self, folder: str, synced: dict[str, int]) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + self.timeout_s
        current = await self._refresh()
        while True:
            hosts = sorted(set(current.primary))
            replies = await asyncio.gather(*(
                self._call(host, "antdt_tables_write", job=self.job, folder=folder,
                           count=current.buckets, synced=synced,
                           buckets=[b for b, p in enumerate(current.primary) if p == host])
                for host in hosts), return_exceptions=True)
            done = [r for r in replies if isinstance(r, dict) and r.get("status") == "OK"]
            if len(done) == len(replies):
                return {name: digest for r in done for name, digest in r["files"].items()}
            for reply in replies:
                if isinstance(reply, dict) and reply.get("stale"):
                    raise Stale(str(reply.get("message")))
                if isinstance(reply, dict) and reply.get("status") != "OK" \
                        and not reply.get("moved"):
                    raise SyncError(f"writing the tables into {folder}: {reply.get('message')}")
            current = await self._again(deadline, f"writing the tables into {folder}")
