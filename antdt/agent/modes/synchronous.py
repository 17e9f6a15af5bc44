"""The synchronous mode (AntDT-DD, for dedicated clusters): one model whose embedding tables are
sharded across the job's workers, trained in synchronous steps by one ``torch.distributed`` rank
per Dask worker, each rank's local batch sized by its speed.

Rendezvous. The job's master forms the group (:class:`SyncMaster`: ranks in worker-address
order, a generation per forming) and the scheduler hosts the TCP store every rank meets in
(:class:`Rendezvous`, handler ``antdt_sync_rank``). A rank joins with gloo on CPU and nccl on
a GPU; the ranks build their shards of the model within ``antdt.sync-steps.form-timeout``, then
every collective has a timeout (``antdt.sync-steps.collective-timeout``): a rank that hangs
breaks its peers' next collective instead of holding the job forever.

The step, on every rank in lock-step (:class:`SyncMode.train`)::

    rows on offer: what the rank's lease may still train, and the next lease's once less than a
        local batch is left (leases asked without waiting)
    header: one all-reduce of [rows on offer per rank | next local batches (rank 0) |
                               checkpoint requests | ranks with no rows left | ranks cancelled]
    any rank cancelled: all stop   a checkpoint asked: all write it here (between two steps)
    no rows on any rank: the job's end once every rank's ledger says so, else ask again
    every rank's rows of this step (:func:`step_rows`, the same on every rank): its local
        batch b_r, and the rows a rank short of it lacks taken by ranks with more on offer
    read this rank's rows (a lease's rest and the next lease's front: one batch), step with
        B = the rows of every rank (the trainer weights its loss by W / B: the step equals one
        step on the global batch however it is split)
    commit the local rows; the rank's own time goes to the monitor

Every step trains the global batch until the rows run out: a rank whose lease ends short of its
local batch, or that has no lease for the moment, does not make the step smaller, its peers
take more. Steps smaller than the global batch cost the model far more than their rows
suggest (Adam moves the dense weights about as far on 5 rows as on 4,096): a job whose slow
rank trained its last lease alone, in three steps of 5 rows at the end, lost 0.013 AUC, and
trained on the same rows without those steps' split it lost none. So only a job's last step,
what the leases hold between them, is smaller (an epoch's last rows share a step with the next
epoch's first, as a step can span two leases).

A rank's own time is what its training thread ran or waited for a CPU (:func:`own_seconds`),
not the wall time: inside the step the collectives (all-to-alls, DDP's all-reduce) make a rank
wait for the rank with the most work, so every rank's step lasts about as long and a rank with
a small batch would look as slow as the busiest one. An injected slowdown sleeps in proportion
to the own time too, and that sleep counts as the rank's own (it stands for slower work). An
injected pause holds a rank between two leases without breaking the group: it offers no rows
but goes on stepping, so a test holds a job whose ranks are all paused (empty steps, in which a
checkpoint is still taken) until it sets the pause's event.

Adaptive batches. The controller's :class:`~antdt.controller.BalanceBatch` sets the workers'
local batches so that every worker's step takes as long (each one's step time, in own seconds,
fitted to its measured windows), summing to the global batch (``batch_rows``: the job's batch
is the rows of one optimizer step in every mode, so a sync job trains as one process would on
the same batch, whatever the number of ranks; the ranks start with equal shares of it); rank 0
reads the sizes every ``antdt.sharding.commit-interval`` and sends them in the header, so every
rank switches at the same step and each step's global batch stays the same.

Checkpoints and the final model. Where the whole model fits the worker that gathers it, it is
gathered there (a checkpoint's ``model.pt``; the final model kept on rank 0 for the master). A
model too large for that is never gathered: every rank writes its own shards (a
:class:`~antdt.agent.contract.SavedModel`), into the checkpoint's version folder, and the final
model into the job's ``model_dir``; a job with no ``model_dir`` whose model could not be gathered
is refused as its group forms, in one line naming the sizes, rather than at its end.

What the ledger counts done. A rank's rows count as synced once their step completed: the model
(its shards on every rank) holds them. A rank that dies takes its shards with it, so the job
never goes on without it: every rank's next collective fails (:class:`GroupBroken`), and the
master forms the group again from the last checkpoint (model and ledger written together at one
step boundary), on the workers left and any that joined; the rows trained past the checkpoint
are trained again (counted replayed). The model therefore holds every done row exactly once.
"""

