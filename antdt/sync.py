"""Model synchronisation for the async training mode: embedding delta logs, dense averaging and
the central group scheduler (AntDT-ND with ShadowSync's background sync and SDPipe's groups).

Every worker trains its own replica of the model. A background thread on each worker repeatedly
asks the scheduler's :class:`SyncScheduler` for a *group* of peers (SDPipe: the decision is
central, the tensors travel worker to worker) and exchanges with them:

* **Embeddings** keep parameter-server semantics. Each worker keeps a ``base`` copy of its tables
  and publishes, per exchange, one sequence-numbered :class:`LogEntry` holding ``current - base``
  for the rows it touched, addressed in the :class:`RowSpace` of all tables end to end. Peers
  pull the entries they have not applied yet and add them in place (to ``current`` *and*
  ``base``, so a peer's update is never re-published as one's own).
  Addition commutes, so every replica converges to ``initial + sum of all deltas`` whatever the
  grouping or order: a row learned by one worker is not diluted, nothing is counted twice.
* **Dense parameters** are averaged in the group as ``x += mean(snapshots) - own snapshot``; the
  snapshots are taken when the exchange starts, so progress made meanwhile is kept. Averaging is
  a consensus step: partial groups still converge.
* **The end**: a final all-member round pulls every remaining entry and averages the dense
  parameters; then every member adopts the whole state of one leader
  (:meth:`SyncScheduler.final_leader`), so the replicas end bit-identical even where
  floating-point sums were added in different orders or where a dead member's last entries
  reached only some survivors.
* **Joiners**: a worker that joins a running job adopts a live member's
  :class:`ReplicaSnapshot` (its tables without its unpublished changes, its dense parameters and
  its cursor per source) and pulls newer entries as usual. The snapshot is taken only once every
  other member has applied a member list naming the joiner (:meth:`SyncScheduler.settled`): a
  source drops an entry only when every peer it knows acknowledged it, so from then on each
  source keeps what the joiner needs (and it never dropped past the snapshot's cursor: the
  snapshot's member is one of those peers, and it acknowledges only entries it applied); before,
  a source unaware of the joiner could drop entries after the snapshot's cursor. The fused
  optimizer state (e.g. row-wise Adagrad momentum) is not part of the snapshot: a joiner's
  starts fresh, which only makes its first steps on a row larger.

The ledger contract: a worker's :meth:`~EmbeddingDeltaLog.synced_offset` is the last trained row
whose deltas every live peer has pulled and applied (acknowledged); if the worker dies, rows after
it are trained again, so its entries that reached only some peers count as duplicates, never as
losses.

This module holds the plain classes (no Dask cluster): :class:`EmbeddingDeltaLog`,
:func:`average_dense`, :class:`ReplicaSync` (one worker's side of the protocol, with the transport
injected) and :class:`SyncScheduler` (the central grouping, with an injected clock). Defaults come
from ``antdt.sync`` in dask config. The Dask glue is in ``antdt/sync_service.py``.
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
import logging
import math
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import dask.utils
import torch

from antdt import config
from antdt.errors import AntdtError, ConfigError

logger = logging.getLogger(__name__)

class SyncError(AntdtError):
    """A sync call is invalid: unknown worker or job, a cursor the log can no longer serve."""


class LogEntry(NamedTuple):
    """One published batch of embedding deltas of one worker.

    ``seq`` counts from 1 per worker without gaps; ``ids`` ``(k,)`` int64, strictly increasing,
    are rows of the log's :class:`RowSpace` (every table end to end) and ``deltas`` ``(k, dim)``
    their changes; ``rows_offset`` is the worker's training progress (rows trained, an opaque
    non-decreasing int chosen by the agent) when the entry was cut: every row up to it has its
    embedding effect in this entry or an earlier one.
    """

    seq: int
    ids: torch.Tensor
    deltas: torch.Tensor
    rows_offset: int


class RowSpace:
    """Embedding tables laid end to end: row ``r`` of table ``name`` is row ``start[name] + r``.

    Every table is ``(num_rows, dim)`` with the same ``dim``, dtype and device. Deltas travel as
    ids of this space, one id array and one delta matrix per log entry however many tables there
    are, so publishing, sending and applying them costs a few tensor operations, not a few per
    table. When the tables are consecutive views of one storage (a ``FusedEmbeddingBagCollection``
    keeps all of its tables in one FBGEMM buffer) :attr:`flat` is a ``(rows, dim)`` view over all
    of them and a gather or an add is one kernel; otherwise the work is split by table.

    >>> storage = torch.zeros(5, 2)
    >>> space = RowSpace({"a": storage[:2], "b": storage[2:]})
    >>> space.start, space.rows, space.flat is not None
    ({'a': 0, 'b': 2}, 5, True)
    >>> RowSpace({"b": storage[2:], "a": storage[:2]}).flat is None  # not in storage order
    True
    """

    def __init__(self, tables: Mapping[str, torch.Tensor]) -> None:
        first = next(iter(tables.values()), torch.zeros(0, 0))
        for name, table in tables.items():
            if table.dim() != 2:
                raise SyncError(f"embedding table {name!r} must be 2-d (num_rows, dim), "
                                f"found shape {tuple(table.shape)}")
            if (table.shape[1], table.dtype, table.device) != (first.shape[1], first.dtype,
                                                               first.device):
                raise SyncError(
                    f"embedding table {name!r} is ({table.shape[1]}, {table.dtype}, "
                    f"{table.device}) in (dim, dtype, device); every table must match the first "
                    f"one's ({first.shape[1]}, {first.dtype}, {first.device})")
        self.tables: dict[str, torch.Tensor] = {name: t.detach() for name, t in tables.items()}
        sizes = [t.shape[0] for t in self.tables.values()]
        self.start = dict(zip(self.tables, itertools.accumulate([0, *sizes[:-1]])))
        self.rows = sum(sizes)
        self.dim, self.dtype, self.device = first.shape[1], first.dtype, first.device
        sized = ";".join(f"{name}:{size}" for name, size in zip(self.tables, sizes))
        self.layout = f"{sized}x{self.dim}"
        """Names and sizes in order: replicas whose ids mean the same rows have equal layouts."""
        self._bounds = torch.tensor(list(itertools.accumulate([0, *sizes])), device=self.device)
        self.flat = _end_to_end(list(self.tables.values()), self.rows)
        """A ``(rows, dim)`` view over every table, or None when they are not end to end."""

    def split(self, space: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per table, its rows of ``space`` (first dimension :attr:`rows`), as views."""
        return {name: space[start:start + table.shape[0]]
                for (name, start), table in zip(self.start.items(), self.tables.values())}

    def concat(self) -> torch.Tensor:
        """A copy of every table, end to end: ``(rows, dim)``."""
        if self.flat is not None:
            return self.flat.clone()
        out = torch.empty(self.rows, self.dim, dtype=self.dtype, device=self.device)
        for name, part in self.split(out).items():
            part.copy_(self.tables[name])
        return out

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (``(k,)`` int64, increasing) of the tables: ``(k, dim)``."""
        if self.flat is not None:
            return self.flat.index_select(0, ids)
        out = torch.empty(len(ids), self.dim, dtype=self.dtype, device=self.device)
        for table, lo, hi, start in self._parts(ids):
            out[lo:hi] = table.index_select(0, ids[lo:hi] - start)
        return out

    def add_(self, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """Add ``deltas`` ``(k, dim)`` to rows ``ids`` (``(k,)`` int64, increasing), in place."""
        if self.flat is not None:
            self.flat.index_add_(0, ids, deltas)
            return
        for table, lo, hi, start in self._parts(ids):
            table.index_add_(0, ids[lo:hi] - start, deltas[lo:hi])

    def _parts(self, ids: torch.Tensor) -> Iterator[tuple[torch.Tensor, int, int, int]]:
        """Per table that ``ids`` (increasing) reach: the table, the slice of ``ids`` in it and
        the table's start."""
        cuts = torch.searchsorted(ids, self._bounds).tolist()
        for (table, start), lo, hi in zip(zip(self.tables.values(), self.start.values()),
                                          cuts, cuts[1:]):
            if hi > lo:
                yield table, lo, hi, start


