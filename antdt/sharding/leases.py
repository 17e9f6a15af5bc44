"""What the shard ledger hands out and reports: leases, the replies to lease and commit calls,
live lease status, commit events and quarantine records (plain values, no behaviour)."""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeAlias

RowGroup: TypeAlias = tuple[str, int, int]
"""``(path, row_group, num_rows)`` as the validator found them."""

QuarantineSpec: TypeAlias = tuple[str, "int | None", str]
"""``(path, row_group or None for the whole file, reason)``."""

Piece: TypeAlias = tuple[int, int, int, int]
"""Requeued rows: ``(epoch, shard, start, stop)``, row-group relative."""

Clock: TypeAlias = Callable[[], float]


class RowState(enum.Enum):
    """Where a row of an epoch is; every row ends DONE or QUARANTINED exactly once."""

    TODO = "todo"
    LEASED = "leased"
    DONE = "done"
    QUARANTINED = "quarantined"


class JobState(enum.Enum):
    """Where a job stands, for its ledger and for its master (:mod:`antdt.jobs`, which imports
    it from here: sharding never imports jobs). A ledger is ``running`` until every row is
    DONE/QUARANTINED (``finished``) or :meth:`~antdt.sharding.ShardLedger.stop` is called
    (``stopped``); a master also passes through ``starting``, ``finishing`` and ``cancelling``
    and ends ``finished``, ``failed`` or ``cancelled``. Those ends and ``stopped`` are final."""

    STARTING = "starting"  # the master registers the job, starts the tracking run
    RUNNING = "running"  # agents train
    FINISHING = "finishing"  # the final model is evaluated and logged
    CANCELLING = "cancelling"  # agents are asked to stop at their next batch
    FINISHED = "finished"
    STOPPED = "stopped"  # the ledger was stopped before every row was done
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        return self in (JobState.FINISHED, JobState.STOPPED, JobState.FAILED,
                        JobState.CANCELLED)


@dataclass(frozen=True, slots=True)
class Lease:
    """A lease as handed to a worker: rows ``[start, stop)`` of ``row_group`` in ``path``; the
    worker may train ``[start, claim_stop)`` before its first commit, in batches of
    ``batch_rows`` rows when the controller set this worker's batch size (None: the job's)."""

    lease_id: int
    token: str
    worker: str
    epoch: int
    path: str
    row_group: int
    start: int
    stop: int
    claim_stop: int
    batch_rows: int | None = None


@dataclass(frozen=True, slots=True)
class Claim:
    """Train on up to row ``stop`` of the lease, then commit."""

    lease_id: int
    stop: int


@dataclass(frozen=True, slots=True)
class Revoked:
    """The lease was cut at ``stop`` (the end of the claim): train up to it, commit, lease again.
    ``retired``: its synced offset reached ``stop``, the ledger forgot it."""

    lease_id: int
    stop: int
    retired: bool


@dataclass(frozen=True, slots=True)
class Finished:
    """Every row of the lease was trained; lease again (report ``synced`` until ``retired``)."""

    lease_id: int
    stop: int
    retired: bool


@dataclass(frozen=True, slots=True)
class Stop:
    """The job finished or was stopped: lease no more."""

    reason: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to lease now, but the job is not over (live leases may requeue rows): ask again.
    ``unsynced``: rows of the job trained but not synced yet (the job may wait for them)."""

    unsynced: int = 0


CommitReply: TypeAlias = Claim | Revoked | Finished | Stop
LeaseReply: TypeAlias = Lease | Wait | Stop


class LeaseStatus(NamedTuple):
    """A live lease as the monitor and the controller see it."""

    lease_id: int
    worker: str
    epoch: int
    path: str
    row_group: int
    start: int
    stop: int
    offset: int
    synced: int
    claim_stop: int
    revoked: bool
    leased_at: float
    committed_at: float

    @property
    def unclaimed(self) -> int:
        """Rows beyond the claim: what the controller may move without touching a trained or
        claimed row."""
        return self.stop - self.claim_stop


class CommitEvent(NamedTuple):
    """Sent to every listener after a commit that trained rows or carried stats."""

    worker: str
    lease_id: int
    epoch: int
    rows: int
    stats: Mapping[str, float]
    time: float


class QuarantineRecord(NamedTuple):
    """Rows that could not be read. ``row_group`` None: the whole file; ``epoch`` None: every
    epoch (registration quarantine); ``start``/``stop`` None: the whole row group. ``rows`` is what
    this record added to ``rows_quarantined`` (0 for a file the validator could not even list)."""

    path: str
    row_group: int | None
    epoch: int | None
    start: int | None
    stop: int | None
    rows: int
    reason: str


@dataclass(slots=True)
class LiveLease:
    """The ledger's own, mutable state of a lease:
    ``start <= synced <= offset <= claim_stop <= stop``."""

    lease_id: int
    token: str
    worker: str
    epoch: int
    shard: int
    start: int
    stop: int
    offset: int
    synced: int
    claim_stop: int
    revoked: bool
    leased_at: float
    committed_at: float
