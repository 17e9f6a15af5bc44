"""`antdt bench hybrid`: the async mode with sharded tables (``model.tables: sharded``) against
its two baselines, both measured in the same run.

Quality: the job trains once in the local mode (the single-process reference), then
``--repeats`` times with sharded tables per worker count (``--workers``, 2 and 4); every run
must reach the reference AUC minus ``--tolerance`` (0.002) with every row trained once. Each
worker count reports every run's AUC and gap, the median, smallest and worst gap, and passes on
the worst (as :mod:`pipeline.bench.quality` does, whose helpers run and judge these runs), and
beside them the AUCs of as many runs with replicated tables (``replicated_aucs``): a gap both
share is the async mode's, not the sharded tables'.

Speed: on 2 workers, ``--repeats`` pairs of runs, sharded and replicated tables
(``model.tables: replicated``), interleaved with the order swapped on odd repeats so that a
machine slowing down slows both alike; samples/s are the medians over the repeats and
``ratio`` is sharded over replicated (target: ``--speed-target``, 0.8). The 2-worker sharded
runs of the pairs are the quality runs of 2 workers too (same job, same settings).

The job is synthetic and sized by time (:mod:`pipeline.bench.sizing`): ``--target-s`` seconds of
ideal training on 2 workers, unless ``--rows`` names its size. The targets decide ``passed``;
``--strict`` makes a failed target exit with status 1.

``--big`` runs the big-model scenario instead (:mod:`pipeline.bench.hybrid_big`): 26 tables of
``--tables-rows`` rows on 4 workers of ``--memory-limit``, one of them ``--slowdown`` times
slower, the async mode (``model.tables: auto``) against the sync mode (target: ``ratio`` >=
``--ratio-target``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import click

from models.config import Tables
from pipeline.bench import emit, median_of
from pipeline.bench import hybrid_big
from pipeline.bench.jobs import SET_HELP, echo, run_async, with_train
from pipeline.bench.quality import async_runs, gaps_of, run_row
from pipeline.bench.sizing import sized_job
from pipeline.job.config import JobConfig
from pipeline.job.report import JobSummary
from pipeline.training.local import train_local

SPEED_WORKERS = 2
"""The worker count of the speed pairs."""

PLACEMENTS: tuple[Tables, ...] = ("sharded", "replicated")
"""The speed pairs' tables, in the order of even repeats (odd repeats run them backwards)."""


def with_tables(job: JobConfig, tables: Tables) -> JobConfig:
    """``job`` in the async mode with its embedding tables placed ``tables``."""
    return dataclasses.replace(with_train(job, mode="async"),
                               model=dataclasses.replace(job.model, tables=tables))


def speed_pairs(job: JobConfig, repeats: int, quiet: bool) -> dict[Tables, list[JobSummary]]:
    """``repeats`` pairs of runs of ``job`` on :data:`SPEED_WORKERS` workers, sharded and
    replicated tables interleaved (the module docstring): each placement's summaries."""
    summaries: dict[Tables, list[JobSummary]] = {tables: [] for tables in PLACEMENTS}
    for repeat in range(repeats):
        order = PLACEMENTS if repeat % 2 == 0 else PLACEMENTS[::-1]
        for tables in order:
            echo(f"async, {tables} tables, with {SPEED_WORKERS} workers (run {repeat + 1}/"
                 f"{repeats})", quiet)
            summaries[tables].append(run_async(with_tables(job, tables), SPEED_WORKERS).summary)
    return summaries


def speed_of(summaries: dict[Tables, list[JobSummary]], target: float) -> dict[str, Any]:
    """The median samples/s of each placement, sharded over replicated, and whether that ratio
    reaches ``target``; the replicated runs' AUCs beside (the sharded runs' are the 2-worker
    quality runs), to tell a gap of the sharded tables from one of the async mode."""
    rates = {tables: median_of([s.samples_per_s for s in runs])
             for tables, runs in summaries.items()}
    ratio = rates["sharded"] / rates["replicated"]
    return {"workers": SPEED_WORKERS,
            "sharded_samples_per_s": round(rates["sharded"]),
            "replicated_samples_per_s": round(rates["replicated"]),
            "sharded_runs": [round(s.samples_per_s) for s in summaries["sharded"]],
            "replicated_runs": [round(s.samples_per_s) for s in summaries["replicated"]],
            "replicated_aucs": [round(s.auc, 4) for s in summaries["replicated"]],
            "ratio": round(ratio, 3), "target": target, "passed": ratio >= target}