def _end_to_end(tables: Sequence[torch.Tensor], rows: int) -> torch.Tensor | None:
    """A ``(rows, dim)`` view over ``tables`` if they are contiguous and follow each other in
    one storage, in this order; else None."""
    if not tables:
        return None
    first = tables[0]
    storage, dim = first.untyped_storage().data_ptr(), first.shape[1]
    offset = first.storage_offset()
    for table in tables:
        if not table.is_contiguous() or table.untyped_storage().data_ptr() != storage \
                or table.storage_offset() != offset:
            return None
        offset += table.shape[0] * dim
    return first.as_strided((rows, dim), (dim, 1))


class EmbeddingDeltaLog:
    """One worker's embedding tables, the ``base`` they are diffed against, and its delta log.

    ``tables`` maps a name to a ``(num_rows, dim)`` tensor that is written in place (for a
    ``FusedEmbeddingBagCollection`` the ``state_dict()`` weights are views of the fused storage,
    so an ``index_add_`` here is seen by the next forward). Entries address rows in the tables'
    :class:`RowSpace`, so every replica of a job must have the same tables in the same order.

    Threads: ``touch`` (training thread) and ``pull`` (peers' requests) may run any time; they
    only take the log's own short lock. ``publish`` and ``apply`` read and write the tables, so
    their caller must hold the replica lock that the training thread holds while it updates the
    tables (see :class:`ReplicaSync`).

    Cursors: ``pull(peer, since_seq)`` is also the peer's acknowledgement that it has *applied*
    every entry up to ``since_seq``. An entry is dropped once every live peer has acknowledged it,
    and :meth:`synced_offset` is the ``rows_offset`` of the newest dropped entry. Counting an
    acknowledgement rather than a reply sent means a reply lost on the way never makes rows look
    synchronised when they are not (the price: the offset lags by one exchange with each peer).

    >>> log = EmbeddingDeltaLog({"s": torch.zeros(2, 2), "t": torch.zeros(4, 2)}, peers=["b"])
    >>> log.tables["t"][1] += 1.0
    >>> log.touch("t", torch.tensor([1]))
    >>> entry = log.publish(rows_offset=8)
    >>> entry.seq, entry.ids.tolist(), entry.deltas.tolist()  # row 1 of t is row 3 of the space
    (1, [3], [[1.0, 1.0]])
    >>> [e.seq for e in log.pull("b", since_seq=0)], log.synced_offset()
    ([1], 0)
    >>> log.pull("b", since_seq=1), log.synced_offset()
    ([], 8)
    """

    def __init__(self, tables: Mapping[str, torch.Tensor], peers: Iterable[str] = (),
                 rows_offset: int = 0) -> None:
        self.space = RowSpace(tables)
        self.tables = self.space.tables
        self._base = self.space.concat()
        self._touched = torch.zeros(self.space.rows, dtype=torch.bool, device=self.space.device)
        self._touched_tables = self.space.split(self._touched)
        self._lock = threading.Lock()
        self._entries: list[LogEntry] = []
        self._last_seq = 0
        self._published_offset = rows_offset
        self._synced_offset = rows_offset
        self._dropped_seq = 0
        self._cursors: dict[str, int] = {peer: 0 for peer in peers}
        self._applied: dict[str, int] = {}

    # -- own deltas ------------------------------------------------------------------------
    def touch(self, table: str, ids: torch.Tensor) -> None:
        """Mark rows ``ids`` (``(k,)`` int64, duplicates allowed) of ``table`` as changed.

        Call it after the optimizer step that changed them (a change made after the mark is
        still published, by the next ``publish`` at the latest).
        """
        mask = self._touched_tables.get(table)
        if mask is None:
            raise SyncError(f"touch: unknown embedding table {table!r}; "
                            f"tables are {sorted(self._touched_tables)}")
        with self._lock:
            mask[ids] = True

    def publish(self, rows_offset: int) -> LogEntry | None:
        """Cut one entry with ``current - base`` of every touched row; ``base`` catches up.

        Returns the entry, or None when no row was touched and ``rows_offset`` did not advance.
        The caller holds the replica lock.
        """
        if rows_offset < self._published_offset:
            raise SyncError(f"publish: rows_offset must not decrease, found {rows_offset} "
                            f"after {self._published_offset}")
        with self._lock:
            ids = self._touched.nonzero().squeeze(1)
            self._touched.zero_()
        if ids.numel() == 0 and rows_offset == self._published_offset:
            return None
        # ids are unique (a mask's nonzero): select/copy, about twice as fast as indexing
        current = self.space.gather(ids)
        deltas = current - self._base.index_select(0, ids)
        self._base.index_copy_(0, ids, current)
        with self._lock:
            self._last_seq += 1
            entry = LogEntry(self._last_seq, ids, deltas, rows_offset)
            self._entries.append(entry)
            self._published_offset = rows_offset
            self._drop_acknowledged()
        return entry

    # -- serving peers -----------------------------------------------------------------------
    def pull(self, peer: str, since_seq: int) -> list[LogEntry]:
        """Entries after ``since_seq`` for ``peer``, which thereby acknowledges those up to it.

        A peer not known yet is added if the log still holds everything it needs; otherwise (it
        joined after entries it never saw were dropped) a :class:`SyncError` says it must
        bootstrap from a peer's state.
        """
        with self._lock:
            if not 0 <= since_seq <= self._last_seq:
                raise SyncError(f"pull from {peer!r}: since_seq must be in [0, {self._last_seq}]"
                                f", found {since_seq}")
            if since_seq < self._dropped_seq:
                raise SyncError(f"pull from {peer!r}: entries after seq {since_seq} were "
                                f"dropped (log starts after {self._dropped_seq}); "
                                "the peer must bootstrap")
            cursor = self._cursors.get(peer, 0)
            self._cursors[peer] = max(cursor, since_seq)
            self._drop_acknowledged()
            start = since_seq - self._dropped_seq
            return self._entries[start:]

    def set_peers(self, peers: Iterable[str]) -> None:
        """Make ``peers`` the live peers: new ones start at cursor 0, missing ones are forgotten
        (which may let entries be dropped and the synced offset advance)."""
        wanted = set(peers)
        with self._lock:
            for peer in list(self._cursors):
                if peer not in wanted:
                    del self._cursors[peer]
            for peer in wanted - self._cursors.keys():
                if self._dropped_seq > 0:
                    logger.info("peer %s joined after entries up to seq %d were dropped; it "
                                "pulls from the cursors of the snapshot it bootstraps from", peer,
                                self._dropped_seq)
                self._cursors[peer] = 0
            self._drop_acknowledged()

    def _drop_acknowledged(self) -> None:
        """Drop entries every live peer acknowledged (lock held)."""
        floor = min(self._cursors.values(), default=self._last_seq)
        count = floor - self._dropped_seq
        if count <= 0:
            return
        self._synced_offset = self._entries[count - 1].rows_offset
        del self._entries[:count]
        self._dropped_seq = floor

    # -- applying peers' deltas ------------------------------------------------------------
    def applied_seq(self, source: str) -> int:
        """Newest seq of ``source``'s log applied here (0: none)."""
        return self._applied.get(source, 0)

    def apply(self, source: str, entries: Sequence[LogEntry]) -> int:
        """Add ``source``'s entries in place to ``current`` and ``base``; return rows added.

        Entries already applied are skipped, so a repeated pull never counts twice; the first new
        entry must follow the last applied one. The caller holds the replica lock.
        """
        done = self.applied_seq(source)
        fresh = [entry for entry in entries if entry.seq > done]
        if not fresh:
            return 0
        expected = list(range(done + 1, done + 1 + len(fresh)))
        if [entry.seq for entry in fresh] != expected:
            raise SyncError(f"apply from {source!r}: expected seqs {expected[0]}..{expected[-1]}"
                            f" without gaps, found {[entry.seq for entry in fresh]}")
        for entry in fresh:
            self._check(source, entry)
        added = sum(self._add(entry) for entry in fresh)
        self._applied[source] = fresh[-1].seq
        return added

    def _check(self, source: str, entry: LogEntry) -> None:
        """Raise :class:`SyncError` unless ``entry`` fits this log's row space."""
        ids, deltas = entry.ids, entry.deltas
        where = f"apply from {source!r}, seq {entry.seq}"
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise SyncError(f"{where}: ids must be (k,) int64, found {tuple(ids.shape)} "
                            f"{ids.dtype}")
        if tuple(deltas.shape) != (len(ids), self.space.dim):
            raise SyncError(f"{where}: deltas must be ({len(ids)}, {self.space.dim}), found "
                            f"{tuple(deltas.shape)}")
        if len(ids) and not (ids[0] >= 0 and ids[-1] < self.space.rows
                             and bool((ids[1:] > ids[:-1]).all())):
            raise SyncError(f"{where}: ids must increase strictly within [0, {self.space.rows})"
                            f", found {ids[0].item()}..{ids[-1].item()}")

    def _add(self, entry: LogEntry) -> int:
        """Add ``entry``'s deltas in place to ``current`` and ``base``; return rows added."""
        ids = entry.ids.to(self.space.device)
        deltas = entry.deltas.to(self.space.device, self.space.dtype)
        self.space.add_(ids, deltas)
        self._base.index_add_(0, ids, deltas)
        return int(ids.numel())

    # -- whole-state copies (joiners, the final adoption) -----------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        """Copies of ``base`` (the tables without own unpublished changes: every entry this log
        published or applied, nothing else) and the applied seq per source. The caller holds the
        replica lock."""
        return ({name: base.clone() for name, base in self.space.split(self._base).items()},
                dict(self._applied))

    def restore(self, tables: Mapping[str, torch.Tensor], applied: Mapping[str, int],
                own_seq: int) -> None:
        """Make ``tables`` the state, in place: they hold every source's entries up to
        ``applied[source]`` and this log's own entries up to ``own_seq``; own entries after it
        are added back (peers will pull them, so they must be in our tables too).

        Own changes not yet published are overwritten: publish first. The caller holds the
        replica lock and does not train meanwhile.
        """
        if tables.keys() != self.tables.keys() or any(
                tables[name].shape != table.shape for name, table in self.tables.items()):
            raise SyncError("restore: expected tables "
                            f"{ {n: tuple(t.shape) for n, t in self.tables.items()} }, found "
                            f"{ {n: tuple(t.shape) for n, t in tables.items()} }")
        if not self._dropped_seq <= own_seq <= self._last_seq:
            raise SyncError(f"restore: own_seq must be in [{self._dropped_seq}, "
                            f"{self._last_seq}] (entries still held), found {own_seq}")
        with self._lock:
            keep = [entry for entry in self._entries if entry.seq > own_seq]
            self._touched.zero_()
        for name, base in self.space.split(self._base).items():
            self.tables[name].copy_(tables[name])
            base.copy_(tables[name])
        for entry in keep:
            self._add(entry)
        self._applied = dict(applied)

    # -- accounting ------------------------------------------------------------------------
    def synced_offset(self) -> int:
        """``rows_offset`` of the newest entry every live peer has acknowledged.

        If this worker dies, rows after it must be trained again (some peers may have applied
        part of them: duplicates, never losses).
        """
        with self._lock:
            return self._synced_offset

    @property
    def last_seq(self) -> int:
        """Seq of the newest published entry (0: none)."""
        return self._last_seq

    def __len__(self) -> int:
        """Entries held (published, not yet acknowledged by every live peer)."""
        with self._lock:
            return len(self._entries)


def snapshot_dense(dense: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``dense`` (same shapes) taken at the start of an exchange."""
    return [p.detach().clone() for p in dense]


