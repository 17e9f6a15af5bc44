"""The job driver of the async mode: ``antdt train JOB [--workers N | --scheduler ADDR]``.

It reads top to bottom like the local trainer, with a cluster in the middle::

    validate the data ─► cluster (LocalCluster of Nanny workers, or --scheduler ADDR)
      ─► plugins on the scheduler and every worker (sharding, controller, sync, agent)
      ─► register the job's shards (bad row groups quarantined; dealt to fixed slots when
         ``train.sharding`` is static), switch its straggler controller on or off, its sync group
      ─► one agent task per worker (and per worker that joins later, when it can)
      ─► watch: progress bar and MLflow metrics from the ledger, the controller's actions and
         the agents' events; an agent whose worker died is written off (the ledger re-queued
         its rows)
      ─► the consensus model from one live worker ─► evaluate ─► MLflow (with the timeline PNG
         of leases and actions) ─► summary

The training step and the reader reach the workers as small picklable recipes
(:mod:`pipeline.recipes`); ``antdt`` never imports this package.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging
import math
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from distributed import Client, Future, LocalCluster, wait
from distributed.scheduler import KilledWorker

from antdt import agent, controller
from antdt.errors import AntdtError, DataError
from antdt.sharding import QuarantineSpec, service
from antdt.sync import service as sync_service
from data.files import RowGroup, expand, row_groups
from data.reader import ShardReader
from models.evaluate import evaluate
from models.train_step import TrainStep
from pipeline.config import JobConfig
from pipeline.local import PreparedData, iterate_batches, prepare_data
from pipeline.recipes import ReaderRecipe, TrainerRecipe
from pipeline.report import JobSummary, ProgressSink, oracle_auc
from pipeline.serving import log_ranking_model
from pipeline.timeline import ActionMark, LeaseSpan, render_timeline
from pipeline.tracking import Tracker

logger = logging.getLogger(__name__)

TICK_S = 1.0
"""The driver's watch loop: how often it reads the ledger, the controller's actions, the agents'
events and the workers."""


# ---- the ledger's view of the data -------------------------------------------------------------


@dataclass(frozen=True)
class LedgerPlan:
    """What the sharding service is told: every training row group (bad ones included, so
    their rows are counted) and the bad units of the training files."""

    row_groups: list[tuple[str, int, int]]
    quarantine: list[QuarantineSpec]


def ledger_plan(job: JobConfig, data: PreparedData) -> LedgerPlan:
    """Row groups and quarantine of ``job``'s training files for :func:`antdt.sharding.service.register_job`.

    The validator's bad units of the training files become the ledger's quarantine: a bad row
    group by itself, a bad file with every row group its footer lists (none when it has no
    readable footer: the ledger then records the file with 0 rows).
    """
    train_files = set(expand(list(job.data.train)))
    quarantine: list[QuarantineSpec] = [(p, g, r) for p, g, r in data.quarantine
                                        if p in train_files]
    bad_files = {p for p, g, _ in quarantine if g is None}
    bad_groups = {(p, g) for p, g, _ in quarantine if g is not None}
    extra: list[RowGroup] = []
    for path in sorted({p for p, _, _ in quarantine}):
        try:
            listed = row_groups([path])
        except DataError:
            continue  # no readable footer: the ledger records the file with 0 rows
        extra.extend(g for g in listed if path in bad_files or (path, g.index) in bad_groups)
    groups = [(g.path, g.index, g.num_rows) for g in [*data.train, *extra]]
    return LedgerPlan(groups, quarantine)


# ---- the cluster -------------------------------------------------------------------------------


@contextlib.contextmanager
def connect(workers: int, scheduler: str | None = None) -> Iterator[Client]:
    """A client of the scheduler at ``scheduler``, or of a new LocalCluster of ``workers``
    Nanny-managed worker processes with one thread each (a GPU resource each when this machine
    has CUDA), closed at the end. The cluster's processes log ``distributed`` at this process's
    level (quiet unless ``-v``: :mod:`pipeline.terminal`)."""
    if scheduler is not None:
        with Client(scheduler) as client:
            yield client
        return
    resources = {"GPU": 1} if torch.cuda.is_available() else None
    level = logging.getLogger("distributed").getEffectiveLevel()
    with LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                      dashboard_address=":0", resources=resources,
                      silence_logs=level) as cluster, \
            Client(cluster) as client:
        # The cluster's own view of its workers can miss one that registered while it started;
        # a worker that then dies makes the cluster fail on close (KeyError). Refresh the view.
        cluster.wait_for_workers(workers)
        logger.info("LocalCluster of %d workers, dashboard %s", workers, client.dashboard_link)
        yield client


def ensure_plugins(client: Client) -> None:
    """The sharding service, the straggler controller and the sync service on the scheduler (kept
    if already there, so other jobs' state survives) and the agent plugin on every worker,
    present and future. Run it before any agent starts."""
    for plugin in (service.ShardingService(), controller.ControllerPlugin(),
                   sync_service.SyncService()):
        plugin.idempotent = True
        client.register_plugin(plugin)
    agent.register(client)


def _workers(client: Client) -> dict[str, Mapping[str, Any]]:
    """The scheduler's workers now. Not ``client.scheduler_info()``: the client's periodic
    refresh may replace its cached identity, whose worker list is empty, between that call's
    fetch and its return, and every agent would look dead."""
    identity: dict[str, Any] = client.sync(client.scheduler.identity, n_workers=-1)
    workers: dict[str, Mapping[str, Any]] = identity["workers"]
    return workers


# ---- the run -----------------------------------------------------------------------------------


@dataclass
class Slot:
    """One agent the driver started: its worker, number (faults refer to it), when it started
    and ended (seconds after training started; None: still running), and its rows and busy
    seconds (from its report, or its latest progress event if it died)."""

    worker: str
    index: int
    future: Future
    join: bool
    started: float
    ended: float | None = None
    rows: int = 0
    busy_s: float = 0.0
    report: agent.AgentReport | None = None
    dead: bool = False

    @property
    def live(self) -> bool:
        return self.report is None and not self.dead

    @property
    def label(self) -> str:
        return f"worker{self.index}"


@dataclass
class _Progress:
    """The agents' progress events: ``inbox`` is filled on the client's event loop (a deque
    appends and pops atomically), the watch loop drains it into the latest rate per worker."""

    inbox: deque[tuple[float, dict[str, Any]]] = field(default_factory=deque)
    rates: dict[str, float] = field(default_factory=dict)
    leasing: dict[tuple[str, int], float] = field(default_factory=dict)
    """Leases started and not yet ended: ``(worker, lease_id)`` -> wall-clock start."""
    spans: list[tuple[str, int, float, float, int, str]] = field(default_factory=list)
    """Ended leases: ``(worker, lease_id, start, end, rows, outcome)``, wall-clock times."""
    actions: list[controller.ActionRecord] = field(default_factory=list)
    """The controller's applied actions so far."""


class AsyncRun:
    """One async-mode job on a connected cluster (see the module docstring); :meth:`run` returns
    its summary. ``job_id`` names the job in the services (unique per run by default).
    ``deadline_s``: stop the job if training takes longer (the rows not done count as lost, no
    model is evaluated: the summary's AUC is nan); benchmarks use it for baselines that never
    finish."""

    def __init__(self, job: JobConfig, client: Client, *, data: PreparedData | None = None,
                 progress: ProgressSink | None = None, job_id: str | None = None,
                 started: float | None = None, deadline_s: float | None = None) -> None:
        self.started = started if started is not None else time.perf_counter()
        self.job = job
        self.client = client
        self.data = data if data is not None else prepare_data(job)
        self.progress = progress
        self.job_id = job_id or f"{job.name}-{uuid.uuid4().hex[:8]}"
        self.slots: list[Slot] = []
        self.deadline_s = deadline_s
        self.stopped: str | None = None
        """Why the driver stopped the job early (None: it ran to its end)."""
        self._faults = {f.worker: agent.Faults(
            slowdown=f.slowdown, hang_after_rows=f.hang_after_rows,
            crash_after_rows=f.crash_after_rows, slow_for_rows=f.slow_for_rows,
            pause_until=f.pause_until, pause_after_rows=f.pause_after_rows) for f in job.faults}
        self._trainer = TrainerRecipe(self.data.schema, job.model, job.train.optim,
                                      job.train.seed)
        self._reader = ReaderRecipe(self.data.schema, job.train.threads)
        self._events = _Progress()
        self._done_rows = 0
        self._ticks = 0
        self._train_started = 0.0
        self._wall_started = 0.0

    def run(self) -> JobSummary:
        """Train, evaluate and track the job; the services and workers forget it afterwards."""
        plan, initial = self._register()
        topic = agent.event_topic(self.job_id)
        self.client.subscribe_topic(topic, self._events.inbox.append)
        try:
            sync_service.start_job(self.client, self.job_id, initial)
            # the run records the workers that trained (--workers, or the cluster's own)
            tracked = dataclasses.replace(self.job, train=dataclasses.replace(
                self.job.train, workers=len(initial)))
            with Tracker(tracked, mode="async", tags={"antdt.job_id": self.job_id}) as tracker:
                tracker.artifact_yaml(self.data.schema.to_dict(), "schema.yaml")
                if plan.quarantine:
                    tracker.artifact_yaml([list(q) for q in plan.quarantine], "quarantine.yaml")
                self._train_started = time.perf_counter()
                self._wall_started = time.time()
                for index, worker in enumerate(initial):
                    self._start(worker, index)
                self._watch(tracker)
                summary = self._summarise(tracker, self._elapsed())
        except BaseException:
            self._abort()
            raise
        finally:
            self.client.unsubscribe_topic(topic)
            self._clean_up()
        return summary

    def _register(self) -> tuple[LedgerPlan, list[str]]:
        """Plugins in place, the initial workers (sorted: fault indices refer to this order)
        and the job registered with the sharding service."""
        plan = ledger_plan(self.job, self.data)
        ensure_plugins(self.client)
        # Import the training stack (torch, TorchRec, the recipes' modules) on every worker now,
        # not while the agents start: seconds per process that are not training.
        self.client.run(importlib.import_module, "pipeline.recipes")
        initial = sorted(_workers(self.client))
        if not initial:
            raise AntdtError("the cluster has no workers; expected at least one")
        unknown = sorted(f for f in self._faults if f >= len(initial))
        if unknown:
            raise AntdtError(f"faults name worker(s) {unknown}, but the cluster has only "
                             f"{len(initial)} worker(s) (indices 0..{len(initial) - 1})")
        sharding = self.job.train.sharding
        controller.enable_controller(self.client, self.job_id, sharding == "antdt")
        state = service.register_job(
            self.client, self.job_id, plan.row_groups, shard_rows=self.job.train.shard_rows,
            batch_rows=self.job.train.batch_size, epochs=self.job.train.epochs,
            seed=self.job.train.seed, quarantine=plan.quarantine,
            static=len(initial) if sharding == "static" else None)
        if self.progress is not None:
            self.progress.total(state["rows_expected"])
        self._advance(state)
        return plan, initial

    def _summarise(self, tracker: Tracker, train_s: float) -> JobSummary:
        """Evaluate the consensus model, log it with the final counters and the timeline, build
        the summary (no model when the driver stopped the job)."""
        state = service.job_state(self.client, self.job_id)
        step = None
        auc = logloss = math.nan
        if self.stopped is None:
            step = self._final_model()
            metrics = evaluate(step.predict, iterate_batches(
                ShardReader(self.data.schema), self.data.validation, self.job.train.batch_size))
            auc, logloss = metrics["auc"], metrics["logloss"]
        summary = JobSummary(
            run_id=tracker.run_id, mode="async", workers=len(self.slots), auc=auc,
            logloss=logloss,
            oracle_auc=oracle_auc(self.job.data.schema, [g.path for g in self.data.validation]),
            rows_trained=state["rows_trained"], rows_lost=state["rows_lost"],
            rows_duplicated=state["rows_duplicated"], rows_quarantined=state["rows_quarantined"],
            wall_s=time.perf_counter() - self.started, train_s=train_s,
            samples_per_s=state["rows_trained"] / max(train_s, 1e-9),
            straggler_actions=len(self._events.actions), tracking_uri=tracker.tracking_uri,
            experiment_id=tracker.experiment_id,
            timeline=tracker.artifact_location("timeline.png"))
        tracker.summary({k: v for k, v in summary.metrics().items() if not math.isnan(v)})
        tracker.summary({f"ledger.{k}": v for k, v in state.items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)})
        tracker.summary(self._agent_metrics())
        if self._events.actions:
            tracker.artifact_yaml(self._events.actions, "straggler_actions.yaml")
        with tempfile.TemporaryDirectory() as folder:
            tracker.artifact_file(self.timeline(f"{folder}/timeline.png"))
        if self.stopped is not None:
            tracker.tag("antdt.stopped", self.stopped)
        if step is not None:
            log_ranking_model(step, self.data.schema, self.job,
                              example=(self.data.validation or self.data.train)[0])
        return summary

    def first_leases(self) -> dict[str, float]:
        """Per worker, when its first lease started (seconds after training started)."""
        first: dict[str, float] = {}
        for worker, _, start, *_ in sorted(self._events.spans, key=lambda span: span[2]):
            first.setdefault(worker, start - self._wall_started)
        return first

    def timeline(self, path: str) -> str:
        """Draw the job's leases per worker and the controller's actions to a PNG at ``path``.
        A lease the controller split ends as ``split``; one whose agent stopped or died in it
        ends as ``lost`` (its rows went back to the queue)."""
        events, t0 = self._events, self._wall_started
        label = {s.worker: s.label for s in self.slots}
        split = {a["lease_id"] for a in events.actions if a["action"] == "split"}
        spans = [LeaseSpan(label.get(w, w), lease_id, start - t0, end - t0, rows,
                           "split" if outcome == "finished" and lease_id in split else
                           outcome if outcome in ("finished", "revoked") else "lost")
                 for w, lease_id, start, end, rows, outcome in events.spans]
        marks = [ActionMark(a["time"] - t0, label.get(a["worker"], a["worker"]), a["action"],
                            a["rows"], a["reason"]) for a in events.actions]
        sharding = self.job.train.sharding
        return render_timeline(spans, marks, path, title=f"{self.job.name} ({self.job_id}, "
                               f"{len(self.slots)} agents, sharding {sharding})")

    # ---- agents -------------------------------------------------------------------------------

    def _elapsed(self) -> float:
        """Seconds since training started."""
        return time.perf_counter() - self._train_started

    def _start(self, worker: str, index: int, join: bool = False) -> None:
        spec = agent.AgentSpec(job=self.job_id, batch_rows=self.job.train.batch_size,
                               sync_period=self.job.train.sync_period, join=join,
                               threads=self.job.train.threads,
                               faults=self._faults.get(index, agent.Faults()))
        future = agent.start_agent(self.client, worker, spec, self._trainer, self._reader)
        self.slots.append(Slot(worker, index, future, join, started=self._elapsed()))
        logger.info("job %s: agent %d started on %s%s%s", self.job_id, index, worker,
                    " (joining)" if join else "",
                    f" with faults {spec.faults}" if spec.faults.active else "")

    def _watch(self, tracker: Tracker) -> None:
        """Until every agent returned or died: collect results, write off agents whose worker
        died, note joiners, and log progress every :data:`TICK_S`."""
        while True:
            pending = [s.future for s in self.slots if s.live]
            if pending:
                with contextlib.suppress(TimeoutError):
                    wait(pending, timeout=TICK_S, return_when="FIRST_COMPLETED")
            workers = _workers(self.client)
            for slot in self.slots:
                if slot.live:
                    self._check(slot, workers)
            self._notice_joiners(workers)
            self._tick(tracker)
            if not any(s.live for s in self.slots):
                break
            if self.deadline_s is not None and self.stopped is None \
                    and self._elapsed() > self.deadline_s:
                self.stopped = f"the deadline of {self.deadline_s:.0f}s of training passed"
                logger.warning("job %s: %s; stopping it", self.job_id, self.stopped)
                service.stop_job(self.client, self.job_id, self.stopped)
                agent.cancel_agents(self.client, self.job_id)
        self._tick(tracker)  # the agents' last events
        if not any(s.report is not None for s in self.slots):
            state = service.job_state(self.client, self.job_id)
            raise AntdtError(f"job {self.job_id}: every agent's worker died "
                             f"({len(self.slots)} agents); {state['rows_done']} of "
                             f"{state['rows_expected']} rows done")

    def _check(self, slot: Slot, workers: Mapping[str, Any]) -> None:
        """Record a returned agent; write off one whose worker left the cluster; re-raise the
        error of one that failed on a live worker (a bug or bad data, not a death)."""
        status = slot.future.status
        if status == "finished":
            slot.report = slot.future.result()
            slot.ended = self._elapsed()
            slot.rows, slot.busy_s = slot.report.rows, slot.report.busy_s
            return
        gone = slot.worker not in workers
        if status == "error":
            error = slot.future.exception()
            if gone or isinstance(error, KilledWorker):
                self._write_off(slot, f"its worker died ({error!r})")
                return
            raise AntdtError(f"job {self.job_id}: the agent on {slot.worker} failed: "
                             f"{error!r}") from error
        if status in ("cancelled", "lost") or gone:
            self._write_off(slot, "its worker left the cluster")

    def _write_off(self, slot: Slot, why: str) -> None:
        slot.dead = True
        slot.ended = self._elapsed()
        self.client.cancel(slot.future)
        events, now = self._events, time.time()
        for worker, lease_id in [key for key in events.leasing if key[0] == slot.worker]:
            start = events.leasing.pop((worker, lease_id))
            events.spans.append((worker, lease_id, start, now, 0, "lost"))
        logger.warning("job %s: agent %d on %s is gone: %s; the ledger re-queues its unsynced "
                       "rows", self.job_id, slot.index, slot.worker, why)

    def _notice_joiners(self, workers: Mapping[str, Any]) -> None:
        """Start an agent on every worker that joined after the start (an added worker, or one
        the nanny restarted after a death): it copies a live member's model, then trains. Faults
        are for the initial workers only."""
        known = {s.worker for s in self.slots}
        for worker in sorted(set(workers) - known):
            self._start(worker, len(self.slots), join=True)

    def _abort(self) -> None:
        """Stop the job (agents waiting for a lease return) and cancel the agents (those
        training or hung return at their next check)."""
        try:
            service.stop_job(self.client, self.job_id, "the driver aborted the job")
            agent.cancel_agents(self.client, self.job_id)
        except (AntdtError, OSError) as exc:  # the job's own error is what propagates
            logger.warning("job %s: stopping the agents failed: %r", self.job_id, exc)

    def _clean_up(self) -> None:
        """Forget the job in the services and on the workers (other jobs are left alone). A
        failure here is logged, so it never hides the job's own outcome."""
        try:
            agent.forget_job(self.client, self.job_id)
            sync_service.stop_job(self.client, self.job_id)
            reply = self.client.sync(self.client.scheduler.antdt_forget_job, job=self.job_id)
        except OSError as exc:
            logger.warning("job %s: clean-up failed: %r", self.job_id, exc)
            return
        if reply.get("status") != "OK":
            logger.warning("job %s: forgetting the ledger failed: %s", self.job_id, reply)

    # ---- the model ----------------------------------------------------------------------------

    def _final_model(self) -> TrainStep:
        """The consensus replica (identical on every worker after the final sync round) fetched
        from the first finished agent whose worker still answers."""
        step = TrainStep(self.data.schema, self.job.model, self.job.train.optim,
                         seed=self.job.train.seed)
        failures = []
        for slot in self.slots:
            if slot.report is None or slot.report.outcome != "finished":
                continue
            try:
                weights = agent.fetch_state(self.client, self.job_id, slot.worker)
            except (OSError, KeyError, AntdtError) as exc:
                failures.append(f"{slot.worker}: {exc!r}")
                continue
            step.model.load_state_dict(weights)
            logger.info("job %s: final model from %s", self.job_id, slot.worker)
            return step
        outcomes = {s.worker: s.report.outcome if s.report else "dead" for s in self.slots}
        raise AntdtError(f"job {self.job_id}: no finished agent could hand over the model; "
                         f"agents: {outcomes}; fetch failures: {failures}")

    # ---- progress -----------------------------------------------------------------------------

    def _advance(self, state: Mapping[str, Any]) -> None:
        done = int(state["rows_done"]) + int(state["rows_quarantined"])
        if self.progress is not None and done > self._done_rows:
            self.progress.advance(done - self._done_rows)
        self._done_rows = max(self._done_rows, done)

    def _tick(self, tracker: Tracker) -> None:
        """Progress bar and MLflow metrics: rows from the ledger; the controller's actions so
        far; loss and samples/s per worker from the agents' events since the last tick, and the
        total over the training agents' latest rates."""
        state = service.job_state(self.client, self.job_id)
        self._advance(state)
        events = self._events
        applied = controller.controller_actions(self.client, self.job_id,
                                                since=len(events.actions))
        events.actions.extend(applied["records"])
        by_worker = {s.worker: s for s in self.slots}
        fresh: dict[str, float] = {}
        losses: list[float] = []
        while events.inbox:
            _, msg = events.inbox.popleft()
            kind, worker = msg.get("kind"), str(msg.get("worker"))
            if kind == "lease":
                key = (worker, msg["lease_id"])
                if msg["phase"] == "start":
                    events.leasing[key] = msg["time"]
                elif events.leasing.pop(key, None) is not None:
                    events.spans.append((*key, msg["start"], msg["time"], msg["rows"],
                                         msg["outcome"]))
            elif kind == "progress":
                fresh[worker] = float(msg["samples_per_s"])
                if msg["loss"] is not None:
                    losses.append(float(msg["loss"]))
                slot = by_worker.get(worker)
                if slot is not None and slot.report is None:
                    slot.rows, slot.busy_s = int(msg["rows"]), float(msg["busy_s"])
        live = {s.worker for s in self.slots if s.live}
        events.rates = {w: r for w, r in {**events.rates, **fresh}.items() if w in live}
        index = {s.worker: s.index for s in self.slots}
        metrics: dict[str, float] = {
            "rows_done": state["rows_done"], "rows_trained": state["rows_trained"],
            "rows_duplicated": state["rows_duplicated"],
            "samples_per_s": sum(events.rates.values()), "workers_training": len(live)}
        metrics.update({f"samples_per_s.worker{index[w]}": r for w, r in fresh.items()})
        if losses:
            metrics["loss"] = sum(losses) / len(losses)
        metrics["controller.actions"] = applied["count"]
        metrics.update({f"controller.{kind}": n for kind, n in applied["counts"].items()})
        tracker.metrics(metrics, step=self._ticks)
        self._ticks += 1

    def _agent_metrics(self) -> dict[str, float]:
        """Final per-agent figures (rows, batches, busy seconds, sync exchanges, mean loss) and
        the agents' fates (dead, started on a worker that joined mid-job)."""
        out: dict[str, float] = {"agents_dead": sum(s.dead for s in self.slots),
                                 "agents_joined": sum(s.join for s in self.slots)}
        for slot in self.slots:
            if slot.report is not None:
                name = f"worker{slot.index}"
                out[f"{name}.rows"] = slot.report.rows
                out[f"{name}.batches"] = slot.report.batches
                out[f"{name}.busy_s"] = slot.report.busy_s
                out[f"{name}.sync_exchanges"] = slot.report.exchanges
                if not math.isnan(slot.report.loss):
                    out[f"{name}.loss"] = slot.report.loss
        return out


def train_async(job: JobConfig, *, workers: int | None = None, scheduler: str | None = None,
                progress: ProgressSink | None = None) -> JobSummary:
    """Train ``job`` in the async mode on a new LocalCluster of ``workers`` (default
    ``train.workers``) or on the cluster at ``scheduler``; evaluate, track, summarise."""
    started = time.perf_counter()
    data = prepare_data(job)  # fail on bad data before starting a cluster
    with connect(workers or job.train.workers, scheduler) as client:
        return AsyncRun(job, client, data=data, progress=progress, started=started).run()
