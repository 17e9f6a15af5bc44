"""`antdt bench scaling`: async samples/s with 1 and 2 workers (one thread each) on this machine.
With ``--network``, the most workers on links at each ``--link-rate`` beside loopback instead,
and what the sync rounds cost there (:mod:`pipeline.bench.scaling_net`).

Every worker count trains the same synthetic job on a fresh LocalCluster; samples/s is rows
trained over training seconds (first agent started to last agent ended). The job is sized by
time (:mod:`pipeline.bench.sizing`): ``--target-s`` seconds of ideal training with the largest
worker count, unless ``--rows`` names its size. Each repeat runs every configuration once, back
to back, and the single-process local mode (one thread) beside them; samples/s and ratios are the
medians over repeats. A repeat runs, for each worker count in turn, its async job and its two
bare runs (below), then the diagnostics and the local mode; odd repeats run that order backwards.
So the two runs of every ratio are as far apart in time as the other ratio's they are compared
with (a machine that slows steadily slows both alike), and no run always follows the same one.
The efficiencies below are taken within each repeat (its async and bare runs minutes apart, so a
machine slowed for a while by its neighbours slows both) and their median reported, with each
repeat's. ``per_repeat`` keeps every run's own figures (each async job's
samples/s, start and tail seconds and straggler actions; each bare run's samples/s), to tell a
repeat the machine slowed from one a job lost time in.

The machine's own ceiling for this workload is measured in the same run: as many bare processes
as workers, each reading and training its share of the row groups the way an agent does (read,
then step, in one thread, one torch thread) with no Dask, no ledger and no model sync around it,
all started together. ``machine_ratio`` is what the hardware gives two such processes over one
(memory bandwidth and shared caches decide it, not our code); ``efficiency`` is the async ratio
over it, the share of the machine's scaling the framework keeps.

Where the rest goes is measured in the same run too, in two steps. Dask's own share: the same
bare trainers run as one task on each worker of a LocalCluster like an async job's (scheduler,
nannies, workers' event loops and monitors, Dask's profiler paused as agents pause it), none of
antdt's plugins registered; ``dask_ratio`` is what Dask's processes leave of the machine's
scaling, and ``efficiency_in_dask`` the async ratio over it, the share antdt itself keeps of
what a Dask cluster gives. The model sync's share: the most workers once more with the periodic
sync rounds off (a period no job reaches; only the rounds of the job's end run), so
``efficiency_without_rounds`` is what Dask, the ledger and the agents alone keep, and the
difference to ``efficiency`` what the model sync costs. (A diagnosis, not a way to train: the
replicas drift apart until the end.) And the most workers with the embedding deltas sent exact
(``antdt.sync.delta-dtype: float32``): ``efficiency_float32_deltas`` against ``efficiency`` is
what rounding them to bfloat16 (the default) saves.

What a job's training threads did with their busy seconds is reported beside it, per worker
count and for the rounds-off job (medians over repeats): ``training_cpu_share``, their CPU
seconds over their busy seconds (the share of a core they got; the threads beside them, the
event loop's and the sync thread's, and the other processes take the rest), and
``training_cpu_us_per_row``, the CPU time a row cost them. Together they split a job's loss
into time its training threads did not run and time they ran slower.
"""

from __future__ import annotations

import functools
import multiprocessing
import time
import uuid
from collections.abc import Callable
from multiprocessing.synchronize import Barrier

import click
import dask.config
from distributed import get_worker

from antdt.agent import pause_profiler, resume_profiler
from antdt.device import FROZEN_HEAP, collapse_steps, prepare_process
from antdt.sync import SyncPeriod
from data.reader import ShardReader
from models.ranking import embedding_tables
from models.train_step import TrainStep
from pipeline.bench import emit, median_of
from pipeline.bench.jobs import SET_HELP, echo, run_async, with_train
from pipeline.bench.sizing import sized_job
from pipeline.job.config import JobConfig
from pipeline.training.local_cluster import connect
from pipeline.training.local import iterate_batches, prepare_data, train_local