def check_dense(own: Sequence[torch.Tensor], peer: Sequence[torch.Tensor]) -> None:
    """Raise :class:`SyncError` unless ``peer``'s snapshot has the shapes of ``own``."""
    if len(peer) != len(own) or any(a.shape != b.shape for a, b in zip(peer, own)):
        raise SyncError("dense snapshot does not match: expected shapes "
                        f"{[tuple(t.shape) for t in own]}, found "
                        f"{[tuple(t.shape) for t in peer]}")


def average_dense(dense: Sequence[torch.Tensor], own: Sequence[torch.Tensor],
                  peers: Sequence[Sequence[torch.Tensor]]) -> None:
    """Group averaging that keeps local progress: ``x += mean(own, *peers) - own`` in place.

    ``dense`` are the live parameters, ``own`` their snapshot from the exchange's start and
    ``peers`` the peers' snapshots of the same round (each the same shapes as ``dense``). When
    the whole group uses the same snapshots the sum of the group's parameters is unchanged.
    """
    if not peers:
        return
    for peer in peers:
        check_dense(own, peer)
    scale = 1.0 / (len(peers) + 1)
    with torch.no_grad():
        for i, (param, mine) in enumerate(zip(dense, own)):
            total = mine.clone()
            for peer in peers:
                total += peer[i]
            param.add_(total.mul_(scale).sub_(mine))


