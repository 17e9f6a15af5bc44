"""One worker's buckets of a job's sharded tables, changed exactly once (:class:`BucketStore`).

A bucket holds the weights of its rows and the sparse optimiser's state beside them. Its
primary applies a trainer's push (row gradients) through the optimiser; the resulting change,
weights and state, is what it forwards to the backup, which adds it as it is: the two stay
equal. Every change is kept as an *entry* ``(trainer, seq, offset)``, where ``offset`` is the
trainer's stream of trained rows once the batch is counted (what its reports to the ledger
count), until the trainer says the ledger confirmed those rows synced:

* a push retried after a timeout carries the same ``seq`` and is applied once (an entry with
  that seq exists, or the trainer's confirmed seqs passed it);
* a trainer that leaves the job with ``synced`` rows counted in the ledger has its entries past
  ``synced`` taken out again (subtracted: the weights and the state), and its later pushes are
  refused: the ledger trains those rows again elsewhere, so the tables hold each done row once;
* a checkpoint or the final model copies the *committed* tables: the live ones less every entry
  past the ledger's synced rows of its trainer (:meth:`BucketStore.committed`).

Entries cross with a bucket when it is copied to a new host, so a backup made after a push can
still take it out.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from antdt.errors import SyncError
from antdt.tables.optim import RowOptimizer

Role = Literal["primary", "backup"]


class Fenced(SyncError):
    """A push or change from a trainer that left the job (its rows are trained elsewhere)."""


class NotHeld(SyncError):
    """A call for a bucket this worker does not hold in the role the call needs (the caller's
    map is stale: it asks the scheduler for the current one)."""


class Stale(SyncError):
    """A committed copy was asked with synced rows older than what a trainer's confirmations
    already dropped: the caller copies the ledger again."""


@dataclass
class Entry:
    """One push's change to one bucket: local rows ``(k,)`` int64 (unique), the weights'
    change ``(k, dim)`` and the state's ``(k, width)``."""

    seq: int
    offset: int
    rows: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor


@dataclass
class BucketState:
    """What a copy of a bucket carries to a new host (tensors cloned)."""

    bucket: int
    start: int
    weights: torch.Tensor
    state: torch.Tensor
    entries: dict[str, list[Entry]]
    confirmed: dict[str, tuple[int, int]]