def quality_of(count: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One worker count's quality figures: :func:`gaps_of` with the smallest gap beside."""
    return {"workers": count, "min_gap": min(run["gap"] for run in runs), **gaps_of(runs)}


def hybrid(job: JobConfig, counts: list[int], repeats: int, tolerance: float,
           speed_target: float, quiet: bool) -> dict[str, Any]:
    """The benchmark's result (the module docstring) on ``job``."""
    echo(f"reference: {job.name} in the local mode", quiet)
    reference = train_local(with_train(job, mode="local"))
    expected = reference.rows_trained
    pairs = speed_pairs(job, repeats, quiet)
    quality = []
    for count in counts:
        if count == SPEED_WORKERS:
            runs = [run_row(s, reference.auc, expected, tolerance) for s in pairs["sharded"]]
            replicated = [round(s.auc, 4) for s in pairs["replicated"]]
        else:
            runs = async_runs(with_tables(job, "sharded"), count, repeats, reference.auc,
                              expected, tolerance, quiet)["runs"]
            replicated = [run["auc"] for run in async_runs(
                with_tables(job, "replicated"), count, repeats, reference.auc, expected,
                tolerance, quiet)["runs"]]
        quality.append({**quality_of(count, runs), "replicated_aucs": replicated})
    speed = speed_of(pairs, speed_target)
    return {"job": job.name, "reference_auc": round(reference.auc, 4),
            "reference_samples_per_s": round(reference.samples_per_s), "rows": expected,
            "epochs": job.train.epochs, "repeats": repeats, "tolerance": tolerance,
            "quality": quality, "speed": speed,
            "passed": speed["passed"] and all(q["passed"] for q in quality)}


def table(result: dict[str, Any]) -> None:
    """The short human summary of ``result``."""
    click.echo(f"job {result['job']}: {result['rows']:,} rows, reference AUC "
               f"{result['reference_auc']:.4f} (local), tolerance {result['tolerance']}")
    click.echo(f"{'workers':>7}  {'AUCs (sharded)':<30} {'min gap':>8} {'worst':>8}  result")
    for q in result["quality"]:
        aucs = " ".join(f"{run['auc']:.4f}" for run in q["runs"])
        click.echo(f"{q['workers']:>7}  {aucs:<30} {q['min_gap']:>8.4f} {q['worst_gap']:>8.4f}"
                   f"  {'pass' if q['passed'] else 'FAIL'}")
    speed = result["speed"]
    click.echo(f"speed on {speed['workers']} workers: sharded {speed['sharded_samples_per_s']:,}"
               f" samples/s, replicated {speed['replicated_samples_per_s']:,} samples/s, ratio "
               f"{speed['ratio']:.3f} (target >= {speed['target']})  "
               f"{'pass' if speed['passed'] else 'FAIL'}")
    click.echo(f"passed: {result['passed']}")


@click.command("hybrid")
@click.option("--target-s", type=click.FloatRange(min=1.0), default=10.0, show_default=True,
              help="Size the synthetic job for this many seconds of ideal training on 2 workers "
                   "(a calibration run measures this machine).")
@click.option("--rows", type=click.IntRange(min=10_000), default=None,
              help="Instead of --target-s, a synthetic job of this many rows.")
@click.option("--data", "data_dir", default=None,
              help="Where the synthetic data is made, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", default="2,4", show_default=True,
              help="Comma-separated worker counts of the quality runs.")
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True,
              help="Quality runs per worker count, and speed pairs.")
@click.option("--tolerance", type=float, default=0.002, show_default=True,
              help="Worst gap to the reference AUC a sharded run may have.")
@click.option("--speed-target", type=float, default=0.8, show_default=True,
              help="Least sharded over replicated samples/s.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--big", is_flag=True,
              help="The big-model scenario instead: async (tables auto) against sync mode on 4 "
                   "memory-limited workers, one slow (module docstring).")
@click.option("--tables-rows", type=click.IntRange(min=2), default=hybrid_big.TABLES_ROWS,
              show_default=True, help="--big: rows of each of the 26 tables.")
@click.option("--memory-limit", default=hybrid_big.MEMORY_LIMIT, show_default=True,
              help="--big: each worker's Dask memory limit.")
@click.option("--slowdown", type=click.FloatRange(min=1.0), default=4.0, show_default=True,
              help="--big: how many times slower the last worker is.")
@click.option("--ratio-target", type=float, default=hybrid_big.RATIO_TARGET,
              show_default=True, help="--big: least async over sync samples/s.")
@click.option("--checkpoint-root", default=".antdt-bench", show_default=True,
              help="--big: where each run's checkpoint_dir is made (removed after the run).")
@click.option("--strict", is_flag=True, help="Exit with status 1 when a target fails.")
@click.option("--json", "as_json", is_flag=True)
def command(target_s: float, rows: int | None, data_dir: str | None, workers: str, repeats: int,
            tolerance: float, speed_target: float, overrides: tuple[str, ...], big: bool,
            tables_rows: int, memory_limit: str, slowdown: float, ratio_target: float,
            checkpoint_root: str, strict: bool, as_json: bool) -> None:
    """Sharded tables against the local reference AUC on 2 and 4 workers (target: every run
    >= ref - 0.002) and against replicated tables' samples/s on 2 workers (target ratio
    >= 0.8); with --big, a model too big for a worker's replica, async against sync."""
    if big:
        result = hybrid_big.big_command(tables_rows, memory_limit, slowdown, ratio_target,
                                        target_s, rows, data_dir, checkpoint_root, overrides,
                                        as_json)
        if as_json:
            emit(result, as_json)
        else:
            hybrid_big.table(result)
        if strict and not result["passed"]:
            raise SystemExit(1)
        return
    try:
        counts = [int(w) for w in workers.split(",")]
    except ValueError:
        raise click.UsageError(f"--workers: expected comma-separated worker counts, e.g. 2,4; "
                               f"found {workers!r}") from None
    if not counts or min(counts) < 1:
        raise click.UsageError(f"--workers: expected worker counts >= 1, found {workers!r}")
    job, sizing = sized_job(SPEED_WORKERS, target_s, rows, data_dir, overrides, as_json)
    result = {**hybrid(job, counts, repeats, tolerance, speed_target, as_json),
              "sizing": sizing.as_dict()}
    if as_json:
        emit(result, as_json)
    else:
        table(result)
    if strict and not result["passed"]:
        raise SystemExit(1)