# ---- the period of the background sync --------------------------------------------------------

_BATCHES = re.compile(r"\s*(\d+)\s*batch(?:es)?\s*")


@dataclass(frozen=True)
class SyncPeriod:
    """How often a worker's background sync starts a round: every ``seconds`` of wall time, or
    whenever its training thread finished ``batches`` batches since the last round began.
    Exactly one of the two is set.

    A period in batches bounds the staleness (the steps a replica takes between exchanges)
    whatever the speed of the machine; a period in seconds bounds the share of the CPU the
    exchanges take. Either way training never waits: a round that takes longer than the period
    is followed by the next one at once.

    >>> SyncPeriod.parse(0.5), SyncPeriod.parse("250ms"), SyncPeriod.parse("4 batches")
    (SyncPeriod(seconds=0.5, batches=None), SyncPeriod(seconds=0.25, batches=None), \
SyncPeriod(seconds=None, batches=4))
    >>> str(SyncPeriod(seconds=0.5)), str(SyncPeriod(batches=1))
    ('0.5s', '1 batch')
    """

    seconds: float | None = None
    batches: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.batches is None):
            raise ConfigError(f"sync period: expected seconds or batches (one of them), found "
                              f"seconds={self.seconds!r}, batches={self.batches!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool)
                                         or not isinstance(self.seconds, (int, float))
                                         or not math.isfinite(self.seconds)
                                         or self.seconds <= 0):
            raise ConfigError(f"sync period: seconds must be a finite number > 0, found "
                              f"{self.seconds!r}")
        if self.batches is not None and (isinstance(self.batches, bool)
                                         or not isinstance(self.batches, int)
                                         or self.batches < 1):
            raise ConfigError(f"sync period: batches must be an int >= 1, found {self.batches!r}")

    @classmethod
    def parse(cls, value: object, where: str = "sync_period") -> SyncPeriod:
        """A number of seconds (``0.5``), a duration (``"500ms"``, ``"2s"``) or a number of
        batches (``"4 batches"``, ``"1 batch"``); a :class:`ConfigError` naming ``where``
        otherwise."""
        try:
            if isinstance(value, str):
                match = _BATCHES.fullmatch(value)
                if match:
                    return cls(batches=int(match.group(1)))
                return cls(seconds=dask.utils.parse_timedelta(value, default="seconds"))
            return cls(seconds=value)  # type: ignore[arg-type]  # checked on construction
        except (ConfigError, TypeError, ValueError, KeyError):
            raise ConfigError(f"{where}: expected seconds > 0 (0.5, '500ms') or batches "
                              f"('4 batches'), found {value!r}") from None

    def __str__(self) -> str:
        if self.batches is not None:
            return f"{self.batches} batch{'es' if self.batches != 1 else ''}"
        return f"{self.seconds:g}s"


