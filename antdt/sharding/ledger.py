"""Stateful dynamic data sharding (AntDT's SDDS): the shard ledger of one training job.

A plain class with an injected clock and no Dask: :mod:`antdt.sharding.service` wraps it in a
scheduler plugin, tests drive it directly, the simulator drives it at 10,000 workers.

Shards and epochs
-----------------
A job registers row groups ``(path, row_group, num_rows)``. Each row group is cut into **shards**
of ``shard_rows`` rows (the last one shorter); a shard never spans row groups. Row offsets are
row-group relative: a shard, a lease and a claim are all ``[start, stop)`` rows of one row group.
Every epoch visits every shard once, in an order shuffled reproducibly from ``(seed, epoch)``.
Epoch ``e + 1``'s shards become leasable as soon as all of epoch ``e``'s shards were handed out,
so a fast worker may start epoch ``e + 1`` while others finish epoch ``e``.

Row states and the queue
------------------------
Every row of every epoch is in exactly one place::

    TODO         a piece at the front of the queue (requeued rows, LIFO), or a shard of the
                 current epoch's permutation not yet handed out, or a shard of a later epoch
    LEASED       rows [synced, stop) of a live lease
    DONE         rows whose effect reached the shared model (a lease's rows below its synced offset)
    QUARANTINED  rows that could not be read (at registration or reported by a lease holder),
                 each with a :class:`QuarantineRecord` naming file, row group and reason

Leasing pops the queue front (a deque) or advances the epoch cursor: O(1) (near the job's end
it also counts the leasing workers paced to no rows). A commit, revoke or split touches one
lease; removing a worker its own leases. Starting an epoch draws its permutation, O(shards).
Per-shard state is two int32 numpy arrays plus the current epoch's int32 permutation (12 bytes a
shard); paths are interned (row groups store a file index). The shards and the queue are kept by
:mod:`antdt.sharding.dealing`.

Leases, claims and commits
--------------------------
A lease holds rows ``[start, stop)`` of one shard, an unguessable token, and a **claim**: the rows
``[offset, claim_stop)`` its holder may train next (at least one batch). The holder trains exactly
the claimed rows and commits ``offset`` (end of what it trained, ``<= claim_stop``) and
``synced_offset`` (``<= offset``: the rows whose effect is in the shared model; equal to ``offset``
in the local and sync modes). A commit returns

* :class:`Claim` - train on up to ``stop``; the claim grows by ``claim_rows`` (a multiple of
  ``batch_rows``, capped by ``max_claim_rows``) beyond the committed offset;
* :class:`Revoked` - the controller took the unclaimed rows; train up to ``stop`` (the end of the
  claim), commit, then lease again;
* :class:`Finished` - every row of the lease was trained; lease again;
* :class:`Stop` - the job stopped.

``Revoked`` and ``Finished`` say whether the lease is ``retired``: while ``synced < stop`` the lease
lives on (it is *draining*) and its holder keeps reporting ``synced_offset`` for it in later
commits. Commits and releases are idempotent (a retry changes nothing); an offset that goes
backwards or beyond the claim, a synced offset beyond the offset, or a wrong token raises
:class:`~antdt.errors.LedgerError` and changes nothing.

The job's end
-------------
Whole shards would leave the job's end to chance: the worker that takes the last shard trains
it alone while the others wait, up to a shard's time. Once the rows left come to less than two
shards per leasing worker, a lease takes at most half an even share of them (whole batches, at
least one; the rest of its piece stays at the queue front), so leases shrink towards one batch
as the rows run out and the workers finish within about a batch of each other (guided
self-scheduling). A single worker, a static ledger and one made with ``guided_end=False``
lease whole pieces to the end.

Paced workers
-------------
The controller may **pace** a slow worker (:meth:`ShardLedger.pace`): its leases and claims
are at most ``rows`` rows (a new lease takes the front of a piece, the rest stays queued), and
with ``rows == 0`` it gets no new lease ("wait") and its next commit revokes the unclaimed rows:
the last rows of the job are never in a straggler's claim. The controller may also set a
worker's **batch size** (:meth:`ShardLedger.set_batch_rows`): its leases carry it.
Paces and batch sizes are the controller's to set and lift; a checkpoint does not keep them.

Exactly-once
------------
``revoke`` and ``split`` move only rows beyond the claim, so the holder never trains a row that
someone else may lease. ``remove_worker`` (worker death) and ``release`` move rows
``[synced, stop)`` of each lease back to the queue front: the claim and the trained-but-unsynced
rows, whose effect died with the worker. Hence every row of every epoch ends DONE or QUARANTINED
exactly once (checked by the hypothesis state machine in ``tests/antdt/sharding/test_ledger.py``).

Counters
--------
* ``rows_trained``: rows committed as trained (offset advances), repeats included.
* ``rows_retrained``: rows trained whose effect was discarded: ``[synced, offset)`` of a lease
  when its worker is removed, it is released, the ledger is restored from a checkpoint, or the
  job is stopped. They are trained again (unless the job was stopped): a cost, not an error.
  The model sync takes the discarded effect out of every replica that received it (the
  entries past the worker's :meth:`ShardLedger.synced_rows`), so the model holds each such row
  once, from its second training.
* ``rows_quarantined``: rows QUARANTINED (registration quarantine counts once per epoch).
* ``rows_lost``: rows neither DONE nor QUARANTINED when the job was stopped early; 0 otherwise.
* ``rows_unsynced``: rows of live leases trained but not synced yet (``offset - synced``). A
  :class:`Wait` carries it: while it is above 0 the job may be waiting for any worker's sync
  round (a row is synced once every peer applied it), so an idle worker should keep syncing.
* ``leases_granted``, ``leases_revoked``, ``leases_split``: leases handed out, revoked (their
  unclaimed rows taken back: a revoke, or a commit of a worker paced to no rows) and split (a split
  that moved rows); watched in :mod:`antdt.watch.metrics`, 0 in a ledger restored from a checkpoint.

At every moment ``rows_trained == rows_done + rows_retrained + rows_unsynced`` and
``rows_todo + rows_leased + rows_done + rows_quarantined + rows_lost == total_rows * epochs``;
so when the job ends ``rows_trained == total_rows * epochs - rows_quarantined - rows_lost +
rows_retrained`` with ``rows_lost == 0`` unless it was stopped.

The static baseline (``static=N``) and the ledger's checkpoints: docs/sharding-and-control.md.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from antdt.errors import LedgerError
from antdt.sharding import checkpoint, dealing
from antdt.sharding.checkpoint import LedgerState
from antdt.sharding.dealing import Dealer, QueueDealer, ShardTable, StaticDealer, check_int
from antdt.sharding.leases import (Claim, Clock, CommitEvent, CommitReply, Finished, JobState,
                                   Lease, LeaseReply, LeaseStatus, LiveLease, Piece,
                                   QuarantineRecord, QuarantineSpec, Revoked, RowGroup,
                                   RowState, Stop, Wait)

logger = logging.getLogger(__name__)


COUNTERS = ("rows_trained", "rows_done", "rows_retrained", "rows_lost", "rows_quarantined")
"""The counters a checkpoint holds (:meth:`ShardLedger.to_state`)."""


class ShardLedger:
    """The shard ledger of one job (see the module docstring for the model and the counters).

    ``clock`` gives the time stamps of leases and commits (seconds, any origin). Listeners
    subscribed with :meth:`subscribe` receive a :class:`CommitEvent` per commit; they run inside
    the commit, after the ledger changed, and must not raise.

    >>> ledger = ShardLedger([("a.parquet", 0, 4)], shard_rows=4, batch_rows=2, clock=lambda: 0.0)
    >>> lease = ledger.lease("w1")
    >>> (lease.start, lease.stop, lease.claim_stop)
    (0, 4, 2)
    >>> ledger.commit(lease.lease_id, lease.token, offset=2, synced_offset=2)
    Claim(lease_id=0, stop=4)
    >>> ledger.commit(lease.lease_id, lease.token, offset=4, synced_offset=4)
    Finished(lease_id=0, stop=4, retired=True)
    """

    def __init__(self, row_groups: Sequence[RowGroup], *, shard_rows: int, batch_rows: int,
                 clock: Clock, epochs: int = 1, seed: int = 0,
                 quarantine: Sequence[QuarantineSpec] = (), max_claim_rows: int | None = None,
                 job: str = "job", static: int | None = None, guided_end: bool = True) -> None:
        self.job = job
        self.guided_end = guided_end
        """Shrink the last leases so the workers finish together (module docstring)."""
        self.static = None if static is None else check_int("static", static, 1, 1_000_000)
        """Slots of the static baseline, or None: dynamic leasing (module docstring)."""
        self.shard_rows = check_int("shard_rows", shard_rows, 1, dealing.MAX_ROWS)
        self.batch_rows = check_int("batch_rows", batch_rows, 1, dealing.MAX_ROWS)
        self.epochs = check_int("epochs", epochs, 1, dealing.MAX_EPOCHS)
        self.seed = check_int("seed", seed, 0, 2**63 - 1)
        if max_claim_rows is None:
            max_claim_rows = max(self.shard_rows, self.batch_rows)
        self.max_claim_rows = check_int("max_claim_rows", max_claim_rows, self.batch_rows)
        self._clock = clock
        self._listeners: list[Callable[[CommitEvent], None]] = []

        self._table = ShardTable(row_groups, shard_rows=self.shard_rows, seed=self.seed,
                                 epochs=self.epochs, quarantine=quarantine, job=job)
        self.total_rows = self._table.total_rows
        """Rows of one epoch, quarantined ones included."""
        self.num_shards = self._table.num_shards
        """Shards of one epoch (quarantined row groups have none)."""
        self._records = list(self._table.records)
        self._dealer: Dealer = QueueDealer(self._table, self.epochs) if self.static is None \
            else StaticDealer(self._table, self.epochs, self.static, job)
        self._leases: dict[int, LiveLease] = {}
        self._by_worker: dict[str, dict[int, None]] = {}
        self._next_id = 0
        self._stopped: str | None = None
        self._paces: dict[str, int] = {}
        self._batch_rows: dict[str, int] = {}  # worker -> the batch size the controller set
        self._leasing: dict[str, None] = {}  # workers that leased and were not removed
        self._paced_out: set[str] = set()  # workers paced to no rows
        self._synced_rows: dict[str, int] = {}  # worker -> its stream's rows counted synced
        self._done_by: dict[str, int] = {}  # worker -> rows its commits counted synced

        self.rows_expected = self.total_rows * self.epochs
        self.rows_quarantined = sum(r.rows for r in self._records)
        self.rows_trained = 0
        self.rows_done = 0
        self._done_by_epoch = [0] * self.epochs
        self.rows_retrained = 0
        self.rows_lost = 0
        self.rows_leased = 0
        self.rows_unsynced = 0
        self.leases_granted = 0
        self.leases_revoked = 0
        self.leases_split = 0

    # ---- queries ------------------------------------------------------------------------------

    @property
    def state(self) -> JobState:
        if self._stopped is not None:
            return JobState.STOPPED
        if self.rows_done + self.rows_quarantined == self.rows_expected:
            return JobState.FINISHED
        return JobState.RUNNING

    @property
    def rows_todo(self) -> int:
        return (self.rows_expected - self.rows_done - self.rows_quarantined - self.rows_lost
                - self.rows_leased)

    @property
    def epoch(self) -> int:
        """The epoch whose shards are being handed out (-1 before the first lease)."""
        return self._dealer.epoch

    @property
    def quarantine_records(self) -> list[QuarantineRecord]:
        return list(self._records)

    def rows_by_state(self) -> dict[RowState, int]:
        """Rows of all epochs per state (the lost rows of a stopped job are in none)."""
        return {RowState.TODO: self.rows_todo, RowState.LEASED: self.rows_leased,
                RowState.DONE: self.rows_done, RowState.QUARANTINED: self.rows_quarantined}

    def summary(self) -> dict[str, Any]:
        """Counters and state as a plain (msgpack-able) dict."""
        return {
            "job": self.job, "state": self.state.value, "epoch": self._dealer.epoch,
            "epochs": self.epochs, "shards": self.num_shards, "total_rows": self.total_rows,
            "rows_expected": self.rows_expected, "rows_todo": self.rows_todo,
            "rows_leased": self.rows_leased, "rows_done": self.rows_done,
            "rows_done_by_epoch": list(self._done_by_epoch),
            "rows_trained": self.rows_trained, "rows_retrained": self.rows_retrained,
            "rows_lost": self.rows_lost, "rows_quarantined": self.rows_quarantined,
            "leases": len(self._leases), "workers": len(self._by_worker),
            "leases_granted": self.leases_granted, "leases_revoked": self.leases_revoked,
            "leases_split": self.leases_split,
            "static": self.static, "stopped_reason": self._stopped,
        }

    @property
    def paces(self) -> dict[str, int]:
        """Paced workers and the most rows a lease or claim of each may hold (a copy)."""
        return dict(self._paces)

    @property
    def batch_sizes(self) -> dict[str, int]:
        """Workers the controller set a batch size for, and that size (a copy)."""
        return dict(self._batch_rows)

    def leases(self, worker: str | None = None) -> list[LeaseStatus]:
        """Live leases (of ``worker`` only, if given), oldest first."""
        ids = self._by_worker.get(worker, {}) if worker is not None else self._leases
        return [self._status(self._leases[i]) for i in sorted(ids)]

    def lease_status(self, lease_id: int) -> LeaseStatus | None:
        lease = self._leases.get(lease_id)
        return self._status(lease) if lease is not None else None

    def subscribe(self, listener: Callable[[CommitEvent], None]) -> None:
        """Call ``listener`` with a :class:`CommitEvent` after every commit that trained rows."""
        self._listeners.append(listener)

    # ---- worker transitions -------------------------------------------------------------------

    def lease(self, worker: str, claim_rows: int | None = None,
              max_rows: int | None = None) -> LeaseReply:
        """Hand ``worker`` the next rows: the queue front first, then the epoch permutation;
        at most ``max_rows`` of them when given (the front of a piece, the rest stays at the
        queue front for the others, as with a pace: a sync rank asks for a few of its local
        batches, so that at the job's end no rank holds many more steps of rows than another)."""
        if not isinstance(worker, str) or not worker:
            raise LedgerError(f"job {self.job!r}: worker must be a non-empty str, found {worker!r}")
        if max_rows is not None:
            max_rows = check_int("max_rows", max_rows, 1, 2**31 - 1)
        claim = self._claim_size(claim_rows, worker)
        if self._stopped is not None:
            return Stop(self._stopped)
        pace = self._paces.get(worker)
        piece = None if pace == 0 else self._dealer.next_piece(worker)
        if piece is None:
            return Stop("finished") if self.state is JobState.FINISHED \
                else Wait(self.rows_unsynced)
        epoch, shard, start, stop = piece
        self._leasing[worker] = None
        most = min((rows for rows in (pace, self._tail_rows(), max_rows) if rows is not None),
                   default=None)
        if most is not None and stop - start > most:
            self._dealer.push_front([(epoch, shard, start + most, stop)], worker)
            stop = start + most
        now = self._clock()
        lease_id = self._next_id
        self._next_id += 1
        token = secrets.token_hex(16)
        claim_stop = min(start + claim, stop)
        self._leases[lease_id] = LiveLease(lease_id, token, worker, epoch, shard, start, stop,
                                            start, start, claim_stop, False, now, now)
        self._by_worker.setdefault(worker, {})[lease_id] = None
        self.rows_leased += stop - start
        self.leases_granted += 1
        path, group = self._table.location(shard)
        return Lease(lease_id, token, worker, epoch, path, group, start, stop, claim_stop,
                     self._batch_rows.get(worker))

    def commit(self, lease_id: int, token: str, offset: int, synced_offset: int,
               stats: Mapping[str, float] | None = None,
               claim_rows: int | None = None) -> CommitReply:
        """Record that rows up to ``offset`` were trained and up to ``synced_offset`` synced;
        returns the next claim or what to do instead (see the module docstring)."""
        if self._stopped is not None:
            return Stop(self._stopped)
        lease = self._live(lease_id, token)
        offset = check_int(f"lease {lease_id}: offset", offset, 0)
        synced_offset = check_int(f"lease {lease_id}: synced_offset", synced_offset, 0)
        claim = self._claim_size(claim_rows, lease.worker)
        if offset < lease.offset:
            raise LedgerError(f"job {self.job!r} lease {lease_id}: offset {offset} goes backwards "
                              f"(committed offset is {lease.offset})")
        if offset > lease.claim_stop:
            raise LedgerError(f"job {self.job!r} lease {lease_id}: offset {offset} is beyond the "
                              f"claim, which ends at {lease.claim_stop}")
        if synced_offset < lease.synced:
            raise LedgerError(f"job {self.job!r} lease {lease_id}: synced_offset {synced_offset} "
                              f"goes backwards (committed synced offset is {lease.synced})")
        if synced_offset > offset:
            raise LedgerError(f"job {self.job!r} lease {lease_id}: synced_offset {synced_offset} "
                              f"is beyond offset {offset}")
        trained = offset - lease.offset
        newly_synced = synced_offset - lease.synced
        lease.offset = offset
        lease.synced = synced_offset
        self.rows_trained += trained
        self.rows_unsynced += trained - newly_synced
        self.rows_done += newly_synced
        self._done_by_epoch[lease.epoch] += newly_synced
        self._done_by[lease.worker] = self._done_by.get(lease.worker, 0) + newly_synced
        self.rows_leased -= newly_synced
        if trained or stats:
            now = self._clock()
            lease.committed_at = now
            event = CommitEvent(lease.worker, lease_id, lease.epoch, trained, stats or {}, now)
            for listener in self._listeners:
                listener(event)
        if self._paces.get(lease.worker) == 0 and not lease.revoked:
            lease.revoked = True
            self.leases_revoked += 1
            self._cut(lease, lease.claim_stop, 1)
        retired = self._retire_if_synced(lease)
        if lease.revoked:
            return Revoked(lease_id, lease.stop, retired)
        if offset == lease.stop:
            return Finished(lease_id, lease.stop, retired)
        lease.claim_stop = max(lease.claim_stop, min(offset + claim, lease.stop))
        return Claim(lease_id, lease.claim_stop)

    def release(self, lease_id: int, token: str) -> int:
        """The holder gives the lease up: rows ``[synced, stop)`` go back to the queue front. The
        rows requeued; 0 for a lease no longer live (a retry whose reply was lost)."""
        if self._stopped is not None or lease_id in range(self._next_id) and \
                lease_id not in self._leases:
            return 0
        return self._requeue_lease(self._live(lease_id, token))

    def quarantine(self, lease_id: int, token: str, stop: int, reason: str) -> Revoked | Stop:
        """The holder could not read rows ``[offset, stop)`` of its lease: they become
        QUARANTINED; the rows after ``stop`` go back to the queue front and the lease ends at its
        committed offset (it still drains its synced offset)."""
        if self._stopped is not None:
            return Stop(self._stopped)
        lease = self._live(lease_id, token)
        stop = check_int(f"lease {lease_id}: quarantine stop", stop, lease.offset + 1,
                         lease.stop)
        if not isinstance(reason, str) or not reason:
            raise LedgerError(f"lease {lease_id}: quarantine reason must be a non-empty str, "
                              f"found {reason!r}")
        path, group = self._table.location(lease.shard)
        rows = stop - lease.offset
        self._records.append(QuarantineRecord(path, group, lease.epoch, lease.offset, stop, rows,
                                              reason))
        self.rows_quarantined += rows
        self.rows_leased -= rows
        logger.warning("job %s: quarantined rows [%d, %d) of row group %d of %s (epoch %d): %s",
                       self.job, lease.offset, stop, group, path, lease.epoch, reason)
        self._dealer.push_front([(lease.epoch, lease.shard, stop, lease.stop)], lease.worker)
        self.rows_leased -= lease.stop - stop
        lease.stop = lease.claim_stop = lease.offset
        lease.revoked = True
        return Revoked(lease_id, lease.stop, self._retire_if_synced(lease))

    # ---- controller and cluster transitions ---------------------------------------------------

    def revoke(self, lease_id: int) -> Piece | None:
        """Move the lease's unclaimed rows to the queue front; its holder finishes its claim and
        gets :class:`Revoked`. Returns the requeued piece (None: nothing unclaimed)."""
        lease = self._known(lease_id)
        self.leases_revoked += not lease.revoked
        lease.revoked = True
        pieces = self._cut(lease, lease.claim_stop, 1)
        return pieces[0] if pieces else None

    def split(self, lease_id: int, parts: int) -> list[Piece]:
        """Cut the lease's rows ``[offset, stop)`` into ``parts`` near-equal parts; the holder
        keeps the first (never less than its claim), the others go to the queue front in order.
        Returns the requeued pieces: fewer than ``parts - 1`` when the unclaimed rows do not
        make that many whole batches."""
        lease = self._known(lease_id)
        parts = check_int(f"lease {lease_id}: parts", parts, 2, 1_000_000)
        keep = lease.offset + -(-(lease.stop - lease.offset) // parts)
        at = max(lease.claim_stop, keep)
        pieces = self._cut(lease, at, min(parts - 1, max(1, (lease.stop - at) // self.batch_rows)))
        self.leases_split += bool(pieces)
        return pieces

    def pace(self, worker: str, rows: int | None) -> None:
        """Hold ``worker``'s leases and claims to at most ``rows`` rows (whole batches; 0: no new
        lease, and its leases are revoked at their next commit); None lifts the pace."""
        if rows is None:
            self._paces.pop(worker, None)
            self._paced_out.discard(worker)
            return
        rows = check_int(f"pace of {worker}", rows, 0, 2**31 - 1)
        if rows % self.batch_rows:
            raise LedgerError(f"job {self.job!r}: the pace of {worker} must be whole batches of "
                              f"{self.batch_rows} rows, found {rows}")
        self._paces[worker] = rows
        if rows:
            self._paced_out.discard(worker)
        else:
            self._paced_out.add(worker)

    def set_batch_rows(self, worker: str, rows: int | None) -> None:
        """``worker`` trains its next leases in batches of ``rows`` rows (None: the job's
        ``batch_rows`` again)."""
        if rows is None:
            self._batch_rows.pop(worker, None)
            return
        self._batch_rows[worker] = check_int(f"batch rows of {worker}", rows, 1, 2**31 - 1)

    def remove_worker(self, worker: str) -> int:
        """The worker is gone: rows ``[synced, stop)`` of each of its leases go back to the queue
        front (trained-but-unsynced rows count as retrained). Returns the rows requeued."""
        ids = sorted(self._by_worker.get(worker, ()), reverse=True)
        requeued = sum(self._requeue_lease(self._leases[i]) for i in ids)
        self._paces.pop(worker, None)
        self._paced_out.discard(worker)
        self._leasing.pop(worker, None)
        self._dealer.remove_worker(worker)
        if not ids:
            return 0
        logger.info("job %s: worker %s removed, %d rows requeued", self.job, worker, requeued)
        return requeued

    def workers(self) -> list[str]:
        """Workers holding live leases."""
        return list(self._by_worker)

    def report_synced(self, worker: str, rows: int) -> None:
        """``worker`` reported, with the commits just applied, that the first ``rows`` rows of
        its stream (every row it trained in this job, in order, over all its leases) are
        synced: the rows its commits counted done. The model sync takes the entries of a worker
        that leaves past its last such report out of every replica (the ledger trains those
        rows again), and a checkpoint's tables hold each worker's rows up to it
        (:mod:`antdt.sync.embeddings`). Never decreases; never exceeds the rows ``worker``'s
        commits counted synced (a report carries no token: an inflated one would keep unsynced
        entries in checkpoints and in the model), unless the job stopped."""
        rows = check_int(f"synced rows of {worker}", rows, 0)
        previous = self._synced_rows.get(worker, 0)
        if rows < previous:
            raise LedgerError(f"job {self.job!r}: synced rows of {worker} go backwards ({rows} "
                              f"after {previous})")
        done = self._done_by.get(worker, 0)
        if rows > done and self._stopped is None:
            raise LedgerError(f"job {self.job!r}: synced rows of {worker} ({rows}) exceed the "
                              f"rows its commits counted synced ({done})")
        self._synced_rows[worker] = rows

    def synced_rows(self, worker: str) -> int:
        """The rows of ``worker``'s stream it last reported synced (0: none); kept after it
        leaves."""
        return self._synced_rows.get(worker, 0)

    def synced_points(self) -> dict[str, int]:
        """Every worker's :meth:`synced_rows` (a copy)."""
        return dict(self._synced_rows)

    def stop(self, reason: str) -> int:
        """Stop the job early: live leases are dropped (their unsynced rows count as retrained),
        every row not DONE or QUARANTINED counts as lost. Returns ``rows_lost``."""
        if self._stopped is not None:
            return self.rows_lost
        self.rows_retrained += self.rows_unsynced
        self.rows_unsynced = 0
        self._leases.clear()
        self._by_worker.clear()
        self._dealer.clear()
        self.rows_leased = 0
        self.rows_lost = self.rows_expected - self.rows_done - self.rows_quarantined
        self._stopped = reason
        if self.rows_lost:
            logger.warning("job %s stopped (%s): %d rows lost", self.job, reason, self.rows_lost)
        return self.rows_lost

    # ---- checkpoint ---------------------------------------------------------------------------

    def to_state(self) -> LedgerState:
        """What a checkpoint holds: the ledger as it would be if every worker were removed now
        (:mod:`antdt.sharding.checkpoint`). O(row groups + queued pieces + live leases)."""
        dealer = self._dealer
        if not isinstance(dealer, QueueDealer):
            raise LedgerError(f"job {self.job!r}: a static ledger (the baseline) cannot be "
                              "checkpointed; only dynamic ledgers can")
        pieces = [(lease.epoch, lease.shard, lease.synced, lease.stop)
                  for lease in sorted(self._leases.values(), key=lambda lease: lease.lease_id)
                  if lease.synced < lease.stop]
        pieces.extend(dealer.front)
        unsynced = sum(lease.offset - lease.synced for lease in self._leases.values())
        return LedgerState(
            job=self.job, shard_rows=self.shard_rows, batch_rows=self.batch_rows,
            epochs=self.epochs, seed=self.seed, max_claim_rows=self.max_claim_rows,
            paths=list(self._table.paths), rg_file=self._table.rg_file,
            rg_group=self._table.rg_group, rg_rows=self._table.rg_rows, epoch=dealer.epoch,
            pos=dealer.pos,
            next_lease_id=self._next_id, stopped=self._stopped,
            done_by_epoch=list(self._done_by_epoch),
            counters={"rows_trained": self.rows_trained, "rows_done": self.rows_done,
                      "rows_retrained": self.rows_retrained + unsynced,
                      "rows_lost": self.rows_lost, "rows_quarantined": self.rows_quarantined},
            quarantine=list(self._records),
            front=np.asarray(pieces, dtype=np.int64).reshape(-1, 4))

    @classmethod
    def from_state(cls, state: LedgerState, *, clock: Clock) -> ShardLedger:
        """Rebuild a ledger from :meth:`to_state`: no live leases, rows of the leases that were
        live at the checkpoint at the queue front."""
        row_groups = [(state.paths[f], int(g), int(n)) for f, g, n in
                      zip(state.rg_file, state.rg_group, state.rg_rows)]
        registration = [(r.path, r.row_group, r.reason) for r in state.quarantine
                        if r.epoch is None]
        ledger = cls(row_groups, shard_rows=state.shard_rows, batch_rows=state.batch_rows,
                     clock=clock, epochs=state.epochs, seed=state.seed, quarantine=registration,
                     max_claim_rows=state.max_claim_rows, job=state.job)
        ledger._records = list(state.quarantine)
        unknown = sorted(set(state.counters) - set(COUNTERS))
        if unknown:
            raise LedgerError(f"job {state.job!r}: the checkpoint counts {unknown}, expected "
                              f"counters among {list(COUNTERS)}")
        for name, value in state.counters.items():
            setattr(ledger, name, int(value))
        ledger._done_by_epoch = list(state.done_by_epoch)
        ledger._next_id = state.next_lease_id
        ledger._stopped = state.stopped
        dealer = ledger._dealer
        assert isinstance(dealer, QueueDealer)
        if ledger._stopped is None:
            dealer.start_epoch(state.epoch)
            dealer.pos = state.pos
            dealer.front.extend((int(e), int(s), int(a), int(b)) for e, s, a, b in
                                 state.front.tolist())
        return ledger

    def to_bytes(self) -> bytes:
        """:meth:`to_state` in the checkpoint format."""
        return checkpoint.encode(self.to_state())

    @classmethod
    def from_bytes(cls, data: bytes, *, clock: Clock) -> ShardLedger:
        """Rebuild a ledger written by :meth:`to_bytes` (:meth:`from_state`), else LedgerError."""
        return checkpoint.restored(data, lambda state: cls.from_state(state, clock=clock))

    def save(self, path: str) -> int:
        """Write :meth:`to_bytes` to an fsspec ``path`` atomically; returns the bytes written."""
        data = self.to_bytes()
        checkpoint.write_atomic(path, data)
        return len(data)

    @classmethod
    def load(cls, path: str, *, clock: Clock) -> ShardLedger:
        """Read a checkpoint written by :meth:`save` from an fsspec ``path``."""
        try:
            return cls.from_bytes(checkpoint.read(path), clock=clock)
        except FileNotFoundError as e:
            raise LedgerError(f"ledger checkpoint {path} does not exist") from e

    # ---- internals ----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recount the TODO rows from the queue and the live leases and compare them with the
        counters; O(shards): for tests and debugging only. Raises AssertionError."""
        assert self.rows_todo + self.rows_leased + self.rows_done + self.rows_quarantined \
            + self.rows_lost == self.rows_expected
        leased = sum(lease.stop - lease.synced for lease in self._leases.values())
        assert leased == self.rows_leased, (leased, self.rows_leased)
        unsynced = sum(lease.offset - lease.synced for lease in self._leases.values())
        assert unsynced == self.rows_unsynced, (unsynced, self.rows_unsynced)
        assert self.rows_trained == self.rows_done + self.rows_retrained + unsynced
        assert sum(self._done_by_epoch) == self.rows_done
        for lease in self._leases.values():
            assert lease.start <= lease.synced <= lease.offset <= lease.claim_stop <= lease.stop
            assert lease.synced < lease.stop
        if self._stopped is not None:
            assert self.rows_todo == 0
            return
        todo = self._dealer.todo_rows()
        assert todo == self.rows_todo, (todo, self.rows_todo)

    def _status(self, lease: LiveLease) -> LeaseStatus:
        path, group = self._table.location(lease.shard)
        return LeaseStatus(lease.lease_id, lease.worker, lease.epoch, path, group, lease.start,
                           lease.stop, lease.offset, lease.synced, lease.claim_stop,
                           lease.revoked, lease.leased_at, lease.committed_at)

    def _claim_size(self, claim_rows: int | None, worker: str) -> int:
        """Requested claim rounded up to whole batches, within ``[batch_rows, max_claim_rows]``
        and the worker's pace (never below one batch: a claim is never empty)."""
        if claim_rows is None:
            return self.batch_rows
        claim_rows = check_int("claim_rows", claim_rows, 0, 2**31 - 1)
        batches = max(1, -(-claim_rows // self.batch_rows))
        most = min(self.max_claim_rows, self._paces.get(worker, self.max_claim_rows))
        return max(self.batch_rows, min(batches * self.batch_rows, most))

    def _tail_rows(self) -> int | None:
        """The most rows a new lease may hold as the job's rows run out: half an even share of
        the rows left among the leasing workers (those not paced to nothing), in whole batches,
        at least one; None while that is a shard or more, or with fewer than two such workers
        (and in a static ledger). Leases then shrink towards one batch, so the workers run out
        of rows within about a batch of each other instead of one shard (guided
        self-scheduling, in its "factoring" form)."""
        todo = self.rows_todo
        if self.static is not None or not self.guided_end \
                or todo >= 2 * len(self._leasing) * self.shard_rows:
            return None  # O(1) until the end nears: then O(paced workers)
        workers = len(self._leasing) - sum(1 for worker in self._paced_out
                                           if worker in self._leasing)
        if workers < 2:
            return None
        share = -(-todo // (2 * workers))
        if share >= self.shard_rows:
            return None
        return max(1, -(-share // self.batch_rows)) * self.batch_rows

    def _known(self, lease_id: int) -> LiveLease:
        if isinstance(lease_id, bool) or not isinstance(lease_id, int):
            raise LedgerError(f"lease_id must be an int, found {lease_id!r}")
        lease = self._leases.get(lease_id)
        if lease is None:
            state = "was never issued" if not 0 <= lease_id < self._next_id else \
                "is no longer live (done, released, or its worker was removed)"
            raise LedgerError(f"job {self.job!r}: lease {lease_id} {state}")
        return lease

    def _live(self, lease_id: int, token: str) -> LiveLease:
        lease = self._known(lease_id)
        if not isinstance(token, str) or not secrets.compare_digest(token, lease.token):
            raise LedgerError(f"job {self.job!r}: wrong token for lease {lease_id}")
        return lease

    def _cut(self, lease: LiveLease, at: int, parts: int) -> list[Piece]:
        """Requeue the lease's rows ``[at, stop)`` as up to ``parts`` pieces; the lease ends at
        ``at`` (``at >= claim_stop``: claimed rows never move)."""
        assert at >= lease.claim_stop
        rows = lease.stop - at
        if rows <= 0:
            return []
        parts = min(parts, rows)
        bounds = [at + (rows * k) // parts for k in range(parts + 1)]
        pieces = [(lease.epoch, lease.shard, a, b) for a, b in zip(bounds, bounds[1:])]
        self._dealer.push_front(pieces, lease.worker)
        self.rows_leased -= rows
        lease.stop = at  # still > synced: a claim is never empty while rows are left
        return pieces

    def _requeue_lease(self, lease: LiveLease) -> int:
        rows = lease.stop - lease.synced
        self._dealer.push_front([(lease.epoch, lease.shard, lease.synced, lease.stop)],
                                lease.worker)
        self.rows_retrained += lease.offset - lease.synced
        self.rows_leased -= rows
        self._forget(lease)
        return rows

    def _retire_if_synced(self, lease: LiveLease) -> bool:
        if lease.synced < lease.stop:
            return False
        self._forget(lease)
        return True

    def _forget(self, lease: LiveLease) -> None:
        self.rows_unsynced -= lease.offset - lease.synced
        del self._leases[lease.lease_id]
        ids = self._by_worker[lease.worker]
        del ids[lease.lease_id]
        if not ids:
            del self._by_worker[lease.worker]
