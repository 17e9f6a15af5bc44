"""`antdt bench quality`: the async mode's AUC next to the single-process reference.

The same job (same data, epochs and seed) trains once in the local mode (the reference) and once
in the async mode per worker count; the async runs must reach the reference AUC minus
``--tolerance`` (0.005). Rows are checked too: every run trains every row once.
"""

from __future__ import annotations

import click

from pipeline.bench import emit
from pipeline.bench.jobs import (SET_HELP, default_job, echo, run_async, synthetic_job,
                                 with_train)
from pipeline.local import train_local


@click.command("quality")
@click.option("--job", "job_path", default="jobs/synthetic.yaml", show_default=True,
              help="The job to train (its data must exist: `make demo-data`).")
@click.option("--rows", type=click.IntRange(min=10_000), default=None,
              help="Instead of --job, a synthetic job of this many rows (made in --data).")
@click.option("--data", "data_dir", default=None,
              help="Where --rows makes its synthetic data, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", default="2,4", show_default=True,
              help="Comma-separated worker counts of the async runs.")
@click.option("--tolerance", type=float, default=0.005, show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(job_path: str, rows: int | None, data_dir: str | None, workers: str,
            tolerance: float, overrides: tuple[str, ...], as_json: bool) -> None:
    """Async AUC with 2 and 4 workers next to the local reference (target: >= ref - 0.005)."""
    counts = [int(w) for w in workers.split(",")]
    job = (synthetic_job(data_dir, rows=rows, overrides=overrides) if rows is not None
           else default_job(job_path, overrides))
    echo(f"reference: {job.name} in the local mode", as_json)
    reference = train_local(with_train(job, mode="local"))
    expected = reference.rows_trained
    runs = []
    for count in counts:
        echo(f"async with {count} workers", as_json)
        summary = run_async(with_train(job, mode="async"), count).summary
        runs.append({
            "workers": count, "auc": round(summary.auc, 4),
            "gap": round(reference.auc - summary.auc, 4),
            "samples_per_s": round(summary.samples_per_s), "train_s": round(summary.train_s, 1),
            "rows_trained": summary.rows_trained, "rows_lost": summary.rows_lost,
            "rows_duplicated": summary.rows_duplicated, "run_id": summary.run_id,
            "passed": summary.auc >= reference.auc - tolerance
            and summary.rows_trained == expected and summary.rows_lost == 0
            and summary.rows_duplicated == 0})
    emit({"job": job.name, "reference_auc": round(reference.auc, 4),
          "oracle_auc": None if reference.oracle_auc is None else round(reference.oracle_auc, 4),
          "reference_samples_per_s": round(reference.samples_per_s),
          "rows": expected, "epochs": job.train.epochs, "tolerance": tolerance,
          "sync_period": str(job.train.sync_period),
          "async": runs, "passed": all(r["passed"] for r in runs)}, as_json)
