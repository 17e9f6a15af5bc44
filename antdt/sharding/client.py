"""Worker-side client of the sharding service: a plain synchronous API for an agent.

The agent's loop::

    shards = ShardClient(job)                  # inside a Dask task on a worker
    while (lease := shards.lease()) is not None:
        offset, stop = lease.start, lease.claim_stop
        while True:
            ...train rows [offset, next batch end <= stop)...
            reply = shards.commit(batch_end, synced_rows=replica_synced, stats={...})
            if not isinstance(reply, Claim):
                break                          # Finished / Revoked: lease again; Stop: quit
            ...
    shards.close(synced_rows=...)             # after the final sync round

Batching. ``commit`` is called after every batch, but sends an RPC only when

* a commit interval (``antdt.sharding.commit-interval``, 1 s) has passed since the last RPC, or
* the claim is used up (the worker may not train a row it has not been granted).

Each RPC asks for a claim of ``claim-intervals`` (2) intervals of training at the rate measured
between RPCs, so at steady state the timed RPC renews the claim before it runs out: about one RPC
per interval whatever the batch rate, and a revocation takes effect within about two intervals.
The last commit of a lease is not sent on its own: it rides on the next ``lease`` call (one RPC
per shard boundary), so choose ``shard_rows`` worth at least an interval of training. When the
worker reaches the end of the lease as it knows it, the lease cannot have been cut shorter (a cut
never takes claimed rows), so answering :class:`~antdt.sharding.Finished` locally is exact.

Synced rows. ``synced_rows`` counts, over the worker's whole stream of trained rows (all leases,
in order; :attr:`ShardClient.trained_rows`), how many are already in the shared model - the
``rows_offset`` of :mod:`antdt.sync`. The client maps it back to each lease's synced offset, and
keeps reporting for leases that are fully trained but not yet synced ("draining"). ``None`` means
"everything trained is synced" (local and synchronous modes), unless the client was given a
``synced_rows`` source to read. The source is read right before each RPC (reading it may publish
the worker's deltas), and each RPC also carries the stream's synced rows whole
(:meth:`~antdt.sharding.ShardLedger.report_synced`); once the ledger accepted them,
``confirmed`` is called with them (:attr:`ShardClient.confirmed_rows`): the model sync keeps its
entries past them provisional. While ``lease`` waits for rows it re-reads the source (at least
every ``antdt.sharding.drain-wait`` while this worker's or any other worker's rows await sync), so
draining leases (which keep the job from finishing) complete as the sync advances: a row is
synced only once every peer applied it, so an idle worker's rounds matter as much as its
holder's.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from distributed import Client, Status, Worker, get_worker
from distributed.utils import sync

from antdt import config
from antdt.errors import LedgerError
from antdt.sharding.leases import Claim, CommitReply, Finished, Lease, Revoked, Stop, Wait

logger = logging.getLogger(__name__)

Call = Callable[..., dict[str, Any]]


@dataclass
class _Held:
    """A lease this worker holds; its rows are trained rows ``[cum_start, cum_start + offset -
    start)`` of the worker's stream."""

    lease: Lease
    cum_start: int
    offset: int
    synced: int
    claim_stop: int
    stop: int
    sent_offset: int
    sent_synced: int
    revoked: bool = False


