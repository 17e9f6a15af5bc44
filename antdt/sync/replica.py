"""One worker's replica and its side of the sync protocol, with the transport injected
(:class:`ReplicaSync`), and what peers hand each other (:class:`PeerPayload`,
:class:`ReplicaSnapshot`, :class:`LeaderRows`).

An exchange publishes the worker's own embedding deltas and snapshots its dense parameters
(:meth:`ReplicaSync.prepare`, once per round), pulls each peer's entries and snapshot, then
merges them under the replica lock. The training thread holds the same lock per step, and the
sync side never holds it across a network call, so a step never waits for a slow peer (only,
between steps, for a round when the replica runs too far ahead: :class:`~antdt.sync.Staleness`).

Joiners copy a whole :class:`ReplicaSnapshot` (:meth:`ReplicaSync.adopt`): a worker that joins a
running job adopts a live member's snapshot (its tables without its unpublished changes, its
dense parameters, its cursor per source, its changed rows and the provisional entries in its
tables) and pulls newer entries as usual.

The ledger (see :mod:`antdt.sync.embeddings`): the worker reports :meth:`ReplicaSync.ledger_offset`
as its synced rows, tells the replica what the ledger accepted (:meth:`ReplicaSync.confirm`), and
the replica takes a departed peer's rows past the ledger's offset out of its tables
(:meth:`ReplicaSync.set_peers`). A checkpoint copies :meth:`ReplicaSync.committed_tables`: the
rows the ledger copied with it counts done, no more.
The fused optimizer state (e.g. row-wise Adagrad momentum) is not part of the snapshot: a
joiner's starts fresh, which only makes its first steps on a row larger.

The job's end copies much less. Once the final leader merged every member's entries and dense
snapshot, each other member sends it its changed rows (a mask, :meth:`ReplicaSync.changed_rows`)
and gets back only the rows either of them changed, with the leader's dense parameters
(:class:`LeaderRows`, :meth:`ReplicaSync.serve_rows`); writing them
(:meth:`ReplicaSync.adopt_rows`) makes it equal to the leader bit for bit, since every other row
still holds the initial tables' bits on both (every member starts from the same initial model,
as the deltas already assume).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from antdt import config
from antdt.errors import ConfigError, SyncError
from antdt.sync.dense import average_dense, check_dense, snapshot_dense
from antdt.sync.embeddings import EmbeddingDeltaLog, LogEntry

logger = logging.getLogger(__name__)

DELTA_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
"""Values of ``antdt.sync.delta-dtype``: the dtype a replica publishes its embedding deltas in."""


def delta_dtype_setting() -> torch.dtype:
    """``antdt.sync.delta-dtype`` as a torch dtype; :class:`ConfigError` names a bad value."""
    value = config.get("antdt.sync.delta-dtype")
    if value not in DELTA_DTYPES:
        raise ConfigError(f"dask config antdt.sync.delta-dtype: expected one of "
                          f"{', '.join(DELTA_DTYPES)}, found {value!r}")
    return DELTA_DTYPES[str(value)]


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The bytes ``tensors`` take (as they travel: one frame each)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def held_bytes(rows: int, tables: int, dense: int, *, tables_dtype: torch.dtype = torch.float32,
               keep_rounds: int | None = None, delta_dtype: torch.dtype | None = None) -> int:
    """The bytes a :class:`ReplicaSync` keeps beside the replica it syncs, for tables of
    ``rows`` rows and ``tables`` bytes in all and dense parameters of ``dense`` bytes (the
    defaults of ``keep_rounds`` and ``delta_dtype`` come from dask config, as the replica's).

    Counted: the log's ``base`` copy of the tables (one byte per table byte), its masks of
    touched and changed rows (a bool per row each, and a third for the rows owing a rounding
    error when deltas travel in a narrower dtype than the tables, as in the default bfloat16),
    and the dense snapshots of the last ``keep_rounds`` rounds plus one cut no round took yet.
    Not counted: the delta entries in flight (they scale with the rows a round touches, not
    with the tables) and the copies a worker makes for a moment: a joiner's snapshot, a
    checkpoint's tables, the final round's rows.

    Measured (2026-11-28): in a 2-worker async job of 8 tables of 1M rows x 16 (512 MB) with
    row-wise Adagrad, each worker's RSS peaked 1.10 GB higher than in the same job with tables
    of 1,000 rows: 2.15x its tables, where the model's own tensors and this count give 2.11x
    (the rest, 23 MB, were entries in flight). The worker that logged the final model peaked
    1.1x the tables higher still (its copy of the weights), and a checkpoint's writer 2x (the
    committed tables and their serialised bytes).

    >>> held_bytes(rows=1000, tables=1000 * 16 * 4, dense=400, keep_rounds=4,
    ...            delta_dtype=torch.bfloat16)  # base + 3 masks + 5 dense snapshots
    69000
    """
    keep_rounds = keep_rounds if keep_rounds is not None else int(
        config.number("antdt.sync.keep-rounds", low=1, integer=True))
    delta_dtype = delta_dtype or delta_dtype_setting()
    masks = 2 + (delta_dtype != tables_dtype)
    return tables + masks * rows * torch.bool.itemsize + (keep_rounds + 1) * dense


@dataclass
class PeerPayload:
    """What a peer serves for one exchange: its log entries after the requester's cursor, its
    dense snapshot for the round (None when it has no dense parameters to share), the
    :attr:`RowSpace.layout` its entries' ids refer to and its confirmed offset (the ledger
    holds its rows up to it as synced: its entries up to it are no longer provisional)."""

    source: str
    entries: list[LogEntry]
    dense: list[torch.Tensor] | None
    layout: str
    confirmed: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it carries."""
        tensors = [t for e in self.entries for t in (e.ids, e.deltas)]
        return tensor_bytes([*tensors, *(self.dense or [])])


