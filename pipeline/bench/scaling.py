"""`antdt bench scaling`: async samples/s with 1 and 2 workers (one thread each) on this machine.

Every worker count trains the same synthetic job on a fresh LocalCluster; samples/s is rows
trained over training seconds (first agent started to last agent ended). The job is sized by
time (:mod:`pipeline.bench.sizing`): ``--target-s`` seconds of ideal training with the largest
worker count, unless ``--rows`` names its size. Repeats are interleaved
and the medians compared; the single-process local mode (one thread) is measured beside them.

The machine's own ceiling for this workload is measured in the same run: as many bare processes
as workers, each reading and training its share of the row groups the way an agent does (read,
then step, in one thread, one torch thread) with no Dask, no ledger and no model sync around it,
all started together. ``machine_ratio`` is what the hardware gives two such processes over one
(memory bandwidth and shared caches decide it, not our code); ``efficiency`` is the async ratio
over it, the share of the machine's scaling the framework keeps.

Where the rest goes is measured in the same run too: the most workers once more with the
periodic sync rounds off (a period no job reaches; only the rounds of the job's end run), so
``efficiency_without_rounds`` is what Dask, the ledger and the agents alone keep, and the
difference to ``efficiency`` what the model sync costs. (A diagnosis, not a way to train: the
replicas drift apart until the end.)
"""

from __future__ import annotations

import multiprocessing
import time
from multiprocessing.synchronize import Barrier

import click

from antdt.device import prepare_process
from antdt.sync import SyncPeriod
from data.reader import ShardReader
from models.train_step import TrainStep
from pipeline.bench import emit, median_of
from pipeline.bench.jobs import SET_HELP, echo, run_async, with_train
from pipeline.bench.sizing import sized_job
from pipeline.config import JobConfig
from pipeline.local import iterate_batches, prepare_data, train_local


ROUNDS_OFF = SyncPeriod(batches=10**9)
"""A sync period no job reaches: no periodic round, only those of the job's end."""


def _bare_trainer(job: JobConfig, share: int, of: int, start: Barrier) -> tuple[int, float]:
    """One bare process: build the model, wait for the others, then read and train row groups
    ``share, share + of, ...`` of the job's training data for the job's epochs; return (rows,
    seconds)."""
    prepare_process(job.train.threads)
    data = prepare_data(job)
    step = TrainStep(data.schema, job.model, job.train.optim, seed=job.train.seed)
    reader = ShardReader(data.schema)
    start.wait()
    began = time.perf_counter()
    rows = 0
    for _ in range(job.train.epochs):
        for batch in iterate_batches(reader, data.train[share::of], job.train.batch_size):
            step.step(batch)
            rows += int(batch.labels.shape[0])
    return rows, time.perf_counter() - began


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
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(target_s: float, rows: int | None, data_dir: str | None, workers: str,
            repeats: int, overrides: tuple[str, ...], as_json: bool) -> None:
    """Samples/s of the async mode with 1 and 2 workers (target: 2 workers >= 1.7x one), next
    to the machine's own ceiling for the same work."""
    counts = [int(w) for w in workers.split(",")]
    job, sizing = sized_job(max(counts), target_s, rows, data_dir, overrides, as_json)
    rates: dict[int, list[float]] = {count: [] for count in counts}
    machine: dict[int, list[float]] = {count: [] for count in counts}
    fixed: dict[int, list[float]] = {count: [] for count in counts}
    without_rounds: list[float] = []
    local: list[float] = []
    for repeat in range(repeats):
        for count in counts:
            echo(f"repeat {repeat + 1}/{repeats}: {count} worker(s)", as_json)
            run = run_async(job, count)
            rates[count].append(run.summary.samples_per_s)
            fixed[count].append(run.overhead()["fixed_s"] or 0.0)
        echo(f"repeat {repeat + 1}/{repeats}: {counts[-1]} worker(s), periodic rounds off",
             as_json)
        without_rounds.append(run_async(with_train(job, sync_period=ROUNDS_OFF),
                                        counts[-1]).summary.samples_per_s)
        for count in counts:
            echo(f"repeat {repeat + 1}/{repeats}: {count} bare process(es)", as_json)
            machine[count].append(machine_samples_per_s(job, count))
        echo(f"repeat {repeat + 1}/{repeats}: local mode", as_json)
        local.append(train_local(with_train(job, mode="local")).samples_per_s)
    medians = {count: median_of(samples) for count, samples in rates.items()}
    bare = {count: median_of(samples) for count, samples in machine.items()}
    ratio = medians[counts[-1]] / medians[counts[0]]
    machine_ratio = bare[counts[-1]] / bare[counts[0]]
    ratio_without_rounds = median_of(without_rounds) / medians[counts[0]]
    emit({"samples_per_s": {str(c): round(m) for c, m in medians.items()},
          "machine_samples_per_s": {str(c): round(m) for c, m in bare.items()},
          "local_samples_per_s": round(median_of(local)),
          "ratio": round(ratio, 3), "machine_ratio": round(machine_ratio, 3),
          "efficiency": round(ratio / machine_ratio, 3),
          "samples_per_s_without_rounds": round(median_of(without_rounds)),
          "efficiency_without_rounds": round(ratio_without_rounds / machine_ratio, 3),
          "fixed_s": {str(c): round(median_of(f), 2) for c, f in fixed.items()},
          "workers": counts, **sizing.as_dict(), "repeats": repeats, "threads_per_worker": 1,
          "sync_period": str(job.train.sync_period)},
         as_json)
