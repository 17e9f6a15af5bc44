"""The scheduler half of the async mode's model sync: :class:`SyncService` owns one
:class:`~antdt.sync.groups.SyncScheduler` per job and answers the workers' group calls.

```
 driver ── antdt_sync_start(job, workers) ──► SyncService (SchedulerPlugin, scheduler process)
                                                one SyncScheduler per job
 worker A: BackgroundSync thread (antdt.sync.background)
   every period: antdt_sync_group(job, A, progress, members_version) ──► {kind: group, ...}
   for each peer P in the group: worker_A.rpc(P).antdt_sync_pull(job, A, round, since_seq)
                                   ──► SyncWorkerPlugin on P: entries + dense snapshot
   apply under the replica lock (short); a peer that fails is skipped and logged
 end: antdt_sync_group(final=True) until the all-member round, then
      antdt_sync_complete(gathered, adopted_from) ──► {step, leader}, until step is "done":
        the leader (step "gather") pulls every member as above and merges, once;
        the others (step "adopt") send the leader their changed-row mask
          worker_B.rpc(leader).antdt_sync_rows(job, B, changed) ──► the leader's values of the
          rows either side changed + its dense parameters, written in place
      stop serving once every member adopted the leader's rows
```

Only small control messages go through the scheduler. Defaults (timeouts, group size...) come
from ``antdt.sync`` in dask config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from distributed import Client, Scheduler
from distributed.diagnostics.plugin import SchedulerPlugin
from distributed.metrics import time
from distributed.protocol.pickle import dumps

from antdt import config, rpc
from antdt.errors import SyncError
from antdt.rpc import Reply
from antdt.sharding.service import PLUGIN_NAME as SHARDING_PLUGIN
from antdt.sharding.service import ShardingService
from antdt.sync.serving import SyncWorkerPlugin
from antdt.sync.groups import MemberState, SyncScheduler
from antdt.sync.wire import PLUGIN_NAME, FinalMsg, GroupMsg, JoinMsg, MembersMsg, group_msg

logger = logging.getLogger(__name__)

STALE_JOBS_KEPT = 1000
"""Jobs whose :meth:`SyncService.stale_refused` count is kept (the newest first seen)."""

MAX_UNREACHABLE = 10_000
"""The most peers one ``antdt_sync_group`` call may report unreachable."""


class SyncService(SchedulerPlugin):
    """Scheduler plugin owning one :class:`~antdt.sync.SyncScheduler` per job.

    Handlers (all arguments by keyword; None means the ``antdt.sync`` dask-config default):

    - ``antdt_sync_start(job, workers, group_size=None, max_wait_s=None, max_progress_gap=None)``
    - ``antdt_sync_group(job, worker, progress, final=False, members_version=None,
      batches=None, unreachable=(), refused=None) -> GroupMsg``: records that the worker applied
      the member list of ``members_version`` (``batches``: the batches it trained, which tell
      whether it is idle), that its pulls of the members ``unreachable`` went unanswered (the
      pairs are not grouped for a while; see :mod:`antdt.sync.reach`) and that it refused
      ``refused`` stale sync messages so far (:meth:`stale_refused`), then waits (on the
      scheduler's loop, not a thread) until the worker is grouped, told to go on alone, told it
      is ``cut`` from every other member, or ``poll_s`` passed (then ``kind == "wait"``: ask
      again)
    - ``antdt_sync_members(job) -> MembersMsg``: the members, and the departed ones with the
      rows the job's ledger counted synced for each when it left (every replica takes their
      entries past those rows out again)
    - ``antdt_sync_join(job, worker) -> JoinMsg``: adds a worker to a running job; waits up to
      ``poll_s`` for every other member to acknowledge it
    - ``antdt_sync_started(job, worker)``: the joiner adopted its snapshot and trains from now
      on (before, no group and not the final round waits for it; an error when the final round
      formed first and dropped it)
    - ``antdt_sync_leave(job, worker)``: the worker stops syncing (idempotent, any job state);
      call it after the worker's last report to the ledger and the release of its leases
    - ``antdt_sync_complete(job, worker, gathered=False, adopted_from=None) -> FinalMsg``: in the
      final round, the leader gathered every member's entries (``gathered``) or the worker
      adopted ``adopted_from``'s rows; waits up to ``poll_s`` until the worker has a step other
      than "wait" (see :meth:`~antdt.sync.SyncScheduler.final_step`)
    - ``antdt_sync_stop(job)``

    Each handler checks its arguments and answers ``{"status": "OK", ...}`` (the message named
    above) or ``{"status": "error", "message": ...}``: a malformed call never raises inside the
    scheduler (:func:`antdt.rpc.handler`). The methods of the same names without ``_handler``
    are the logic, for callers in the scheduler (the job service). A worker that leaves the
    cluster leaves every job's group scheduling. Registering this plugin also registers
    :class:`SyncWorkerPlugin` on every worker.

    The rows a departed worker leaves synced are the job's ledger's (the sharding service's
    job of the same name, :meth:`~antdt.sharding.ShardLedger.synced_rows`; 0 without one: a
    job whose rows nobody counts keeps none of a departed worker's provisional entries).

    Partitions and zombies: the members that reach no other member (every pair with them
    reported unreachable) are :meth:`partitioned`; the job's master hands them to its monitor
    (:meth:`~antdt.monitor.Monitor.partitions`), whose verdict on them is partitioned until
    they reach one again or leave. A call naming a worker that is no member
    (it left, or the scheduler removed it: a partitioned worker that goes on training until its
    process exits) is refused: a group ask, a final-round step, a start; and a join from a
    worker not in the cluster. Each refusal counts toward :meth:`stale_refused`, with the stale
    messages the members refused themselves (pulls, payloads), as they report with their asks.
    """

    name = PLUGIN_NAME

    def __init__(self, poll_s: float | None = None) -> None:
        if poll_s is None:
            poll_s = config.seconds("antdt.sync.poll")
        if poll_s <= 0:
            raise SyncError(f"poll_s must be > 0, found {poll_s}")
        self.poll_s = poll_s
        self.jobs: dict[str, SyncScheduler] = {}
        self._events: dict[tuple[str, str], asyncio.Event] = {}  # (job, worker): grouped
        self._changes: dict[str, asyncio.Event] = {}  # job: a join settled or the final moved
        self._refused: dict[str, dict[str | None, int]] = {}  # job: by whom (None: here)

    async def start(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        scheduler.handlers.update({
            "antdt_sync_start": self.start_handler,
            "antdt_sync_group": self.group_handler,
            "antdt_sync_members": self.members_handler,
            "antdt_sync_join": self.join_handler,
            "antdt_sync_started": self.started_handler,
            "antdt_sync_leave": self.leave_handler,
            "antdt_sync_complete": self.complete_handler,
            "antdt_sync_stop": self.stop_handler,
        })
        await scheduler.register_worker_plugin(None, dumps(SyncWorkerPlugin()), name=PLUGIN_NAME,
                                               idempotent=True)

    def start_job(self, job: str, workers: list[str], group_size: int | None = None,
                  max_wait_s: float | None = None, max_progress_gap: int | None = None) -> None:
        """Create the job's scheduler with ``workers`` (addresses) as its members."""
        if job in self.jobs:
            raise SyncError(f"sync job {job!r} already started")
        unknown = sorted(set(workers) - self.scheduler.workers.keys())
        if unknown:
            raise SyncError(f"sync job {job!r}: workers {unknown} are not in the cluster")
        if not workers:
            raise SyncError(f"sync job {job!r}: expected at least one worker, found none")
        scheduler = SyncScheduler(group_size, max_wait_s, max_progress_gap)
        for worker in workers:
            scheduler.join(worker)
        self.jobs[job] = scheduler
        logger.info("sync job %s started: %d workers, group_size %d", job, len(workers),
                    scheduler.group_size)

    def stop_job(self, job: str) -> None:
        """Forget the job (idempotent); its :meth:`stale_refused` count stays."""
        self.jobs.pop(job, None)
        self._notify(job)
        for key in [k for k in self._events if k[0] == job]:
            del self._events[key]

    def stale_refused(self, job: str) -> int:
        """The stale sync messages of ``job`` refused so far (0 for a job never seen): calls
        to this service from workers that are no members (see the class docstring), and pulls
        and payloads the members refused, as of their latest asks. Kept after the job stops,
        for the newest ``STALE_JOBS_KEPT`` jobs."""
        return sum(self._refused.get(job, {}).values())

    def partitioned(self, job: str) -> dict[str, str]:
        """The members of ``job`` that reach no other member now, each with why (its link to
        its peers is cut, not its link to the scheduler: see :mod:`antdt.sync.reach`); {} for
        a job not started. Nothing they train can be synced: the job's master hands them to
        its monitor (:meth:`~antdt.monitor.Monitor.partitions`), and the controller retires
        them. O(members with an unreachable peer)."""
        scheduler = self.jobs.get(job)
        if scheduler is None:
            return {}
        return {worker: f"reaches no sync peer ({len(peers)} unreachable: "
                        f"{', '.join(peers[:3])}{', ...' if len(peers) > 3 else ''})"
                for worker, peers in scheduler.isolated(time()).items()}

    def members(self, job: str) -> MembersMsg:
        scheduler = self._job(job)
        return {"members": scheduler.members(), "members_version": scheduler.members_version,
                "departed": scheduler.departed()}

    async def group(self, job: str, worker: str, progress: int, final: bool = False,
                    members_version: int | None = None, batches: int | None = None,
                    unreachable: Sequence[str] = (), refused: int | None = None) -> GroupMsg:
        """See the class docstring."""
        self._member(job, worker, "antdt_sync_group")
        if refused is not None:
            self._refusals(job)[worker] = refused
        if members_version is not None and self._job(job).acknowledge(worker, members_version):
            self._notify(job)
        if unreachable:
            cut = self._job(job).unreachable(worker, unreachable, time())
            if cut:
                logger.warning("sync job %s: %s cannot reach %s: not grouped for %gs", job,
                               worker, cut, self._job(job).reach.for_s)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            event = self._event(job, worker)
            event.clear()
            answer = scheduler.ready(worker, progress, time(), final=bool(final),
                                     batches=batches)
            if answer.group is not None:
                self._wake(job, answer.group.members)
                if answer.group.final:  # a joiner it dropped learns so now
                    self._notify(job)
            if final:  # one partner fewer: the waiting workers may make a full group now
                self._wake(job, scheduler.waiting())
            if answer.kind != "wait":
                return group_msg(answer, scheduler.members_version)
            now = time()
            left = deadline - now
            if scheduler.state(worker) is MemberState.READY:
                left = min(left, scheduler.wait_left(worker, now))
            if left <= 0:
                return group_msg(answer, scheduler.members_version)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)

    async def join(self, job: str, worker: str) -> JoinMsg:
        """See the class docstring."""
        if worker not in self.scheduler.workers:
            self._refuse(job)
            raise SyncError(f"sync job {job!r}: worker {worker!r} is not in the cluster")
        self._job(job).join_running(worker)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            settled = scheduler.settled(worker)
            left = deadline - time()
            if settled or left <= 0:
                return {"settled": settled, "bootstrap": scheduler.joined_running(worker),
                        "waiting": scheduler.waiting_for(worker),
                        "members": scheduler.members(),
                        "members_version": scheduler.members_version,
                        "departed": scheduler.departed()}
            await self._changed(job, left)

    def leave(self, job: str, worker: str) -> None:
        """See the class docstring."""
        scheduler = self.jobs.get(job)
        if scheduler is None:
            return
        final = scheduler.leave(worker, self._synced_rows(job, worker))
        if final is not None:
            self._wake(job, final.members)
            self._notify(job)
        self._wake(job, scheduler.waiting())
        self._events.pop((job, worker), None)
        self._notify(job)

    async def complete(self, job: str, worker: str, gathered: bool = False,
                       adopted_from: str | None = None) -> FinalMsg:
        """See the class docstring."""
        scheduler = self._member(job, worker, "antdt_sync_complete")
        if gathered:
            scheduler.gathered(worker)
        if adopted_from is not None:
            scheduler.adopted(worker, adopted_from)
        if gathered or adopted_from is not None:
            self._notify(job)
        deadline = time() + self.poll_s
        while True:
            scheduler = self._job(job)
            step = scheduler.final_step(worker)
            left = deadline - time()
            if step != "wait" or left <= 0:
                return {"step": step, "leader": scheduler.final_leader()}
            await self._changed(job, left)

    # ---- handlers: arguments checked, errors as replies ----------------------------------------

    @rpc.handler
    async def start_handler(self, job: object, workers: object, group_size: object = None,
                            max_wait_s: object = None, max_progress_gap: object = None) -> Reply:
        job = _name("job", job)
        if not isinstance(workers, (list, tuple)) or not all(isinstance(w, str)
                                                             for w in workers):
            raise SyncError(f"sync job {job!r}: workers must be a list of addresses, found "
                            f"{str(workers)[:80]!r}")
        self.start_job(job, list(workers),
                       rpc.integer("group_size", group_size, 2, optional=True, error=SyncError),
                       rpc.seconds("max_wait_s", max_wait_s, 3600.0, optional=True,
                                   error=SyncError),
                       rpc.integer("max_progress_gap", max_progress_gap, optional=True,
                                   error=SyncError))
        return {"status": "OK"}

    @rpc.handler
    async def stop_handler(self, job: object) -> Reply:
        self.stop_job(_name("job", job))
        return {"status": "OK"}

    @rpc.handler
    async def members_handler(self, job: object) -> Reply:
        return {"status": "OK", **self.members(_name("job", job))}

    @rpc.handler
    async def group_handler(self, job: object, worker: object, progress: object,
                            final: object = False, members_version: object = None,
                            batches: object = None, unreachable: object = (),
                            refused: object = None) -> Reply:
        msg = await self.group(_name("job", job), _name("worker", worker),
                               rpc.integer("progress", progress, error=SyncError),
                               _flag("antdt_sync_group", "final", final),
                               rpc.integer("members_version", members_version, optional=True,
                                           error=SyncError),
                               rpc.integer("batches", batches, optional=True, error=SyncError),
                               _names("unreachable", unreachable),
                               rpc.integer("refused", refused, optional=True, error=SyncError))
        return {"status": "OK", **msg}

    @rpc.handler
    async def join_handler(self, job: object, worker: object) -> Reply:
        return {"status": "OK", **await self.join(_name("job", job), _name("worker", worker))}

    @rpc.handler
    async def started_handler(self, job: object, worker: object) -> Reply:
        job, worker = _name("job", job), _name("worker", worker)
        self._member(job, worker, "antdt_sync_started").started(worker, time())
        return {"status": "OK"}

    @rpc.handler
    async def leave_handler(self, job: object, worker: object) -> Reply:
        self.leave(_name("job", job), _name("worker", worker))
        return {"status": "OK"}

    @rpc.handler
    async def complete_handler(self, job: object, worker: object, gathered: object = False,
                               adopted_from: object = None) -> Reply:
        adopted = None if adopted_from is None else _name("adopted_from", adopted_from)
        msg = await self.complete(_name("job", job), _name("worker", worker),
                                  _flag("antdt_sync_complete", "gathered", gathered), adopted)
        return {"status": "OK", **msg}

    # ---- cluster events ---------------------------------------------------------------------

    def remove_worker(self, scheduler: Scheduler, worker: str, *, stimulus_id: str,
                      **kwargs: Any) -> None:
        for job in list(self.jobs):
            self.leave(job, worker)

    def restart(self, scheduler: Scheduler) -> None:
        self.jobs.clear()
        self._events.clear()
        for job in list(self._changes):
            self._notify(job)

    def _synced_rows(self, job: str, worker: str) -> int:
        """The rows ``job``'s ledger counts synced for ``worker`` (0 without a ledger)."""
        sharding = self.scheduler.plugins.get(SHARDING_PLUGIN)
        ledger = sharding.jobs.get(job) if isinstance(sharding, ShardingService) else None
        return 0 if ledger is None else ledger.synced_rows(worker)

    def _member(self, job: str, worker: str, handler: str) -> SyncScheduler:
        """``job``'s scheduler, once ``worker`` is one of its members; else a refusal counted
        (unless the final round dropped the worker while it joined: then the scheduler says
        so)."""
        scheduler = self._job(job)
        if not scheduler.is_member(worker) and not scheduler.declined(worker):
            self._refuse(job)
            raise SyncError(f"sync job {job!r}: {handler} from {worker!r} refused: it is no "
                            f"member (it left the job, or the scheduler removed it)")
        return scheduler

    def _refusals(self, job: str) -> dict[str | None, int]:
        """``job``'s refusal counts: by each member that reported some, and here (None)."""
        counts = self._refused.get(job)
        if counts is None:
            counts = self._refused[job] = {None: 0}
            while len(self._refused) > STALE_JOBS_KEPT:
                del self._refused[next(iter(self._refused))]
        return counts

    def _refuse(self, job: str) -> None:
        self._refusals(job)[None] += 1

    def _job(self, job: str) -> SyncScheduler:
        scheduler = self.jobs.get(job)
        if scheduler is None:
            raise SyncError(f"unknown sync job {job!r}; started jobs: {sorted(self.jobs)}")
        return scheduler

    def _event(self, job: str, worker: str) -> asyncio.Event:
        return self._events.setdefault((job, worker), asyncio.Event())

    def _wake(self, job: str, workers: Sequence[str]) -> None:
        for worker in workers:
            self._event(job, worker).set()

    async def _changed(self, job: str, timeout_s: float) -> None:
        """Wait until :meth:`_notify` is called for ``job`` or ``timeout_s`` passed."""
        event = self._changes.setdefault(job, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)

    def _notify(self, job: str) -> None:
        """Wake every call waiting in :meth:`_changed` for ``job`` (they check again)."""
        event = self._changes.pop(job, None)
        if event is not None:
            event.set()


