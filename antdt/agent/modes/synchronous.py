"""The synchronous mode (AntDT-DD, for dedicated clusters): one model whose embedding tables are
sharded across the job's workers, trained in synchronous steps by one ``torch.distributed`` rank
per Dask worker, each rank's local batch sized by its speed.

Rendezvous. The job's master forms the group (:class:`~antdt.agent.modes.sync_master.SyncMaster`:
ranks in worker-address order, a generation per forming) and the scheduler hosts the job's TCP
store its ranks meet in, on the scheduler's own address, under a key prefix random to each forming
(:class:`~antdt.agent.modes.sync_master.Rendezvous`, handler ``antdt_sync_rank``). A rank joins with gloo on CPU and nccl on a GPU; the ranks build their
shards of the model within ``antdt.sync-steps.form-timeout``, then every collective has a
timeout (``antdt.sync-steps.collective-timeout``): a rank that hangs breaks its peers' next
collective instead of holding the job forever. gloo listens on the interface of the Dask
worker's own address (:func:`gloo_on`), which its peers reach on a cluster of hosts. A rank whose
collective broke asks the rendezvous, with its generation, whether its forming is still the
job's group: a rank cut off until the master formed the group again without it (a zombie, back
once its link healed) is refused, counted, and says so in its error. The step's parts are in
:mod:`~antdt.agent.modes.sync_steps`.

The step, on every rank in lock-step (:class:`SyncMode.train`)::

    rows on offer: what the rank's lease may still train, and the next lease's once the claim
        reaches the lease's end (the next lease asked when less than two local batches are
        left, without waiting)
    header: one all-reduce of [rows on offer per rank | next local batches (rank 0) |
                               checkpoint requests | ranks with no rows left | ranks cancelled]
    any rank cancelled: all stop   a checkpoint asked: all write it here (between two steps)
    no rows on any rank: the job's end once every rank's ledger says so, else ask again
    every rank's rows of this step (``step_rows``, the same on every rank): its local
        batch b_r, and the rows a rank short of it lacks taken by ranks with more on offer
    read this rank's rows (a lease's rest and the next lease's front: one batch; read while
        the step before ran, :class:`~antdt.agent.modes.sync_steps.ReadAhead`, when they are
        the rows that followed its own), start reading the rows that follow these, step with
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

A rank's own time is what its training thread ran or waited for a CPU (:func:`~antdt.agent.modes.sync_steps.own_seconds`),
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
import ipaddress
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import fsspec
import psutil
import torch
import torch.distributed as dist
from dask.utils import format_bytes, parse_bytes
from distributed import Worker
from distributed.utils import sync
from torch.distributed.distributed_c10d import _set_pg_timeout

from antdt import config, rpc
from antdt.agent.contract import (AgentSpec, Outcome, SavedModel, Trainer, TrainerFactory,
                                  event_topic)
from antdt.agent.modes.mode import AgentParts, Declined, EverySynced, OwnTables
from antdt.agent.modes.sync_steps import (Header, ReadAhead, Span, StepRows, own_seconds,
                                          step_rows)
from antdt.device import FROZEN_HEAP
from antdt.errors import AntdtError, CheckpointError, ConfigError, SyncError
from antdt.sharding import shares

logger = logging.getLogger(__name__)


STALE_RETRY_S = 0.5
"""A rank whose group broke asks the scheduler again this often while it does not answer."""


class GroupBroken(AntdtError):
    """A collective of the synchronous group failed: a rank died, hung past the collective
    timeout or left. The job's master forms the group again from the last checkpoint.
    ``group_rows``: the rows the group's model trained since it formed, as this rank saw its
    steps complete (what the model lost with the group held past its starting point)."""

    def __init__(self, message: str, group_rows: int = 0) -> None:
        super().__init__(message)
        self.group_rows = group_rows


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
    files. ``state_bytes()``: the whole model's bytes (the same on every rank), which sizes
    the time a gather or a write of it may take."""

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

    def state_bytes(self) -> int: ...


