"""`antdt bench quality`: the async mode's AUC next to the single-process reference.

The same job (same data, epochs and seed) trains once in the local mode (the reference) and
``--repeats`` times in the async mode per worker count; every async run must reach the reference
AUC minus ``--tolerance`` (0.005): one run is not a figure, so each worker count reports every
run's gap, the median and the worst, and passes on the worst. Rows are checked too: every run
trains every row once. The job is the default one (``--job``), a synthetic one of ``--rows``
rows, or a synthetic one sized for ``--target-s`` seconds of ideal training with the most
workers (:mod:`pipeline.bench.sizing`).
"""

from __future__ import annotations

import statistics
from typing import Any

import click

from pipeline.bench import emit
from pipeline.bench.jobs import (SET_HELP, default_job, echo, run_async, synthetic_job,
                                 with_train)
from pipeline.bench.sizing import sized_job
from pipeline.job.config import JobConfig
from pipeline.training.local import train_local


def async_runs(job: JobConfig, count: int, repeats: int, reference_auc: float, expected: int,
               tolerance: float, quiet: bool) -> dict[str, Any]:
    """``repeats`` async runs of ``job`` on ``count`` workers: each run's AUC and gap, the
    median and worst gap, and whether every run is within ``tolerance`` with every row trained
    once."""
    runs = []
    gaps = []
    for repeat in range(repeats):
        echo(f"async with {count} workers (run {repeat + 1}/{repeats})", quiet)
        summary = run_async(with_train(job, mode="async"), count).summary
        gaps.append(round(reference_auc - summary.auc, 4))
        runs.append({
            "auc": round(summary.auc, 4), "gap": gaps[-1],
            "samples_per_s": round(summary.samples_per_s), "train_s": round(summary.train_s, 1),
            "rows_trained": summary.rows_trained, "rows_lost": summary.rows_lost,
            "rows_retrained": summary.rows_retrained, "run_id": summary.run_id,
            "passed": summary.auc >= reference_auc - tolerance
            and summary.rows_trained == expected and summary.rows_lost == 0
            and summary.rows_retrained == 0})
    return {"workers": count, "median_gap": round(statistics.median(gaps), 4),
            "worst_gap": max(gaps), "passed": all(run["passed"] for run in runs),
            "runs": runs}


@click.command("quality")
@click.option("--job", "job_path", default="jobs/synthetic.yaml", show_default=True,
              help="The job to train (its data must exist: `make demo-data`).")
@click.option("--rows", type=click.IntRange(min=10_000), default=None,
              help="Instead of --job, a synthetic job of this many rows (made in --data).")
@click.option("--target-s", type=click.FloatRange(min=1.0), default=None,
              help="Instead of --job, a synthetic job sized for this many seconds of ideal "
                   "training with the most workers (a calibration run measures this machine).")
@click.option("--data", "data_dir", default=None,
              help="Where --rows makes its synthetic data, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", default="2,4", show_default=True,
              help="Comma-separated worker counts of the async runs.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Async runs per worker count; each count passes on its worst run.")
@click.option("--tolerance", type=float, default=0.005, show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(job_path: str, rows: int | None, target_s: float | None, data_dir: str | None,
            workers: str, repeats: int, tolerance: float, overrides: tuple[str, ...],
            as_json: bool) -> None:
    """Async AUC with 2 and 4 workers next to the local reference (target: the worst run
    >= ref - 0.005)."""
    counts = [int(w) for w in workers.split(",")]
    if target_s is not None:
        job, _ = sized_job(max(counts), target_s, rows, data_dir, overrides, as_json)
    elif rows is not None:
        job = synthetic_job(data_dir, rows=rows, overrides=overrides)
    else:
        job = default_job(job_path, overrides)
    echo(f"reference: {job.name} in the local mode", as_json)
    reference = train_local(with_train(job, mode="local"))
    expected = reference.rows_trained
    results = [async_runs(job, count, repeats, reference.auc, expected, tolerance, as_json)
               for count in counts]
    emit({"job": job.name, "reference_auc": round(reference.auc, 4),
          "oracle_auc": None if reference.oracle_auc is None else round(reference.oracle_auc, 4),
          "reference_samples_per_s": round(reference.samples_per_s),
          "rows": expected, "epochs": job.train.epochs, "tolerance": tolerance,
          "repeats": repeats, "sync_period": str(job.train.sync_period),
          "async": results, "passed": all(r["passed"] for r in results)}, as_json)
