"""How a shard ledger deals its rows: the job's shards (:class:`ShardTable`) and the two ways of
handing them out, dynamic (:class:`QueueDealer`) and the static baseline (:class:`StaticDealer`).

The ledger (:mod:`antdt.sharding.ledger`) keeps the leases, claims and counters; a dealer only
answers "which rows does this worker lease next?" and takes back the rows the ledger requeues.
Both dealers walk the same epoch permutations, drawn from ``(seed, epoch)`` by the table, so a
static job and a dynamic one visit the same shards in the same order.

Dynamic dealing
---------------
One queue for all workers: its front holds requeued pieces (LIFO), behind it lies the current
epoch's permutation, then the later epochs'. Epoch ``e + 1`` starts as soon as every shard of
epoch ``e`` was handed out. Leasing and requeueing are O(1); starting an epoch draws its
permutation, O(shards).

Static dealing (the baseline)
-----------------------------
``static=N`` turns the ledger into the classic static split that the benchmarks compare against:
each epoch's shards are dealt to ``N`` slots up front (slot ``k`` gets positions ``k, k + N, ...``
of the epoch's permutation), a worker takes the lowest free slot on its first lease and from then
on leases only that slot's rows (its queue front first: rows it released, or the controller
moved, go back to its own slot). A worker without a slot waits; a removed worker's slot, with its
requeued rows, waits for the next new worker (a restarted process takes over its predecessor's
share, as in a static job that restarts the failed task). Every slot walks the epochs on its own.
Nothing moves between slots, so the job takes as long as its slowest slot, and a slot whose
worker hangs or dies for good never finishes: that is the point of the baseline. A static ledger
cannot be checkpointed.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from antdt.errors import LedgerError
from antdt.sharding.leases import Piece, QuarantineRecord, QuarantineSpec, RowGroup

logger = logging.getLogger(__name__)

MAX_SHARDS = 2_000_000
"""Most shards of one epoch a ledger takes: its tables cost 12 bytes a shard, and each epoch's
permutation is drawn on the scheduler's event loop (about 30 ms at this size)."""
MAX_EPOCHS = 1000
"""Most epochs of a job: the ledger keeps and reports its rows done per epoch."""
MAX_ROWS = 2**31 - 1
"""Most rows of a row group, a shard or a batch: the ledger's offsets are int32."""
MAX_ROW_GROUPS = 1_000_000
"""Most row groups of a job: registering them is a Python loop (about a second at this size,
run off the event loop)."""


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """``value`` as an int in ``[low, high]``; bools and floats are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise LedgerError(f"{name} must be an int, found {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise LedgerError(f"{name} must be in {bound}, found {value}")
    return int(value)


class ShardTable:
    """A job's row groups cut into shards of ``shard_rows`` rows, and each epoch's shard order.

    Paths are interned (a row group stores a file index) and a shard is its row group and first
    row: two int32 arrays, so the table stays small at millions of shards. Row groups that
    ``quarantine`` names at registration get no shards; :attr:`records` says why, with their rows
    over all ``epochs``.

    >>> table = ShardTable([("a.parquet", 0, 5), ("b.parquet", 0, 3)], shard_rows=4, seed=0,
    ...                    epochs=1, quarantine=[("b.parquet", None, "unreadable")])
    >>> table.num_shards, table.epoch_rows, table.piece(0, 1)
    (2, 5, (0, 1, 4, 5))
    """

    def __init__(self, row_groups: Sequence[RowGroup], *, shard_rows: int, seed: int,
                 epochs: int, quarantine: Sequence[QuarantineSpec] = (), job: str = "job"
                 ) -> None:
        self.shard_rows = shard_rows
        self.seed = seed
        self.paths: list[str] = []
        path_index: dict[str, int] = {}
        seen: set[tuple[str, int]] = set()
        files: list[int] = []
        groups: list[int] = []
        rows: list[int] = []
        for i, item in enumerate(row_groups):
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise LedgerError(f"job {job!r}: row_groups[{i}] must be (path, row_group, "
                                  f"num_rows), found {item!r}")
            path, raw_group, raw_rows = item
            if not isinstance(path, str) or not path:
                raise LedgerError(f"job {job!r}: row_groups[{i}] path must be a non-empty str, "
                                  f"found {path!r}")
            number = check_int(f"row_groups[{i}] ({path}) row_group", raw_group, 0, MAX_ROWS)
            num_rows = check_int(f"row_groups[{i}] ({path}) num_rows", raw_rows, 0, MAX_ROWS)
            if (path, number) in seen:
                raise LedgerError(f"job {job!r}: row group {number} of {path} is listed twice")
            seen.add((path, number))
            files.append(path_index.setdefault(path, len(path_index)))
            if files[-1] == len(self.paths):
                self.paths.append(path)
            groups.append(number)
            rows.append(num_rows)
        self.rg_file = np.asarray(files, dtype=np.int32)
        self.rg_group = np.asarray(groups, dtype=np.int32)
        self.rg_rows = np.asarray(rows, dtype=np.int64)
        self.total_rows = int(self.rg_rows.sum())
        """Rows of one epoch, quarantined ones included."""

        self.records: list[QuarantineRecord] = []
        """The row groups quarantined at registration, with their rows over all epochs."""
        quarantined = np.zeros(len(groups), dtype=bool)
        group_index = {key: i for i, key in enumerate(zip(files, groups))}
        for i, spec in enumerate(quarantine):
            if not isinstance(spec, (tuple, list)) or len(spec) != 3:
                raise LedgerError(f"job {job!r}: quarantine[{i}] must be (path, row_group | None, "
                                  f"reason), found {spec!r}")
            path, named_group, reason = spec
            if not isinstance(path, str) or not isinstance(reason, str):
                raise LedgerError(f"job {job!r}: quarantine[{i}] path and reason must be str, "
                                  f"found {spec!r}")
            file = path_index.get(path)
            group = None
            if named_group is None:
                hit = (self.rg_file == file) if file is not None else np.zeros_like(quarantined)
            else:
                group = check_int(f"quarantine[{i}] ({path}) row_group", named_group, 0,
                                  2**31 - 1)
                index = group_index.get((file, group)) if file is not None else None
                if index is None:
                    raise LedgerError(f"job {job!r}: quarantine[{i}] names row group {group} of "
                                      f"{path}, which is not among the registered row groups")
                hit = np.zeros(len(groups), dtype=bool)
                hit[index] = True
            hit &= ~quarantined
            quarantined |= hit
            spec_rows = int(self.rg_rows[hit].sum()) * epochs
            self.records.append(QuarantineRecord(path, group, None, None, None, spec_rows,
                                                 reason))
        self.epoch_rows = self.total_rows - int(self.rg_rows[quarantined].sum())
        """Rows of one epoch that are dealt (the registration quarantine left out)."""

        counts = np.where(quarantined, 0, -(-self.rg_rows // shard_rows))
        if int(counts.sum()) > MAX_SHARDS:
            raise LedgerError(f"job {job!r}: shard_rows {shard_rows:,} cuts the row groups into "
                              f"{int(counts.sum()):,} shards, more than the {MAX_SHARDS:,} a job "
                              "may have; use larger shards")
        self._shard_rg = np.repeat(np.arange(len(groups), dtype=np.int32), counts)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        self._shard_start = ((np.arange(len(self._shard_rg)) - first)
                             * shard_rows).astype(np.int32)
        self.num_shards = len(self._shard_rg)
        """Shards of one epoch (quarantined row groups have none)."""

    def location(self, shard: int) -> tuple[str, int]:
        """``(path, row_group)`` of ``shard``."""
        rg = int(self._shard_rg[shard])
        return self.paths[self.rg_file[rg]], int(self.rg_group[rg])

    def piece(self, epoch: int, shard: int) -> Piece:
        """All of ``shard``'s rows in ``epoch``."""
        start = int(self._shard_start[shard])
        return epoch, shard, start, min(start + self.shard_rows,
                                        int(self.rg_rows[self._shard_rg[shard]]))

    def rows_of(self, shards: np.ndarray) -> int:
        """Rows of the ``shards`` together."""
        start = self._shard_start[shards].astype(np.int64)
        return int((np.minimum(start + self.shard_rows, self.rg_rows[self._shard_rg[shards]])
                    - start).sum())

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s shard order, drawn from ``(seed, epoch)``: the same every time."""
        rng = np.random.default_rng([self.seed, epoch])
        return rng.permutation(self.num_shards).astype(np.int32)


def _prepend(front: deque[Piece], pieces: Sequence[Piece]) -> None:
    """Put the non-empty ``pieces`` at ``front``'s head, keeping their order."""
    for piece in reversed(pieces):
        if piece[3] > piece[2]:
            front.appendleft(piece)