class _OneGroup:
    """The process's one default process group, claimed by a job's rank before it forms it and
    let go once it destroyed it: the claim and the check are one step under a lock, so two jobs'
    ranks starting on one worker at once cannot both pass the check (the second would overwrite
    the first's group, and one job's collectives would run on the other's)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self.job: str | None = None
        self.claims = 0
        """Claims granted in this process's life: more than one, a group was formed before."""

    def claim(self, job: str, wait_s: float = 0.0) -> str | None:
        """Claim the group for ``job``: None, or the job that holds it. A rank of an older
        forming of ``job`` itself that still holds it (cut off, its forming or collective not
        timed out yet, when the master formed the group again with this worker) is waited for,
        at most ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._lock:
            while self.job == job and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
            if self.job is None and dist.is_initialized():
                return "a process group formed outside antdt"
            if self.job is not None:
                return self.job
            self.job = job
            self.claims += 1
            return None

    def release(self, job: str) -> None:
        with self._lock:
            if self.job == job:
                self.job = None
                self._lock.notify_all()


PROCESS_GROUP = _OneGroup()


@dataclass
class _Request:
    """A checkpoint asked of this rank by another thread, fulfilled by the training thread at
    the next step boundary: ``taken`` once the boundary is reached, ``done`` once written (or
    failed). The asking thread may give up on it at any time; the training thread then still
    writes it (every rank is in the checkpoint's collectives), and nobody reads the result."""

    copy_ledger: Callable[[], Mapping[str, Any]]
    folder: str
    taken: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[Mapping[str, Any], Any] | None = None
    error: BaseException | None = None


class SyncMode(EverySynced, OwnTables):
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
        self.token = ""
        """The forming of the group this rank is in (unique across the cluster's life)."""
        self.generation = 0
        """The job's count of its group's formings at this rank's (from 1; 0: not formed)."""
        self.steps = 0
        self.group_rows = 0
        """Rows the group's model trained since it formed (every step's rows, once completed)."""
        self._waited_s = 0.0
        self._request: _Request | None = None
        self._joined = False  # this rank claimed the process's default group
        self._lock = threading.Lock()
        self._timeout_s = config.seconds("antdt.sync-steps.collective-timeout")
        self._form_s = config.seconds("antdt.sync-steps.form-timeout")
        self._write_rate = parse_bytes(str(config.get("antdt.sync-steps.write-rate")))

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
        holder = PROCESS_GROUP.claim(self.spec.job, self._form_s)
        if holder == self.spec.job:
            raise GroupBroken(f"worker {self.worker.address}: a rank of an older forming of job "
                              f"{holder} still holds its process group after "
                              f"{self._form_s:g}s (antdt.sync-steps.form-timeout)")
        if holder is not None:
            raise SyncError(f"worker {self.worker.address} already takes part in a process "
                            f"group ({holder}): one synchronous job per worker process at a "
                            "time")
        self._joined = True
        try:
            self._form()
        except BaseException:
            self.leave()
            raise

    def _form(self) -> None:
        reply = rpc.ok(sync(self.worker.loop, self.worker.scheduler.antdt_sync_rank,
                            job=self.spec.job, worker=self.worker.address), error=SyncError)
        self.rank, self.workers = int(reply["rank"]), list(reply["workers"])
        self.token, self.generation = str(reply["token"]), int(reply["generation"])
        forming = datetime.timedelta(seconds=self._form_s)
        store = dist.PrefixStore(reply["prefix"], dist.TCPStore(  # the job's own store
            str(reply["host"]), int(reply["port"]), is_master=False, timeout=forming))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if backend == "gloo":
            gloo_on(self.worker.ip)
        # A group formed again in this process: the last one's model can still be held by the
        # reference cycles of its broken collective's traceback (frames that held the trainer),
        # frozen out of every collection since. Free it before this one's shards are allocated,
        # or the worker holds two models (its memory is sized for one). The first group has
        # none to free, and the collection holds the GIL for a third of a second.
        if PROCESS_GROUP.claims > 1:
            FROZEN_HEAP.collect()
        try:
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=len(self.workers), timeout=forming)
            self.trainer = self.make_trainer(self.device)  # type: ignore[assignment]
            dist.barrier()  # every rank built its shards: the steps' timeout holds from here
            _set_pg_timeout(datetime.timedelta(seconds=self._timeout_s))
        except (RuntimeError, dist.DistBackendError) as exc:
            raise GroupBroken(f"rank {self.rank} of job {self.spec.job} could not form its "
                              f"group: {exc}") from exc
        assert self.trainer is not None
        refusal = self.trainer.gather_refusal(0)
        if refusal is not None and self.spec.model_dir is None:
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
        """The step loop (see the module docstring), the rank's batches read in a thread of
        their own, the next while a step runs (:class:`ReadAhead`)."""
        trainer = self.trainer
        assert trainer is not None

        def read(spans: Sequence[Span]) -> Any:
            return trainer.batch([agent.reader.read(lease.path, lease.row_group, start, stop)
                                  for lease, start, stop in spans])

        reads = ReadAhead(read)
        try:
            return self._steps(agent, trainer, reads)
        finally:
            reads.close()

    def _steps(self, agent: AgentParts, trainer: ShardedTrainer, reads: ReadAhead) -> Outcome:
        world = trainer.world_size
        rows = StepRows(agent)
        header = Header(world)
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
            request = self._request  # read once: the asking thread may give it up meanwhile
            header.set(self.rank, offer, new_sizes, request is not None,
                       rows.over and offer == 0, agent.cancelled.is_set())
            local_s, own_local = time.perf_counter() - began, own_seconds() - own_began
            self._collective(lambda: dist.all_reduce(header.values), "the step's header")
            self._waited_s += time.perf_counter() - began - local_s
            if header.cancelled():
                return "cancelled"
            asker = header.checkpoint_by()
            if asker is not None:
                self._checkpoint(agent, asker, request if asker == self.rank else None)
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
            batch = reads.batch(spans) if spans else trainer.batch([])
            reads.read_ahead(rows.following(spans, sizes[self.rank]))
            loss = self._collective(lambda: trainer.step(batch, total), "the step")
            self.steps += 1
            self.group_rows += total
            own = own_local + own_seconds() - own_started
            asleep = time.perf_counter()
            agent.faults.slow_down(agent.rows, own)  # a slow rank is slow on empty steps too
            busy = own + time.perf_counter() - asleep
            cpu = time.thread_time() - cpu_started
            if not spans:
                agent.count(0, busy, cpu, math.nan)
                continue
            agent.count(counts[self.rank], busy, cpu, loss)
            rows.trained(spans, busy, sizes[self.rank], min(cpu, busy))
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

    def _collective(self, call: Callable[[], Any], what: str, timeout_s: float | None = None
                    ) -> Any:
        """``call()``, a collective of every rank; its failure is :class:`GroupBroken`. With
        ``timeout_s``, the group's timeout is that long for it (every rank sets the same)."""
        limit = self._timeout_s if timeout_s is None else timeout_s
        try:
            if timeout_s is None:
                return call()
            _set_pg_timeout(datetime.timedelta(seconds=timeout_s))
            try:
                return call()
            finally:
                _set_pg_timeout(datetime.timedelta(seconds=self._timeout_s))
        except (RuntimeError, dist.DistBackendError) as exc:
            raise GroupBroken(f"rank {self.rank} of job {self.spec.job}: {what} failed (a peer "
                              f"died, hung past {limit:g}s or left): {exc}{self._stale()}",
                              self.group_rows) from exc

    def _stale(self) -> str:
        """Asked as this rank's group broke: "" while its forming is still the job's group, else
        why not, for the rank's error (``antdt_sync_rank`` with the rank's generation: a rank
        cut off until the master formed the group again without it is refused, and the refusal
        counted). Asked again while the scheduler does not answer (the rank may be cut off from
        it too), for at most ``antdt.sync-steps.form-timeout``. Nothing is asked of a rank
        whose group was not formed through the rendezvous (generation 0)."""
        if self.generation == 0:
            return ""
        deadline = time.monotonic() + self._form_s
        while True:
            try:
                reply = sync(self.worker.loop, self.worker.scheduler.antdt_sync_rank,
                             job=self.spec.job, worker=self.worker.address,
                             generation=self.generation)
            except (OSError, RuntimeError) as exc:  # unreachable, or the worker is closing
                if time.monotonic() >= deadline:
                    return (f"; the scheduler did not answer within {self._form_s:g}s whether "
                            f"the group formed again: {exc!r}")
                time.sleep(STALE_RETRY_S)
                continue
            return "" if reply.get("status") == "OK" else f"; {reply.get('message')}"

    def saving_s(self) -> float:
        """How long gathering or writing the whole model may take: the collective timeout, plus
        its bytes at ``antdt.sync-steps.write-rate`` (a big model's slowest rank may still be
        writing its part when the others reach the next collective)."""
        assert self.trainer is not None
        return self._timeout_s + self.trainer.state_bytes() / self._write_rate

    def _checkpoint(self, agent: AgentParts, asker: int, request: _Request | None) -> None:
        """Every rank at this step boundary: report every trained row (their steps completed),
        wait for the others to have done so, then the model's state goes to the asking rank,
        which copies the ledger in between: the two hold exactly the same rows. A model too
        large for the asking rank is written by every rank into the checkpoint's folder (the
        asker's, sent to the others) instead. ``request``: the asking rank's, as it read it
        for the header (the asking thread may have given up on it since: it is written all the
        same, every rank being in it)."""
        if request is not None:
            request.taken.set()
        agent.shards.flush()
        self._collective(dist.barrier, "the checkpoint's barrier")
        ledger: Mapping[str, Any] | None = None
        if request is not None:
            try:
                ledger = request.copy_ledger()
            except BaseException as exc:  # handed to the asking thread, training goes on
                request.error = CheckpointError(f"copying the ledger failed: {exc!r}")
        assert self.trainer is not None
        trainer = self.trainer
        state: Any = None
        try:
            if trainer.gather_refusal(asker) is None:
                state = self._collective(lambda: trainer.full_state(asker),
                                         "the checkpoint's gather", self.saving_s())
            else:
                folder = [None if request is None else request.folder]
                self._collective(lambda: dist.broadcast_object_list(folder, src=asker),
                                 "the checkpoint's folder")
                try:
                    state = self._write(str(folder[0]), "the checkpoint's shards")
                except OSError as exc:  # every rank has it; the checkpoint fails, training goes on
                    if request is not None:
                        request.error = exc
        except GroupBroken as exc:
            if request is not None:
                request.error = exc
            raise
        finally:
            if request is not None:
                if ledger is not None and request.error is None:
                    request.result = (ledger, state)
                elif request.error is None:
                    request.error = CheckpointError("the checkpoint was interrupted")
                with self._lock:
                    if self._request is request:
                        self._request = None
                request.done.set()

    def _write(self, folder: str, what: str) -> SavedModel:
        """Every rank writes its part of the model into ``folder``; the files of all."""
        assert self.trainer is not None
        trainer = self.trainer
        return SavedModel(folder, self._collective(lambda: trainer.write_shards(folder), what,
                                                   self.saving_s()))

    # ---- the rest of WorkerMode ---------------------------------------------------------------

    def step(self, batch: Any, rows_after: int) -> float:
        raise SyncError("the synchronous mode trains in its own step loop, not the lease loop")

    def checkpoint(self, copy_ledger: Callable[[], Mapping[str, Any]], folder: str
                   ) -> tuple[Mapping[str, Any], Any]:
        """Asked from another thread: every rank writes its part at the next step boundary
        (:meth:`_checkpoint`). Waits for the boundary at most the collective timeout (the
        request is then withdrawn, unless the training thread took it meanwhile), then for the
        checkpoint at most :meth:`saving_s` and the timeout again (the gather or the writes
        and the barrier before them)."""
        with self._lock:
            if self._request is not None:
                raise CheckpointError(f"job {self.spec.job}: a checkpoint is already being "
                                      "taken on this rank")
            request = self._request = _Request(copy_ledger, folder)
        if not request.taken.wait(self._timeout_s):
            with self._lock:
                if self._request is request:
                    self._request = None
            raise CheckpointError(f"job {self.spec.job}: rank {self.rank} reached no step "
                                  f"boundary within {self._timeout_s:g}s")
        limit = self._timeout_s + self.saving_s()
        if not request.done.wait(limit):
            raise CheckpointError(
                f"job {self.spec.job}: the checkpoint did not finish within {limit:.0f}s (the "
                f"collective timeout twice and the model's {self._model_size()} at "
                f"antdt.sync-steps.write-rate, {format_bytes(self._write_rate)}/s: raise it "
                "if the workers write slower)")
        if request.error is not None or request.result is None:
            raise CheckpointError(f"job {self.spec.job}: the checkpoint failed: "
                                  f"{request.error}") from request.error
        return request.result

    def _model_size(self) -> str:
        trainer = self.trainer
        return "?" if trainer is None else format_bytes(trainer.state_bytes())

    def finish(self) -> Trainer[Any] | SavedModel | None:
        """The final model goes to rank 0, which keeps a single-process trainer over it; a model
        too large for rank 0 is written by every rank into a folder of this forming of the
        group, which rank 0 then puts in place of the job's ``model_dir`` (so a group formed
        again after a finish that failed half-way never mixes its files with an older one's),
        and hands on. The rank leaves the group whatever happens."""
        try:
            assert self.trainer is not None
            trainer = self.trainer
            if trainer.gather_refusal(0) is None:
                state = self._collective(lambda: trainer.full_state(0),
                                         "gathering the final model", self.saving_s())
                return trainer.final(state) if self.rank == 0 else None
            assert self.spec.model_dir is not None, "refused in start()"
            written = f"{self.spec.model_dir}.{self.token}"
            saved = self._write(written, "writing the final model")
            if self.rank != 0:
                return None
            publish(written, self.spec.model_dir)
            return SavedModel(self.spec.model_dir, saved.files)
        finally:
            self.leave()

    def stop(self) -> None:
        """A checkpoint waiting for a boundary will not get one."""
        request = self._request
        if request is not None:
            request.error = GroupBroken("the rank stopped training", self.group_rows)
            request.taken.set()
            request.done.set()

    def leave(self) -> None:
        """Leave the process group this rank joined (a later job, or this one formed again,
        makes a new one); a group another job's rank made here stays. Idempotent."""
        self.trainer = None
        if self._joined:
            self._joined = False
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            finally:
                PROCESS_GROUP.release(self.spec.job)

    def check(self) -> None:
        """No thread of its own can fail."""


