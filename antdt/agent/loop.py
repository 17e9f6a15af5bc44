"""The agent: one long-running Dask task per worker that trains the rows the sharding service
leases to it, in the job's training mode (:mod:`antdt.agent.modes`), and the lease loop of the
replica modes (async, independent).

```
 master ── submit(run_agent, spec, make_trainer, make_reader, workers=[addr]) ──► worker
 run_agent:  secede from the worker's thread pool (a long-running service, not a task)
             mode = worker_mode(...) (it builds the trainer); reader = make_reader()
             mode.start(join); mode.train(agent)
   lease loop (replica modes):  lease ─► read rows [offset, end) ─► mode.step ─► commit
             Claim: go on   Revoked: finish the claim, lease again   Finished: lease again
             Stop: the job was stopped   (no lease left: the job finished)
   end:      finished: mode.finish (the final state forms), keep its trainer for the master
             stopped / cancelled: mode.stop, give the leases back, mode.leave
```
The synchronous mode's step loop is :mod:`antdt.agent.modes.synchronous`; it uses the same parts
(the shard client, the reader, :meth:`Agent.count`, :meth:`Agent.event`).

The ledger learns the rows the mode counts synced before each RPC (``mode.synced_rows``), and
tells the mode what it accepted (``mode.confirm``). An agent waiting for a lease returns when the
job is stopped (:func:`antdt.sharding.service.stop_job`); it checks its cancellation flag
(:func:`antdt.agent.plugin.cancel_here`) between batches. It secedes from its worker's thread
pool, so agents of several jobs, and the jobs' other tasks, run on one worker side by side.

Progress reaches the job's master as Dask events (topic :func:`event_topic`), no extra RPC to
wait on: ``progress`` every ``antdt.agent.report-interval`` (rows, busy seconds, loss,
samples/s, the mode's exchanges and their bytes), ``lease`` at the start and end of every lease (wall-clock times, rows, ``finished`` /
``revoked`` or the agent's outcome; the job's timeline is drawn from them), ``fault`` when a hang
or a pause fires, and ``log`` for each warning or error the agent's training thread and its
mode's threads log (``antdt logs`` shows them). The per-batch timings reach the monitor through
the commits (``busy_s``, ``batches``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from distributed import Worker, get_worker, secede
from distributed.utils import sync

from antdt import config
from antdt.agent.contract import (AgentReport, AgentSpec, Outcome, ReaderFactory, SavedModel,
                                  TrainerFactory, event_topic)
from antdt.agent.faults import FaultInjector
from antdt.agent.modes import Declined, worker_mode
from antdt.agent.plugin import plugin_of
from antdt.device import FROZEN_HEAP, pick_device, prepare_process
from antdt.errors import AntdtError
from antdt.monitor import BATCHES, BUSY, CPU
from antdt.sharding import Claim, Finished, Lease, Revoked, Stop
from antdt.sharding.client import ShardClient

logger = logging.getLogger(__name__)


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
        self.mode = worker_mode(spec, make_trainer, self.device, self.worker)
        self.reader = make_reader()
        self._lease_reads: int | None = None
        """While leasing: how often the ShardClient read the synced rows (None: not leasing)."""
        self.shards = ShardClient(spec.job, worker=self.worker, synced_rows=self._synced_rows,
                                  confirmed=self.mode.confirm)
        self.faults = FaultInjector(spec.faults, f"of job {spec.job} on {self.worker.address}",
                                    self.cancelled, self.event)
        self.rows = self.batches = self.leases = 0
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self._loss_sum = 0.0
        self._report_every = config.seconds("antdt.agent.report-interval")
        self._window = _Window(time.perf_counter())
        self.holds_model = False
        """The finished agent's worker holds the final model (kept for the master)."""
        self.saved_model: SavedModel | None = None
        """The files the finished ranks wrote the final model to (rank 0's agent)."""

    def run(self) -> AgentReport:
        """Train until the job finishes or stops or the agent is cancelled; then end cleanly."""
        started = time.perf_counter()
        logger.info("agent of job %s on %s (%s) starting", self.spec.job, self.worker.address,
                    self.device)
        forward = _ForwardLogs(self)
        logging.getLogger("antdt").addHandler(forward)
        self._plugin.begin(self.spec.job, self.worker, self.mode)
        try:
            with FROZEN_HEAP:
                try:
                    try:
                        outcome = self._start()
                        if outcome is None:
                            outcome = self.mode.train(self)
                    finally:
                        self._plugin.end(self.spec.job, self.worker)
                    self._end(outcome)
                except BaseException:
                    self._abandon()
                    raise
        finally:
            logging.getLogger("antdt").removeHandler(forward)
        self._report(force=True)
        report = AgentReport(
            worker=self.worker.address, outcome=outcome, rows=self.rows, batches=self.batches,
            leases=self.leases, seconds=time.perf_counter() - started, busy_s=self.busy_s,
            loss=self._loss_sum / self.batches if self.batches else math.nan,
            exchanges=self.mode.exchanges, device=str(self.device),
            joined_from=self.mode.joined_from, sync_wait_s=self.mode.waited_s, cpu_s=self.cpu_s,
            holds_model=self.holds_model, saved_model=self.saved_model,
            group_rows=self.mode.group_rows, tables=self.mode.tables_stats())
        logger.info("agent of job %s on %s %s: %d rows in %d batches, %.1fs", self.spec.job,
                    self.worker.address, outcome, report.rows, report.batches, report.seconds)
        return report

    # ---- the loop -----------------------------------------------------------------------------

    def _start(self) -> Outcome | None:
        """Start the mode; a joiner first copies a live member's model. None: train;
        ``declined``: the joiner could not join."""
        try:
            self.mode.start(self.spec.join)
        except Declined as exc:
            logger.warning("agent of job %s on %s cannot join the running job: %s",
                           self.spec.job, self.worker.address, exc)
            return "declined"
        if self.mode.joined_from is not None:
            logger.info("agent of job %s on %s joined with %s's model", self.spec.job,
                        self.worker.address, self.mode.joined_from)
        return None

    def train_leases(self) -> Outcome:
        """The replica modes' loop: lease, train the lease batch by batch, lease again."""
        while not self.cancelled.is_set():
            if self._pause():
                return "cancelled"
            self._lease_reads = 0
            try:
                lease = self.shards.lease()
            finally:
                self._lease_reads = None
            if lease is None:
                return "finished" if self.job_state() == "finished" else "stopped"
            self.leases += 1
            outcome = self._train_lease(lease)
            if outcome is not None:
                return outcome
        return "cancelled"

    def _train_lease(self, lease: Lease) -> Outcome | None:
        """Train the lease, reporting its span (start, end, rows, how it ended) as events."""
        started = time.time()
        self.event({"kind": "lease", "phase": "start", "lease_id": lease.lease_id,
                    "time": started})
        rows_before = self.rows
        outcome, revoked = self._train_claims(lease)
        ended = "revoked" if revoked else "finished" if outcome is None else outcome
        self.event({"kind": "lease", "phase": "end", "lease_id": lease.lease_id,
                    "start": started, "time": time.time(), "rows": self.rows - rows_before,
                    "outcome": ended})
        return outcome

    def _train_claims(self, lease: Lease) -> tuple[Outcome | None, bool]:
        """Train the lease's claimed rows batch by batch; None when it is done (lease again),
        and whether the controller revoked it."""
        offset, limit = lease.start, lease.claim_stop
        batch_rows = lease.batch_rows or self.spec.batch_rows  # the controller's, if it set one
        revoked = False
        while offset < limit:
            if self.cancelled.is_set():
                return "cancelled", revoked
            end = min(offset + batch_rows, limit)
            started, cpu_started = time.perf_counter(), time.thread_time()
            batch = self.reader.read(lease.path, lease.row_group, offset, end)
            loss = self.mode.step(batch, self.shards.trained_rows + end - offset)
            self.faults.slow_down(self.rows, time.perf_counter() - started)
            cpu = time.thread_time() - cpu_started  # read first: CPU time within the wall time
            busy = time.perf_counter() - started
            self.count(end - offset, busy, cpu, loss)
            reply = self.shards.commit(end, stats={BUSY: busy, BATCHES: 1.0, CPU: cpu})
            offset = end
            if self.faults.fire(self.rows):
                return "cancelled", revoked
            if isinstance(reply, (Claim, Revoked)):
                limit = reply.stop
                revoked = revoked or isinstance(reply, Revoked)
            elif isinstance(reply, Finished):
                return None, revoked
            elif isinstance(reply, Stop):
                return "stopped", revoked
        return None, revoked

    def _synced_rows(self) -> int:
        """The ShardClient's synced-rows source, read before each RPC: the mode's
        (:meth:`~antdt.agent.modes.WorkerMode.synced_rows`), told to hurry while the agent waits
        for a lease (the ledger said "wait" at least once: every trained row is in the ledger).
        The first read of a lease call is not waiting: leasing the next shard must not wait for
        a copy of the touched rows."""
        waiting = bool(self._lease_reads)
        if self._lease_reads is not None:
            self._lease_reads += 1
        return self.mode.synced_rows(self.shards.trained_rows, waiting)

    def _pause(self) -> bool:
        """The injected pause, once its rows are trained: the mode settles first (the rows
        trained so far synced), the last lease's last commit goes out (it would ride on the
        next lease call), then the agent waits holding no lease. True when it was cancelled
        meanwhile."""
        if not self.faults.pause_due(self.rows):
            return False
        self.mode.settle(self.cancelled)
        self.shards.flush()
        return self.faults.pause(self.rows, self.mode.waiting)

    # ---- the end ------------------------------------------------------------------------------

    def _end(self, outcome: Outcome) -> None:
        """Finished: the mode forms the final state, and the trainer is kept for the master.
        Otherwise stop the mode, make the last report and give the leases back (their unsynced
        rows are queued again), then leave the mode: its peers take this worker's effect past
        the last report out again."""
        if outcome == "finished":
            final = self.mode.finish()
            self.shards.close()
            if isinstance(final, SavedModel):
                self.saved_model = final
            elif final is not None:
                self._plugin.keep(self.spec.job, final)
                self.holds_model = True
            return
        try:
            self.mode.stop()
            self.shards.close()
        finally:
            self.mode.leave()
        self.mode.check()

    def _abandon(self) -> None:
        """The loop or its end raised: stop the mode, give the leases back if the services still
        answer, and leave the mode whatever happened (a synchronous rank's process group: a group
        left open would refuse the job's next forming on this worker). The error that got us
        here is what propagates; these are only logged."""
        try:
            self.mode.stop()
            self.shards.close()
        except (AntdtError, OSError) as exc:
            logger.warning("agent of job %s on %s: clean-up after a failure failed too: %r",
                           self.spec.job, self.worker.address, exc)
        finally:
            self.mode.leave()

    def job_state(self) -> str:
        reply: dict[str, Any] = sync(self.worker.loop, self.worker.scheduler.antdt_job_state,
                                     job=self.spec.job)
        state: str = reply.get("state", "unknown")
        return state

    # ---- progress -----------------------------------------------------------------------------

    def count(self, rows: int, busy_s: float, cpu_s: float, loss: float) -> None:
        """Count a trained batch (a batch of 0 rows only adds its time) and report progress
        when it is due (at once after the first batch: followers see training begin)."""
        self.rows += rows
        self.busy_s += busy_s
        self.cpu_s += cpu_s
        if rows:
            self.batches += 1
            self._loss_sum += loss
            self._window.add(rows, loss)
        self._report(force=self.batches == 1 and rows > 0)

    def _report(self, force: bool = False) -> None:
        """Every ``antdt.agent.report-interval``: rows, mean loss and rate since the last report,
        as a Dask event the driver reads."""
        now = time.perf_counter()
        window = self._window
        if not force and now - window.start < self._report_every:
            return
        if window.batches or force:
            elapsed = max(now - window.start, 1e-9)
            self.event({
                "kind": "progress", "rows": self.rows, "batches": self.batches,
                "busy_s": self.busy_s, "cpu_s": self.cpu_s, "window_rows": window.rows,
                "loss": window.loss / window.batches if window.batches else None,
                "samples_per_s": window.rows / elapsed, "exchanges": self.mode.exchanges,
                "exchanged_bytes": self.mode.exchanged_bytes,
                "tables": self.mode.tables_stats()})
        self._window = _Window(now)

    def event(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` (with this worker's address) to the driver on the job's event topic."""
        self.worker.log_event(event_topic(self.spec.job), {**msg, "worker": self.worker.address})


class _ForwardLogs(logging.Handler):
    """Sends the warnings and errors the agent's own threads log (training, and its mode's) to
    its job's event topic, where the job's master keeps them for ``antdt logs``."""

    def __init__(self, agent: Agent) -> None:
        super().__init__(logging.WARNING)
        self.agent = agent
        self.thread = threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread and record.thread not in self.agent.mode.threads:
            return
        self.agent.event({"kind": "log", "level": record.levelname.lower(),
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