def _rows(pieces: Iterable[Piece]) -> int:
    return sum(stop - start for _, _, start, stop in pieces)


class Dealer(Protocol):
    """What the ledger asks of a way of dealing rows."""

    @property
    def epoch(self) -> int:
        """The latest epoch whose shards are being handed out (-1 before the first)."""

    def next_piece(self, worker: str) -> Piece | None:
        """The rows ``worker`` leases next (None: none for it now)."""

    def push_front(self, pieces: Sequence[Piece], worker: str) -> None:
        """Take back ``pieces`` (requeued from ``worker``'s lease), to be dealt first."""

    def remove_worker(self, worker: str) -> None:
        """``worker`` is gone (its leases were requeued already)."""

    def clear(self) -> None:
        """The job stopped: nothing is dealt any more."""

    def todo_rows(self) -> int:
        """The rows still to deal, recounted: O(shards), for the ledger's invariant checks."""


class QueueDealer:
    """Dynamic dealing (see the module docstring): requeued pieces at the queue front first, then
    the epochs' permutations in turn. ``front``, ``epoch`` and ``pos`` (the next position in the
    epoch's permutation) are what a checkpoint holds."""

    def __init__(self, table: ShardTable, epochs: int) -> None:
        self._table = table
        self._epochs = epochs
        self.front: deque[Piece] = deque()
        self.epoch = -1
        self.pos = 0
        self._perm: np.ndarray | None = None

    def start_epoch(self, epoch: int) -> None:
        """Deal epoch ``epoch``'s permutation from its start."""
        self.epoch = epoch
        self.pos = 0
        self._perm = self._table.permutation(epoch) \
            if epoch >= 0 and self._table.num_shards else None

    def next_piece(self, worker: str) -> Piece | None:
        if self.front:
            return self.front.popleft()
        if self._table.num_shards == 0:
            return None
        while self._perm is None or self.pos == len(self._perm):
            if self.epoch + 1 >= self._epochs:
                return None
            self.start_epoch(self.epoch + 1)
        shard = int(self._perm[self.pos])
        self.pos += 1
        return self._table.piece(self.epoch, shard)

    def push_front(self, pieces: Sequence[Piece], worker: str) -> None:
        _prepend(self.front, pieces)

    def remove_worker(self, worker: str) -> None:
        """Nothing to do: the queue is shared, no rows belong to a worker."""

    def clear(self) -> None:
        self.front.clear()
        self._perm = None

    def todo_rows(self) -> int:
        todo = _rows(self.front)
        if self._perm is not None:
            todo += self._table.rows_of(self._perm[self.pos:])
        return todo + self._table.epoch_rows * (self._epochs - 1 - self.epoch)