GLOO_INTERFACE = "GLOO_SOCKET_IFNAME"


def gloo_on(host: str) -> None:
    """gloo's ranks in this process listen on, and tell their peers, the network interface that
    holds ``host`` (the Dask worker's own address: on a cluster of hosts, or of network
    namespaces, the one its peers reach it at). Left to gloo when an operator set
    ``GLOO_SOCKET_IFNAME`` or no interface holds ``host`` (an address behind NAT): gloo then
    takes the address the machine's hostname resolves to, which may be one its peers cannot
    reach (``127.0.0.1`` where ``/etc/hosts`` says so)."""
    interface = interface_of(host)
    if interface is not None and os.environ.get(GLOO_INTERFACE, interface) == interface:
        os.environ[GLOO_INTERFACE] = interface


def interface_of(host: str) -> str | None:
    """The name of the network interface that holds address ``host``, or None."""
    try:
        wanted = ipaddress.ip_address(host)
    except ValueError:
        return None
    family = socket.AF_INET if wanted.version == 4 else socket.AF_INET6
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == family \
                    and ipaddress.ip_address(address.address.split("%")[0]) == wanted:
                return name
    return None


def publish(written: str, folder: str) -> None:
    """Put the folder ``written`` in place of ``folder`` (a local path or fsspec URL): the old
    one is moved aside first and deleted last, so a failure half-way leaves one of the two
    whole; other forms' leftovers beside it (``<folder>.<token>``) go too."""
    fs, path = fsspec.core.url_to_fs(folder)
    _, source = fsspec.core.url_to_fs(written)
    aside = f"{path}.replaced"
    if fs.exists(aside):
        fs.rm(aside, recursive=True)
    if fs.exists(path):
        fs.mv(path, aside, recursive=True)
    fs.mv(source, path, recursive=True)
    for stale in fs.glob(f"{path}.*"):
        fs.rm(stale, recursive=True)
