"""What the distributed benchmarks share: their data, their job, and one run of it.

Each run starts its own LocalCluster (like ``antdt train --workers N``), so the runs of a
benchmark are independent and measured the same way: ``train_s`` from the first agent's start to
the last agent's end, rows from the ledger. The runs go to the MLflow experiment ``antdt-bench``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import click
import dask
from distributed import Client

from data.synth import generate
from antdt.jobs import JobClient
from pipeline.job.config import (FaultConfig, JobConfig, Sharding, apply_override,
                                 job_from_dict, load_job)
from pipeline.job.report import JobSummary
from pipeline.training.cluster import job_spec
from pipeline.training.local_cluster import connect, worker_modules
from pipeline.training.following import AgentRecord, outcome

logger = logging.getLogger(__name__)

EXPERIMENT = "antdt-bench"


SET_HELP = "Override a job setting, e.g. --set train.sync_period=0.5 (repeatable)."


def synthetic_job(folder: str | None, *, rows: int, days: int = 4, seed: int = 0,
                  batch_size: int = 4096, overrides: Sequence[str] = ()) -> JobConfig:
    """A DLRM job on ``rows`` synthetic rows in ``folder`` (default
    ``.antdt-bench/synthetic-ROWS``; made once, then reused): the last day validates, the others
    train. ``overrides`` are ``key.path=value`` settings, as ``antdt train --set`` takes."""
    folder = folder or os.path.join(".antdt-bench", f"synthetic-{rows}")
    schema = os.path.join(folder, "schema.yaml")
    if not os.path.exists(os.path.join(folder, "oracle.json")):
        generate(folder, rows=rows, days=days, seed=seed, files_per_day=2,
                 row_group_rows=16_384)
    days_found = sorted(d for d in os.listdir(folder) if d.startswith("date="))
    raw: dict[str, Any] = {
        "name": f"bench-{rows}",
        "data": {"train": [os.path.join(folder, d) for d in days_found[:-1]],
                 "validation": os.path.join(folder, days_found[-1]), "schema": schema},
        "model": {"arch": "dlrm", "embedding_dim": 16},
        # the default sync period (4 peer batches); a benchmark measures the worker counts it
        # names, however small its job
        "train": {"batch_size": batch_size, "seed": seed, "shard_rows": 4 * batch_size,
                  "min_batches_per_worker": 0},
        "mlflow": {"experiment": EXPERIMENT},
    }
    for item in overrides:
        apply_override(raw, item)
    return job_from_dict(raw, source=f"benchmark job on {folder}")


def default_job(path: str, overrides: Sequence[str] = ()) -> JobConfig:
    """The job at ``path`` (tracked in the benchmark experiment) with ``overrides``; a clear
    error when its data is missing."""
    job = load_job(path, [*overrides, "mlflow.experiment=" + EXPERIMENT])
    if not os.path.exists(job.data.schema):
        raise click.UsageError(f"{path}: its schema {job.data.schema} does not exist; make the "
                               "demo data first (`make demo-data`)")
    return job


def with_train(job: JobConfig, *, sharding: Sharding | None = None,
               faults: Sequence[FaultConfig] | None = None, **train: Any) -> JobConfig:
    """``job`` with ``train`` fields (and ``sharding``) replaced and, if given, ``faults``
    instead of its own."""
    if sharding is not None:
        train["sharding"] = sharding
    return dataclasses.replace(job, train=dataclasses.replace(job.train, **train),
                               faults=job.faults if faults is None else tuple(faults))


@dataclass(frozen=True)
class Outcome:
    """One benchmark run: its summary, its agents (rows, busy seconds, start and end), when
    each worker's first lease started and when the last lease that trained rows ended (seconds
    after training started), why the driver stopped it, if it did, and (sync mode) each
    agent's last local batch as the controller set it (None: it set none), in ``slots`` order."""

    summary: JobSummary
    slots: list[AgentRecord]
    first_lease: dict[str, float]
    last_row: float | None
    stopped: str | None
    batch_rows: tuple[int | None, ...] = ()

    def training_cpu(self) -> dict[str, float]:
        """Where the agents' training threads spent their busy seconds: ``cpu_share``, the CPU
        seconds over the busy seconds (what of a core they got), and ``cpu_us_per_row``, the
        CPU microseconds a trained row cost them (what each row took on it)."""
        rows = sum(slot.rows for slot in self.slots)
        busy = sum(slot.busy_s for slot in self.slots)
        cpu = sum(slot.cpu_s for slot in self.slots)
        return {"cpu_share": round(cpu / busy, 3) if busy else 0.0,
                "cpu_us_per_row": round(cpu / rows * 1e6, 3) if rows else 0.0}

    def steady_rate(self) -> float:
        """Samples per second of the training seconds without the fixed costs
        (:meth:`overhead`): the rate the run held once every agent trained; nan when a fixed
        cost is unknown or no time is left."""
        fixed = self.overhead()["fixed_s"]
        seconds = self.summary.train_s - fixed if fixed is not None else math.nan
        return self.summary.rows_trained / seconds if seconds > 0 else math.nan

    def overhead(self) -> dict[str, float | None]:
        """The job's fixed costs inside its training seconds: ``start_s`` until every agent
        of the start has its first lease (models built, readers open), ``tail_s`` from the last
        row trained until the last agent ended (the final sync round), ``fixed_s`` both."""
        starts = [self.first_lease.get(slot.worker) for slot in self.slots if not slot.join]
        start = max((s for s in starts if s is not None), default=None)
        tail = None if self.last_row is None else max(0.0, self.summary.train_s - self.last_row)
        fixed = None if start is None or tail is None else start + tail
        return {name: None if value is None else round(value, 2)
                for name, value in (("start_s", start), ("tail_s", tail), ("fixed_s", fixed))}