ROUNDS_OFF = SyncPeriod(batches=10**9)
"""A sync period no job reaches: no periodic round, only those of the job's end."""

ROUNDS_OFF_KEY = "rounds_off"
"""The rounds-off job's key beside the worker counts in the training threads' figures."""


class _Trainer:
    """A bare trainer of one share of a job's row groups: the model built (with this process
    prepared as an agent's is), then read-and-step in the calling thread with no Dask, no ledger
    and no model sync around it."""

    def __init__(self, job: JobConfig, share: int, of: int) -> None:
        prepare_process(job.train.threads)
        self.job = job
        self.data = prepare_data(job)
        self.groups = self.data.train[share::of]
        self.step = TrainStep(self.data.schema, job.model, job.train.optim, seed=job.train.seed)
        for _ in collapse_steps(embedding_tables(self.step.model).values()):
            pass  # on huge pages now, as an agent's tables are once its sync thread moved them
        self.reader = ShardReader(self.data.schema)

    def train(self) -> tuple[int, float, float]:
        """Train every epoch of the share: (rows, wall-clock start, wall-clock end)."""
        began = time.time()
        rows = 0
        with FROZEN_HEAP:
            for _ in range(self.job.train.epochs):
                for batch in iterate_batches(self.reader, self.groups,
                                             self.job.train.batch_size):
                    self.step.step(batch)
                    rows += int(batch.labels.shape[0])
        return rows, began, time.time()


def _bare_trainer(job: JobConfig, share: int, of: int, start: Barrier) -> tuple[int, float]:
    """One bare process: build its :class:`_Trainer`, wait for the others, then train; return
    (rows, seconds)."""
    trainer = _Trainer(job, share, of)
    start.wait()
    rows, began, ended = trainer.train()
    return rows, ended - began


def bare_run(job: JobConfig, processes: int) -> list[tuple[int, float]]:
    """(rows, seconds) of each of ``processes`` bare trainers started together, each on its
    share of the row groups (every training row once per epoch, over all of them)."""
    context = multiprocessing.get_context("spawn")
    with context.Manager() as manager, context.Pool(processes) as pool:
        start = manager.Barrier(processes)
        return pool.starmap(_bare_trainer,
                            [(job, share, processes, start) for share in range(processes)])


def machine_samples_per_s(job: JobConfig, processes: int) -> float:
    """Rows over seconds (first start to last end) of :func:`bare_run`."""
    results = bare_run(job, processes)
    return sum(rows for rows, _ in results) / max(seconds for _, seconds in results)


_BUILT: dict[str, _Trainer] = {}
"""Trainers :func:`_build_in_dask` left on this worker for :func:`_train_in_dask`."""


def _build_in_dask(key: str, job: JobConfig, share: int, of: int) -> None:
    _BUILT[key] = _Trainer(job, share, of)


def _train_in_dask(key: str) -> tuple[int, float, float]:
    """Train the share built under ``key``, with Dask's statistical profiler paused as it is
    while agents train."""
    worker = get_worker()
    paused = pause_profiler(worker)
    try:
        return _BUILT.pop(key).train()
    finally:
        resume_profiler(worker, paused)


def dask_run(job: JobConfig, workers: int) -> list[tuple[int, float, float]]:
    """(rows, start, end) of a bare trainer on each worker of a new LocalCluster like an async
    job's (:func:`pipeline.training.cluster.connect`), each on its share of the row groups: the
    models are built by one round of tasks, then trained by a second submitted at once, so they
    start together."""
    with connect(workers) as client:
        addresses = sorted(client.scheduler_info(n_workers=-1)["workers"])
        keys = [f"{uuid.uuid4().hex}-{share}" for share in range(workers)]
        client.gather([client.submit(_build_in_dask, key, job, share, workers, pure=False,
                                     workers=[address], allow_other_workers=False)
                       for share, (key, address) in enumerate(zip(keys, addresses))])
        return client.gather([client.submit(_train_in_dask, key, pure=False, workers=[address],
                                            allow_other_workers=False)
                              for key, address in zip(keys, addresses)])