# ---- one worker's side ----------------------------------------------------------------------


@dataclass
class PeerPayload:
    """What a peer serves for one exchange: its log entries after the requester's cursor, its
    dense snapshot for the round (None when it has no dense parameters to share) and the
    :attr:`RowSpace.layout` its entries' ids refer to."""

    source: str
    entries: list[LogEntry]
    dense: list[torch.Tensor] | None
    layout: str


@dataclass
class ReplicaSnapshot:
    """A replica's whole state, for a joiner to start from or for the final adoption.

    ``dense``: the source's dense parameters (shapes as its ``dense``); ``tables``: its tables
    ``(num_rows, dim)`` without its own unpublished changes; ``applied``: per source, the newest
    seq whose entry is in ``tables`` (the snapshot's source included: its newest published seq).
    """

    source: str
    dense: list[torch.Tensor]
    tables: dict[str, torch.Tensor]
    applied: dict[str, int]


@dataclass
class ExchangeReport:
    """Outcome of one exchange as seen by one worker."""

    round: int
    merged: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    rows_applied: int = 0


PeerFetch = Callable[[str, int, int], PeerPayload]
"""``fetch(peer, round, since_seq)``: ask ``peer`` for its payload; raises ``OSError`` or
``TimeoutError`` when the peer is gone or too slow, :class:`SyncError` when it refuses."""

PEER_FAILURES: tuple[type[BaseException], ...] = (OSError, TimeoutError, SyncError)
"""Errors that mean "skip this peer for this exchange"; any other error is a bug and propagates."""


class ReplicaSync:
    """One worker's replica and its side of the sync protocol, transport injected.

    ``dense`` (parameters, updated in place) and ``tables`` (see :class:`EmbeddingDeltaLog`) are
    the replica. The training thread holds :attr:`lock` while it updates them (forward, backward,
    optimizer step) and then calls :meth:`touch`; the sync side takes the lock only to cut its own
    entry and snapshot, and to apply peers' deltas and the dense average, never across a network
    call, so training never waits for a slow peer.

    An exchange of round ``r`` is ``prepare(r)`` (idempotent per round: publish own deltas, take
    the dense snapshot), one fetch per peer (served by the peer's :meth:`serve`, which prepares
    the same round on its side, so a pull always sees the peer's newest deltas and every member
    averages the same snapshots), then :meth:`merge`.
    """

    def __init__(self, worker: str, dense: Sequence[torch.Tensor],
                 tables: Mapping[str, torch.Tensor], *, peers: Iterable[str] = (),
                 keep_rounds: int | None = None) -> None:
        if keep_rounds is None:
            keep_rounds = int(config.number("antdt.sync.keep-rounds", low=1, integer=True))
        if keep_rounds < 1:
            raise SyncError(f"keep_rounds must be >= 1, found {keep_rounds}")
        self.worker = worker
        self.dense = list(dense)
        self.log = EmbeddingDeltaLog(tables, peers=(p for p in peers if p != worker))
        self.lock = threading.Lock()
        self._keep_rounds = keep_rounds
        self._rows_offset = 0
        self._snapshots: dict[int, list[torch.Tensor]] = {}
        self._prepare_lock = threading.Lock()

    @property
    def tables(self) -> dict[str, torch.Tensor]:
        """The embedding tables, ``(num_rows, dim)`` each, updated in place."""
        return self.log.tables

    @property
    def rows_offset(self) -> int:
        """Training progress as last reported by :meth:`touch`."""
        return self._rows_offset

    def touch(self, ids: Mapping[str, torch.Tensor], rows_offset: int) -> None:
        """After a training step: rows ``ids[table]`` (``(k,)`` int64) changed; ``rows_offset``
        rows are now trained.

        Call it after the step, with or without :attr:`lock`: an exchange in between publishes
        at most the step's changes without counting its rows, which errs towards re-training
        rows (duplicates), never towards losing them.
        """
        for table, table_ids in ids.items():
            self.log.touch(table, table_ids)
        self._rows_offset = max(self._rows_offset, rows_offset)

    def set_peers(self, peers: Iterable[str]) -> None:
        """The live sync members (this worker is ignored if listed)."""
        self.log.set_peers(p for p in peers if p != self.worker)

    def synced_offset(self) -> int:
        """See :meth:`EmbeddingDeltaLog.synced_offset`."""
        return self.log.synced_offset()

    def prepare(self, round: int) -> list[torch.Tensor]:
        """Publish own deltas and snapshot the dense parameters for ``round``, once per round;
        return the snapshot (shapes as ``dense``)."""
        with self._prepare_lock:
            snapshot = self._snapshots.get(round)
            if snapshot is not None:
                return snapshot
            with self.lock:
                self.log.publish(self._rows_offset)
                snapshot = snapshot_dense(self.dense)
            self._snapshots[round] = snapshot
            while len(self._snapshots) > self._keep_rounds:
                del self._snapshots[min(self._snapshots)]
            return snapshot

    def snapshot(self) -> ReplicaSnapshot:
        """This replica's whole state (see :class:`ReplicaSnapshot`), taken under the lock."""
        with self.lock:
            tables, applied = self.log.state()
            applied[self.worker] = self.log.last_seq
            dense = snapshot_dense(self.dense)
        return ReplicaSnapshot(self.worker, dense, tables, applied)

    def adopt(self, snapshot: ReplicaSnapshot) -> None:
        """Make ``snapshot`` this replica's state, in place (fused tables stay fused).

        Own unpublished changes are published first, and own entries the snapshot lacks are added
        back, so nothing this worker published is lost; its cursors become the snapshot's, so it
        pulls from each source exactly the entries after them. Call it while the training thread
        does not step: before training starts (a joiner) or after it ended (the final round).
        """
        if snapshot.source == self.worker:
            raise SyncError(f"adopt: {self.worker!r} cannot adopt its own snapshot")
        check_dense(self.dense, snapshot.dense)
        with self.lock:
            self.log.publish(self._rows_offset)
            self.log.restore(snapshot.tables,
                             {s: seq for s, seq in snapshot.applied.items() if s != self.worker},
                             own_seq=snapshot.applied.get(self.worker, 0))
            with torch.no_grad():
                for param, value in zip(self.dense, snapshot.dense):
                    param.copy_(value)

    def serve(self, requester: str, round: int, since_seq: int) -> PeerPayload:
        """A peer's request: our entries after ``since_seq`` and our snapshot of ``round``."""
        snapshot = self.prepare(round)
        entries = self.log.pull(requester, since_seq)
        return PeerPayload(self.worker, entries, snapshot if self.dense else None,
                           self.log.space.layout)

    def merge(self, round: int, own: Sequence[torch.Tensor],
              payloads: Sequence[PeerPayload]) -> ExchangeReport:
        """Apply peers' entries and average the dense snapshots, under the replica lock.

        A payload that cannot be applied (other tables, a gap in the log, bad ids, mismatched
        shapes) is skipped and reported as failed; the others still merge.
        """
        report = ExchangeReport(round)
        snapshots: list[list[torch.Tensor]] = []
        with self.lock:
            for payload in payloads:
                try:
                    if payload.layout != self.log.space.layout:
                        raise SyncError(f"its tables are {payload.layout!r}, ours are "
                                        f"{self.log.space.layout!r}")
                    if payload.dense is not None:
                        check_dense(own, payload.dense)
                    report.rows_applied += self.log.apply(payload.source, payload.entries)
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


