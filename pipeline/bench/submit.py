"""`antdt bench submit`: what running a job's control on the scheduler costs, against the
client-driven run antdt had before (the control loop in the client process).

Both ways train the same job on one LocalCluster, repeats interleaved:

* **submitted**: ``JobClient.submit`` and follow, as ``antdt submit`` does: AntDT's master on
  the scheduler registers the job, opens the MLflow run in a task on a worker, starts the agents
  and watches them.
* **client-driven** (the baseline): this process registers the job with the same services,
  opens the MLflow run itself, submits the same agent tasks and waits for them, as the old driver
  did.

Two figures per run, from the agents' own events (an agent reports right after its first batch,
then every ``antdt.agent.report-interval``) and the moment this process asked: **first batch**,
seconds from the request to the first trained batch of any agent, and **samples/s**, rows over
the seconds from that first report to the agents' last event. The first pair runs on fresh
workers and is reported apart (``cold``: the workers import the training and tracking stacks);
medians over the repeats after it; the ratios are submitted over client-driven.
"""

from __future__ import annotations

import statistics
import time
import uuid
from typing import Any

import click
from distributed import Client

from antdt.agent import AgentSpec, event_topic, forget_here
from antdt.controller import enable_controller
from antdt.jobs import JobClient, JobSpec
from antdt.jobs import tasks
from antdt.jobs.spec import load
from antdt.sharding.service import register_job
from antdt.sync import SyncPeriod
from antdt.sync.service import start_job, stop_job
from pipeline.bench import emit
from pipeline.bench.jobs import SET_HELP, echo, synthetic_job
from pipeline.training.cluster import job_spec
from pipeline.training.local_cluster import connect


def timings(client: Client, job: str, asked: float, rows: int) -> dict[str, float]:
    """First-batch seconds (after ``asked``) and samples/s of ``job``, from its agents'
    events."""
    events = client.get_events(event_topic(job))
    batches = [at for at, msg in events if msg.get("kind") == "progress"]
    if not batches:
        raise click.ClickException(f"job {job}: its agents reported no trained batch")
    first, last = min(batches), max(at for at, _ in events)
    return {"first_batch_s": first - asked, "samples_per_s": rows / max(last - first, 1e-9)}


def submitted(jobs: JobClient, spec: JobSpec) -> dict[str, float]:
    """Submit ``spec`` to AntDT's master and follow it to its end."""
    asked = time.time()
    record = jobs.follow(jobs.submit(spec)["job"]["job_id"])
    if record["state"] != "finished":
        raise click.ClickException(f"job {record['job_id']} {record['state']}: "
                                   f"{record['error']}")
    return timings(jobs.client, record["job_id"], asked, record["rows"]["trained"])


def client_driven(client: Client, spec: JobSpec) -> dict[str, float]:
    """The same job with its control in this process (the baseline)."""
    plan, code = spec.plan, spec.code
    job = f"{plan.name}-client-{uuid.uuid4().hex[:8]}"
    asked = time.time()
    workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
    client.run(tasks.prepare_worker, plan.preload)
    register_job(client, job, plan.row_groups, shard_rows=plan.shard_rows,
                 batch_rows=plan.batch_rows, epochs=plan.epochs, seed=plan.seed,
                 quarantine=plan.quarantine)
    start_job(client, job, workers)
    enable_controller(client, job, plan.sharding == "antdt")
    hooks = load(code.hooks, "hooks")
    run = hooks.start(job, len(workers))
    period = SyncPeriod.parse(plan.sync_period, where="job plan sync_period")
    futures = [client.submit(tasks.agent_task,
                             AgentSpec(job=job, batch_rows=plan.batch_rows, sync_period=period,
                                       threads=plan.threads),
                             code.trainer, code.reader, workers=[worker],
                             allow_other_workers=False, pure=False, key=f"antdt-agent-{job}-{i}")
               for i, worker in enumerate(workers)]
    rows = sum(report.rows for report in client.gather(futures))
    hooks.abort(run, "FINISHED", "the bench's client-driven baseline")
    stop_job(client, job)
    client.sync(client.scheduler.antdt_forget_job, job=job)
    client.run(forget_here, job)
    return timings(client, job, asked, rows)


@click.command("submit")
@click.option("--rows", type=click.IntRange(min=10_000), default=1_200_000, show_default=True)
@click.option("--data", "data_dir", default=None,
              help="Where the synthetic data is made, then reused (default: "
                   ".antdt-bench/synthetic-ROWS).")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(rows: int, data_dir: str | None, workers: int, repeats: int,
            overrides: tuple[str, ...], as_json: bool) -> None:
    """A job submitted to AntDT's master against the same job driven from this process, on one
    cluster: seconds to the first trained batch and samples/s (target: within 5%)."""
    job = synthetic_job(data_dir, rows=rows, overrides=overrides)
    spec = job_spec(job)
    runs: dict[str, list[dict[str, float]]] = {"client_driven": [], "submitted": []}
    cold: dict[str, dict[str, float]] = {}
    with connect(workers) as client, JobClient(client) as jobs:
        for repeat in range(repeats + 1):  # the first pair warms the workers up (cold start)
            for way in runs:
                figures = submitted(jobs, spec) if way == "submitted" \
                    else client_driven(client, spec)
                echo(f"repeat {repeat}{' (warm-up)' * (repeat == 0)}: {way} "
                     f"{figures['samples_per_s']:,.0f} samples/s, first batch after "
                     f"{figures['first_batch_s']:.2f}s", as_json)
                if repeat:
                    runs[way].append(figures)
                else:
                    cold[way] = figures

    def median(way: str, key: str) -> float:
        return statistics.median(run[key] for run in runs[way])

    result: dict[str, Any] = {
        "benchmark": "submit", "rows": spec.plan.rows * spec.plan.epochs, "workers": workers,
        "repeats": repeats, "runs": runs, "cold": cold,
        **{f"{way}_{key}": median(way, key) for way in runs
           for key in ("samples_per_s", "first_batch_s")}}
    result["samples_per_s_ratio"] = result["submitted_samples_per_s"] \
        / result["client_driven_samples_per_s"]
    result["first_batch_extra_s"] = result["submitted_first_batch_s"] \
        - result["client_driven_first_batch_s"]
    result["ok"] = result["samples_per_s_ratio"] >= 0.95
    emit(result, as_json)
