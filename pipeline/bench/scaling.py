"""`antdt bench scaling`: async samples/s with 1 and 2 workers (one thread each) on this machine.

Every worker count trains the same synthetic job on a fresh LocalCluster; samples/s is rows
trained over training seconds (first agent started to last agent ended). Repeats are interleaved
and the medians compared; the single-process local mode (one thread) is measured beside them.
"""

from __future__ import annotations

import click

from pipeline.bench import emit, median_of
from pipeline.bench.jobs import SET_HELP, echo, run_async, synthetic_job, with_train
from pipeline.local import train_local


@click.command("scaling")
@click.option("--rows", type=click.IntRange(min=10_000), default=1_200_000, show_default=True)
@click.option("--data", "data_dir", default=None,
              help="Where the synthetic data is made, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", default="1,2", show_default=True,
              help="Comma-separated worker counts; the ratio is the last over the first.")
@click.option("--repeats", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(rows: int, data_dir: str | None, workers: str, repeats: int,
            overrides: tuple[str, ...], as_json: bool) -> None:
    """Samples/s of the async mode with 1 and 2 workers (target: 2 workers >= 1.7x one)."""
    counts = [int(w) for w in workers.split(",")]
    job = with_train(synthetic_job(data_dir, rows=rows, overrides=overrides), mode="async")
    rates: dict[int, list[float]] = {count: [] for count in counts}
    local: list[float] = []
    for repeat in range(repeats):
        for count in counts:
            echo(f"repeat {repeat + 1}/{repeats}: {count} worker(s)", as_json)
            rates[count].append(run_async(job, count).summary.samples_per_s)
        echo(f"repeat {repeat + 1}/{repeats}: local mode", as_json)
        local.append(train_local(with_train(job, mode="local")).samples_per_s)
    medians = {count: median_of(samples) for count, samples in rates.items()}
    emit({"samples_per_s": {str(c): round(m) for c, m in medians.items()},
          "local_samples_per_s": round(median_of(local)),
          "ratio": round(medians[counts[-1]] / medians[counts[0]], 3),
          "workers": counts, "rows": rows, "repeats": repeats, "threads_per_worker": 1,
          "sync_period": str(job.train.sync_period)},
         as_json)
