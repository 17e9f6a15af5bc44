"""The agent (AntDT's Agent): one long-running Dask task per worker that trains the rows the
sharding service leases to it.

```
 master ── submit(run_agent, spec, make_trainer, make_reader, workers=[addr]) ──► worker
 run_agent:  secede from the worker's thread pool (a long-running service, not a task)
             trainer = make_trainer(device); reader = make_reader()
             async mode: ReplicaSync(dense, tables) + BackgroundSync (antdt.sync.background)
   loop:     lease ─► read rows [offset, end) ─► step (under the replica lock, once the
             replica is not too far ahead of its sync rounds) ─► touch ─► commit
             Claim: go on   Revoked: finish the claim, lease again   Finished: lease again
             Stop: the job was stopped   (no lease left: the job finished)
   end:      finished: final sync round (replicas identical), keep the trainer for the master
             stopped / cancelled: stop syncing, give the leases back
```

``antdt`` knows nothing of models or data: the training step and the reader are handed in as
factories (:class:`TrainerFactory`, :class:`ReaderFactory`) that the worker calls, so only small
picklable recipes travel, never a model.

Cancellation is cooperative (a running Dask task cannot be interrupted): :func:`cancel_here`
sets a flag in this module's worker plugin (:class:`AgentPlugin`); the agent checks it between
batches and while it hangs. An agent waiting for a lease returns when the job is stopped
(:func:`antdt.sharding.service.stop_job`), so a master that aborts does both. An agent secedes
from its worker's thread pool, so agents of several jobs, and the jobs' other tasks, run on one
worker side by side.

Fault injection (tests and benchmarks; off by default, see :class:`Faults`): a slowdown factor
(after each batch, sleep ``(factor - 1)`` x the batch's measured time), a hang (stop making
progress after some rows, until cancelled), a pause (before leasing again after some rows, wait
for a named Dask ``Event``: a test's gate) and a crash (``os._exit`` of the worker process after
some rows, which looks like a real death to the scheduler and the nanny).

Progress reaches the job's master as Dask events (topic :func:`event_topic`), no extra RPC to
wait on: ``progress`` every ``antdt.agent.report-interval`` (rows, busy seconds, loss,
samples/s), ``lease`` at the start and end of every lease (wall-clock times, rows, ``finished`` /
``revoked`` or the agent's outcome; the job's timeline is drawn from them), ``fault`` when a hang
or a pause fires, and ``log`` for each warning or error the agent's training and sync threads
log (``antdt logs`` shows them). The per-batch timings reach the monitor through the commits
(``busy_s``, ``batches``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

import torch
from distributed import Client, Event, Future, Worker, get_worker, secede
from distributed.diagnostics.plugin import WorkerPlugin
from distributed.utils import sync
from tornado.ioloop import PeriodicCallback

from antdt import config
from antdt.device import FROZEN_HEAP, pick_device, prepare_process
from antdt.errors import AntdtError, ConfigError, SyncError
from antdt.monitor import BATCHES, BUSY
from antdt.sharding import Claim, Finished, Lease, Revoked, Stop
from antdt.sharding.client import ShardClient
from antdt.sync import DEFAULT_PERIOD, ReplicaSync, SyncPeriod
from antdt.sync.background import BackgroundSync

logger = logging.getLogger(__name__)

PLUGIN_NAME = "antdt-agent"
"""``worker.plugins[PLUGIN_NAME]``: the :class:`AgentPlugin`."""

PROFILER_CALLBACKS = ("profile", "profile-cycle")
"""A Dask worker's periodic callbacks of its statistical profiler."""

CRASH_EXIT_CODE = 75
"""Exit status of a worker process killed by the crash fault."""

PAUSE_POLL_S = 0.2
"""A paused agent checks its cancellation flag (and starts a sync round) this often while it
waits for its event."""