@dataclass
class ReplicaSnapshot:
    """A replica's whole state, for a joiner to start from.

    ``dense``: the source's dense parameters (shapes as its ``dense``); ``tables``: its tables
    ``(num_rows, dim)`` without its own unpublished changes; ``applied``: per source, the newest
    seq whose entry is in ``tables`` (the snapshot's source included: its newest published seq);
    ``changed``: ``(rows,)`` bool over the tables end to end, the rows that may differ from the
    initial tables (see :meth:`~antdt.sync.EmbeddingDeltaLog.changed`); ``kept``: per source
    (the snapshot's included), the provisional entries in ``tables``, past the source's
    ``confirmed`` offset: a joiner takes them out again if the source departs.
    """

    source: str
    dense: list[torch.Tensor]
    tables: dict[str, torch.Tensor]
    applied: dict[str, int]
    changed: torch.Tensor
    kept: dict[str, list[LogEntry]] = field(default_factory=dict)
    confirmed: dict[str, int] = field(default_factory=dict)


@dataclass
class LeaderRows:
    """What the final leader sends a member so that it ends equal to the leader, bit for bit.

    ``ids``: ``(k,)`` int64, increasing, the rows of the :class:`~antdt.sync.RowSpace` that the
    leader or the member changed (every other row holds the initial tables' bits on both);
    ``rows``: ``(k, dim)``, the leader's values of them; ``dense``: the leader's dense parameters;
    ``applied``: the leader's newest applied seq per source (itself included: its newest
    published seq).
    """

    source: str
    ids: torch.Tensor
    rows: torch.Tensor
    dense: list[torch.Tensor]
    applied: dict[str, int]

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors it carries."""
        return tensor_bytes([self.ids, self.rows, *self.dense])


@dataclass
class ExchangeReport:
    """Outcome of one exchange (or of one worker's part in the final round) as seen by one
    worker: the peers merged and failed, the rows added from entries, the rows copied from the
    final leader, and the tensor bytes received and sent in its requests."""

    round: int
    merged: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    rows_applied: int = 0
    rows_copied: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0


class ReplicaLock:
    """The replica lock, fair to the sync side.

    The training thread holds it for a whole step and takes it again at once for the next one;
    a plain lock would let a sync thread that waits for it (to cut its entry, to merge its
    peers') wait through several steps, each one more batch its replica trains unsynced. Here
    the training thread takes it with :meth:`training`, which first lets every waiting sync
    call in: the sync side waits at most for the rest of the current step.

    ``with lock:`` is the sync side's (and any other caller's) way to hold it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._turn = threading.Condition()
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Sync-side calls waiting for the lock now."""
        with self._turn:
            return self._waiting

    def __enter__(self) -> ReplicaLock:
        with self._turn:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._turn:
                self._waiting -= 1
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()
        with self._turn:
            self._turn.notify_all()

    @contextlib.contextmanager
    def training(self) -> Iterator[None]:
        """Hold the lock for one training step, after every sync call that waits for it."""
        with self._turn:
            self._turn.wait_for(lambda: self._waiting == 0)
        with self._lock:
            yield
        with self._turn:
            self._turn.notify_all()


PeerFetch = Callable[[str, int, int], PeerPayload]
"""``fetch(peer, round, since_seq)``: ask ``peer`` for its payload; raises ``OSError`` or
``TimeoutError`` when the peer is gone or too slow, :class:`SyncError` when it refuses."""

PEER_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError, SyncError)
"""Errors that mean "skip this peer for this exchange"; any other error is a bug and propagates."""


class ReplicaSync:
    """One worker's replica and its side of the sync protocol, transport injected.

    ``dense`` (parameters, updated in place) and ``tables`` (see :class:`EmbeddingDeltaLog`) are
    the replica. The training thread holds :attr:`lock` (with :meth:`ReplicaLock.training`)
    while it updates them (forward, backward, optimizer step) and then calls :meth:`touch`; the
    sync side takes the lock only to cut its own entry and snapshot, and to apply peers' deltas
    and the dense average, never across a network call, so a step never waits for a slow peer.
    Its embedding deltas travel in ``delta_dtype`` (default: ``antdt.sync.delta-dtype``).

    An exchange of round ``r`` is ``prepare(r)`` (idempotent per round: publish own deltas, take
    the dense snapshot, or take those of the training thread's newest :meth:`cut`), one fetch
    per peer (served by the peer's :meth:`serve`, which prepares
    the same round on its side, so a pull always sees the peer's newest deltas and every member
    averages the same snapshots), then :meth:`merge`.
    """

    def __init__(self, worker: str, dense: Sequence[torch.Tensor],
                 tables: Mapping[str, torch.Tensor], *, peers: Iterable[str] = (),
                 keep_rounds: int | None = None, delta_dtype: torch.dtype | None = None) -> None:
        if keep_rounds is None:
            keep_rounds = int(config.number("antdt.sync.keep-rounds", low=1, integer=True))
        if keep_rounds < 1:
            raise SyncError(f"keep_rounds must be >= 1, found {keep_rounds}")
        self.worker = worker
        self.dense = list(dense)
        self.log = EmbeddingDeltaLog(tables, peers=(p for p in peers if p != worker),
                                     delta_dtype=delta_dtype or delta_dtype_setting())
        self.lock = ReplicaLock()
        self._keep_rounds = keep_rounds
        self._rows_offset = 0
        self._snapshots: dict[int, list[torch.Tensor]] = {}
        self._cut: list[torch.Tensor] | None = None  # taken by cut(), for the next prepare
        self._ended = False  # training ended: publish exactly (rounding errors included)
        self._prepare_lock = threading.Lock()
        self._merges = 0  # merges and adoptions so far (under the lock)
        self._served: tuple[int, LeaderRows] | None = None  # see serve_rows
        self.refused = 0
        """Stale sync messages refused so far: requests (:meth:`admit`) and payloads
        (:meth:`merge`) of workers that are no peers of this replica (they left the job, or
        the scheduler removed them while they went on training)."""

    @property
    def tables(self) -> dict[str, torch.Tensor]:
        """The embedding tables, ``(num_rows, dim)`` each, updated in place."""
        return self.log.tables

    @property
    def rows_offset(self) -> int:
        """Training progress as last reported by :meth:`touch`."""
        return self._rows_offset

    def page_steps(self) -> Iterator[int]:
        """Steps that move the tables and the log's base onto huge pages
        (:meth:`EmbeddingDeltaLog.page_steps`): :class:`BackgroundSync` takes them between
        rounds, off the training thread and off the job's start."""
        return self.log.page_steps()

    def touch(self, ids: Mapping[str, torch.Tensor], rows_offset: int) -> None:
        """After a training step, still holding :attr:`lock`: rows ``ids[table]`` (``(k,)``
        int64) changed; ``rows_offset`` rows are now trained. Under the same lock as the step,
        so no publish takes the step's changes without counting its rows: an entry's effect is
        exactly that of the rows up to its ``rows_offset`` (the ledger trains the rows past a
        departed worker's offset again, and its peers take out exactly its entries past it).
        """
        for table, table_ids in ids.items():
            self.log.touch(table, table_ids)
        self._rows_offset = max(self._rows_offset, rows_offset)

    def set_peers(self, peers: Iterable[str], departed: Mapping[str, int] | None = None) -> None:
        """The live sync members (this worker is ignored if listed), and the members that left
        the job with the rows the ledger counts synced for each: their entries past that are
        taken out of the tables (:meth:`EmbeddingDeltaLog.depart`; the lock is taken for it)."""
        self.log.set_peers(p for p in peers if p != self.worker)
        news = {source: rows for source, rows in (departed or {}).items()
                if source != self.worker and self.log.departed().get(source) != rows}
        if not news:
            return
        with self.lock:
            self._merges += 1
            for source, rows in news.items():
                undone = self.log.depart(source, rows)
                if undone:
                    logger.warning("%s left the job with rows up to %d synced: took its entries "
                                   "%d..%d (rows up to %d) out again, the ledger trains them "
                                   "again", source, rows, undone[0].seq, undone[-1].seq,
                                   undone[-1].rows_offset)

    def synced_offset(self) -> int:
        """See :meth:`EmbeddingDeltaLog.synced_offset`."""
        return self.log.synced_offset()

    def ledger_offset(self, publish: bool = False) -> int:
        """The rows to report to the ledger as synced now (:meth:`synced_offset`). With
        ``publish``, or while the replica has no live peers (every row it trains is then synced
        once published: the base is what a joiner or a checkpoint copies), own changes are
        published first. The training thread calls it between steps, before each report (about
        once a second)."""
        if publish or not self.log.has_peers:
            with self.lock:
                self.log.publish(self._rows_offset)
        return self.log.synced_offset()

    def confirm(self, rows_offset: int) -> None:
        """The ledger accepted ``rows_offset`` as synced (see
        :meth:`EmbeddingDeltaLog.confirm`)."""
        self.log.confirm(rows_offset)

    def committed_tables(self, synced: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Copies of the tables holding exactly the rows a ledger counts done, whose synced
        offset of each worker is ``synced[worker]`` (see
        :meth:`EmbeddingDeltaLog.committed`). The caller holds :attr:`lock` and copied that
        ledger after taking it."""
        return self.log.committed(synced.get(self.worker, 0), synced)

    def cut(self) -> None:
        """The training thread, between two steps, when a round is due: publish own deltas and
        snapshot the dense parameters now, so that the next round's :meth:`prepare` (here, or
        a peer's pull of it) takes them without waiting for the replica lock through a step.
        A newer cut replaces one no round took (its deltas stay published)."""
        with self.lock:
            self.log.publish(self._rows_offset)
            snapshot = snapshot_dense(self.dense)
        with self._prepare_lock:
            self._cut = snapshot

    def drop_cut(self) -> None:
        """Training ended: later rounds (the final one) prepare from the replica as it is and
        publish exactly, rows still owing a rounding error included."""
        with self._prepare_lock:
            self._cut = None
            self._ended = True

    def prepare(self, round: int) -> list[torch.Tensor]:
        """Publish own deltas and snapshot the dense parameters for ``round``, once per round
        (from the newest :meth:`cut` no round took, if any); return the snapshot (shapes as
        ``dense``)."""
        with self._prepare_lock:
            snapshot = self._snapshots.get(round)
            if snapshot is not None:
                return snapshot
            if self._cut is not None:
                snapshot, self._cut = self._cut, None
            else:
                with self.lock:
                    self.log.publish(self._rows_offset, exact=self._ended)
                    snapshot = snapshot_dense(self.dense)
            self._snapshots[round] = snapshot
            while len(self._snapshots) > self._keep_rounds:
                del self._snapshots[min(self._snapshots)]
            return snapshot

    def snapshot(self) -> ReplicaSnapshot:
        """This replica's whole state (see :class:`ReplicaSnapshot`), taken under the lock."""
        with self.lock:
            state = self.log.state(self.worker)
            state.applied[self.worker] = self.log.last_seq
            dense = snapshot_dense(self.dense)
        return ReplicaSnapshot(self.worker, dense, state.tables, state.applied, state.changed,
                               state.kept, state.confirmed)

    def adopt(self, snapshot: ReplicaSnapshot) -> None:
        """Make ``snapshot`` this replica's state, in place (fused tables stay fused).

        Own unpublished changes are published first, and own entries the snapshot lacks are added
        back, so nothing this worker published is lost; its cursors become the snapshot's, so it
        pulls from each source exactly the entries after them, and its provisional entries the
        snapshot's (departures known before are forgotten: apply them again with
        :meth:`set_peers`). Call it while the training thread does not step (a joiner: before
        training starts).
        """
        if snapshot.source == self.worker:
            raise SyncError(f"adopt: {self.worker!r} cannot adopt its own snapshot")
        check_dense(self.dense, snapshot.dense)
        with self.lock:
            self._merges += 1
            self.log.publish(self._rows_offset, exact=True)
            self.log.restore(snapshot.tables,
                             {s: seq for s, seq in snapshot.applied.items() if s != self.worker},
                             own_seq=snapshot.applied.get(self.worker, 0),
                             changed=snapshot.changed,
                             kept={s: e for s, e in snapshot.kept.items() if s != self.worker},
                             confirmed={s: rows for s, rows in snapshot.confirmed.items()
                                        if s != self.worker})
            with torch.no_grad():
                for param, value in zip(self.dense, snapshot.dense):
                    param.copy_(value)

    # -- the job's end ---------------------------------------------------------------------
    def changed_rows(self) -> torch.Tensor:
        """After training ended, to ask the final leader for its rows: publish the last own
        changes, then return the rows this replica changed (``(rows,)`` bool, see
        :meth:`~antdt.sync.EmbeddingDeltaLog.changed`)."""
        with self.lock:
            self.log.publish(self._rows_offset, exact=True)
            return self.log.changed()

    def serve_rows(self, changed: torch.Tensor) -> LeaderRows:
        """As the final leader: what a member whose changed rows are ``changed`` (``(rows,)``
        bool) needs to end equal to this replica (see :class:`LeaderRows`), under the lock.
        Costs O(rows) for the mask plus O(k dim) for the rows either side changed.

        Once training ended, a leader that gathered every member's entries changed every row
        any of them did, so it answers every member the same: its own changed rows. That
        answer is taken once and served again while nothing merges into this replica."""
        with self.lock:
            if self.log.publish(self._rows_offset, exact=True) is not None:
                self._served = None
            covered = self._ended and self.log.covers(changed)
            if covered and self._served is not None and self._served[0] == self._merges:
                return self._served[1]
            ids, rows = self.log.rows_for(changed)
            dense = snapshot_dense(self.dense)
            applied = self.log.applied_seqs()
            applied[self.worker] = self.log.last_seq
            answer = LeaderRows(self.worker, ids, rows, dense, applied)
            if covered:
                self._served = (self._merges, answer)
        return answer

    def adopt_rows(self, leader: LeaderRows) -> int:
        """Write the final leader's rows and dense parameters in place: this replica is then
        equal to the leader bit for bit (see :meth:`~antdt.sync.EmbeddingDeltaLog.adopt_rows`);
        returns the rows copied. ``leader`` answers :meth:`changed_rows`; the training thread
        does not step in between."""
        if leader.source == self.worker:
            raise SyncError(f"adopt_rows: {self.worker!r} cannot adopt its own rows")
        check_dense(self.dense, leader.dense)
        with self.lock:
            self._merges += 1
            copied = self.log.adopt_rows(
                leader.source, leader.ids, leader.rows,
                {s: seq for s, seq in leader.applied.items() if s != self.worker},
                own_seq=leader.applied.get(self.worker, 0))
            with torch.no_grad():
                for param, value in zip(self.dense, leader.dense):
                    param.copy_(value)
        return copied

    def admit(self, requester: str, what: str) -> None:
        """Raise :class:`SyncError` (and count it in :attr:`refused`) unless ``requester``,
        asking for ``what``, is a live peer: a worker that left the job, or that the scheduler
        removed (a partitioned one still training, its link healed), is served nothing."""
        if not self.log.is_peer(requester):
            self.refused += 1
            raise SyncError(f"{what} for {requester!r} refused by {self.worker!r}: it is no "
                            "member of the job (it left, or the scheduler removed it)")

    def serve(self, requester: str, round: int, since_seq: int) -> PeerPayload:
        """A peer's request: our entries after ``since_seq`` and our snapshot of ``round``
        (:meth:`admit` first)."""
        self.admit(requester, "a pull")
        snapshot = self.prepare(round)
        entries = self.log.pull(requester, since_seq)
        return PeerPayload(self.worker, entries, snapshot if self.dense else None,
                           self.log.space.layout, self.log.confirmed)

    def merge(self, round: int, own: Sequence[torch.Tensor],
              payloads: Sequence[PeerPayload]) -> ExchangeReport:
        """Apply peers' entries and average the dense snapshots, under the replica lock.

        A payload that cannot be applied (other tables, a gap in the log, bad ids, mismatched
        shapes) is skipped and reported as failed; the others still merge. So is a payload whose
        source is no live peer (it left the job, or was removed): counted in :attr:`refused`.
        """
        report = ExchangeReport(round, bytes_received=sum(p.nbytes for p in payloads))
        snapshots: list[list[torch.Tensor]] = []
        with self.lock:
            self._merges += 1
            for payload in payloads:
                try:
                    if not self.log.is_peer(payload.source):
                        self.refused += 1
                        raise SyncError("its source is no member of the job (it left, or the "
                                        "scheduler removed it)")
                    if payload.layout != self.log.space.layout:
                        raise SyncError(f"its tables are {payload.layout!r}, ours are "
                                        f"{self.log.space.layout!r}")
                    if payload.dense is not None:
                        check_dense(own, payload.dense)
                    report.rows_applied += self.log.apply(payload.source, payload.entries,
                                                          payload.confirmed)
                except SyncError as exc:
                    logger.warning("round %d: skipping %s's payload: %s", round, payload.source,
                                   exc)
                    report.failed.append(payload.source)
                    continue
                if payload.dense is not None:
                    snapshots.append(payload.dense)
                report.merged.append(payload.source)
            average_dense(self.dense, own, snapshots)
        return report

    def exchange(self, round: int, peers: Sequence[str], fetch: PeerFetch) -> ExchangeReport:
        """One exchange with ``peers`` through ``fetch``; a failing peer is skipped and logged."""
        own = self.prepare(round)
        payloads: list[PeerPayload] = []
        failed: list[str] = []
        for peer in peers:
            if peer == self.worker:
                continue
            try:
                payloads.append(fetch(peer, round, self.log.applied_seq(peer)))
            except PEER_FAILURES as exc:
                logger.warning("round %d: peer %s skipped: %r", round, peer, exc)
                failed.append(peer)
        report = self.merge(round, own, payloads)
        report.failed[:0] = failed
        return report