def dask_samples_per_s(job: JobConfig, workers: int) -> float:
    """Rows over seconds (first start to last end) of :func:`dask_run`."""
    results = dask_run(job, workers)
    return (sum(rows for rows, _, _ in results)
            / (max(end for _, _, end in results) - min(start for _, start, _ in results)))


@click.command("scaling")
@click.option("--target-s", type=click.FloatRange(min=1.0), default=30.0, show_default=True,
              help="Size the dataset for this many seconds of ideal training with the most "
                   "workers (a calibration run measures this machine's speed first).")
@click.option("--rows", type=click.IntRange(min=10_000), default=None,
              help="Instead of --target-s, a dataset of exactly this many synthetic rows.")
@click.option("--data", "data_dir", default=None,
              help="Where the synthetic data is made, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", default="1,2", show_default=True,
              help="Comma-separated worker counts; the ratio is the last over the first.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--network", is_flag=True,
              help="Run the most workers on a cluster of hosts (a network namespace each, root "
                   "only) at each --link-rate, beside loopback, the data served over HTTP "
                   "(pipeline.bench.scaling_net).")
@click.option("--link-rate", "link_rates", default="1gbit,100mbit", show_default=True,
              help="--network: comma-separated rates of every worker's link (tc units).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(target_s: float, rows: int | None, data_dir: str | None, workers: str,
            repeats: int, network: bool, link_rates: str, overrides: tuple[str, ...],
            as_json: bool) -> None:
    """Samples/s of the async mode with 1 and 2 workers (target: 2 workers >= 1.7x one), next
    to the machine's own ceiling for the same work; with --network, on links at each rate
    beside loopback and what the sync rounds cost there."""
    counts = [int(w) for w in workers.split(",")]
    if network:
        from pipeline.bench.network import burst_for
        from pipeline.bench.scaling_net import network_command
        links = link_rates.split(",")
        try:
            for link in links:
                burst_for(link)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--link-rate") from exc
        network_command(max(counts), target_s, rows, data_dir, links, repeats, overrides,
                        as_json)
        return
    job, sizing = sized_job(max(counts), target_s, rows, data_dir, overrides, as_json)
    rates: dict[int, list[float]] = {count: [] for count in counts}
    machine: dict[int, list[float]] = {count: [] for count in counts}
    fixed: dict[int, list[float]] = {count: [] for count in counts}
    hosted: dict[int, list[float]] = {count: [] for count in counts}
    without_rounds: list[float] = []
    training: dict[str, list[dict[str, float]]] = {
        key: [] for key in [*(str(c) for c in counts), ROUNDS_OFF_KEY]}
    float32_deltas: list[float] = []
    local: list[float] = []
    jobs: list[dict[str, dict[str, object]]] = []  # per repeat, per worker count: the job's run

    def async_job(count: int) -> None:
        run = run_async(job, count)
        rates[count].append(run.summary.samples_per_s)
        fixed[count].append(run.overhead()["fixed_s"] or 0.0)
        cpu = run.training_cpu()
        training[str(count)].append(cpu)
        jobs[-1][str(count)] = {"samples_per_s": round(run.summary.samples_per_s),
                                **run.overhead(), **cpu,
                                "straggler_actions": run.summary.straggler_actions}

    def bare_processes(count: int) -> None:
        machine[count].append(machine_samples_per_s(job, count))

    def bare_in_dask(count: int) -> None:
        hosted[count].append(dask_samples_per_s(job, count))

    def rounds_off() -> None:
        run = run_async(with_train(job, sync_period=ROUNDS_OFF), counts[-1])
        without_rounds.append(run.summary.samples_per_s)
        cpu = run.training_cpu()
        training[ROUNDS_OFF_KEY].append(cpu)
        jobs[-1][ROUNDS_OFF_KEY] = {"samples_per_s": round(run.summary.samples_per_s), **cpu}

    def float32() -> None:
        with dask.config.set({"antdt.sync.delta-dtype": "float32"}):  # the workers inherit it
            float32_deltas.append(run_async(job, counts[-1]).summary.samples_per_s)

    def local_mode() -> None:
        local.append(train_local(with_train(job, mode="local")).samples_per_s)

    steps: list[tuple[str, Callable[[], None]]] = []
    for count in counts:
        steps += [(f"{count} worker(s)", functools.partial(async_job, count)),
                  (f"{count} bare process(es)", functools.partial(bare_processes, count)),
                  (f"{count} bare trainer(s) on Dask workers",
                   functools.partial(bare_in_dask, count))]
    steps += [(f"{counts[-1]} worker(s), periodic rounds off", rounds_off),
              (f"{counts[-1]} worker(s), float32 deltas", float32), ("local mode", local_mode)]
    orders = [steps if repeat % 2 == 0 else steps[::-1] for repeat in range(repeats)]
    for repeat, order in enumerate(orders):
        jobs.append({})
        for name, step in order:
            echo(f"repeat {repeat + 1}/{repeats}: {name}", as_json)
            step()
    medians = {count: median_of(samples) for count, samples in rates.items()}
    bare = {count: median_of(samples) for count, samples in machine.items()}
    in_dask = {count: median_of(samples) for count, samples in hosted.items()}

    def scaling(samples: dict[int, list[float]], repeat: int) -> float:
        return samples[counts[-1]][repeat] / samples[counts[0]][repeat]

    efficiency = [scaling(rates, r) / scaling(machine, r) for r in range(repeats)]
    efficiency_in_dask = [scaling(rates, r) / scaling(hosted, r) for r in range(repeats)]
    efficiency_without_rounds = [without_rounds[r] / rates[counts[0]][r] / scaling(machine, r)
                                 for r in range(repeats)]
    efficiency_float32_deltas = [float32_deltas[r] / rates[counts[0]][r] / scaling(machine, r)
                                 for r in range(repeats)]
    emit({"samples_per_s": {str(c): round(m) for c, m in medians.items()},
          "machine_samples_per_s": {str(c): round(m) for c, m in bare.items()},
          "local_samples_per_s": round(median_of(local)),
          "ratio": round(medians[counts[-1]] / medians[counts[0]], 3),
          "machine_ratio": round(bare[counts[-1]] / bare[counts[0]], 3),
          "efficiency": round(median_of(efficiency), 3),
          "efficiency_per_repeat": [round(e, 3) for e in efficiency],
          "dask_samples_per_s": {str(c): round(m) for c, m in in_dask.items()},
          "dask_ratio": round(in_dask[counts[-1]] / in_dask[counts[0]], 3),
          "efficiency_in_dask": round(median_of(efficiency_in_dask), 3),
          "efficiency_in_dask_per_repeat": [round(e, 3) for e in efficiency_in_dask],
          "samples_per_s_without_rounds": round(median_of(without_rounds)),
          "efficiency_without_rounds": round(median_of(efficiency_without_rounds), 3),
          "samples_per_s_float32_deltas": round(median_of(float32_deltas)),
          "efficiency_float32_deltas": round(median_of(efficiency_float32_deltas), 3),
          "efficiency_float32_deltas_per_repeat": [round(e, 3)
                                                   for e in efficiency_float32_deltas],
          "fixed_s": {str(c): round(median_of(f), 2) for c, f in fixed.items()},
          **{f"training_{name}": {key: median_of([run[name] for run in runs])
                                  for key, runs in training.items()}
             for name in ("cpu_share", "cpu_us_per_row")},
          "per_repeat": [{"order": [name for name, _ in orders[r]],
                          "jobs": jobs[r],
                          "machine_samples_per_s": {str(c): round(machine[c][r]) for c in counts},
                          "dask_samples_per_s": {str(c): round(hosted[c][r]) for c in counts},
                          "samples_per_s_without_rounds": round(without_rounds[r]),
                          "samples_per_s_float32_deltas": round(float32_deltas[r]),
                          "local_samples_per_s": round(local[r])} for r in range(repeats)],
          "workers": counts, **sizing.as_dict(), "repeats": repeats, "threads_per_worker": 1,
          "sync_period": str(job.train.sync_period)},
         as_json)