@dataclass(slots=True)
class _StaticSlot:
    """One slot of the static baseline: its worker, requeued rows, and cursor in the epochs."""

    index: int
    worker: str | None = None
    front: deque[Piece] = field(default_factory=deque)
    epoch: int = 0
    pos: int = 0

    def __post_init__(self) -> None:
        self.pos = self.index


class StaticDealer:
    """The static baseline's dealing (see the module docstring): ``slots`` fixed shares of every
    epoch, one per worker, each with its own queue front; nothing moves between slots.

    >>> table = ShardTable([("a.parquet", 0, 8)], shard_rows=2, seed=0, epochs=1)
    >>> dealer = StaticDealer(table, epochs=1, slots=2)
    >>> len([dealer.next_piece("w0") for _ in range(2)]), dealer.next_piece("w0")
    (2, None)
    >>> dealer.next_piece("w1") is not None, dealer.next_piece("w2")
    (True, None)
    """

    def __init__(self, table: ShardTable, epochs: int, slots: int, job: str = "job") -> None:
        self._table = table
        self._epochs = epochs
        self._job = job
        self.slots = slots
        self._slots = [_StaticSlot(k) for k in range(slots)]
        self._slot_of: dict[str, _StaticSlot] = {}
        self._perms: dict[int, np.ndarray] = {}
        self.epoch = -1

    def next_piece(self, worker: str) -> Piece | None:
        """The slot's queue front, then its share of the epochs' permutations in turn (each
        permutation is drawn once and dropped when every slot has passed its epoch)."""
        slot = self._slot_for(worker)
        if slot is None:
            return None
        if slot.front:
            return slot.front.popleft()
        while self._table.num_shards and slot.epoch < self._epochs:
            perm = self._perms.get(slot.epoch)
            if perm is None:
                perm = self._perms[slot.epoch] = self._table.permutation(slot.epoch)
            if slot.pos < len(perm):
                shard = int(perm[slot.pos])
                slot.pos += self.slots
                self.epoch = max(self.epoch, slot.epoch)
                return self._table.piece(slot.epoch, shard)
            slot.epoch += 1
            slot.pos = slot.index
            oldest = min(s.epoch for s in self._slots)
            for epoch in [e for e in self._perms if e < oldest]:
                del self._perms[epoch]
        return None

    def push_front(self, pieces: Sequence[Piece], worker: str) -> None:
        """Back to the front of ``worker``'s own slot."""
        _prepend(self._slot_of[worker].front, pieces)

    def remove_worker(self, worker: str) -> None:
        """Free ``worker``'s slot, with its requeued rows, for the next new worker."""
        slot = self._slot_of.pop(worker, None)
        if slot is not None:
            slot.worker = None
            logger.info("job %s: static slot %d of %s is free for the next new worker",
                        self._job, slot.index, worker)

    def clear(self) -> None:
        for slot in self._slots:
            slot.front.clear()
        self._perms.clear()

    def todo_rows(self) -> int:
        todo = 0
        for slot in self._slots:
            todo += _rows(slot.front)
            for epoch in range(slot.epoch, self._epochs):
                first = slot.pos if epoch == slot.epoch else slot.index
                todo += self._table.rows_of(self._table.permutation(epoch)[first::self.slots])
        return todo

    def _slot_for(self, worker: str) -> _StaticSlot | None:
        """``worker``'s slot; a new worker takes the lowest free one (None: none free)."""
        slot = self._slot_of.get(worker)
        if slot is None:
            slot = next((s for s in self._slots if s.worker is None), None)
            if slot is not None:
                slot.worker = worker
                self._slot_of[worker] = slot
                logger.info("job %s: %s takes static slot %d", self._job, worker, slot.index)
        return slot


def shares(weights: Sequence[float], total: int) -> list[int]:
    """``total`` rows (a global batch) split in proportion to ``weights`` (each at least 1 when ``total`` allows),
    rounded by largest remainders so the parts sum to ``total`` exactly.

    >>> shares([1.0, 1.0, 1.0, 0.25], 64)
    [20, 19, 19, 6]
    """
    if total < len(weights):
        raise ValueError(f"cannot split {total} rows among {len(weights)} ranks")
    positive = [max(w, 0.0) for w in weights]
    if not any(positive):
        positive = [1.0] * len(weights)
    spare = total - len(positive)  # one row each first
    exact = [spare * w / sum(positive) for w in positive]
    parts = [1 + int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: int(exact[i]) - exact[i])[
            :total - sum(parts)]:
        parts[i] += 1
    return parts
