"""`antdt bench quality`: the async mode's AUC next to the single-process reference.

The same job (same data, epochs and seed) trains once in the local mode (the reference) and
``--repeats`` times in the async mode per worker count; every async run must reach the reference
AUC minus ``--tolerance`` (0.005): one run is not a figure, so each worker count reports every
run's gap, the median and the worst, and passes on the worst. Rows are checked too: every run
trains every row once. The job is the default one (``--job``), a synthetic one of ``--rows``
rows, or a synthetic one sized for ``--target-s`` seconds of ideal training with the most
workers (:mod:`pipeline.bench.sizing`).

``--mode sync`` checks the synchronous mode instead: per worker count, ``--repeats`` pairs of
runs, interleaved: ``fixed`` (equal local batches) and ``adaptive`` (the controller's local
batches, with worker 0 ``--slowdown`` times slower so that they really differ; a slowdown
changes no row's arithmetic, only when it is trained). A step's gradient is the global batch's
mean however it is split, so both should match the reference: every run within
``--tolerance`` (0.003 in this mode) with every row trained once, and the two ways' median
AUCs within ``--pair-tolerance`` (0.001) of each other. Each run lists the local batches the
controller set last (``batch_rows``, by worker index).
"""

from __future__ import annotations

import statistics
from typing import Any

import click

from pipeline.bench import emit
from pipeline.bench.jobs import (SET_HELP, default_job, echo, run_async, synthetic_job,
                                 with_train)
from pipeline.bench.sizing import sized_job
from pipeline.job.config import FaultConfig, JobConfig
from pipeline.job.report import JobSummary
from pipeline.training.local import train_local


def run_row(summary: JobSummary, reference_auc: float, expected: int,
            tolerance: float) -> dict[str, Any]:
    """One run's figures: its AUC and gap to the reference, and whether it passed (within
    ``tolerance``, ``expected`` rows trained once, none lost)."""
    return {
        "auc": round(summary.auc, 4), "gap": round(reference_auc - summary.auc, 4),
        "samples_per_s": round(summary.samples_per_s), "train_s": round(summary.train_s, 1),
        "rows_trained": summary.rows_trained, "rows_lost": summary.rows_lost,
        "rows_retrained": summary.rows_retrained, "run_id": summary.run_id,
        "passed": summary.auc >= reference_auc - tolerance
        and summary.rows_trained == expected and summary.rows_lost == 0
        and summary.rows_retrained == 0}