from __future__ import annotations

import datetime
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout
from distributed import Worker
from distributed.utils import sync

from antdt import config, rpc
from antdt.agent.contract import (AgentSpec, Outcome, SavedModel, Trainer, TrainerFactory,
                                  event_topic)
from antdt.agent.faults import PAUSE_POLL_S
from antdt.agent.modes.mode import AgentParts, Declined, EverySynced
from antdt.device import FROZEN_HEAP
from antdt.errors import AntdtError, CheckpointError, ConfigError, SyncError
from antdt.monitor import BATCHES, BUSY
from antdt.rpc import Reply
from antdt.sharding import Claim, CommitReply, Finished, Lease, Revoked, Stop, Wait, shares

logger = logging.getLogger(__name__)

RETRY_S = 0.05
"""A rank told to wait for rows asks again after this long (it trains empty steps meanwhile);
when no rank has rows, the request waits this long server side."""


_SCHEDSTAT = "/proc/thread-self/schedstat"


def step_rows(sizes: Sequence[int], offered: Sequence[int]) -> list[int]:
    """Each rank's rows of one step: its local batch ``sizes[r]`` where it offers that many;
    the rows of the ranks that offer fewer are spread over the ranks that offer more, in
    proportion to their local batches (the faster ranks take more), each at most what it
    offers. The step trains ``min(sum(sizes), sum(offered))`` rows: the global batch until
    the rows run out. Integer arithmetic on the header's figures only, so every rank finds
    the same.

    >>> step_rows([5, 1364, 1364, 1363], [40, 4, 7, 10904])  # two leases end
    [15, 4, 7, 4070]
    >>> step_rows([5, 1364, 1364, 1363], [40, 0, 0, 0])  # the job's last rows
    [40, 0, 0, 0]
    """
    rows = [min(size, max(offer, 0)) for size, offer in zip(sizes, offered)]
    short = sum(sizes) - sum(rows)
    while short > 0:
        room = [max(offer, 0) - r for offer, r in zip(offered, rows)]
        weights = [max(size, 1) if space > 0 else 0 for size, space in zip(sizes, room)]
        if not any(weights):
            break
        more = _spread(min(short, sum(room)), weights)
        added = [min(extra, space) for extra, space in zip(more, room)]
        rows = [r + extra for r, extra in zip(rows, added)]
        short -= sum(added)  # > 0: each round fills the shortfall or some rank's room
    return rows