def run_async(job: JobConfig, workers: int, *, deadline_s: float | None = None,
              setting: Callable[[Client], AbstractContextManager[Any]] | None = None,
              memory_limit: str | None = None) -> Outcome:
    """Train ``job`` on a new LocalCluster of ``workers`` single-threaded workers (each limited
    to ``memory_limit`` by Dask when given), as ``antdt train`` does; ``setting`` (given the
    client) surrounds the run, e.g. a CPU hog next to one worker. A job with faults (the
    benchmark's stragglers) runs on a cluster that allows them (``antdt.jobs.allow-faults``)."""
    spec = job_spec(job, deadline_s=deadline_s)
    allow = dask.config.set({"antdt.jobs.allow-faults": True}) if job.faults \
        else contextlib.nullcontext()
    with allow, \
            connect(workers, preload=worker_modules(job), memory_limit=memory_limit) as client, \
            (setting(client) if setting is not None else contextlib.nullcontext()), \
            JobClient(client) as jobs:
        record = jobs.follow(jobs.submit(spec)["job"]["job_id"])
    return Outcome(outcome(record), [AgentRecord.of(a) for a in record["agents"]],
                   record["first_lease"], record["last_row"], record["stopped"],
                   tuple(w["batch_rows"] for w in record["workers"]))


def pin_process(cpus: set[int]) -> None:
    """Pin every thread of this process to ``cpus`` (threads started later inherit it)."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


@contextlib.contextmanager
def cpu_hog(client: Client) -> Iterator[None]:
    """Real CPU contention: the sorted first worker and a busy-looping process share CPU 0, the
    other workers get the other CPUs (Linux; at least two CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise click.UsageError(f"the contention scenario needs at least 2 CPUs, found {cpus}")
    workers = sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])
    client.run(pin_process, {cpus[0]}, workers=workers[:1])
    client.run(pin_process, set(cpus[1:]), workers=workers[1:])
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(hog.pid, {cpus[0]})
        yield
    finally:
        hog.kill()
        hog.wait()


def echo(message: str, quiet: bool) -> None:
    """A progress line on stderr (not with ``--json``, whose stdout is one JSON object)."""
    if not quiet:
        click.echo(message, err=True)