class ShardClient:
    """Synchronous access to ``job``'s shards for one worker (see the module docstring).

    ``worker`` defaults to the worker running the calling task; with ``client`` the calls go
    through that client instead (a driver or a benchmark acting for ``worker_address``).
    ``synced_rows``, if given, returns the worker's current synced row count (e.g. the model
    sync's ``ledger_offset``); it is read before every RPC whose call does not pass one, in
    particular while ``lease`` waits, so that leases this worker is still draining can complete.
    ``confirmed(rows)`` is called once the ledger accepted ``rows`` synced rows. ``clock`` is
    monotonic seconds, injectable for tests.
    """

    def __init__(self, job: str, *, worker: Worker | None = None, client: Client | None = None,
                 worker_address: str | None = None, commit_interval_s: float | None = None,
                 claim_intervals: float | None = None, lease_wait_s: float | None = None,
                 drain_wait_s: float | None = None,
                 synced_rows: Callable[[], int] | None = None,
                 confirmed: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job = job
        self._synced_source = synced_rows
        self._confirmed = confirmed
        if client is not None:
            if worker_address is None:
                raise LedgerError("ShardClient with a client needs the worker_address it acts for")
            self.address = worker_address
            self.incarnation: str | None = None
            self._send: Call = lambda op, **kw: client.sync(getattr(client.scheduler, op), **kw)
            self._reachable: Callable[[], bool] = lambda: client.status == "running"
        else:
            dask_worker = worker if worker is not None else get_worker()
            self.address = dask_worker.address
            self.incarnation = dask_worker.id
            self._send = lambda op, **kw: sync(dask_worker.loop, getattr(dask_worker.scheduler,
                                                                         op), **kw)
            self._reachable = lambda: dask_worker.status == Status.running
        self.retry_s = config.seconds("antdt.sharding.retry")
        self.interval = (config.seconds("antdt.sharding.commit-interval")
                         if commit_interval_s is None else commit_interval_s)
        self.claim_intervals = (float(config.defaults["antdt"]["sharding"]["claim-intervals"])
                                if claim_intervals is None else claim_intervals)
        self.lease_wait_s = (config.seconds("antdt.sharding.lease-wait")
                             if lease_wait_s is None else lease_wait_s)
        self.drain_wait_s = (config.seconds("antdt.sharding.drain-wait")
                             if drain_wait_s is None else drain_wait_s)
        self._clock = clock
        self._held: dict[int, _Held] = {}
        self._current: _Held | None = None
        self._next: _Held | None = None
        self._stats: dict[str, float] = {}
        self._stopped: Stop | None = None
        self._last_rpc = clock()
        self._rows_since_rpc = 0
        self._rate = 0.0
        self.trained_rows = 0
        """Rows trained by this worker so far, over all leases (pass to the model sync)."""
        self.synced_rows = 0
        self.confirmed_rows = 0
        """The synced rows the ledger last accepted from this worker."""
        self.rpcs = 0
        """RPCs sent so far."""
        self._seq = secrets.randbits(48)
        """This client's last lease request's number (a retry sends it again); the first is
        drawn, so that a new agent on the same worker never gets an earlier one's reply."""

    def lease(self) -> Lease | None:
        """The next lease, sending pending commits with the request; None when the job is over
        (finished or stopped). While rows may still come back it asks again, waiting server side
        (the first request does not wait: a "wait" reply lets the synced-rows source publish).
        While leases of this worker are draining, or rows of another worker await sync, a
        request waits at most ``drain_wait_s``: the scheduler cannot see this worker's sync
        advance, and the job may be waiting only for it (its own rows, or its acknowledgement
        of a peer's), so the next request must carry it soon."""
        wait_s = 0.0
        while True:
            reply = self._ask(wait_s)
            if not isinstance(reply, Wait):
                return reply
            wait_s = self.drain_wait_s if self.draining or reply.unsynced else \
                self.lease_wait_s

    def poll_lease(self, wait_s: float = 0.0, max_rows: int | None = None,
                   ahead: bool = False) -> Lease | Wait | None:
        """One lease request (pending commits sent with it) that waits at most ``wait_s`` server
        side: the next lease (of at most ``max_rows`` rows when given), :class:`Wait` (nothing
        to lease now, the job is not over) or None (the job is over). The synchronous mode asks
        this way between steps: a rank waiting for rows must not keep its peers waiting in the
        step's collectives. ``ahead``: asked while the current lease is still trained, the lease
        that follows it (one at most): its rows come after the current lease's in the worker's
        stream, and :meth:`commit` goes on with it once the current lease is trained to its end
        (a sync rank's step can end one lease and begin the next)."""
        return self._ask(wait_s, max_rows, ahead)

    def _ask(self, wait_s: float, max_rows: int | None = None, ahead: bool = False
             ) -> Lease | Wait | None:
        waiting = self._next if ahead else self._current
        if waiting is not None:
            raise LedgerError(f"job {self.job!r}: lease {waiting.lease.lease_id} is not "
                              f"finished; commit up to its end before leasing again")
        self._sync_to(None)
        self._seq += 1
        reply = self._rpc("antdt_lease", worker=self.address, commits=self._pending(),
                          claim_rows=self._claim_rows(), wait_s=wait_s,
                          synced_rows=self.synced_rows, max_rows=max_rows,
                          incarnation=self.incarnation, seq=self._seq)
        msg = reply["lease"]
        if msg["kind"] == "stop":
            logger.info("job %s: %s stops leasing (%s)", self.job, self.address, msg["reason"])
            return None
        if msg["kind"] != "lease":
            return Wait(int(msg.get("unsynced", 0)))
        lease = Lease(**{k: v for k, v in msg.items() if k != "kind"})
        held = _Held(lease, self.trained_rows, lease.start, lease.start, lease.claim_stop,
                     lease.stop, lease.start, lease.start)
        self._held[lease.lease_id] = held
        if self._current is None:
            self._current = held
        else:
            self._next = held
        return lease

    def commit(self, offset: int, synced_rows: int | None = None,
               stats: Mapping[str, float] | None = None, claim_ahead: int = 0) -> CommitReply:
        """Rows of the current lease up to ``offset`` are trained; ``synced_rows`` of the
        worker's stream are synced. Returns the claim (possibly unchanged, without an RPC),
        :class:`Finished`/:class:`Revoked` (lease again) or :class:`Stop`. ``claim_ahead``: an
        RPC extends the claim now, not at the next interval, when it holds fewer rows than
        that past ``offset`` and the lease holds more (a sync rank's next step would otherwise
        be cut short by its claim, and a slower peer would train the rest)."""
        held = self._current
        if held is None:
            raise LedgerError(f"job {self.job!r}: commit without a lease on {self.address}")
        if not held.offset <= offset <= held.claim_stop:
            raise LedgerError(f"job {self.job!r} lease {held.lease.lease_id}: offset {offset} "
                              f"outside [{held.offset}, {held.claim_stop}] (committed offset, "
                              f"claim end)")
        self.trained_rows += offset - held.offset
        self._rows_since_rpc += offset - held.offset
        held.offset = offset
        if synced_rows is not None:
            self._sync_to(synced_rows)
        for key, value in (stats or {}).items():
            self._stats[key] = self._stats.get(key, 0.0) + value
        if offset == held.stop:
            self._end_current()
            return Finished(held.lease.lease_id, held.stop, held.synced == held.stop)
        if offset < held.claim_stop and self._clock() - self._last_rpc < self.interval \
                and held.claim_stop - offset >= min(claim_ahead, held.stop - offset):
            return Claim(held.lease.lease_id, held.claim_stop)
        if synced_rows is None:
            self._sync_to(None)
        self._commit(self._pending())
        if self._stopped is not None:
            return self._stopped
        return self._answer_for(held)

    def flush(self, synced_rows: int | None = None) -> None:
        """Send every pending commit now (e.g. the synced offsets after the final sync round)."""
        self._sync_to(synced_rows)
        pending = self._pending()
        if pending:
            self._commit(pending)

    def close(self, synced_rows: int | None = None) -> None:
        """Flush, then give back the leases still held (their unsynced rows are queued again)."""
        self.flush(synced_rows)
        for held in list(self._held.values()):
            self._rpc("antdt_release", lease_id=held.lease.lease_id, token=held.lease.token)
            del self._held[held.lease.lease_id]
        self._current = self._next = None

    @property
    def current(self) -> Lease | None:
        """The lease being trained (None between leases)."""
        return self._current.lease if self._current is not None else None

    @property
    def draining(self) -> list[int]:
        """Lease ids fully trained whose synced offset has not reached their end yet."""
        return [i for i, h in self._held.items() if h not in (self._current, self._next)]

    # ---- internals ----------------------------------------------------------------------------

    def _end_current(self) -> None:
        """The current lease is trained to its end: the lease asked ahead, if any, follows, its
        rows from here on in the worker's stream."""
        self._current, self._next = self._next, None
        if self._current is not None:
            self._current.cum_start = self.trained_rows

    def _sync_to(self, synced_rows: int | None) -> None:
        """Map the worker's synced row count (default: the source, else all trained rows) to
        every held lease's synced offset."""
        if synced_rows is not None:
            synced = synced_rows
        elif self._synced_source is not None:
            synced = self._synced_source()
        else:
            synced = self.trained_rows
        if not self.synced_rows <= synced <= self.trained_rows:
            raise LedgerError(f"job {self.job!r}: synced_rows {synced} outside "
                              f"[{self.synced_rows}, {self.trained_rows}] (previous, trained)")
        self.synced_rows = synced
        for held in self._held.values():
            trained = held.offset - held.lease.start
            held.synced = held.lease.start + max(0, min(synced - held.cum_start, trained))

    def _pending(self) -> list[dict[str, Any]]:
        """A commit item for every held lease with news. The stats gathered since the last RPC
        are shared among the items that report new rows, in proportion to them: each commit
        event carries the busy time of its own rows, so the monitor's BPT stays exact when a
        lease's last rows ride a lease request beside a draining lease's synced offset."""
        news = [held for held in self._held.values()
                if (held.offset, held.synced) != (held.sent_offset, held.sent_synced)]
        pending: list[dict[str, Any]] = [
            {"lease_id": held.lease.lease_id, "token": held.lease.token, "offset": held.offset,
             "synced_offset": held.synced, "claim_rows": self._claim_rows()} for held in news]
        rows = [held.offset - held.sent_offset for held in news]
        total = sum(rows)
        if total > 0 and self._stats:
            for item, item_rows in zip(pending, rows):
                if item_rows > 0:
                    item["stats"] = {key: value * item_rows / total
                                     for key, value in self._stats.items()}
            self._stats = {}
        return pending

    def _commit(self, pending: list[dict[str, Any]]) -> None:
        self._rpc("antdt_commit", commits=pending, worker=self.address,
                  synced_rows=self.synced_rows, incarnation=self.incarnation)

    def _claim_rows(self) -> int | None:
        if self._rate <= 0:
            return None
        return max(1, int(self._rate * self.interval * self.claim_intervals))

    def _call(self, op: str, **kwargs: Any) -> dict[str, Any]:
        """``op`` on the scheduler, sent again while the link fails (``OSError``) for up to
        :attr:`retry_s` (``antdt.sharding.retry``) and this worker still runs: every call is
        safe to repeat (commits carry offsets, a lease request its ``seq``, a release repeated
        finds its lease gone and changes nothing; see
        :mod:`antdt.fencing`). A worker cut off longer is removed by then, and its retry is
        refused."""
        deadline = self._clock() + self.retry_s
        pause = 0.1
        while True:
            try:
                return self._send(op, **kwargs)
            except OSError as exc:
                if self._clock() + pause > deadline or not self._reachable():
                    raise
                logger.warning("job %s: %s from %s failed (%r); sending it again", self.job, op,
                               self.address, exc)
            threading.Event().wait(pause)
            pause = min(2 * pause, 2.0)

    def _rpc(self, op: str, **kwargs: Any) -> dict[str, Any]:
        commits = kwargs.get("commits") or []
        reply = self._call(op, job=self.job, **kwargs)
        self.rpcs += 1
        if reply.get("status") != "OK":
            raise LedgerError(f"job {self.job!r}: {op} from {self.address} failed: "
                              f"{reply.get('message', reply)}")
        now = self._clock()
        elapsed = now - self._last_rpc
        if elapsed > 0 and self._rows_since_rpc:
            rate = self._rows_since_rpc / elapsed
            self._rate = rate if self._rate <= 0 else 0.5 * (self._rate + rate)
        self._last_rpc = now
        self._rows_since_rpc = 0
        for item, answer in zip(commits, reply.get("replies", [])):
            self._apply(item, answer)
        synced = kwargs.get("synced_rows")
        if synced is not None and synced > self.confirmed_rows:
            self.confirmed_rows = synced
            if self._confirmed is not None:
                self._confirmed(synced)
        return reply

    def _apply(self, item: Mapping[str, Any], answer: Mapping[str, Any]) -> None:
        """Record what the scheduler said about one commit."""
        held = self._held.get(item["lease_id"])
        if held is None:
            return
        kind = answer["kind"]
        if kind == "error":
            raise LedgerError(f"job {self.job!r} lease {held.lease.lease_id}: commit refused: "
                              f"{answer['message']}")
        held.sent_offset, held.sent_synced = item["offset"], item["synced_offset"]
        if kind == "stop":
            self._held.clear()
            self._current = self._next = None
            self._stopped = Stop(answer["reason"])
            return
        if kind == "claim":
            held.claim_stop = answer["stop"]
        else:
            held.claim_stop = held.stop = answer["stop"]
            held.revoked = kind == "revoked"
            if answer["retired"]:
                del self._held[held.lease.lease_id]

    def _answer_for(self, held: _Held) -> CommitReply:
        """The reply to the agent for the current lease after an RPC."""
        retired = held.lease.lease_id not in self._held
        if held.offset == held.stop:
            self._end_current()
        if held.revoked:
            return Revoked(held.lease.lease_id, held.stop, retired)
        if held.offset == held.stop:
            return Finished(held.lease.lease_id, held.stop, retired)
        return Claim(held.lease.lease_id, held.claim_stop)
