"""Benchmarks sized by time, not rows: machines differ 3x in speed, and a job sized in rows
that trains 30 s on one machine trains 10 s on another, where a job's fixed costs (agents
starting, the final sync round) weigh three times as much.

:func:`calibrate` runs a short job of the benchmark's kind on the benchmark's own cluster (same
worker count, one thread each), takes the workers' summed training rate from it (each agent's
rows over its busy seconds, as the straggler benchmark's ideal time does) and sizes the
synthetic dataset so that perfect sharing of that capacity trains it in ``target_s`` seconds.
A synchronous benchmark calibrates on a synchronous job (equal local batches, no fault): its
ranks step together, so its rate is the job's rows over its training seconds less the fixed
costs (:meth:`~pipeline.bench.jobs.Outcome.steady_rate`), and ``target_s`` is that many seconds
of fault-free synchronous training.
Row counts are rounded to two significant digits, so that runs of similar machines reuse one
synthetic dataset (made once in ``.antdt-bench/synthetic-ROWS``). The sizing is a function of
the calibration run's outcome (:func:`calibration_rate`, :func:`rows_for`): a test holds it
against the outcome it was given, not against how long the sized job then took.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import click

from data.files import expand, row_groups
from pipeline.bench.jobs import Outcome, echo, run_async, synthetic_job, with_train
from pipeline.job.config import JobConfig

CALIBRATION_ROWS = 640_000
"""Rows of the calibration job's dataset, 480,000 of them to train (three of its four days):
seconds of training on any machine, so that a second of contention from a noisy neighbour moves
the measured rate by a few percent, not by a fifth."""

DAYS = 4
"""Days of the synthetic datasets; the last one validates."""


Runner = Callable[[JobConfig, int], Outcome]
"""``run(job, workers)``: one run of ``job`` on a new cluster of ``workers`` (:func:`run_async`;
a test may wrap it to see the calibration run)."""


class Calibration(NamedTuple):
    """``rows`` of synthetic data for ``target_s`` seconds of ideal training at
    ``samples_per_s``, the workers' summed rate in a calibration run of ``seconds``."""

    rows: int
    target_s: float
    samples_per_s: float
    seconds: float


@dataclass(frozen=True)
class Sizing:
    """How a benchmark's dataset was sized: ``rows`` of synthetic data, ``train_rows`` of them
    train; ``calibration`` None when ``--rows`` gave the size."""

    rows: int
    train_rows: int
    calibration: Calibration | None

    def as_dict(self) -> dict[str, Any]:
        calibration = self.calibration
        return {"rows": self.rows, "train_rows": self.train_rows,
                "target_s": None if calibration is None else calibration.target_s,
                "calibration": None if calibration is None else {
                    "samples_per_s": round(calibration.samples_per_s),
                    "seconds": round(calibration.seconds, 1)}}


def capacity(outcome: Outcome) -> float:
    """The summed training rate of a run's agents: rows over busy seconds, each."""
    return sum(slot.rows / slot.busy_s for slot in outcome.slots
               if slot.rows > 0 and slot.busy_s > 0)


def rows_for(samples_per_s: float, target_s: float) -> int:
    """Synthetic rows (all days) whose training days take ``target_s`` at ``samples_per_s``,
    rounded to two significant digits.

    >>> rows_for(100_000.0, 30.0)  # 3M rows train, 4M in all
    4000000
    >>> rows_for(123_456.0, 10.0)
    1600000
    """
    total = samples_per_s * target_s * DAYS / (DAYS - 1)
    scale = 10 ** max(0, int(math.log10(total)) - 1)
    return max(10_000, round(total / scale) * scale)


def calibration_rate(outcome: Outcome, mode: Literal["async", "sync"]) -> float:
    """The samples/s a calibration run of ``mode`` measured (the module docstring): its
    agents' summed rate (async), or its rate without the fixed costs (sync)."""
    return outcome.steady_rate() if mode == "sync" else capacity(outcome)


def train_rows(job: JobConfig) -> int:
    """Rows of one epoch of ``job``'s training data, from the Parquet footers."""
    return sum(group.num_rows for group in row_groups(expand(list(job.data.train))))


def calibrate(workers: int, target_s: float, *, overrides: Sequence[str] = (),
              quiet: bool = False, mode: Literal["async", "sync"] = "async",
              run: Runner = run_async) -> Calibration:
    """Size a synthetic job for ``target_s`` seconds of ideal training on ``workers`` workers
    of this machine in ``mode`` (the module docstring), from one ``run`` of the calibration
    job."""
    echo(f"calibrating: {CALIBRATION_ROWS:,} rows on {workers} workers ({mode} mode)", quiet)
    job = synthetic_job(None, rows=CALIBRATION_ROWS, overrides=overrides)
    began = time.perf_counter()
    if mode == "sync":
        job = with_train(job, mode="sync", adaptive_batch=False, faults=())
    else:
        job = with_train(job, mode="async", sharding="pull")
    rate = calibration_rate(run(job, workers), mode)
    if not rate > 0:
        raise click.ClickException(f"calibration measured no training rate ({rate} samples/s "
                                   f"on {workers} workers, {mode} mode); give --rows instead")
    rows = rows_for(rate, target_s)
    echo(f"calibrated: {rate:,.0f} samples/s on {workers} workers; {rows:,} rows for "
         f"{target_s:g}s of training", quiet)
    return Calibration(rows, target_s, rate, time.perf_counter() - began)


def sized_job(workers: int, target_s: float, rows: int | None, data_dir: str | None,
              overrides: Sequence[str], quiet: bool,
              mode: Literal["async", "sync"] = "async",
              run: Runner = run_async) -> tuple[JobConfig, Sizing]:
    """The benchmark's synthetic job in ``mode``: of ``rows`` rows if given, else calibrated
    for ``target_s`` seconds on ``workers`` workers (by one ``run`` of the calibration job);
    with how it was sized."""
    calibration = None
    size = rows
    if size is None:
        calibration = calibrate(workers, target_s, overrides=overrides, quiet=quiet, mode=mode,
                                run=run)
        size = calibration.rows
    job = with_train(synthetic_job(data_dir, rows=size, overrides=overrides), mode=mode)
    return job, Sizing(size, train_rows(job), calibration)