def _spread(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (integers; a zero weight gets nothing),
    rounded by largest remainders, ties to the lower index."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    left = total - sum(parts)
    order = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in order[:left]:
        parts[i] += 1
    return parts


def own_seconds() -> float:
    """Seconds the calling thread has run on a CPU or waited in the run queue for one (Linux's
    ``/proc/thread-self/schedstat``: its first two fields, in nanoseconds); its CPU seconds
    where the kernel does not keep that (then time spent waiting for a CPU goes uncounted).
    Time the thread was blocked, in a collective waiting for its peers or asleep, is not counted.

    It measures the training thread only: with ``train.threads`` > 1 torch's other threads'
    work is missed. On a GPU the kernels' time is missed too (the thread waits for them)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            ran, waited = f.read().split()[:2]
    except OSError:
        return time.thread_time()
    return (int(ran) + int(waited)) / 1e9


class GroupBroken(AntdtError):
    """A collective of the synchronous group failed: a rank died, hung past the collective
    timeout or left. The job's master forms the group again from the last checkpoint."""


class ShardedTrainer(Protocol):
    """A synchronous rank's trainer (e.g. a wrapper of ``models.sharded.ShardedTrainStep``), built
    after the rank joined the default process group.

    ``step(batch, global_rows)`` trains the rank's local batch (0 rows too: every rank takes
    part in every step) as its share of a global batch of ``global_rows`` rows;
    ``batch(parts)`` is one batch of the rows of ``parts`` (the reader's batches, in order: a
    step can end one lease and begin the next), a batch of no rows for no parts.
    ``full_state(dst)`` (every rank calls it) is the whole model and optimiser state on rank
    ``dst`` (None on the others), in the form a checkpoint holds and ``restore_state`` takes;
    ``final(state)`` is a single-process trainer over it, what the master evaluates and logs.
    ``gather_refusal(dst)`` is None when the whole fits on rank ``dst`` (the same answer on
    every rank), else why not, naming the sizes; then ``write_shards(folder)`` (every rank
    calls it) writes each rank's part into ``folder`` and gives every file's name with its
    size and sha256, and ``restore_state`` also takes the :class:`SavedModel` of those
    files."""

    rank: int
    world_size: int

    def step(self, batch: Any, global_rows: int) -> float: ...

    def batch(self, parts: Sequence[Any]) -> Any: ...

    def gather_refusal(self, dst: int) -> str | None: ...

    def full_state(self, dst: int) -> Any: ...

    def write_shards(self, folder: str) -> dict[str, dict[str, Any]]: ...

    def restore_state(self, state: Any) -> None: ...

    def final(self, state: Any) -> Trainer[Any]: ...

    def plan_summary(self) -> Mapping[str, str]: ...


# ---- the scheduler's side -----------------------------------------------------------------------

@dataclass
class Group:
    """One forming of a job's group: its workers in rank order and its generation."""

    workers: list[str]
    generation: int

    @property
    def prefix(self) -> str:
        return f"g{self.generation}"


@dataclass
class Rendezvous:
    """On the scheduler: the TCP store every synchronous job's ranks meet in (made on first
    use, on a free port of the scheduler's host) and each job's current :class:`Group`.

    Handler ``antdt_sync_rank(job, worker)``: the worker's rank, the world size, the workers in
    rank order, the store's port and the group's key prefix."""

    groups: dict[str, Group] = field(default_factory=dict)
    _store: dist.TCPStore | None = None
    _generations: dict[str, int] = field(default_factory=dict)

    @property
    def port(self) -> int:
        if self._store is None:
            self._store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False)
        return int(self._store.port)

    def form(self, job: str, workers: Collection[str]) -> Group:
        generation = self._generations.get(job, 0) + 1
        self._generations[job] = generation
        group = self.groups[job] = Group(sorted(workers), generation)
        return group

    def forget(self, job: str) -> None:
        self.groups.pop(job, None)
        self._generations.pop(job, None)

    @rpc.handler
    async def rank(self, job: str, worker: str) -> Reply:
        job = rpc.name("job", job, SyncError)
        worker = rpc.name("worker", worker, SyncError)
        group = self.groups.get(job)
        if group is None:
            raise SyncError(f"job {job!r} has no synchronous group; groups: {sorted(self.groups)}")
        if worker not in group.workers:
            raise SyncError(f"worker {worker} is not in job {job!r}'s group (generation "
                            f"{group.generation}: {group.workers})")
        return {"status": "OK", "rank": group.workers.index(worker),
                "workers": list(group.workers), "port": self.port,
                "prefix": f"antdt/{job}/{group.prefix}"}