# ---- the central scheduler ------------------------------------------------------------------


class MemberState(enum.Enum):
    """Where a sync member stands with the scheduler."""

    IDLE = "idle"  # training, not asking to sync
    READY = "ready"  # waiting in the pool for partners
    ASSIGNED = "assigned"  # put in a group by a partner's call; told on its next call
    FINISHED = "finished"  # done training, waiting for the final all-member round
    DONE = "done"  # received the final round


class SyncGroup(NamedTuple):
    """A group the scheduler formed: ``members`` (sorted worker ids) exchange in ``round``."""

    round: int
    members: tuple[str, ...]
    final: bool


@dataclass(frozen=True)
class Answer:
    """The scheduler's answer to one worker: sync with ``group``, ``wait`` and ask again, or go
    on ``alone`` (waited ``max_wait_s`` without a partner: nothing to exchange)."""

    kind: Literal["group", "wait", "alone"]
    group: SyncGroup | None = None


@dataclass
class _Member:
    state: MemberState = MemberState.IDLE
    key: tuple[int, int, str] | None = None  # position in the ready pool while READY
    ready_since: float = 0.0
    queued: int = -1  # ticket of its entry in the FIFO of waiting workers while READY
    pending: SyncGroup | None = None
    acked: int = -1  # members_version of the newest member list it applied (-1: none reported)
    joined_version: int | None = None  # members_version its mid-job join created; None: listed