def gaps_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median and worst gap of ``runs``, whether all passed, and the runs."""
    gaps = [run["gap"] for run in runs]
    return {"median_gap": round(statistics.median(gaps), 4), "worst_gap": max(gaps),
            "passed": all(run["passed"] for run in runs), "runs": runs}


def async_runs(job: JobConfig, count: int, repeats: int, reference_auc: float, expected: int,
               tolerance: float, quiet: bool) -> dict[str, Any]:
    """``repeats`` async runs of ``job`` on ``count`` workers: each run's AUC and gap, the
    median and worst gap, and whether every run is within ``tolerance`` with every row trained
    once."""
    runs = []
    for repeat in range(repeats):
        echo(f"async with {count} workers (run {repeat + 1}/{repeats})", quiet)
        summary = run_async(with_train(job, mode="async"), count).summary
        runs.append(run_row(summary, reference_auc, expected, tolerance))
    return {"workers": count, **gaps_of(runs)}


def sync_runs(job: JobConfig, count: int, repeats: int, reference_auc: float, expected: int,
              tolerance: float, pair_tolerance: float, slowdown: float,
              quiet: bool) -> dict[str, Any]:
    """``repeats`` pairs of sync runs of ``job`` on ``count`` workers, ``fixed`` and
    ``adaptive`` interleaved (the module docstring): each way's runs and gaps, the difference
    of their median AUCs, and whether every run passed and that difference is within
    ``pair_tolerance``."""
    faults = [FaultConfig(worker=0, slowdown=slowdown)] if slowdown > 1.0 else []
    ways = {"fixed": with_train(job, mode="sync", adaptive_batch=False, faults=()),
            "adaptive": with_train(job, mode="sync", adaptive_batch=True, faults=faults)}
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for repeat in range(repeats):
        for way, way_job in ways.items():
            echo(f"sync, {way} local batches, with {count} workers (run {repeat + 1}/"
                 f"{repeats})", quiet)
            outcome = run_async(way_job, count)
            batch_rows = sorted(zip((slot.index for slot in outcome.slots), outcome.batch_rows))
            runs[way].append({**run_row(outcome.summary, reference_auc, expected, tolerance),
                              "batch_rows": [size for _, size in batch_rows]})
    medians = {way: statistics.median(run["auc"] for run in way_runs)
               for way, way_runs in runs.items()}
    difference = round(abs(medians["fixed"] - medians["adaptive"]), 4)
    results = {way: {"median_auc": round(medians[way], 4), **gaps_of(way_runs)}
               for way, way_runs in runs.items()}
    return {"workers": count, "slowdown": slowdown, **results,
            "fixed_adaptive_difference": difference,
            "passed": all(r["passed"] for r in results.values())
            and difference <= pair_tolerance}


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
@click.option("--mode", type=click.Choice(["async", "sync"]), default="async",
              show_default=True,
              help="async: the async mode's runs; sync: the sync mode's fixed and adaptive "
                   "local batches.")
@click.option("--workers", default=None,
              help="Comma-separated worker counts of the runs (default: 2,4 async, 4 sync).")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True,
              help="Runs (sync: pairs of runs) per worker count; each count passes on its "
                   "worst run.")
@click.option("--tolerance", type=float, default=None,
              help="Worst gap to the reference a run may have (default: 0.005 async, "
                   "0.003 sync).")
@click.option("--pair-tolerance", type=float, default=0.001, show_default=True,
              help="Sync: the largest difference of the fixed and adaptive median AUCs.")
@click.option("--slowdown", type=click.FloatRange(min=1.0), default=4.0, show_default=True,
              help="Sync: worker 0 of the adaptive runs is this many times slower (1: none).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(job_path: str, rows: int | None, target_s: float | None, data_dir: str | None,
            mode: str, workers: str | None, repeats: int, tolerance: float | None,
            pair_tolerance: float, slowdown: float, overrides: tuple[str, ...],
            as_json: bool) -> None:
    """Async AUC with 2 and 4 workers next to the local reference (target: the worst run
    >= ref - 0.005); with --mode sync, fixed and adaptive local batches on 4 workers (targets:
    every run >= ref - 0.003, fixed and adaptive within 0.001)."""
    sync = mode == "sync"
    counts = [int(w) for w in (workers or ("4" if sync else "2,4")).split(",")]
    tolerance = tolerance if tolerance is not None else 0.003 if sync else 0.005
    if target_s is not None:
        job, _ = sized_job(max(counts), target_s, rows, data_dir, overrides, as_json,
                           mode="sync" if sync else "async")
    elif rows is not None:
        job = synthetic_job(data_dir, rows=rows, overrides=overrides)
    else:
        job = default_job(job_path, overrides)
    echo(f"reference: {job.name} in the local mode", as_json)
    reference = train_local(with_train(job, mode="local"))
    expected = reference.rows_trained
    common = {"job": job.name, "reference_auc": round(reference.auc, 4),
              "oracle_auc": None if reference.oracle_auc is None
              else round(reference.oracle_auc, 4),
              "reference_samples_per_s": round(reference.samples_per_s),
              "rows": expected, "epochs": job.train.epochs, "tolerance": tolerance,
              "repeats": repeats}
    if sync:
        results = [sync_runs(job, count, repeats, reference.auc, expected, tolerance,
                             pair_tolerance, slowdown, as_json) for count in counts]
        emit({"mode": "sync", **common, "pair_tolerance": pair_tolerance, "sync": results,
              "passed": all(r["passed"] for r in results)}, as_json)
        return
    results = [async_runs(job, count, repeats, reference.auc, expected, tolerance, as_json)
               for count in counts]
    emit({**common, "sync_period": str(job.train.sync_period), "async": results,
          "passed": all(r["passed"] for r in results)}, as_json)
