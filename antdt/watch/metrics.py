"""The jobs' live state on the scheduler's ``/metrics``: :class:`JobsCollector`, a Dask
``PrometheusCollector`` under the ``dask_antdt_`` prefix that operators scrape into Prometheus
beside Dask's own ``dask_scheduler_*`` series.

Dask has no registration API for a plugin's collectors (dask/distributed#7364): the job service
registers this one in ``prometheus_client``'s default registry, the one the scheduler's
``/metrics`` handler serves, when it starts and unregisters it when it closes. Registering
calls :meth:`JobsCollector.describe` (the families, empty), never :meth:`~JobsCollector.collect`:
a scrape is what reads the jobs.

A scrape reads every job runner the service keeps, in place, on the scheduler's event loop (the
handler runs there): the ledger's counters and the controller's actions as the runner's journal
last read them (every ``antdt.jobs.tick``), the agents' progress events, the monitor's verdicts.
Nothing is kept between scrapes. Labels stay bounded: a job's id, ``job_id`` (and, in
``dask_antdt_job_info``, its name, mode and sharding), a worker's address with its agent's
label (``worker0``...), a kind from a closed list. A job that ended more than
``antdt.watch.forget-after`` ago has no series any more (its record stays for ``antdt
status``), so a cluster that runs many jobs does not grow its scrape without end.

=================================  =======  ========================================================
series (``dask_antdt_`` + ...)     type     labels: what it is
=================================  =======  ========================================================
``job_info``                       gauge    job_id, name, mode, sharding: 1
``job_state``                      gauge    job_id, state: 1 for the job's state, 0 for the others
                                            (``starting`` ... ``failed``)
``job_workers``                    gauge    job_id: agents training now
``job_epochs``, ``job_epoch``      gauge    job_id: epochs planned; the epoch being dealt
``job_rows_expected``              gauge    job_id: rows of every epoch
``job_rows_per_epoch``             gauge    job_id: rows of one epoch
``job_epoch_rows_done``            gauge    job_id, epoch: rows done in that epoch
``job_rows_done``                  gauge    job_id: rows whose effect is in the model
``job_rows_trained``               gauge    job_id: rows trained, repeats included
``job_rows_lost``                  gauge    job_id: rows never done (a stopped job)
``job_rows_retrained``             gauge    job_id: rows trained again, their first effect discarded
                                            (duplicated work)
``job_rows_quarantined``           gauge    job_id: rows that could not be read
``job_rows_replayed``              gauge    job_id: rows trained past the checkpoint a job restarted
                                            from, trained again
``job_leases_total``               counter  job_id, kind (granted, revoked, split)
``job_controller_actions_total``   counter  job_id, kind (reassign, split, revoke, retire, pace,
                                            adjust_batch)
``job_checkpoints_written_total``  counter  job_id: checkpoints this master wrote
``job_refused_total``              counter  job_id, kind (leases, commits, sync, ranks): calls
                                            of workers the scheduler had removed, refused
``worker_rows_total``              counter  job_id, worker, agent: rows its agent trained
``worker_rows_per_second``         gauge    job_id, worker, agent: its latest pace
``worker_batch_seconds``           gauge    job_id, worker, agent: the monitor's batch time (BPT) of
                                            its last judged window
``worker_state``                   gauge    job_id, worker, agent, state: 1 for the monitor's
                                            verdict (ok, transient, persistent, hung), 0 for the
                                            others
``worker_sync_rounds_total``       counter  job_id, worker, agent: model exchanges
``worker_sync_bytes_total``        counter  job_id, worker, agent: bytes its exchanges received
                                            (async mode; each byte moved is counted once, by its
                                            receiver)
``job_tables_buckets``             gauge    job_id, worker, role (primary, backup): buckets of the
                                            job's sharded tables it holds
``job_tables_moves_total``         counter  job_id: buckets copied (new backups, joiners)
``job_tables_lost``                gauge    job_id: buckets whose primary and backup both left
``worker_tables_pull_seconds``     gauge    job_id, worker, agent: its mean pull of a batch's rows
``worker_tables_push_seconds``     gauge    job_id, worker, agent: its mean push, sent to
                                            acknowledged by both holders
``worker_tables_inflight``         gauge    job_id, worker, agent: its pushes unacknowledged
=================================  =======  ========================================================

The rows are gauges, not counters: a job that restarts from a checkpoint goes back to the
checkpoint's rows. The counters start again from 0 when their source does (a ledger restored
from a checkpoint, an agent started again), which Prometheus's ``rate`` reads as a reset. The
worker series are those of the agents training now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias

import prometheus_client
from distributed import Scheduler
from distributed.http.prometheus import PrometheusCollector
from distributed.metrics import time
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import DuplicateTimeseries

from antdt import config, fencing
from antdt.jobs.placement import Slot
from antdt.jobs.runner import JobRunner
from antdt.monitor import WorkerState
from antdt.sharding import Clock, JobState

logger = logging.getLogger(__name__)

SUBSYSTEM = "antdt"
"""After Dask's namespace (``dask``): the series are ``dask_antdt_*``."""