Outcome = Literal["finished", "stopped", "cancelled", "declined"]
"""How an agent ended: the job ``finished`` (final sync done, trainer kept for the driver), the
job was ``stopped`` early, the driver ``cancelled`` the agent, or a joiner ``declined``: it could
not join the running job's model sync (typically the final round had formed), trained nothing."""

B_co = TypeVar("B_co", covariant=True)
B_contra = TypeVar("B_contra", contravariant=True)


def pause_profiler(worker: Worker) -> list[PeriodicCallback]:
    """Stop ``worker``'s statistical profiler (from any thread); return what was stopped."""
    paused = [callback for name in PROFILER_CALLBACKS
              if (callback := worker.periodic_callbacks.get(name)) is not None
              and callback.is_running()]
    for callback in paused:
        worker.loop.add_callback(callback.stop)
    return paused


def resume_profiler(worker: Worker, paused: list[PeriodicCallback]) -> None:
    """Start again what :func:`pause_profiler` stopped."""
    for callback in paused:
        worker.loop.add_callback(callback.start)


class Reader(Protocol[B_co]):
    """Turns rows ``[start, stop)`` of one row group into a batch (e.g. ``data.reader``)."""

    def read(self, path: str, row_group: int, start: int, stop: int) -> B_co: ...


class Trainer(Protocol[B_contra]):
    """One worker's model and its training step (e.g. a wrapper of ``models.TrainStep``).

    ``dense`` and ``tables`` are the live tensors the async mode synchronises in place: the dense
    parameters (updated by the step's optimiser) and the embedding tables ``(num_rows, dim)``
    (views of the storage the step updates). ``touched(batch)`` names, per table, the row ids
    ``(k,)`` int64 the step on ``batch`` changes. ``state()`` is what the driver fetches at the
    end (e.g. the model's weights on the CPU). ``checkpoint_state(tables)`` is everything a
    resumed job needs to go on exactly (weights and every optimiser's state, tensors copied:
    training goes on while it is written), with ``tables`` (same names and shapes as
    :meth:`tables`) in place of the live tables when given, and ``restore_state(state)`` puts it
    back in place (before the replica is built on the tables).
    """

    def step(self, batch: B_contra) -> float: ...

    def touched(self, batch: B_contra) -> Mapping[str, torch.Tensor]: ...

    def dense(self) -> Sequence[torch.Tensor]: ...

    def tables(self) -> Mapping[str, torch.Tensor]: ...

    def state(self) -> Any: ...

    def checkpoint_state(self, tables: Mapping[str, torch.Tensor] | None = None) -> Any: ...

    def restore_state(self, state: Any) -> None: ...


class TrainerFactory(Protocol):
    """Builds the trainer on the worker, on ``device``; must be picklable."""

    def __call__(self, device: torch.device) -> Trainer[Any]: ...


class ReaderFactory(Protocol):
    """Builds the reader on the worker; must be picklable."""

    def __call__(self) -> Reader[Any]: ...