class SyncScheduler:
    """Central half of SDPipe-style grouping: who syncs with whom, and when.

    Workers :meth:`join` before training starts, then call :meth:`ready` whenever they want to
    sync (with their progress in rows); the scheduler groups up to ``group_size`` ready workers of
    similar progress: the nearest ones, and with ``max_progress_gap`` set, only partners within
    that many rows of the caller until it has waited ``max_wait_s``. A worker put in a group by a
    partner's call learns it on its next call. A worker that waited ``max_wait_s`` takes
    whichever ready partners there are, or is told to go on ``alone``: nobody ever blocks on a
    straggler. ``ready(..., final=True)`` says the worker
    is done training; once every live member has said so, one final group of all members forms.
    After its exchange each member calls :meth:`complete`; once all did, every member other than
    the :meth:`final_leader` adopts the leader's state and says so with :meth:`adopted`, and
    :meth:`final_done` turns True.

    A worker that joins a running job calls :meth:`join_running`; it may take a snapshot once
    :meth:`settled`, i.e. once every other member reported (:meth:`acknowledge`) that it applied
    a member list naming the joiner (see the module docstring for why).

    Each call costs O(log n + group_size) (a sorted pool of ready workers; the insert/delete
    moves pointers, no Python-level scan over workers). Time comes in as ``now``.

    >>> s = SyncScheduler(group_size=2, max_wait_s=5.0)
    >>> for w in ("a", "b", "c"):
    ...     s.join(w)
    >>> s.ready("a", progress=100, now=0.0)
    Answer(kind='wait', group=None)
    >>> s.ready("b", progress=90, now=0.1)
    Answer(kind='group', group=SyncGroup(round=1, members=('a', 'b'), final=False))
    >>> s.ready("a", progress=100, now=0.2).group.round
    1
    >>> s.ready("c", progress=10, now=1.0).kind, s.ready("c", progress=10, now=6.0).kind
    ('wait', 'alone')
    """

    def __init__(self, group_size: int | None = None, max_wait_s: float | None = None,
                 max_progress_gap: int | None = None) -> None:
        if group_size is None:
            group_size = int(config.number("antdt.sync.group-size", integer=True))
        if max_wait_s is None:
            max_wait_s = config.seconds("antdt.sync.max-wait")
        if group_size < 2:
            raise SyncError(f"group_size must be >= 2, found {group_size}")
        if max_wait_s < 0:
            raise SyncError(f"max_wait_s must be >= 0, found {max_wait_s}")
        if max_progress_gap is not None and max_progress_gap < 0:
            raise SyncError(f"max_progress_gap must be >= 0 or None, found {max_progress_gap}")
        self.group_size = group_size
        self.max_wait_s = max_wait_s
        self.max_progress_gap = max_progress_gap
        self._members: dict[str, _Member] = {}
        self._pool: list[tuple[int, int, str]] = []  # sorted (progress, ticket, worker)
        self._waiting: collections.deque[tuple[int, str]] = collections.deque()  # FIFO, lazy
        self._tickets = itertools.count()
        self._round = 0
        self._finished = 0
        self._final: SyncGroup | None = None
        self._completed: set[str] = set()
        self._adopted: dict[str, str] = {}  # member -> leader whose final state it adopted
        self._joining: dict[str, set[str]] = {}  # joiner -> members yet to acknowledge it
        self.members_version = 0

    # -- membership ------------------------------------------------------------------------
    def join(self, worker: str) -> None:
        """Add ``worker`` as a sync member before training starts (idempotent)."""
        if worker in self._members:
            return
        if self._final is not None:
            raise SyncError(f"join {worker!r}: the final round {self._final.round} already "
                            "formed")
        self._members[worker] = _Member()
        self.members_version += 1

    def join_running(self, worker: str) -> None:
        """Add ``worker`` to the running job: it bootstraps from a member's snapshot once
        :meth:`settled` (O(members), once per joiner). Idempotent; a member already listed is
        left as it is (it needs no snapshot: every member kept its log for it)."""
        if worker in self._members:
            return
        self.join(worker)
        self._members[worker].joined_version = self.members_version
        waiting = {other for other, member in self._members.items()
                   if other != worker and member.acked < self.members_version}
        if waiting:
            self._joining[worker] = waiting
        logger.info("%s joins the running sync job: %d members, %d to acknowledge it", worker,
                    len(self._members), len(waiting))

    def acknowledge(self, worker: str, members_version: int) -> bool:
        """``worker`` applied the member list of ``members_version``; True when this settled a
        joiner (O(joiners))."""
        member = self._member(worker)
        if not -1 <= members_version <= self.members_version:
            raise SyncError(f"acknowledge {worker!r}: members_version must be in [-1, "
                            f"{self.members_version}], found {members_version}")
        member.acked = max(member.acked, members_version)
        settled = False
        for joiner, waiting in list(self._joining.items()):
            joined = self._members[joiner].joined_version
            if worker in waiting and joined is not None and joined <= member.acked:
                waiting.discard(worker)
                if not waiting:
                    del self._joining[joiner]
                    settled = True
        return settled

    def settled(self, worker: str) -> bool:
        """Whether every other member applied a member list naming ``worker``."""
        self._member(worker)
        return worker not in self._joining

    def waiting_for(self, worker: str) -> list[str]:
        """The members that have not acknowledged ``worker``'s join yet, sorted."""
        return sorted(self._joining.get(worker, ()))

    def joined_running(self, worker: str) -> bool:
        """Whether ``worker`` joined the running job (so it must bootstrap from a snapshot)."""
        return self._member(worker).joined_version is not None

    def leave(self, worker: str) -> SyncGroup | None:
        """Forget ``worker`` (it left or died); return the final group if this completes it."""
        member = self._members.pop(worker, None)
        if member is None:
            return None
        self.members_version += 1
        if member.state is MemberState.READY:
            self._pool_remove(member)
        if member.state in (MemberState.FINISHED, MemberState.DONE):
            self._finished -= 1
        self._completed.discard(worker)
        self._adopted.pop(worker, None)
        self._joining.pop(worker, None)
        for joiner, waiting in list(self._joining.items()):
            waiting.discard(worker)
            if not waiting:
                del self._joining[joiner]
        return self._maybe_final(caller=None)

    def members(self) -> list[str]:
        """The live members, sorted."""
        return sorted(self._members)

    def state(self, worker: str) -> MemberState:
        """``worker``'s state (raises :class:`SyncError` for a non-member)."""
        return self._member(worker).state

    def complete(self, worker: str) -> bool:
        """``worker`` finished its exchange of the final round; True once every live member has
        (until then peers may still pull from it, so it keeps serving)."""
        if self._member(worker).state is not MemberState.DONE:
            raise SyncError(f"complete {worker!r}: expected a member that received the final "
                            f"round, found state {self.state(worker).value}")
        self._completed.add(worker)
        return self.all_complete()

    def all_complete(self) -> bool:
        """Whether every live member finished its final exchange."""
        return self._final is not None and len(self._completed) == len(self._members)

    def final_leader(self) -> str | None:
        """Once :meth:`all_complete`: the member whose state every other one adopts (the
        smallest live address; a new one if it dies). None before."""
        return min(self._members) if self.all_complete() else None

    def adopted(self, worker: str, leader: str) -> None:
        """``worker`` adopted ``leader``'s state after the final exchange."""
        if worker not in self._completed:
            raise SyncError(f"adopted {worker!r}: expected a member that completed its final "
                            f"exchange, found state {self.state(worker).value}")
        self._adopted[worker] = leader

    def adopted_from(self, worker: str) -> str | None:
        """The leader whose state ``worker`` reported adopting last, if any."""
        return self._adopted.get(worker)

    def final_done(self) -> bool:
        """Every live member other than the leader adopted the current leader's state: the
        replicas are identical, members may stop serving."""
        leader = self.final_leader()
        return leader is not None and all(
            self._adopted.get(worker) == leader for worker in self._members if worker != leader)

    def wait_left(self, worker: str, now: float) -> float:
        """Seconds until a READY ``worker`` stops waiting for partners (0 when not READY)."""
        member = self._member(worker)
        if member.state is not MemberState.READY:
            return 0.0
        return max(0.0, member.ready_since + self.max_wait_s - now)

    # -- the one call workers make ---------------------------------------------------------
    def ready(self, worker: str, progress: int, now: float, final: bool = False) -> Answer:
        """``worker`` (at ``progress`` rows) asks whom to sync with; see the class docstring."""
        member = self._member(worker)
        if member.state is MemberState.ASSIGNED:
            return self._hand_over(member)
        if member.state is MemberState.DONE:
            assert self._final is not None
            return Answer("group", self._final)
        if final:
            return self._finish(worker, member)
        if member.state is MemberState.FINISHED:
            raise SyncError(f"ready {worker!r}: already finished training, expected "
                            "final=True")
        if member.state is MemberState.READY:
            self._pool_remove(member)
        else:
            member.state = MemberState.READY
            member.ready_since = now
            member.queued = next(self._tickets)
            self._waiting.append((member.queued, worker))
        member.key = (progress, next(self._tickets), worker)
        bisect.insort(self._pool, member.key)
        return self._try_group(worker, member, now)

    # -- transitions -----------------------------------------------------------------------
    def _try_group(self, worker: str, member: _Member, now: float) -> Answer:
        active = len(self._members) - self._finished
        size = min(self.group_size, active)
        expired = now - member.ready_since >= self.max_wait_s
        if len(self._pool) < size and not expired:
            return Answer("wait")
        gap = None if expired else self.max_progress_gap
        count = min(size, len(self._pool)) - 1
        overdue = self._overdue(worker, now) if count > 0 else None
        partners = [] if overdue is None else [overdue]
        partners += self._nearest(member, count - len(partners), gap, skip=overdue)
        if not expired and len(partners) < size - 1:
            return Answer("wait")
        if not partners:
            self._pool_remove(member)
            member.state = MemberState.IDLE
            return Answer("alone")
        self._round += 1
        group = SyncGroup(self._round, tuple(sorted([worker, *partners])), final=False)
        for partner in partners:
            other = self._members[partner]
            self._pool_remove(other)
            other.state = MemberState.ASSIGNED
            other.pending = group
        self._pool_remove(member)
        member.state = MemberState.IDLE
        return Answer("group", group)

    def _overdue(self, caller: str, now: float) -> str | None:
        """The longest-waiting READY worker, unless it is ``caller``, if it waited
        ``max_wait_s``: it joins the next group formed, so nobody starves because the others'
        progress is closer. Stale FIFO entries are dropped on the way (amortised O(1))."""
        while self._waiting:
            ticket, worker = self._waiting[0]
            member = self._members.get(worker)
            if member is None or member.state is not MemberState.READY or member.queued != ticket:
                self._waiting.popleft()
                continue
            if worker == caller or now - member.ready_since < self.max_wait_s:
                return None
            return worker
        return None

    def _nearest(self, member: _Member, count: int, gap: int | None,
                 skip: str | None = None) -> list[str]:
        """Up to ``count`` READY workers closest in progress to ``member`` (other than
        ``skip``), none further than ``gap`` rows when given (O(log n + count))."""
        assert member.key is not None
        pos = bisect.bisect_left(self._pool, member.key)
        left, right = pos - 1, pos + 1
        progress = member.key[0]
        chosen: list[str] = []
        while len(chosen) < count and (left >= 0 or right < len(self._pool)):
            take_left = right >= len(self._pool) or (
                left >= 0 and progress - self._pool[left][0] <= self._pool[right][0] - progress)
            index = left if take_left else right
            if gap is not None and abs(self._pool[index][0] - progress) > gap:
                break
            if self._pool[index][2] != skip:
                chosen.append(self._pool[index][2])
            if take_left:
                left -= 1
            else:
                right += 1
        return chosen

    def _hand_over(self, member: _Member) -> Answer:
        group = member.pending
        assert group is not None
        member.pending = None
        member.state = MemberState.DONE if group.final else MemberState.IDLE
        return Answer("group", group)

    def _finish(self, worker: str, member: _Member) -> Answer:
        if member.state is MemberState.READY:
            self._pool_remove(member)
        if member.state is not MemberState.FINISHED:
            member.state = MemberState.FINISHED
            self._finished += 1
        group = self._maybe_final(caller=worker)
        return Answer("wait") if group is None else Answer("group", group)

    def _maybe_final(self, caller: str | None) -> SyncGroup | None:
        """Form the final group once every live member finished (O(n), once per job)."""
        if self._final is not None or not self._members:
            return None
        if self._finished < len(self._members):
            return None
        self._round += 1
        self._final = SyncGroup(self._round, tuple(sorted(self._members)), final=True)
        for worker, member in self._members.items():
            if worker == caller:
                member.state = MemberState.DONE
            else:
                member.state = MemberState.ASSIGNED
                member.pending = self._final
        logger.info("final sync round %d with %d members", self._round, len(self._members))
        return self._final

    def _pool_remove(self, member: _Member) -> None:
        assert member.key is not None
        pos = bisect.bisect_left(self._pool, member.key)
        assert self._pool[pos] == member.key
        del self._pool[pos]
        member.key = None

    def _member(self, worker: str) -> _Member:
        member = self._members.get(worker)
        if member is None:
            raise SyncError(f"{worker!r} is not a sync member ({len(self._members)} members); "
                            "call join first")
        return member