JOB = ["job_id"]
"""Not ``job``: Prometheus gives every series it scrapes a ``job`` label of its own (the scrape
job), and would rename ours ``exported_job``."""
WORKER = ["job_id", "worker", "agent"]

LEASE_KINDS = ("granted", "revoked", "split")
JOB_STATES = tuple(state.value for state in JobState)
WORKER_STATES = tuple(state.value for state in WorkerState)

_GAUGE, _COUNTER = "gauge", "counter"
Families: TypeAlias = dict[str, GaugeMetricFamily | CounterMetricFamily]
FAMILIES: dict[str, tuple[str, str, list[str]]] = {
    # name: (type, help, labels); the module docstring's table says more
    "job_info": (_GAUGE, "An antdt job on this scheduler (1), its name, mode and sharding",
                 [*JOB, "name", "mode", "sharding"]),
    "job_state": (_GAUGE, "1 for the job's state, 0 for the others", [*JOB, "state"]),
    "job_workers": (_GAUGE, "Agents of the job training now", JOB),
    "job_epochs": (_GAUGE, "Epochs the job trains", JOB),
    "job_epoch": (_GAUGE, "The epoch whose shards are being dealt (-1 before the first)", JOB),
    "job_rows_expected": (_GAUGE, "Rows of every epoch of the job", JOB),
    "job_rows_per_epoch": (_GAUGE, "Rows of one epoch of the job", JOB),
    "job_epoch_rows_done": (_GAUGE, "Rows done in each epoch", [*JOB, "epoch"]),
    "job_rows_done": (_GAUGE, "Rows whose effect reached the job's model", JOB),
    "job_rows_trained": (_GAUGE, "Rows trained, repeats included", JOB),
    "job_rows_lost": (_GAUGE, "Rows neither done nor quarantined when the job stopped early",
                      JOB),
    "job_rows_retrained": (_GAUGE, "Rows trained again because their first effect was "
                                   "discarded (a worker died, the job restarted)", JOB),
    "job_rows_quarantined": (_GAUGE, "Rows that could not be read", JOB),
    "job_rows_replayed": (_GAUGE, "Rows trained past the checkpoint the job restarted from, "
                                  "trained again", JOB),
    "job_leases": (_COUNTER, "Leases the job's ledger granted, revoked and split",
                   [*JOB, "kind"]),
    "job_controller_actions": (_COUNTER, "Actions the job's controller applied, per kind",
                               [*JOB, "kind"]),
    "job_checkpoints_written": (_COUNTER, "Checkpoints the job's master wrote", JOB),
    "job_refused": (_COUNTER, "Calls refused from workers the scheduler had removed "
                              "(antdt.fencing), per kind", [*JOB, "kind"]),
    "worker_rows": (_COUNTER, "Rows the worker's agent trained", WORKER),
    "worker_rows_per_second": (_GAUGE, "The agent's rows per second in its latest report",
                               WORKER),
    "worker_batch_seconds": (_GAUGE, "The monitor's batch processing time of the worker in "
                                     "its last judged window", WORKER),
    "worker_state": (_GAUGE, "1 for the monitor's verdict on the worker (ok, transient, "
                             "persistent, hung), 0 for the others", [*WORKER, "state"]),
    "worker_sync_rounds": (_COUNTER, "Model exchanges of the worker's agent", WORKER),
    "worker_sync_bytes": (_COUNTER, "Bytes the worker's model exchanges received", WORKER),
    "job_tables_buckets": (_GAUGE, "Buckets of the job's sharded tables a worker holds, by "
                                   "role", [*JOB, "worker", "role"]),
    "job_tables_moves": (_COUNTER, "Buckets of the job's sharded tables copied to a worker",
                         JOB),
    "job_tables_lost": (_GAUGE, "Buckets of the job's sharded tables whose holders both left",
                        JOB),
    "worker_tables_pull_seconds": (_GAUGE, "The agent's mean time to pull a batch's rows of the "
                                           "sharded tables", WORKER),
    "worker_tables_push_seconds": (_GAUGE, "The agent's mean time from a push of the sharded "
                                           "tables to its acknowledgement", WORKER),
    "worker_tables_inflight": (_GAUGE, "The agent's pushes not yet acknowledged", WORKER),
}
"""Every family the collector exports, without the ``dask_antdt_`` prefix (a counter's samples
add ``_total``)."""


