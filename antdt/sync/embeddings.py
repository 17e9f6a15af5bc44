"""One worker's log of embedding deltas (:class:`EmbeddingDeltaLog`): the parameter-server half
of the async mode's model sync, over the tables laid end to end
(:class:`~antdt.sync.rows.RowSpace`).

Each worker keeps a ``base`` copy of its tables and publishes, per exchange, one
sequence-numbered :class:`LogEntry` holding ``current - base`` for the rows it touched,
addressed in the :class:`RowSpace` of all tables end to end. Peers pull the entries they have not
applied yet and add them in place (to ``current`` *and* ``base``, so a peer's update is never
re-published as one's own). Addition commutes, so every replica converges to ``initial + sum of
all deltas`` whatever the grouping or order: a row learned by one worker is not diluted, nothing
is counted twice.

The ledger contract: a worker's :meth:`~EmbeddingDeltaLog.synced_offset` is the last trained row
whose deltas every live peer has pulled and applied (acknowledged); the worker reports it to the
shard ledger, which then counts the rows up to it done. If the worker dies or leaves, the ledger
trains the rows after the offset it holds again, so their first effect must leave every replica.

Provisional entries: the ledger learns of a synced offset only when the worker next reports
(about once a second), and a peer may apply an entry long before that. Until the ledger has
*confirmed* an entry's ``rows_offset`` (the worker's report was accepted), the entry is
provisional: every log keeps its own published entries and the peers' entries it applied until
their source's confirmed offset passes them (:meth:`EmbeddingDeltaLog.confirm`; a pull carries the
source's), hands them to a joiner with its snapshot, and when a source departs
(:meth:`EmbeddingDeltaLog.depart`, with the offset the ledger holds for it) subtracts the ones past
that offset and refuses the source's entries from then on. So every live replica holds a departed
worker's rows exactly up to what the ledger counts done, and a checkpoint's tables
(:meth:`EmbeddingDeltaLog.committed`: the base less every entry past the offsets of the ledger
copied with it) hold exactly the rows that ledger counts done. A confirmed offset never passes the
ledger's (the worker learns it from the ledger's reply), so nothing a departure or a checkpoint
must take out was dropped before. A worker without live peers publishes all the same (its
entries are dropped at once, and kept until confirmed): a joiner's snapshot and a checkpoint copy
the base, and a row counted synced must be in it.

Rounded deltas: a log may publish its deltas in a narrower dtype than its tables (bfloat16 for
float32 tables: half the bytes on the wire and in the log). Its ``base`` then advances by the
rounded delta, not to ``current``, so what rounding left out stays in ``current - base`` and
travels with the row's next delta (error feedback): peers lag the exact sum by at most the
rounding of each row's newest delta (2^-9 of it in bfloat16), never by an error that grows. An
exact publish (:meth:`EmbeddingDeltaLog.publish`, once training ended) sends every row still
owing its rounding in the tables' dtype, so replicas end at the exact sum all the same.

Changed rows: addition commutes in exact arithmetic, not in floating point, so replicas that added
the same deltas in different orders hold rows that differ in their last bits. Each log keeps a
mask of the rows it ever changed (trained, added an entry to, or copied); every other row still
holds the initial tables' bits. Replicas built from the same initial tables therefore differ at
most in the rows either of them changed, and the job's end copies only those
(:meth:`EmbeddingDeltaLog.rows_for`, :meth:`EmbeddingDeltaLog.adopt_rows`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from antdt.device import collapse_steps, huge_pages
from antdt.errors import SyncError
from antdt.sync import kernels
from antdt.sync.rows import RowSpace, true_rows

logger = logging.getLogger(__name__)


class LogEntry(NamedTuple):
    """One published batch of embedding deltas of one worker.

    ``seq`` counts from 1 per worker without gaps; ``ids`` ``(k,)`` int64, strictly increasing,
    are rows of the log's :class:`RowSpace` (every table end to end) and ``deltas`` ``(k, dim)``
    their changes, in the log's delta dtype (see :class:`EmbeddingDeltaLog`); ``rows_offset`` is
    the worker's training progress (rows trained, an opaque non-decreasing int chosen by the
    agent) when the entry was cut: every row up to it has its embedding effect in this entry or an
    earlier one.
    """

    seq: int
    ids: torch.Tensor
    deltas: torch.Tensor
    rows_offset: int


class LogState(NamedTuple):
    """A log's whole state for a joiner (:meth:`EmbeddingDeltaLog.state`): ``tables`` its base
    per table, ``applied`` the newest seq applied per source, ``changed`` ``(rows,)`` bool, the
    rows that may differ from the initial tables; ``kept`` per source the provisional entries in
    ``tables`` (the log's own under ``own``) and ``confirmed`` per source the offset they are
    past."""

    tables: dict[str, torch.Tensor]
    applied: dict[str, int]
    changed: torch.Tensor
    kept: dict[str, list[LogEntry]]
    confirmed: dict[str, int]


class EmbeddingDeltaLog:
    """One worker's embedding tables, the ``base`` they are diffed against, and its delta log.

    ``tables`` maps a name to a ``(num_rows, dim)`` tensor that is written in place (for a
    ``FusedEmbeddingBagCollection`` the ``state_dict()`` weights are views of the fused storage,
    so an ``index_add_`` here is seen by the next forward). Entries address rows in the tables'
    :class:`RowSpace`, so every replica of a job must have the same tables in the same order.

    Threads: ``touch`` (training thread) and ``pull`` (peers' requests) may run any time; they
    only take the log's own short lock. ``publish``, ``apply`` and the whole-state and changed-row
    methods read and write the tables, so their caller must hold the replica lock that the
    training thread holds while it updates the tables (see :class:`ReplicaSync`).

    ``delta_dtype`` (default: the tables' dtype) is the dtype entries carry their deltas in; a
    narrower one rounds them, with the rounding error fed back (see the module).

    Cursors: ``pull(peer, since_seq)`` is also the peer's acknowledgement that it has *applied*
    every entry up to ``since_seq``. An entry is dropped once every live peer has acknowledged it,
    and :meth:`synced_offset` is the ``rows_offset`` of the newest dropped entry. Counting an
    acknowledgement rather than a reply sent means a reply lost on the way never makes rows look
    synchronised when they are not (the price: the offset lags by one exchange with each peer).

    Provisional entries (see the module): :meth:`confirm` is the ledger's word that it holds the
    rows up to an offset as synced; own entries past it and peers' entries past their source's
    (each :meth:`apply` says it) are kept, for :meth:`depart`, :meth:`state` and
    :meth:`committed`.

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
                 rows_offset: int = 0, delta_dtype: torch.dtype | None = None) -> None:
        self.space = RowSpace(tables)
        self.tables = self.space.tables
        self.delta_dtype = self.space.dtype if delta_dtype is None else delta_dtype
        if not self.delta_dtype.is_floating_point:
            raise SyncError(f"delta dtype must be a floating-point dtype, found {delta_dtype}")
        self._owed: torch.Tensor | None = None
        """Rows whose rounding error is not published yet, when deltas are rounded."""
        if self.delta_dtype != self.space.dtype:
            self._owed = torch.zeros(self.space.rows, dtype=torch.bool, device=self.space.device)
        self._base = self.space.concat()
        huge_pages(self._base)  # a round gathers and scatters rows at random
        self._touched = torch.zeros(self.space.rows, dtype=torch.bool, device=self.space.device)
        self._touched_tables = self.space.split(self._touched)
        self._changed = torch.zeros(self.space.rows, dtype=torch.bool, device=self.space.device)
        self._host = kernels.host_rows(self.space.flat, self.delta_dtype)
        """The tables as one array when the cut and the merge run as :mod:`kernels`, else None
        (torch's index operations)."""
        self._lock = threading.Lock()
        self._entries: list[LogEntry] = []
        self._last_seq = 0
        self._published_offset = rows_offset
        self._synced_offset = rows_offset
        self._dropped_seq = 0
        self._cursors: dict[str, int] = {peer: 0 for peer in peers}
        self._applied: dict[str, int] = {}
        self._confirmed = rows_offset
        """The ledger holds own rows up to here as synced (the newest :meth:`confirm`)."""
        self._unconfirmed: deque[LogEntry] = deque()
        """Own published entries past :attr:`_pruned` (changed with the replica lock held)."""
        self._pruned = rows_offset
        """The confirmed offset :attr:`_unconfirmed` was last pruned to."""
        self._kept: dict[str, deque[LogEntry]] = {}
        """Per source, the applied entries past its confirmed offset (:attr:`_confirmed_of`)."""
        self._confirmed_of: dict[str, int] = {}
        self._departed: dict[str, int] = {}
        """Sources that left the job, and the offset up to which their rows count synced."""

    def page_steps(self) -> Iterator[int]:
        """Move the tables and the base onto huge pages a few MB at a time
        (:func:`antdt.device.collapse_steps`); the caller takes the steps between rounds."""
        return collapse_steps([*self.tables.values(), self._base])

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
            mask.index_fill_(0, ids, True)

    def publish(self, rows_offset: int, exact: bool = False) -> LogEntry | None:
        """Cut one entry with ``current - base`` of every touched row, in the delta dtype;
        ``base`` advances by the entry's deltas (to ``current`` unless they were rounded).
        ``exact``: in the tables' dtype, and every row still owing a rounding error too, so
        that ``base`` is ``current`` afterwards.

        Without live peers the entry is dropped at once (``rows_offset`` is synced then), and
        kept until confirmed like any other: a row counts synced only once its effect is in the
        base, which is what a joiner and a checkpoint copy.

        Returns the entry, or None when no row was touched and ``rows_offset`` did not advance.
        The caller holds the replica lock.
        """
        if rows_offset < self._published_offset:
            raise SyncError(f"publish: rows_offset must not decrease, found {rows_offset} "
                            f"after {self._published_offset}")
        self._prune()
        owed = self._owed
        with self._lock:
            ids = true_rows(self._touched | owed if exact and owed is not None else self._touched)
            self._touched.zero_()
        if ids.numel() == 0 and rows_offset == self._published_offset:
            return None
        rounding = None if exact else owed
        if self._host is not None:
            deltas = self._cut_host(self._host, ids, rounding)
        else:
            deltas = self._cut(ids, rounding)
        if owed is not None and exact:
            owed.zero_()
        with self._lock:
            self._last_seq += 1
            entry = LogEntry(self._last_seq, ids, deltas, rows_offset)
            self._entries.append(entry)
            self._published_offset = rows_offset
            self._drop_acknowledged()
        if rows_offset > self._pruned:
            self._unconfirmed.append(entry)
        return entry

    # -- provisional entries -----------------------------------------------------------------
    def confirm(self, rows_offset: int) -> None:
        """The ledger accepted ``rows_offset`` as this worker's synced rows: own entries up to it
        are no longer provisional (dropped at the next publish). Any thread, no lock."""
        self._confirmed = max(self._confirmed, rows_offset)

    @property
    def confirmed(self) -> int:
        """The newest offset :meth:`confirm` was given (what a pull tells peers)."""
        return self._confirmed

    def is_peer(self, worker: str) -> bool:
        """Whether ``worker`` is a live peer (named by the last :meth:`set_peers`, or added by
        a pull since)."""
        with self._lock:
            return worker in self._cursors

    @property
    def has_peers(self) -> bool:
        """Whether any live peer pulls this log's entries."""
        with self._lock:
            return bool(self._cursors)

    def _prune(self) -> None:
        """Forget own entries the ledger confirmed (replica lock held)."""
        confirmed = self._confirmed
        while self._unconfirmed and self._unconfirmed[0].rows_offset <= confirmed:
            self._unconfirmed.popleft()
        self._pruned = confirmed

    def depart(self, source: str, synced: int) -> list[LogEntry]:
        """``source`` left the job and the ledger trains its rows past ``synced`` again: subtract
        its kept entries past that offset from ``current`` and ``base``, and refuse its entries
        from now on. Returns the entries taken out. Idempotent; the caller holds the replica lock.

        Raises :class:`SyncError` if an entry past ``synced`` was already forgotten (the source
        said the ledger confirmed more than it holds: another antdt, or a bug), rather than
        keeping rows the ledger will train again."""
        kept = self._kept.pop(source, deque())
        confirmed = self._confirmed_of.pop(source, 0)
        self._departed[source] = synced
        if confirmed > synced:
            raise SyncError(f"{source} left with rows up to {synced} synced, but it said rows up "
                            f"to {confirmed} were confirmed: its entries between cannot be taken "
                            "back")
        undo = [entry for entry in kept if entry.rows_offset > synced]
        for entry in reversed(undo):
            self._add(entry._replace(deltas=-entry.deltas))
        return undo

    def departed(self) -> dict[str, int]:
        """Sources that left the job and their synced offsets (a copy)."""
        return dict(self._departed)

    def committed(self, own_synced: int, synced: Mapping[str, int]) -> dict[str, torch.Tensor]:
        """Copies of the tables holding exactly the rows a ledger counts done, when this log's
        own synced offset there is ``own_synced`` and each source's ``synced[source]`` (absent:
        0): the base less own entries past ``own_synced`` and kept entries past their source's
        offset (a checkpoint's tables; see the module).

        The caller holds the replica lock and copied that ledger after taking it (so it holds
        no offset this log had not applied, and confirmed nothing past it: checked)."""
        behind = {source: confirmed for source, confirmed in self._confirmed_of.items()
                  if confirmed > synced.get(source, 0)}
        if self._pruned > own_synced:
            behind["this worker"] = self._pruned
        if behind:
            raise SyncError(f"the ledger's copy is older than the replica's: confirmed offsets "
                            f"{behind} are past its synced offsets")
        undo = [entry for entry in self._unconfirmed if entry.rows_offset > own_synced]
        undo += [entry for source, kept in self._kept.items() for entry in kept
                 if entry.rows_offset > synced.get(source, 0)]
        flat = self._base.clone()
        for entry in undo:
            flat.index_add_(0, entry.ids.to(flat.device),
                            entry.deltas.to(flat.device, flat.dtype), alpha=-1)
        return self.space.split(flat)

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

    def apply(self, source: str, entries: Sequence[LogEntry], confirmed: int = 0) -> int:
        """Add ``source``'s entries in place to ``current`` and ``base``; return rows added.
        ``confirmed``: the ledger holds ``source``'s rows up to it as synced, so its entries up
        to it need not be kept (see the module).

        Entries already applied are skipped, so a repeated pull never counts twice; the first new
        entry must follow the last applied one. A departed source's entries are refused. The
        caller holds the replica lock.
        """
        if source in self._departed:
            raise SyncError(f"apply from {source!r}: it left the job (its rows past "
                            f"{self._departed[source]} are trained again)")
        kept = self._kept.setdefault(source, deque())
        confirmed = max(confirmed, self._confirmed_of.get(source, 0))
        self._confirmed_of[source] = confirmed
        while kept and kept[0].rows_offset <= confirmed:
            kept.popleft()
        done = self.applied_seq(source)
        fresh = [entry for entry in entries if entry.seq > done]
        if not fresh:
            return 0
        expected = list(range(done + 1, done + 1 + len(fresh)))
        if [entry.seq for entry in fresh] != expected:
            raise SyncError(f"apply from {source!r}: expected seqs {expected[0]}..{expected[-1]}"
                            f" without gaps, found {[entry.seq for entry in fresh]}")
        for entry in fresh:
            self._check(f"apply from {source!r}, seq {entry.seq}", entry.ids, entry.deltas)
        added = sum(self._add(entry) for entry in fresh)
        self._applied[source] = fresh[-1].seq
        kept.extend(entry for entry in fresh if entry.rows_offset > confirmed)
        return added

    def _check(self, where: str, ids: torch.Tensor, values: torch.Tensor,
               what: str = "deltas") -> None:
        """Raise :class:`SyncError` (saying ``where``) unless ``ids`` and their ``values``
        (``what`` they are) fit this log's row space."""
        if ids.dim() != 1 or ids.dtype != torch.int64:
            raise SyncError(f"{where}: ids must be (k,) int64, found {tuple(ids.shape)} "
                            f"{ids.dtype}")
        if tuple(values.shape) != (len(ids), self.space.dim):
            raise SyncError(f"{where}: {what} must be ({len(ids)}, {self.space.dim}), found "
                            f"{tuple(values.shape)}")
        if len(ids) and not (ids[0] >= 0 and ids[-1] < self.space.rows
                             and bool((ids[1:] > ids[:-1]).all())):
            raise SyncError(f"{where}: ids must increase strictly within [0, {self.space.rows})"
                            f", found {ids[0].item()}..{ids[-1].item()}")

    def _cut(self, ids: torch.Tensor, owed: torch.Tensor | None) -> torch.Tensor:
        """The deltas of rows ``ids`` (``current - base``), advancing ``base`` by them, through
        torch's index operations; the rows become changed. With ``owed`` (the rows owing a
        rounding error) the deltas are rounded to the delta dtype and the rows become owed too;
        without it they are exact, in the tables' dtype."""
        # ids are unique (a mask's true rows): select/copy, about twice as fast as indexing
        current = self.space.gather(ids)
        if owed is not None:
            base = self._base.index_select(0, ids)
            deltas = current.sub_(base).to(self.delta_dtype)
            self._base.index_copy_(0, ids, base.add_(deltas))
            owed.index_fill_(0, ids, True)
        else:
            deltas = current - self._base.index_select(0, ids)
            self._base.index_copy_(0, ids, current)
        self._changed.index_fill_(0, ids, True)
        return deltas

    def _cut_host(self, host: np.ndarray, ids: torch.Tensor,
                  owed: torch.Tensor | None) -> torch.Tensor:
        """:meth:`_cut` of the tables ``host`` in one pass over the rows (:mod:`kernels`), bit
        for bit the same."""
        base, changed, rows = self._base.numpy(), self._changed.numpy(), ids.numpy()
        if owed is not None:
            deltas = torch.empty(len(ids), self.space.dim, dtype=self.delta_dtype)
            kernels.cut_bfloat16(host, base, changed, owed.numpy(), rows, kernels.bits(deltas))
        else:
            deltas = torch.empty(len(ids), self.space.dim, dtype=self.space.dtype)
            kernels.cut(host, base, changed, rows, deltas.numpy())
        return deltas

    def _add(self, entry: LogEntry) -> int:
        """Add ``entry``'s deltas in place to ``current`` and ``base``; return rows added."""
        ids = entry.ids.to(self.space.device)
        if self._host is not None and entry.deltas.dtype in kernels.KERNEL_DELTAS:
            self._add_host(self._host, ids.contiguous(), entry.deltas.contiguous())
            return int(ids.numel())
        deltas = entry.deltas.to(self.space.device, self.space.dtype)
        self.space.add_(ids, deltas)
        self._base.index_add_(0, ids, deltas)
        self._changed.index_fill_(0, ids, True)
        return int(ids.numel())

    def _add_host(self, host: np.ndarray, ids: torch.Tensor, deltas: torch.Tensor) -> None:
        """:meth:`_add` to the tables ``host`` in one pass over the rows (:mod:`kernels`), bit
        for bit the same."""
        base, changed, rows = self._base.numpy(), self._changed.numpy(), ids.numpy()
        if deltas.dtype == torch.bfloat16:
            kernels.add_bfloat16(host, base, changed, rows, kernels.bits(deltas))
        else:
            kernels.add(host, base, changed, rows, deltas.numpy())

    # -- whole-state copies (joiners) --------------------------------------------------------
    def state(self, own: str) -> LogState:
        """Copies of ``base`` (the tables without own unpublished changes: every entry this log
        published or applied, nothing else), of the applied seq per source and of the changed
        rows (``(rows,)`` bool), with the provisional entries in them (this log's own under the
        name ``own``). The caller holds the replica lock."""
        self._prune()
        kept = {source: list(entries) for source, entries in self._kept.items() if entries}
        confirmed = dict(self._confirmed_of)
        if self._unconfirmed:
            kept[own] = list(self._unconfirmed)
        confirmed[own] = self._pruned
        tables = {name: base.clone() for name, base in self.space.split(self._base).items()}
        return LogState(tables, dict(self._applied), self._changed.clone(), kept, confirmed)

    def restore(self, tables: Mapping[str, torch.Tensor], applied: Mapping[str, int],
                own_seq: int, changed: torch.Tensor,
                kept: Mapping[str, Sequence[LogEntry]] | None = None,
                confirmed: Mapping[str, int] | None = None) -> None:
        """Make ``tables`` the state, in place: they hold every source's entries up to
        ``applied[source]`` and this log's own entries up to ``own_seq``, and differ from the
        initial tables at most in the ``changed`` rows (``(rows,)`` bool); own entries after
        ``own_seq`` are added back (peers will pull them, so they must be in our tables too).
        ``kept`` are the provisional entries of each source in ``tables``, past its
        ``confirmed`` offset (see :class:`LogState`); departures known before are forgotten
        (the caller applies them again).

        Own changes not yet published are overwritten (rounding errors included): publish
        first, exactly. The caller holds the replica lock and does not train meanwhile.
        """
        if tables.keys() != self.tables.keys() or any(
                tables[name].shape != table.shape for name, table in self.tables.items()):
            raise SyncError("restore: expected tables "
                            f"{ {n: tuple(t.shape) for n, t in self.tables.items()} }, found "
                            f"{ {n: tuple(t.shape) for n, t in tables.items()} }")
        self._check_own_seq("restore", own_seq)
        self._check_mask("restore", changed)
        with self._lock:
            keep = [entry for entry in self._entries if entry.seq > own_seq]
            self._touched.zero_()
        if self._owed is not None:
            self._owed.zero_()
        for name, base in self.space.split(self._base).items():
            self.tables[name].copy_(tables[name])
            base.copy_(tables[name])
        self._changed.copy_(changed)
        for entry in keep:
            self._add(entry)
        self._applied = dict(applied)
        self._kept = {source: deque(entries) for source, entries in (kept or {}).items()}
        self._confirmed_of = dict(confirmed or {})
        self._departed = {}

    # -- the job's end: copying only the rows that may differ --------------------------------
    def changed(self) -> torch.Tensor:
        """A copy of the changed rows, ``(rows,)`` bool: the rows this replica trained, added an
        entry to or copied since its start (or those of the snapshot it restored); every other
        row holds the initial tables' bits. The caller holds the replica lock."""
        return self._changed.clone()

    def covers(self, changed: torch.Tensor) -> bool:
        """Whether every row in ``changed`` (``(rows,)`` bool) is one this replica changed:
        then :meth:`rows_for` gives the same answer for it as for our own :meth:`changed`."""
        self._check_mask("covers", changed)
        return not bool((changed.to(self.space.device) & ~self._changed).any())

    def rows_for(self, changed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows in which this replica and one whose changed rows are ``changed``
        (``(rows,)`` bool) may differ: their ids (``(k,)`` int64, increasing: the rows either
        changed) and this replica's values of them (``(k, dim)``). The caller holds the replica
        lock and published first (the values are the tables, unpublished changes included)."""
        self._check_mask("rows_for", changed)
        ids = true_rows(self._changed | changed.to(self.space.device))
        return ids, self.space.gather(ids)

    def adopt_rows(self, source: str, ids: torch.Tensor, rows: torch.Tensor,
                   applied: Mapping[str, int], own_seq: int) -> int:
        """Make this replica equal to ``source``'s, bit for bit, from what
        :meth:`rows_for` gave there for our :meth:`changed` rows: ``rows`` (``(k, dim)``, its
        values of rows ``ids``) overwrite ``current`` and ``base``; every other row holds the
        initial tables' bits on both. Takes ``source``'s applied seq per other source
        (``applied``) and of ours (``own_seq``); returns the rows copied.

        Own entries after ``own_seq`` (``source`` never applied them: their rows now hold its
        values) are dropped from the log with a warning, so no peer adds them on top. The caller
        holds the replica lock, published first and does not train meanwhile.
        """
        self._check(f"rows from {source!r}", ids, rows, what="rows")
        self._check_own_seq(f"rows from {source!r}", own_seq)
        ids = ids.to(self.space.device)
        rows = rows.to(self.space.device, self.space.dtype)
        self.space.copy_(ids, rows)
        self._base.index_copy_(0, ids, rows)
        self._changed.index_fill_(0, ids, True)
        self._applied = dict(applied)
        with self._lock:
            if own_seq == self._last_seq:
                return int(ids.numel())
            lost = [entry for entry in self._entries if entry.seq > own_seq]
            self._entries = [entry for entry in self._entries if entry.seq <= own_seq]
            self._unconfirmed = deque(e for e in self._unconfirmed if e.seq <= own_seq)
            self._last_seq = own_seq
            self._cursors = {peer: min(cursor, own_seq) for peer, cursor in self._cursors.items()}
        logger.warning("%s lacks our entries %d..%d (rows_offset up to %d): dropped, our rows "
                       "now hold its values", source, lost[0].seq, lost[-1].seq,
                       lost[-1].rows_offset)
        return int(ids.numel())

    def _check_own_seq(self, where: str, own_seq: int) -> None:
        if not self._dropped_seq <= own_seq <= self._last_seq:
            raise SyncError(f"{where}: own_seq must be in [{self._dropped_seq}, "
                            f"{self._last_seq}] (entries still held), found {own_seq}")

    def _check_mask(self, where: str, changed: torch.Tensor) -> None:
        if changed.dtype != torch.bool or tuple(changed.shape) != (self.space.rows,):
            raise SyncError(f"{where}: changed rows must be ({self.space.rows},) bool, found "
                            f"{tuple(changed.shape)} {changed.dtype}")

    # -- accounting ------------------------------------------------------------------------
    def synced_offset(self) -> int:
        """``rows_offset`` of the newest entry every live peer has acknowledged.

        If this worker dies, rows after it are trained again, and the peers take out what
        they applied of them (see the module).
        """
        with self._lock:
            return self._synced_offset

    def applied_seqs(self) -> dict[str, int]:
        """Newest seq applied here per source (a copy; sources with none left out)."""
        return dict(self._applied)

    @property
    def last_seq(self) -> int:
        """Seq of the newest published entry (0: none)."""
        return self._last_seq

    def __len__(self) -> int:
        """Entries held (published, not yet acknowledged by every live peer)."""
        with self._lock:
            return len(self._entries)