@dataclass
class Bucket:
    """Global rows ``[start, start + len(weights))``; ``role`` and ``epoch`` (of the map that
    set it) fence it; a primary forwards its changes to ``backup``."""

    bucket: int
    start: int
    weights: torch.Tensor
    state: torch.Tensor
    role: Role
    epoch: int
    backup: str | None = None
    awaiting: bool = False
    """A primary whose backup is being made: its pushes are applied, not yet acknowledged."""
    entries: dict[str, dict[int, Entry]] = field(default_factory=dict)
    confirmed: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per trainer: the offset its confirmations reached and the newest seq they dropped."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def seen(self, trainer: str, seq: int) -> bool:
        if seq in self.entries.get(trainer, ()):
            return True
        return seq <= self.confirmed.get(trainer, (0, -1))[1]

    def add(self, trainer: str, entry: Entry) -> None:
        self.weights.index_add_(0, entry.rows, entry.weights)
        self.state.index_add_(0, entry.rows, entry.state)
        self.entries.setdefault(trainer, {})[entry.seq] = entry

    def confirm(self, trainer: str, offset: int) -> None:
        entries = self.entries.get(trainer)
        if not entries:
            return
        done = [seq for seq, e in entries.items() if e.offset <= offset]
        if not done:
            return
        old_offset, old_seq = self.confirmed.get(trainer, (0, -1))
        self.confirmed[trainer] = (max(old_offset, offset), max(old_seq, *done))
        for seq in done:
            del entries[seq]

    def take_out(self, trainer: str, synced: int) -> int:
        """Subtract ``trainer``'s entries past ``synced`` and drop all of its entries; the
        number taken out."""
        entries = self.entries.pop(trainer, {})
        out = 0
        for e in entries.values():
            if e.offset > synced:
                self.weights.index_add_(0, e.rows, e.weights, alpha=-1)
                self.state.index_add_(0, e.rows, e.state, alpha=-1)
                out += 1
        return out

    def committed(self, synced: Mapping[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        weights, state = self.weights.clone(), self.state.clone()
        for trainer, entries in self.entries.items():
            done = synced.get(trainer, 0)
            if self.confirmed.get(trainer, (0, -1))[0] > done:
                raise Stale(f"bucket {self.bucket}: trainer {trainer}'s confirmed rows "
                            f"({self.confirmed[trainer][0]}) passed the synced rows asked "
                            f"({done})")
            for e in entries.values():
                if e.offset > done:
                    weights.index_add_(0, e.rows, e.weights, alpha=-1)
                    state.index_add_(0, e.rows, e.state, alpha=-1)
        return weights, state

    def export(self) -> BucketState:
        return BucketState(self.bucket, self.start, self.weights.clone(), self.state.clone(),
                           {t: list(es.values()) for t, es in self.entries.items()},
                           dict(self.confirmed))


class BucketStore:
    """The buckets one worker holds of one job, with their locks (one per bucket: pushes to
    different buckets apply in parallel), and the job's departed trainers (see the module
    docstring)."""

    def __init__(self, job: str, optimizer: RowOptimizer, dim: int, bucket_size: int) -> None:
        self.job = job
        self.optimizer = optimizer
        self.dim = dim
        self.bucket_size = bucket_size
        self.width = optimizer.state_width(dim)
        self.buckets: dict[int, Bucket] = {}
        self.departed: dict[str, int] = {}
        self._lock = threading.Lock()

    # ---- holding buckets ------------------------------------------------------------------

    def create(self, bucket: int, start: int, weights: torch.Tensor, role: Role, epoch: int,
               backup: str | None = None, state: torch.Tensor | None = None) -> None:
        """Hold ``bucket`` with its initial ``weights`` and optimiser ``state`` (a job's first
        map: every host draws its own buckets; None: zeros)."""
        if state is None:
            state = torch.zeros(weights.shape[0], self.width)
        if state.shape != (weights.shape[0], self.width):
            raise SyncError(f"job {self.job}: bucket {bucket}'s state must be "
                            f"({weights.shape[0]}, {self.width}), found {tuple(state.shape)}")
        with self._lock:
            self.buckets[bucket] = Bucket(bucket, start, weights, state, role, epoch, backup)

    def install(self, copy: BucketState, epoch: int) -> None:
        """Hold a copy as ``bucket``'s backup; departed trainers' entries are taken out."""
        entries = {t: {e.seq: e for e in es} for t, es in copy.entries.items()}
        held = Bucket(copy.bucket, copy.start, copy.weights, copy.state, "backup", epoch,
                      entries=entries, confirmed=dict(copy.confirmed))
        with self._lock:
            for trainer, synced in self.departed.items():
                held.take_out(trainer, synced)
            self.buckets[copy.bucket] = held

    def drop(self, bucket: int) -> None:
        with self._lock:
            self.buckets.pop(bucket, None)

    def held(self, bucket: int, role: Role | None = None) -> Bucket:
        held = self.buckets.get(bucket)
        if held is None or (role is not None and held.role != role):
            raise NotHeld(f"job {self.job}: bucket {bucket} is not held here"
                          + ("" if held is None or role is None else f" as {role} (here: "
                             f"{held.role})"))
        return held

    def still_held(self, held: Bucket, role: Role) -> None:
        """Under ``held``'s lock: it is still this store's bucket in ``role`` (a hand-over or
        a new copy may have changed either while the caller waited for the lock)."""
        if self.buckets.get(held.bucket) is not held or held.role != role:
            raise NotHeld(f"job {self.job}: bucket {held.bucket} moved while a call waited "
                          "for it")

    # ---- training -------------------------------------------------------------------------

    def pull(self, bucket: int, rows: torch.Tensor) -> torch.Tensor:
        """The weights of local ``rows`` of ``bucket``, as its primary or its backup holds them.
        A backup lacks only changes not yet acknowledged (the primary forwards each before it
        acknowledges it): pushes still in flight, which the staleness bound already allows a
        reader not to see."""
        held = self.held(bucket)
        with held.lock:
            return held.weights.index_select(0, rows)

    def push(self, trainer: str, seq: int, offset: int, bucket: int, rows: torch.Tensor,
             grads: torch.Tensor) -> tuple[Entry | None, str | None, bool]:
        """Apply ``trainer``'s gradients ``(k, dim)`` of local ``rows`` (unique) to ``bucket``
        as its primary, once: the entry to forward (None: applied before), the backup to
        forward it to, and whether the bucket awaits a backup (not acknowledged yet)."""
        held = self.held(bucket, "primary")
        with held.lock:
            self.still_held(held, "primary")
            self._check(trainer)
            if held.seen(trainer, seq):
                return None, held.backup, held.awaiting
            dw, ds = self.optimizer.update(held.weights.index_select(0, rows),
                                           held.state.index_select(0, rows), grads)
            entry = Entry(seq, offset, rows, dw, ds)
            held.add(trainer, entry)
            return entry, held.backup, held.awaiting

    def forward(self, trainer: str, bucket: int, entry: Entry, epoch: int) -> None:
        """Add the primary's change to this backup of ``bucket`` once; a change it does not
        hold yet from a primary of an older map than this bucket's is refused (a change the
        copy it was installed from held is not: the copy's primary forwarded it late)."""
        held = self.held(bucket, "backup")
        with held.lock:
            self.still_held(held, "backup")
            if held.seen(trainer, entry.seq):
                return  # e.g. in the copy this backup was installed from since
            if epoch < held.epoch:
                raise NotHeld(f"job {self.job}: bucket {bucket}: a change of map epoch {epoch}, "
                              f"older than this backup's ({held.epoch})")
            self._check(trainer)
            held.add(trainer, entry)

    def confirm(self, trainer: str, offset: int, buckets: Iterable[int] | None = None) -> None:
        """The ledger confirmed ``trainer``'s rows up to ``offset``: its entries up to there
        are dropped (in ``buckets``, or all)."""
        for b in list(self.buckets) if buckets is None else buckets:
            held = self.buckets.get(b)
            if held is not None:
                with held.lock:
                    held.confirm(trainer, offset)

    def depart(self, trainer: str, synced: int) -> int:
        """``trainer`` left with ``synced`` rows synced: its later changes are taken out and
        refused from now on; the number of entries taken out."""
        with self._lock:
            if trainer in self.departed:
                return 0
            self.departed[trainer] = synced
            held = list(self.buckets.values())
        out = 0
        for bucket in held:
            with bucket.lock:
                out += bucket.take_out(trainer, synced)
        return out

    def _check(self, trainer: str) -> None:
        if trainer in self.departed:
            raise Fenced(f"job {self.job}: trainer {trainer} left the job (its rows past "
                         f"{self.departed[trainer]:,} are trained again elsewhere); its "
                         "changes are refused")

    # ---- roles ----------------------------------------------------------------------------

    def promote(self, bucket: int, epoch: int, backup: str | None, awaiting: bool) -> None:
        """This worker serves ``bucket`` as its primary from now on, forwarding to ``backup``
        (``awaiting``: a backup is being made)."""
        held = self.held(bucket)
        with held.lock:
            held.role, held.epoch = "primary", epoch
            held.backup, held.awaiting = backup, awaiting

    def demote(self, bucket: int, epoch: int) -> None:
        held = self.held(bucket)
        with held.lock:
            held.role, held.epoch, held.backup = "backup", epoch, None

    def committed(self, bucket: int, synced: Mapping[str, int]
                  ) -> tuple[int, torch.Tensor, torch.Tensor]:
        """``bucket``'s first row, weights and state holding exactly the rows ``synced``
        counts (:class:`Stale` when confirmations passed it)."""
        held = self.held(bucket)
        with held.lock:
            weights, state = held.committed(synced)
        return held.start, weights, state