class SyncMaster:
    """:class:`~antdt.agent.modes.MasterMode` of the synchronous mode: forms the job's group at
    its start and anew after a restart; a worker that arrives later waits for the next forming
    (a group of fixed ranks cannot take a joiner between two steps)."""

    regroups = True

    def __init__(self, rendezvous: Rendezvous) -> None:
        self.rendezvous = rendezvous

    def start(self, job: str, workers: Collection[str]) -> None:
        self.rendezvous.form(job, workers)

    def restart(self, job: str, workers: Collection[str]) -> None:
        self.rendezvous.form(job, workers)

    def accepts_joiners(self, job: str) -> bool:
        return False


# ---- a rank's side ------------------------------------------------------------------------------

@dataclass
class _Request:
    """A checkpoint asked of this rank by another thread, fulfilled by the training thread at
    the next step boundary."""

    copy_ledger: Callable[[], Mapping[str, Any]]
    folder: str
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[Mapping[str, Any], Any] | None = None
    error: BaseException | None = None


class _Header:
    """The step's header, one all-reduced int64 vector: per rank the rows it offers, the next
    local batches (filled by rank 0), checkpoint requests, then the ranks with no rows left and
    the ranks cancelled."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.values = torch.zeros(3 * world + 2, dtype=torch.int64)

    def set(self, rank: int, rows: int, sizes: Sequence[int] | None, checkpoint: bool,
            over: bool, cancelled: bool) -> None:
        w = self.world
        self.values.zero_()
        self.values[rank] = rows
        if sizes is not None:
            self.values[w:2 * w] = torch.tensor(list(sizes), dtype=torch.int64)
        self.values[2 * w + rank] = int(checkpoint)
        self.values[3 * w] = int(over)
        self.values[3 * w + 1] = int(cancelled)

    def rows(self) -> list[int]:
        return [int(v) for v in self.values[:self.world]]

    def sizes(self) -> list[int] | None:
        sizes = [int(v) for v in self.values[self.world:2 * self.world]]
        return sizes if any(sizes) else None

    def checkpoint_by(self) -> int | None:
        asked = self.values[2 * self.world:3 * self.world].nonzero()
        return int(asked[0]) if len(asked) else None

    def over(self) -> int:
        return int(self.values[3 * self.world])

    def cancelled(self) -> int:
        return int(self.values[3 * self.world + 1])


Span = tuple[Lease, int, int]
"""Rows ``[start, stop)`` of a lease."""


class _Rows:
    """This rank's rows: the lease it trains and where the next batch starts, and the lease
    that follows it once the rest of this one is less than a local batch; the lease requests
    never wait (a rank told to wait offers no rows and asks again).

    A lease holds at most ``antdt.sync-steps.lease-steps`` of the rank's local batches: leases
    of whole shards left a slow rank, whose local batch is small, hundreds of steps of rows
    when the others ran out, which it then trains alone, at its pace, at the job's end. A
    lease's end rarely falls on a step's (the local batches change, a shard's last lease is
    shorter), so a step may take a lease's rest and the front of the next: without it, ranks
    whose leases ended in the same step offered only their rests, and the slow rank, the one
    with rows to spare, took the rest of the global batch (9,872 of 16,384 rows in one step:
    twice a balanced step's time)."""

    def __init__(self, agent: AgentParts) -> None:
        self.agent = agent
        self.lease_steps = int(config.number("antdt.sync-steps.lease-steps", low=1,
                                             integer=True))
        self.lease: Lease | None = None
        self.offset = self.limit = 0
        self.ahead: Lease | None = None
        self.over = False
        self.retry_at = 0.0
        self._started = 0.0

    def offer(self, rows: int, idle: bool) -> int:
        """The rows this rank can train in the next step: what its lease's claim holds past
        the committed offset, and the next lease's claim once the claim reaches the lease's end
        with less than ``rows`` (the local batch) left; a lease is asked for (sized for
        ``rows``) when the rank has none or such a rest. 0 when it has none now. ``idle``: no
        rank had rows in the last step, so the request may wait for rows server side (every
        rank waits in the next header anyway)."""
        if self.over or rows <= 0:
            return 0
        lease = self.lease
        if lease is None:
            if self._paused(idle):
                return 0
            lease = self._ask(rows, RETRY_S if idle else 0.0, ahead=False)
            if lease is None:
                return 0
            self._begin(lease)
        elif self.ahead is None and lease.stop - self.offset < rows \
                and not self.agent.faults.pause_due(self.agent.rows):
            self.ahead = self._ask(rows, 0.0, ahead=True)
        offered = self.limit - self.offset
        if self.ahead is not None and self.limit == lease.stop:
            offered += self.ahead.claim_stop - self.ahead.start
        return offered

    def _paused(self, idle: bool) -> bool:
        """Whether the injected pause holds this rank between two leases
        (:meth:`~antdt.agent.faults.FaultInjector.held`, waiting for its event at most
        ``PAUSE_POLL_S`` after a step of no rows): it asks for no lease but takes part in every
        step, so its peers take its rows, and once every rank is paused the steps are empty,
        the job cannot end and a checkpoint is still taken (a test's gate). The rows it trained
        are reported first: the last lease's last commit rides on the next lease call."""
        if not self.agent.faults.pause_due(self.agent.rows):
            return False
        self.agent.shards.flush()
        return self.agent.faults.held(self.agent.rows, PAUSE_POLL_S if idle else 0.0)

    def _ask(self, rows: int, wait_s: float, ahead: bool) -> Lease | None:
        """A lease of at most ``lease_steps`` local batches, or None (asked again after
        ``RETRY_S`` when told to wait; :attr:`over` when the job is)."""
        if wait_s == 0 and time.perf_counter() < self.retry_at:
            return None
        reply = self.agent.shards.poll_lease(wait_s, max_rows=rows * self.lease_steps,
                                             ahead=ahead)
        if reply is None:
            self.over = True
            return None
        if isinstance(reply, Wait):
            self.retry_at = time.perf_counter() + RETRY_S
            return None
        return reply

    def _begin(self, lease: Lease) -> None:
        self.lease, self.offset, self.limit = lease, lease.start, lease.claim_stop
        self._started = time.time()
        self.agent.event({"kind": "lease", "phase": "start", "lease_id": lease.lease_id,
                          "time": self._started})

    def take(self, rows: int) -> list[Span]:
        """The spans of this step's ``rows`` rows (at most what :meth:`offer` said): the
        lease's, then the next lease's front."""
        if rows <= 0:
            return []
        assert self.lease is not None
        first = min(rows, self.limit - self.offset)
        spans = [(self.lease, self.offset, self.offset + first)] if first else []
        if rows > first:
            assert self.ahead is not None and self.ahead.start + rows - first <= \
                self.ahead.claim_stop
            spans.append((self.ahead, self.ahead.start, self.ahead.start + rows - first))
        return spans

    def trained(self, spans: Sequence[Span], busy_s: float, next_rows: int) -> None:
        """The spans' rows were trained (their step completed); the claim is extended at once
        if it holds fewer than ``next_rows`` (the local batch) past them. The step's
        measurements ride with its last commit."""
        for i, (_, _, end) in enumerate(spans):
            last = i == len(spans) - 1
            reply = self.agent.shards.commit(
                end, stats={BUSY: busy_s, BATCHES: 1.0} if last else None,
                claim_ahead=next_rows if last else 0)
            self._committed(end, reply)
            if self.lease is None:  # its last span, or the job stopped under it
                return

    def _committed(self, end: int, reply: CommitReply) -> None:
        """What the commit of rows up to ``end`` said: the claim, or the lease's end (the
        lease asked ahead follows it)."""
        assert self.lease is not None
        self.offset = end
        if isinstance(reply, (Claim, Revoked)):
            self.limit = reply.stop
        if isinstance(reply, Revoked) and reply.stop > end:
            return
        if isinstance(reply, (Finished, Revoked, Stop)):
            self.agent.event({"kind": "lease", "phase": "end", "lease_id": self.lease.lease_id,
                              "start": self._started, "time": time.time(),
                              "rows": end - self.lease.start,
                              "outcome": "revoked" if isinstance(reply, Revoked) else "finished"})
            self.lease, ahead, self.ahead = None, self.ahead, None
            self.over = isinstance(reply, Stop)
            if ahead is not None and not self.over:
                self._begin(ahead)


class SyncMode(EverySynced):
    """:class:`~antdt.agent.modes.WorkerMode` of the synchronous mode: one rank of the job's
    group (see the module docstring). A rank's trained rows are synced once their step
    completed (the model's shards on every rank hold them)."""

    joined_from: str | None = None
    threads: Collection[int] = ()

    def __init__(self, spec: AgentSpec, make_trainer: TrainerFactory, device: torch.device,
                 worker: Worker) -> None:
        self.spec = spec
        self.make_trainer = make_trainer
        self.device = device
        self.worker = worker
        self.trainer: ShardedTrainer | None = None
        self.rank = 0
        self.workers: list[str] = []
        self.steps = 0
        self._waited_s = 0.0
        self._request: _Request | None = None
        self._joined = False  # this rank initialised the process's default group
        self._lock = threading.Lock()
        self._timeout_s = config.seconds("antdt.sync-steps.collective-timeout")

    @property
    def exchanges(self) -> int:
        """Synchronous steps taken."""
        return self.steps

    @property
    def waited_s(self) -> float:
        """Seconds this rank waited for its peers at the steps' headers."""
        return self._waited_s

    @property
    def exchanged_bytes(self) -> None:
        """Not counted: the steps' collectives are TorchRec's and gloo's, which do not say."""
        return None

    def start(self, join: bool) -> None:
        """Join the job's process group and build the sharded trainer on it."""
        if join:
            raise Declined("a synchronous group takes new workers only when it forms again")
        if dist.is_initialized():
            raise SyncError(f"worker {self.worker.address} already takes part in a process "
                            "group: one synchronous job per worker process at a time")
        reply = rpc.ok(sync(self.worker.loop, self.worker.scheduler.antdt_sync_rank,
                            job=self.spec.job, worker=self.worker.address), error=SyncError)
        self.rank, self.workers = int(reply["rank"]), list(reply["workers"])
        host = urlsplit(self.worker.scheduler.address).hostname or "127.0.0.1"
        forming = datetime.timedelta(seconds=config.seconds("antdt.sync-steps.form-timeout"))
        store = dist.PrefixStore(reply["prefix"], dist.TCPStore(
            host, int(reply["port"]), is_master=False, timeout=forming))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        # A group formed again in this process: the last one's model can still be held by the
        # reference cycles of its broken collective's traceback (frames that held the trainer),
        # frozen out of every collection since. Free it before this one's shards are allocated,
        # or the worker holds two models (its memory is sized for one).
        FROZEN_HEAP.collect()
        try:
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=len(self.workers), timeout=forming)
            self._joined = True
            self.trainer = self.make_trainer(self.device)  # type: ignore[assignment]
            dist.barrier()  # every rank built its shards: the steps' timeout holds from here
            _set_pg_timeout(datetime.timedelta(seconds=self._timeout_s))
        except (RuntimeError, dist.DistBackendError) as exc:
            self.leave()
            raise GroupBroken(f"rank {self.rank} of job {self.spec.job} could not form its "
                              f"group: {exc}") from exc
        assert self.trainer is not None
        refusal = self.trainer.gather_refusal(0)
        if refusal is not None and self.spec.model_dir is None:
            self.leave()
            raise ConfigError(f"job {self.spec.job}: {refusal}, and the job has no folder to "
                              "write it in parts (set train.checkpoint_dir)")
        # into the job's log (``antdt logs``) too: where each table went, and how the model is kept
        message = (f"rank {self.rank} of {len(self.workers)} ({backend}); tables: "
                   f"{dict(self.trainer.plan_summary())}"
                   + ("" if refusal is None else f"; the model is written in parts: {refusal}"))
        logger.info("job %s on %s: %s", self.spec.job, self.worker.address, message)
        self.worker.log_event(event_topic(self.spec.job), {
            "kind": "log", "level": "info", "message": message, "worker": self.worker.address})

    def train(self, agent: AgentParts) -> Outcome:
        """The step loop (see the module docstring)."""
        trainer = self.trainer
        assert trainer is not None
        world = trainer.world_size
        rows = _Rows(agent)
        header = _Header(world)
        sizes = shares([1.0] * world, agent.spec.batch_rows)
        sizes_due = 0.0
        interval = config.seconds("antdt.sharding.commit-interval")
        idle = False
        while True:
            began, own_began = time.perf_counter(), own_seconds()
            offer = rows.offer(sizes[self.rank], idle)
            new_sizes = None
            if self.rank == 0 and began >= sizes_due:
                new_sizes = self._controller_sizes(agent, sum(sizes))
                sizes_due = began + interval
            header.set(self.rank, offer, new_sizes, self._request is not None,
                       rows.over and offer == 0, agent.cancelled.is_set())
            local_s, own_local = time.perf_counter() - began, own_seconds() - own_began
            self._collective(lambda: dist.all_reduce(header.values), "the step's header")
            self._waited_s += time.perf_counter() - began - local_s
            if header.cancelled():
                return "cancelled"
            asker = header.checkpoint_by()
            if asker is not None:
                self._checkpoint(agent, asker)
            counts = step_rows(sizes, header.rows())
            total = sum(counts)
            if header.sizes() is not None:
                sizes = header.sizes() or sizes
            idle = total == 0
            if idle:
                if header.over() == world:
                    return "finished" if agent.job_state() == "finished" else "stopped"
                continue
            cpu_started, own_started = time.thread_time(), own_seconds()
            spans = rows.take(counts[self.rank])
            batch = trainer.batch([agent.reader.read(lease.path, lease.row_group, start, stop)
                                   for lease, start, stop in spans])
            loss = self._collective(lambda: trainer.step(batch, total), "the step")
            self.steps += 1
            own = own_local + own_seconds() - own_started
            asleep = time.perf_counter()
            agent.faults.slow_down(agent.rows, own)  # a slow rank is slow on empty steps too
            busy = own + time.perf_counter() - asleep
            cpu = time.thread_time() - cpu_started
            if not spans:
                agent.count(0, busy, cpu, math.nan)
                continue
            agent.count(counts[self.rank], busy, cpu, loss)
            rows.trained(spans, busy, sizes[self.rank])
            if agent.faults.fire(agent.rows):
                return "cancelled"

    def _controller_sizes(self, agent: AgentParts, total: int) -> list[int] | None:
        """Rank 0: the local batches the controller set (by worker), made to sum to ``total``
        (largest remainders), in rank order; None when it set none."""
        reply = sync(self.worker.loop, self.worker.scheduler.antdt_controller_actions,
                     job=self.spec.job, since=1 << 62)
        if reply.get("status") != "OK":
            return None
        chosen = reply.get("batch_sizes") or {}
        if not chosen:
            return None
        wanted = [float(chosen.get(w, agent.spec.batch_rows / len(self.workers)))
                  for w in self.workers]
        return shares(wanted, total)

    def _collective(self, call: Callable[[], Any], what: str) -> Any:
        try:
            return call()
        except (RuntimeError, dist.DistBackendError) as exc:
            raise GroupBroken(f"rank {self.rank} of job {self.spec.job}: {what} failed (a peer "
                              f"died, hung past {self._timeout_s:g}s or left): {exc}") from exc

    def _checkpoint(self, agent: AgentParts, asker: int) -> None:
        """Every rank at this step boundary: report every trained row (their steps completed),
        wait for the others to have done so, then the model's state goes to the asking rank,
        which copies the ledger in between: the two hold exactly the same rows. A model too
        large for the asking rank is written by every rank into the checkpoint's folder (the
        asker's, sent to the others) instead."""
        agent.shards.flush()
        self._collective(dist.barrier, "the checkpoint's barrier")
        request = self._request if asker == self.rank else None
        ledger: Mapping[str, Any] | None = None
        if request is not None:
            try:
                ledger = request.copy_ledger()
            except BaseException as exc:  # handed to the asking thread, training goes on
                request.error = CheckpointError(f"copying the ledger failed: {exc!r}")
        assert self.trainer is not None
        trainer = self.trainer
        state: Any = None
        if trainer.gather_refusal(asker) is None:
            state = self._collective(lambda: trainer.full_state(asker),
                                     "the checkpoint's gather")
        else:
            folder = [None if request is None else request.folder]
            self._collective(lambda: dist.broadcast_object_list(folder, src=asker),
                             "the checkpoint's folder")
            assert isinstance(folder[0], str)
            try:
                state = self._write(folder[0], "the checkpoint's shards")
            except OSError as exc:  # every rank has it; the checkpoint fails, training goes on
                if request is not None:
                    request.error = exc
        if request is not None:
            if ledger is not None and request.error is None:
                request.result = (ledger, state)
            self._request = None
            request.done.set()

    def _write(self, folder: str, what: str) -> SavedModel:
        """Every rank writes its part of the model into ``folder``; the files of all."""
        assert self.trainer is not None
        trainer = self.trainer
        return SavedModel(folder, self._collective(lambda: trainer.write_shards(folder), what))

    # ---- the rest of WorkerMode ---------------------------------------------------------------

    def step(self, batch: Any, rows_after: int) -> float:
        raise SyncError("the synchronous mode trains in its own step loop, not the lease loop")

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        """Asked from another thread: every rank writes its part at the next step boundary
        (:meth:`_checkpoint`); waits for it at most the collective timeout."""
        with self._lock:
            if self._request is not None:
                raise CheckpointError(f"job {self.spec.job}: a checkpoint is already being "
                                      "taken on this rank")
            request = self._request = _Request(copy_ledger, folder)
        if not request.done.wait(self._timeout_s):
            self._request = None
            raise CheckpointError(f"job {self.spec.job}: rank {self.rank} reached no step "
                                  f"boundary within {self._timeout_s:g}s")
        if request.error is not None:
            raise CheckpointError(f"job {self.spec.job}: the checkpoint failed: "
                                  f"{request.error}") from request.error
        assert request.result is not None
        return request.result

    def finish(self) -> Trainer[Any] | SavedModel | None:
        """The final model goes to rank 0, which keeps a single-process trainer over it; a model
        too large for rank 0 is written by every rank into the job's ``model_dir``, and rank 0
        hands on where."""
        assert self.trainer is not None
        trainer = self.trainer
        final: Trainer[Any] | SavedModel | None
        if trainer.gather_refusal(0) is None:
            state = self._collective(lambda: trainer.full_state(0), "gathering the final model")
            final = trainer.final(state) if self.rank == 0 else None
        else:
            assert self.spec.model_dir is not None, "refused in start()"
            saved = self._write(self.spec.model_dir, "writing the final model")
            final = saved if self.rank == 0 else None
        self.leave()
        return final

    def stop(self) -> None:
        """A checkpoint waiting for a boundary will not get one."""
        request = self._request
        if request is not None:
            request.error = GroupBroken("the rank stopped training")
            request.done.set()

    def leave(self) -> None:
        """Leave the process group this rank joined (a later job, or this one formed again,
        makes a new one); a group another job's rank made here stays."""
        self.trainer = None
        if self._joined:
            self._joined = False
            dist.destroy_process_group()

    def check(self) -> None:
        """No thread of its own can fail."""