@dataclass(frozen=True)
class Faults:
    """Injected faults of one agent (all off by default).

    ``slowdown``: after each batch sleep ``(slowdown - 1)`` x its measured time (a straggler);
    ``slow_for_rows``: only for the first this many rows (a transient straggler; None: always).
    ``hang_after_rows``: once this many rows are trained, make no more progress until cancelled.
    ``crash_after_rows``: once this many rows are trained, ``os._exit`` the worker process.
    ``pause_until``: the name of a Dask ``Event``; once ``pause_after_rows`` rows (default 0) are
    trained, the agent waits for it before its next lease, holding no lease meanwhile (a test
    gates a worker on an explicit event rather than on its speed).
    """

    slowdown: float = 1.0
    hang_after_rows: int | None = None
    crash_after_rows: int | None = None
    slow_for_rows: int | None = None
    pause_until: str | None = None
    pause_after_rows: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.slowdown, bool) or not isinstance(self.slowdown, (int, float)) \
                or not math.isfinite(self.slowdown) or self.slowdown < 1.0:
            raise ConfigError(f"fault slowdown must be a finite number >= 1, found "
                              f"{self.slowdown!r}")
        for name in ("hang_after_rows", "crash_after_rows", "slow_for_rows", "pause_after_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ConfigError(f"fault {name} must be an int >= 0 or None, found {value!r}")
        if self.pause_until is not None and (not isinstance(self.pause_until, str)
                                             or not self.pause_until):
            raise ConfigError(f"fault pause_until must be the name of a Dask Event or None, "
                              f"found {self.pause_until!r}")

    @property
    def active(self) -> bool:
        return (self.slowdown > 1.0 or self.hang_after_rows is not None
                or self.crash_after_rows is not None or self.pause_until is not None)


@dataclass(frozen=True)
class AgentSpec:
    """What one agent does: train ``job``'s leases in batches of ``batch_rows`` rows.

    ``sync_period``: the async mode's background sync period; None trains without model sync
    (every trained row counts as synced: one model per worker, for tests and the local modes).
    ``join``: the worker joined a running job; it copies a live member's model before training
    (:meth:`antdt.sync.background.BackgroundSync.start`). ``threads``: torch threads. ``device``:
    forced device (default: :func:`antdt.device.pick_device` on the worker: cuda when it has a
    GPU).
    """

    job: str
    batch_rows: int
    sync_period: SyncPeriod | None = DEFAULT_PERIOD
    join: bool = False
    threads: int = 1
    device: str | None = None
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if isinstance(self.batch_rows, bool) or not isinstance(self.batch_rows, int) \
                or self.batch_rows < 1:
            raise ConfigError(f"agent batch_rows must be an int >= 1, found {self.batch_rows!r}")
        if self.sync_period is not None and not isinstance(self.sync_period, SyncPeriod):
            raise ConfigError(f"agent sync_period must be a SyncPeriod or None, found "
                              f"{self.sync_period!r}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1:
            raise ConfigError(f"agent threads must be an int >= 1, found {self.threads!r}")


@dataclass(frozen=True)
class AgentReport:
    """What an agent returns to the driver.

    ``rows``/``batches``: trained by this agent (rows later re-queued after its death are not its
    rows any more, but a returned agent did not die). ``seconds``: the whole task; ``busy_s``:
    reading and training (injected slowdown included); ``cpu_s``: the CPU time the training
    thread spent in them (against ``busy_s``, the share of a core it got: on a loaded machine
    the threads beside it take the rest). ``loss``: mean batch loss (nan: no batch).
    ``joined_from``: the member whose model a joiner copied. ``sync_wait_s``: seconds training
    waited for sync rounds (the replica was too far ahead; part of ``busy_s``).
    """

    worker: str
    outcome: Outcome
    rows: int
    batches: int
    leases: int
    seconds: float
    busy_s: float
    loss: float
    exchanges: int
    device: str
    joined_from: str | None = None
    sync_wait_s: float = 0.0
    cpu_s: float = 0.0


def event_topic(job: str) -> str:
    """The Dask event topic an agent of ``job`` reports its progress on."""
    return f"antdt-agent-{job}"


# ---- worker plugin: cancellation flags and finished trainers ----------------------------------


class AgentPlugin(WorkerPlugin):
    """Per worker: each job's cancellation flag, its running agent (a checkpoint copies its
    model), and the trainer of a finished agent until the job's master is done with it (it
    evaluates and logs the model here) and forgets the job (:func:`forget_here`)."""

    name = PLUGIN_NAME
    idempotent = True  # registering again (another job, another driver) keeps the state

    def __init__(self) -> None:
        self._cancel: dict[str, threading.Event] = {}
        self._trainers: dict[str, Trainer[Any]] = {}
        self._running: dict[str, Agent] = {}
        self._lock = threading.Lock()
        self._paused: list[PeriodicCallback] = []  # Dask's profiler, while agents train

    def __reduce__(self) -> tuple[type[AgentPlugin], tuple[()]]:
        """Registration ships a new plugin: its state lives on one worker only."""
        return AgentPlugin, ()

    def begin(self, job: str, agent: Agent) -> None:
        """``agent`` of ``job`` trains here from now on. The first agent pauses the worker's
        statistical profiler unless ``antdt.agent.dask-profiler``: it walks the training
        thread's stack 100 times a second (a few percent of a core, and the GIL), and the
        agents report their own batch times."""
        keep = config.flag("antdt.agent.dask-profiler")
        with self._lock:
            self._running[job] = agent
            if len(self._running) > 1 or keep:
                return
            self._paused = pause_profiler(agent.worker)

    def end(self, job: str, worker: Worker) -> None:
        """``job``'s agent stopped training here; the last one resumes what :meth:`begin`
        paused."""
        with self._lock:
            self._running.pop(job, None)
            if self._running:
                return
            resume_profiler(worker, self._paused)
            self._paused = []

    def cancelled(self, job: str) -> threading.Event:
        """``job``'s cancellation flag on this worker (made on first use, set by the driver)."""
        return self._cancel.setdefault(job, threading.Event())

    def keep(self, job: str, trainer: Trainer[Any]) -> None:
        self._trainers[job] = trainer

    def trainer(self, job: str) -> Trainer[Any]:
        """The trainer the finished agent of ``job`` left on this worker."""
        trainer = self._trainers.get(job)
        if trainer is None:
            raise AntdtError(f"no finished agent of job {job!r} on this worker; finished jobs "
                             f"here: {sorted(self._trainers)}")
        return trainer

    def state(self, job: str) -> Any:
        return self.trainer(job).state()

    def checkpoint_state(self, job: str, copy_ledger: Callable[[], Mapping[str, Any]]
                         ) -> tuple[Mapping[str, Any], Any]:
        """A checkpoint of ``job``'s agent training here: ``copy_ledger()`` (the job's ledger,
        with every worker's synced rows under ``synced``) and the agent's
        :meth:`Trainer.checkpoint_state`, taken between two steps. In the async mode both under
        the replica lock, the ledger copied after it was taken, so the tables written are
        exactly the rows that copy counts done (:meth:`ReplicaSync.committed_tables`); the
        dense part and the optimisers' state are this replica's as they are."""
        agent = self._running.get(job)
        if agent is None:
            raise AntdtError(f"no agent of job {job!r} is training on this worker; training "
                             f"here: {sorted(self._running)}")
        if agent.replica is None:
            return copy_ledger(), agent.trainer.checkpoint_state()
        with agent.replica.lock:
            ledger = copy_ledger()
            tables = agent.replica.committed_tables(ledger["synced"])
            return ledger, agent.trainer.checkpoint_state(tables)

    def forget(self, job: str) -> None:
        self._cancel.pop(job, None)
        self._trainers.pop(job, None)
        self._running.pop(job, None)


def plugin_of(worker: Worker) -> AgentPlugin:
    """``worker``'s :class:`AgentPlugin`."""
    plugin = worker.plugins.get(PLUGIN_NAME)
    if not isinstance(plugin, AgentPlugin):
        raise AntdtError(f"worker {worker.address} has no {PLUGIN_NAME!r} plugin: call "
                         "antdt.agent.register(client) before starting agents")
    return plugin


def cancel_here(job: str, dask_worker: Worker) -> None:
    """Ask this worker's agent of ``job`` to stop at its next check (``client.run``)."""
    plugin_of(dask_worker).cancelled(job).set()


def forget_here(job: str, dask_worker: Worker) -> None:
    """Drop ``job``'s flag and finished trainer on this worker (``client.run``)."""
    plugin_of(dask_worker).forget(job)


def _state_here(job: str, dask_worker: Worker) -> Any:
    return plugin_of(dask_worker).state(job)


# ---- driver helpers ---------------------------------------------------------------------------


def register(client: Client) -> None:
    """Put :class:`AgentPlugin` on every worker, present and future (idempotent)."""
    client.register_plugin(AgentPlugin())


def start_agent(client: Client, worker: str, spec: AgentSpec, make_trainer: TrainerFactory,
                make_reader: ReaderFactory) -> Future:
    """Submit one agent pinned to ``worker``; its result is an :class:`AgentReport`."""
    future: Future = client.submit(run_agent, spec, make_trainer, make_reader, workers=[worker],
                                   allow_other_workers=False, pure=False)
    return future


def cancel_agents(client: Client, job: str, workers: Sequence[str] | None = None) -> None:
    """Ask ``job``'s agents (on ``workers``, default all) to stop at their next check."""
    client.run(cancel_here, job, workers=list(workers) if workers is not None else None,
               on_error="ignore")


def fetch_state(client: Client, job: str, worker: str) -> Any:
    """The ``state()`` of the trainer a finished agent of ``job`` left on ``worker``."""
    return client.run(_state_here, job, workers=[worker])[worker]



# ---- the task ---------------------------------------------------------------------------------


def run_agent(spec: AgentSpec, make_trainer: TrainerFactory,
              make_reader: ReaderFactory) -> AgentReport:
    """The agent task (see the module docstring); runs on the worker it was pinned to, out of
    the worker's thread pool."""
    secede()
    return Agent(spec, make_trainer, make_reader).run()


class Agent:
    """One worker's training loop; :func:`run_agent` runs it as a Dask task.

    ``worker`` defaults to the worker running the calling task.
    """

    def __init__(self, spec: AgentSpec, make_trainer: TrainerFactory,
                 make_reader: ReaderFactory, *, worker: Worker | None = None) -> None:
        self.spec = spec
        self.worker = worker if worker is not None else get_worker()
        self._plugin = plugin_of(self.worker)
        self.cancelled = self._plugin.cancelled(spec.job)
        prepare_process(spec.threads)
        self.device = pick_device(spec.device)
        self.trainer = make_trainer(self.device)
        self.reader = make_reader()
        self.joined_from: str | None = None
        self.replica: ReplicaSync | None = None
        self.sync: BackgroundSync | None = None
        if spec.sync_period is not None:
            self.replica = ReplicaSync(self.worker.address, self.trainer.dense(),
                                       self.trainer.tables())
            self.sync = BackgroundSync(self.replica, spec.job, worker=self.worker,
                                       period=spec.sync_period)
        self._lease_reads: int | None = None
        """While leasing: how often the ShardClient read the synced rows (None: not leasing)."""
        self.shards = ShardClient(spec.job, worker=self.worker,
                                  synced_rows=None if self.sync is None else self._synced_rows,
                                  confirmed=None if self.replica is None else self.replica.confirm)
        self.rows = self.batches = self.leases = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self._loss_sum = 0.0
        self._report_every = config.seconds("antdt.agent.report-interval")
        self._paused = False
        self._window = _Window(time.perf_counter())

    def run(self) -> AgentReport:
        """Train until the job finishes or stops or the agent is cancelled; then end cleanly."""
        started = time.perf_counter()
        logger.info("agent of job %s on %s (%s) starting", self.spec.job, self.worker.address,
                    self.device)
        forward = _ForwardLogs(self)
        logging.getLogger("antdt").addHandler(forward)
        self._plugin.begin(self.spec.job, self)
        try:
            with FROZEN_HEAP:
                try:
                    outcome = self._join_sync()
                    if outcome is None:
                        outcome = self._train()
                except BaseException:
                    self._abandon()
                    raise
                finally:
                    self._plugin.end(self.spec.job, self.worker)
                self._end(outcome)
        finally:
            logging.getLogger("antdt").removeHandler(forward)
        self._report(force=True)
        report = AgentReport(
            worker=self.worker.address, outcome=outcome, rows=self.rows, batches=self.batches,
            leases=self.leases, seconds=time.perf_counter() - started, busy_s=self.busy_s,
            loss=self._loss_sum / self.batches if self.batches else math.nan,
            exchanges=self.sync.exchanges if self.sync is not None else 0,
            device=str(self.device), joined_from=self.joined_from,
            sync_wait_s=self.sync.waited_s if self.sync is not None else 0.0, cpu_s=self.cpu_s)
        logger.info("agent of job %s on %s %s: %d rows in %d batches, %.1fs", self.spec.job,
                    self.worker.address, outcome, report.rows, report.batches, report.seconds)
        return report

    # ---- the loop -----------------------------------------------------------------------------

    def _join_sync(self) -> Outcome | None:
        """Start the background sync; a joiner first copies a live member's model. None: train;
        ``declined``: the joiner could not join (it has left the sync again by then)."""
        if self.sync is None:
            return None
        try:
            source = self.sync.start(join=self.spec.join)
        except SyncError as exc:
            if not self.spec.join:
                raise
            logger.warning("agent of job %s on %s cannot join the running job: %s",
                           self.spec.job, self.worker.address, exc)
            return "declined"
        if source is not None:
            logger.info("agent of job %s on %s joined with %s's model", self.spec.job,
                        self.worker.address, source)
        self.joined_from = source
        return None

    def _train(self) -> Outcome:
        while not self.cancelled.is_set():
            if self._pause():
                return "cancelled"
            self._lease_reads = 0
            try:
                lease = self.shards.lease()
            finally:
                self._lease_reads = None
            if lease is None:
                return "finished" if self._job_state() == "finished" else "stopped"
            self.leases += 1
            outcome = self._train_lease(lease)
            if outcome is not None:
                return outcome
        return "cancelled"

    def _train_lease(self, lease: Lease) -> Outcome | None:
        """Train the lease, reporting its span (start, end, rows, how it ended) as events."""
        started = time.time()
        self._event({"kind": "lease", "phase": "start", "lease_id": lease.lease_id,
                     "time": started})
        rows_before = self.rows
        outcome, revoked = self._train_claims(lease)
        ended = "revoked" if revoked else "finished" if outcome is None else outcome
        self._event({"kind": "lease", "phase": "end", "lease_id": lease.lease_id,
                     "start": started, "time": time.time(), "rows": self.rows - rows_before,
                     "outcome": ended})
        return outcome

    def _train_claims(self, lease: Lease) -> tuple[Outcome | None, bool]:
        """Train the lease's claimed rows batch by batch; None when it is done (lease again),
        and whether the controller revoked it."""
        offset, limit = lease.start, lease.claim_stop
        revoked = False
        while offset < limit:
            if self.cancelled.is_set():
                return "cancelled", revoked
            end = min(offset + self.spec.batch_rows, limit)
            started, cpu_started = time.perf_counter(), time.thread_time()
            batch = self.reader.read(lease.path, lease.row_group, offset, end)
            loss = self._step(batch, end - offset)
            self._slow_down(time.perf_counter() - started)
            busy = time.perf_counter() - started
            self.rows += end - offset
            self.batches += 1
            self.busy_s += busy
            self.cpu_s += time.thread_time() - cpu_started
            self._loss_sum += loss
            self._window.add(end - offset, loss)
            reply = self.shards.commit(end, stats={BUSY: busy, BATCHES: 1.0})
            offset = end
            self._report(force=self.batches == 1)  # followers see training begin at once
            if self._faults_fire():
                return "cancelled", revoked
            if isinstance(reply, (Claim, Revoked)):
                limit = reply.stop
                revoked = revoked or isinstance(reply, Revoked)
            elif isinstance(reply, Finished):
                return None, revoked
            elif isinstance(reply, Stop):
                return "stopped", revoked
        return None, revoked

    def _step(self, batch: Any, rows: int) -> float:
        """One training step; in the async mode once the replica is not too far ahead of its
        sync rounds and under the replica lock (waits for either count as busy time, as the
        monitor judges a worker by its pace), marking the touched rows with the worker's stream
        offset after this batch (what the ledger will hold) before the lock is released: a
        round's entry then holds whole batches, each counted in its offset."""
        if self.replica is None:
            return self.trainer.step(batch)
        touched = self.trainer.touched(batch)
        assert self.sync is not None
        self.sync.before_step()  # the replica may not run too far ahead of its sync rounds
        with self.replica.lock.training():
            loss = self.trainer.step(batch)
            self.replica.touch(touched, self.shards.trained_rows + rows)
        self.sync.batch_done()
        return loss

    def _synced_rows(self) -> int:
        """The ShardClient's synced-rows source in the async mode, read before each report
        (:meth:`ReplicaSync.ledger_offset`: a worker without live peers publishes first).

        While waiting for a lease (the ledger said "wait" at least once: every trained row is in
        the ledger) the agent publishes its newest deltas itself, instead of only in group
        exchanges, and hurries the background sync (:meth:`BackgroundSync.hurry`): the job may
        be waiting only for these rows, and the next periodic round can be a second away. The
        first read of a lease call does neither: leasing the next shard must not wait for a
        copy of the touched rows.
        """
        assert self.sync is not None and self.replica is not None
        self.sync.raise_if_failed()  # a dead sync thread would leave the leases draining forever
        publish = bool(self._lease_reads)
        if self._lease_reads is not None:
            self._lease_reads += 1
        synced = self.replica.ledger_offset(publish=publish)
        if publish:
            self.sync.hurry()
        return synced

    # ---- faults -------------------------------------------------------------------------------

    def _slow_down(self, batch_s: float) -> None:
        faults = self.spec.faults
        if faults.slow_for_rows is not None and self.rows >= faults.slow_for_rows:
            return
        extra = (faults.slowdown - 1.0) * batch_s
        if extra > 0:
            self.cancelled.wait(extra)

    def _pause(self) -> bool:
        """Once ``pause_after_rows`` rows are trained, wait (once) for the Dask Event
        ``pause_until``; True when the agent was cancelled meanwhile. The paused agent's sync
        keeps exchanging meanwhile: a peer's rows count as synced only once every member pulled
        them, and a peer that pauses later waits for that (:meth:`_await_synced`)."""
        faults = self.spec.faults
        if faults.pause_until is None or self._paused or self.rows < faults.pause_after_rows:
            return False
        self._paused = True
        self._await_synced()
        self.shards.flush()  # the last lease's last commit would ride on the next lease call
        logger.warning("agent of job %s on %s: injected pause after %d rows until event %r",
                       self.spec.job, self.worker.address, self.rows, faults.pause_until)
        self._event({"kind": "fault", "fault": "pause", "rows": self.rows})
        event = Event(faults.pause_until)
        while True:
            if self.sync is not None:
                self.sync.hurry()
            if event.wait(PAUSE_POLL_S):
                return False
            if self.cancelled.is_set():
                return True

    def _await_synced(self) -> None:
        """Before a pause: wait (at most ``antdt.sync.rpc-timeout``) until the peers have this
        agent's rows, so a paused job's ledger counts them done (a test's state is settled)."""
        if self.sync is None or self.replica is None:
            return
        deadline = time.perf_counter() + config.seconds("antdt.sync.rpc-timeout")
        while self.sync.synced_offset < self.replica.rows_offset \
                and time.perf_counter() < deadline and not self.cancelled.is_set():
            self.sync.hurry()
            self.cancelled.wait(PAUSE_POLL_S / 10)

    def _faults_fire(self) -> bool:
        """Crash or hang once their row counts are reached; True when a hang was cancelled."""
        faults = self.spec.faults
        if faults.crash_after_rows is not None and self.rows >= faults.crash_after_rows:
            logger.warning("agent of job %s on %s: injected crash after %d rows",
                           self.spec.job, self.worker.address, self.rows)
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        if faults.hang_after_rows is not None and self.rows >= faults.hang_after_rows:
            logger.warning("agent of job %s on %s: injected hang after %d rows", self.spec.job,
                           self.worker.address, self.rows)
            self._event({"kind": "fault", "fault": "hang", "rows": self.rows})
            self.cancelled.wait()
            return True
        return False

    # ---- the end ------------------------------------------------------------------------------

    def _end(self, outcome: Outcome) -> None:
        """Finished: take part in the final sync round (every replica ends identical) and keep
        the trainer for the driver. Otherwise stop syncing, make the last report and give the
        leases back (their unsynced rows are queued again), then leave the sync: its peers take
        this replica's entries past the last report out again."""
        if outcome == "finished":
            if self.sync is not None:
                self.sync.finish()
            self.shards.close()
            self._plugin.keep(self.spec.job, self.trainer)
            return
        if self.sync is not None and outcome != "declined":
            self.sync.stop()
        self.shards.close()
        if self.sync is not None and outcome != "declined":
            self.sync.leave()
            self.sync.raise_if_failed()

    def _abandon(self) -> None:
        """The loop raised: stop syncing, give the leases back and leave the sync if the
        services still answer (the error that got us here is what propagates; these are only
        logged)."""
        try:
            if self.sync is not None:
                self.sync.stop()
            self.shards.close()
            if self.sync is not None:
                self.sync.leave()
        except (AntdtError, OSError) as exc:
            logger.warning("agent of job %s on %s: clean-up after a failure failed too: %r",
                           self.spec.job, self.worker.address, exc)

    def _job_state(self) -> str:
        reply: dict[str, Any] = sync(self.worker.loop, self.worker.scheduler.antdt_job_state,
                                     job=self.spec.job)
        state: str = reply.get("state", "unknown")
        return state

    # ---- progress -----------------------------------------------------------------------------

    def _report(self, force: bool = False) -> None:
        """Every ``antdt.agent.report-interval``: rows, mean loss and rate since the last report,
        as a Dask event the driver reads."""
        now = time.perf_counter()
        window = self._window
        if not force and now - window.start < self._report_every:
            return
        if window.batches or force:
            elapsed = max(now - window.start, 1e-9)
            self._event({
                "kind": "progress", "rows": self.rows, "batches": self.batches,
                "busy_s": self.busy_s, "cpu_s": self.cpu_s, "window_rows": window.rows,
                "loss": window.loss / window.batches if window.batches else None,
                "samples_per_s": window.rows / elapsed})
        self._window = _Window(now)

    def _event(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` (with this worker's address) to the driver on the job's event topic."""
        self.worker.log_event(event_topic(self.spec.job), {**msg, "worker": self.worker.address})


class _ForwardLogs(logging.Handler):
    """Sends the warnings and errors the agent's own threads log (training, and its background
    sync) to its job's event topic, where the job's master keeps them for ``antdt logs``."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(logging.WARNING)
        self.agent = agent
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        sync = self.agent.sync
        if record.thread not in (self.thread, sync.thread_id if sync is not None else None):
            return
        self.agent._event({"kind": "log", "level": record.levelname.lower(),
                           "logger": record.name, "message": record.getMessage()})


@dataclass
class _Window:
    """Rows, batches and summed loss since ``start`` (perf_counter seconds)."""

    start: float
    rows: int = 0
    batches: int = 0
    loss: float = 0.0

    def add(self, rows: int, loss: float) -> None:
        self.rows += rows
        self.batches += 1
        self.loss += loss
