"""What a controller policy proposes and what the controller records: typed actions, each with
its :class:`Evidence`, and the plain :class:`ActionRecord` of an applied one."""

from __future__ import annotations

from typing import NamedTuple, TypeAlias, TypedDict

from antdt.monitor import Health
from antdt.sharding import LeaseStatus


class Evidence(NamedTuple):
    """Why a policy proposed an action: its reason in words and the monitor's numbers."""

    reason: str
    bpt: float | None = None
    median: float | None = None
    window: int | None = None
    silent_s: float | None = None

    @classmethod
    def of(cls, health: Health | None, reason: str) -> Evidence:
        if health is None:
            return cls(reason)
        return cls(reason, health.bpt, health.median, health.window, health.silent_s)


class Reassign(NamedTuple):
    """Move a straggler's unclaimed rows to the queue front, for faster workers to pull."""

    lease: LeaseStatus
    evidence: Evidence


class Split(NamedTuple):
    """Cut a lease's rows into ``parts``; the holder keeps the first, the rest are queued."""

    lease: LeaseStatus
    parts: int
    evidence: Evidence


class Revoke(NamedTuple):
    """Take a (hung) lease's unclaimed rows back to the queue front."""

    lease: LeaseStatus
    evidence: Evidence


class Retire(NamedTuple):
    """Retire the worker (its leases' rows are queued again when it leaves)."""

    worker: str
    evidence: Evidence


class Pace(NamedTuple):
    """Hold the worker's leases and claims to ``rows`` rows (0: no new lease; None: lift)."""

    worker: str
    rows: int | None
    evidence: Evidence


class AdjustBatch(NamedTuple):
    """Set the worker's batch size (synchronous mode)."""

    worker: str
    size: int
    evidence: Evidence


Action: TypeAlias = Reassign | Split | Revoke | Retire | Pace | AdjustBatch
LeaseAction: TypeAlias = Reassign | Split | Revoke

ACTION_NAMES: dict[type, str] = {Reassign: "reassign", Split: "split", Revoke: "revoke",
                                 Retire: "retire", Pace: "pace", AdjustBatch: "adjust_batch"}


class ActionRecord(TypedDict):
    """An applied action as logged, emitted and kept (plain, msgpack-able). ``rows``: rows moved
    to the queue (lease actions); ``size``: the batch size (adjust_batch) or the most rows a
    lease may hold (pace; None: lifted); ``seq``: its index among the job's applied actions."""

    seq: int
    tick: int
    time: float
    job: str
    stimulus_id: str
    action: str
    policy: str
    worker: str
    lease_id: int | None
    parts: int | None
    size: int | None
    rows: int | None
    reason: str
    bpt: float | None
    median: float | None
    window: int | None
    silent_s: float | None