class JobsCollector(PrometheusCollector):
    """The ``dask_antdt_*`` series of the jobs ``jobs()`` yields (see the module docstring);
    ``clock`` is the runners' clock (their ``ended_at``)."""

    def __init__(self, server: Scheduler | None, jobs: Callable[[], Iterable[JobRunner]],
                 clock: Clock = time) -> None:
        super().__init__(server)
        self.subsystem = SUBSYSTEM
        self.registered = False
        self._jobs = jobs
        self._clock = clock

    def register(self) -> None:
        """Serve the series on the scheduler's ``/metrics``. Another scheduler in this process
        (tests, a LocalCluster beside a job's) may hold the names already: its jobs are served,
        and this one's are not, which is logged."""
        try:
            prometheus_client.REGISTRY.register(self)
        except DuplicateTimeseries:
            logger.warning("another scheduler in this process serves the dask_antdt_* series "
                           "on /metrics; this scheduler's jobs are not among them")
            return
        self.registered = True

    def unregister(self) -> None:
        if self.registered:
            prometheus_client.REGISTRY.unregister(self)
            self.registered = False

    def describe(self) -> Iterator[Metric]:
        """The families with no samples: what registering reads instead of a scrape."""
        yield from self._families().values()

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        forget_s = config.seconds("antdt.watch.forget-after")
        now = self._clock()
        for runner in self._jobs():
            if runner.state.final and runner.ended_at is not None \
                    and now - runner.ended_at > forget_s:
                continue
            _add_job(families, runner)
        yield from families.values()

    def _families(self) -> Families:
        made: Families = {}
        for name, (kind, text, labels) in FAMILIES.items():
            made[name] = (GaugeMetricFamily if kind == _GAUGE else CounterMetricFamily)(
                self.build_name(name), text, labels=labels)
        return made


def _add_job(families: Families, runner: JobRunner) -> None:
    """One job's samples; its rows only once its ledger was read (the job registered)."""
    job = runner.job_id
    journal = runner.journal
    plan = runner.plan

    def add(name: str, value: float, *labels: str) -> None:
        families[name].add_metric([job, *labels], value)

    add("job_info", 1, plan.name, plan.mode, plan.sharding)
    for state in JOB_STATES:
        add("job_state", float(state == runner.state.value), state)
    live = {slot.worker: slot for slot in runner.placement.slots if slot.live}
    add("job_workers", len(live))
    rows = journal.rows
    if rows:
        epochs = int(rows["epochs"])
        add("job_epochs", epochs)
        add("job_epoch", rows["epoch"])
        add("job_rows_expected", rows["expected"])
        add("job_rows_per_epoch", rows["expected"] // epochs)
        for epoch, done in enumerate(rows["done_by_epoch"]):
            add("job_epoch_rows_done", done, str(epoch))
        for key in ("done", "trained", "lost", "retrained", "quarantined"):
            add(f"job_rows_{key}", rows[key])
    add("job_rows_replayed", runner.recovery.rows_replayed)
    for kind, count in journal.leases.items():
        add("job_leases", count, kind)
    for kind, count in sorted(journal.action_counts.items()):
        add("job_controller_actions", count, kind)
    add("job_checkpoints_written", runner.checkpoints.written)
    for kind, count in sorted(fencing.refused(runner.ctx.scheduler, runner.job_id,
                                              runner.ctx.mode).items()):
        add("job_refused", count, kind)
    tables = runner.tables()
    if tables is not None:
        add("job_tables_moves", tables["moves"])
        add("job_tables_lost", len(tables["lost"]))
        for worker, held in tables["held"].items():
            for role in ("primary", "backup"):
                add("job_tables_buckets", held[role], worker, role)
    for worker, slot in live.items():
        _add_worker(families, job, slot, journal.verdicts.get(worker))


def _add_worker(families: Families, job: str, slot: Slot,
                verdict: Mapping[str, Any] | None) -> None:
    """One training agent's samples; ``verdict`` is the monitor's
    (:meth:`~antdt.monitor.Health.as_dict`; None before it judged the worker: ok)."""
    labels = [job, slot.worker, slot.label]
    families["worker_rows"].add_metric(labels, slot.rows)
    families["worker_rows_per_second"].add_metric(labels, slot.rate)
    state = WorkerState.OK.value if verdict is None else verdict["state"]
    if verdict is not None and verdict["bpt"] is not None:
        families["worker_batch_seconds"].add_metric(labels, verdict["bpt"])
    for name in WORKER_STATES:
        families["worker_state"].add_metric([*labels, name], float(name == state))
    families["worker_sync_rounds"].add_metric(labels, slot.exchanges)
    if slot.exchanged_bytes is not None:
        families["worker_sync_bytes"].add_metric(labels, slot.exchanged_bytes)
    if slot.tables:
        families["worker_tables_pull_seconds"].add_metric(labels, slot.tables["pull_ms"] / 1000)
        families["worker_tables_push_seconds"].add_metric(labels, slot.tables["push_ms"] / 1000)
        families["worker_tables_inflight"].add_metric(labels, slot.tables["inflight"])