def _name(what: str, value: object) -> str:
    return rpc.name(what, value, error=SyncError)


def _names(what: str, value: object) -> list[str]:
    if not isinstance(value, (list, tuple)) or len(value) > MAX_UNREACHABLE:
        raise SyncError(f"antdt_sync_group: {what} must be a list of at most {MAX_UNREACHABLE} "
                        f"addresses, found {str(value)[:80]!r}")
    return [_name(what, v) for v in value]


def _flag(handler: str, what: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise SyncError(f"{handler}: {what} must be a bool, found {value!r}")
    return value


def start_job(client: Client, job: str, workers: Sequence[str], *, group_size: int | None = None,
              max_wait_s: float | None = None, max_progress_gap: int | None = None) -> None:
    """From a client: make ``workers`` the members of ``job``'s sync (before training). None
    takes the ``antdt.sync`` default of the client's dask config."""
    if group_size is None:
        group_size = int(config.number("antdt.sync.group-size", low=2, integer=True))
    if max_wait_s is None:
        max_wait_s = config.seconds("antdt.sync.max-wait")
    rpc.ok(client.sync(client.scheduler.antdt_sync_start, job=job, workers=list(workers),
                       group_size=group_size, max_wait_s=max_wait_s,
                       max_progress_gap=max_progress_gap), error=SyncError)


def stop_job(client: Client, job: str) -> None:
    """From a client, after every agent returned: forget ``job``'s sync state."""
    rpc.ok(client.sync(client.scheduler.antdt_sync_stop, job=job), error=SyncError)
