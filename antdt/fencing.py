"""Fencing: a worker the scheduler no longer counts as a member speaks for no job.

A worker cut off from the scheduler long enough is removed from the cluster (Dask's comm
timeouts, or the controller retiring it as hung): its leases go back to the queue, its rows are
trained elsewhere, its model's unsynced entries are taken out of its peers. Its process may
live on for a while, its agent still training (a *zombie*), and if the link heals in that window
its calls reach the scheduler again, which serves them: Dask's handlers do not ask who calls. So
every antdt handler a worker's agent calls checks the caller against the membership first:

* **identity**: the caller names its address and its *incarnation*, the Dask worker's ``id``
  (``Worker.id``, the scheduler's ``WorkerState.server_id``): a process that left and one that
  joined later at the same address are told apart;
* **lease epoch**: a lease's id and token, which a removed worker's leases lose (the ledger
  forgets them, so a commit on one is refused by the ledger too);
* **sequence**: a lease request carries a number of the caller's own (``seq``); the same number
  again is a retry whose reply was lost, answered with the same reply, never with a second
  lease. Commits are idempotent by their offsets, releases by their lease (a lease released
  is gone): one sent twice changes nothing.

A refused call is counted per job and kind in the scheduler's :class:`Fences` (``fences(scheduler)``,
one per scheduler, kept in ``scheduler.extensions``); a job's record shows :func:`refused`:
``leases`` and ``commits``, with ``sync`` (the async mode's sync asks, pulls and deltas its
:class:`~antdt.sync.service.SyncService` and the members refused) or ``ranks`` (a sync rank of
an older forming, refused by the rendezvous).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Protocol

from distributed import Scheduler

from antdt.errors import LedgerError

logger = logging.getLogger(__name__)

EXTENSION = "antdt-fences"
"""``scheduler.extensions[EXTENSION]``: the scheduler's :class:`Fences`."""


class Fenced(LedgerError):
    """A call from a worker that is not (or no longer) a member of the cluster: refused."""


class Fences:
    """The stale calls refused, per job and kind (``leases``, ``commits``, ...)."""

    def __init__(self) -> None:
        self._counts: dict[str, Counter[str]] = {}

    def refuse(self, job: str, kind: str, worker: str, why: str, count: int = 1) -> Fenced:
        """Count ``count`` calls of ``kind`` from ``worker`` refused for ``job``; the error to
        raise (its message says why)."""
        self._counts.setdefault(job, Counter())[kind] += count
        logger.info("job %s: %d %s from %s refused: %s", job, count, kind, worker, why)
        return Fenced(f"job {job!r}: {worker} {why}; its {kind} are refused")

    def counts(self, job: str) -> dict[str, int]:
        """``job``'s refused calls by kind (empty: none)."""
        return dict(self._counts.get(job, {}))

    def forget(self, job: str) -> None:
        self._counts.pop(job, None)


def fences(scheduler: Scheduler) -> Fences:
    """The scheduler's :class:`Fences` (made on first use)."""
    found = scheduler.extensions.get(EXTENSION)
    if not isinstance(found, Fences):
        found = scheduler.extensions[EXTENSION] = Fences()
    return found


def check(scheduler: Scheduler, job: str, kind: str, worker: str, incarnation: str | None,
          count: int = 1) -> None:
    """Raise :class:`Fenced` (counted) unless ``worker`` is a member of the cluster now and,
    when ``incarnation`` is given, the same process (its Dask worker ``id``)."""
    state = scheduler.workers.get(worker)
    if state is None:
        raise fences(scheduler).refuse(job, kind, worker, "is not a worker of this cluster "
                                       "(removed, or never joined)", count)
    if incarnation is not None and state.server_id != incarnation:
        raise fences(scheduler).refuse(job, kind, worker, f"is worker {incarnation}, which "
                                       f"left: {worker} is {state.server_id} now", count)


class _Model(Protocol):
    regroups: bool

    def stale_refused(self, job: str) -> int: ...


def refused(scheduler: Scheduler, job: str, mode: _Model) -> dict[str, int]:
    """``job``'s refused calls by kind: the scheduler's, and its training mode's as ``sync``
    (the async mode) or ``ranks`` (the sync mode, whose model regroups)."""
    counts = fences(scheduler).counts(job)
    model = mode.stale_refused(job)
    if model:
        counts["ranks" if mode.regroups else "sync"] = model
    return counts
