"""The ``antdt`` command line: data tools, training, benchmarks.

Long work shows a progress bar on stderr; ``--json`` prints one machine-readable object on stdout.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import logging
import os
import sys
import threading

import click

from antdt.errors import AntdtError, JobCancelled, JobFailed
from pipeline import terminal
from pipeline.bench import bench
from pipeline.cli.experiments import EXPERIMENT_COMMANDS
from pipeline.cli.jobs import (JOB_COMMANDS, Cluster, cluster_options, follow_and_report,
                               init_from_option, initialising, register_option, registering,
                               resume_option, resume_spec)
from pipeline.terminal import progress_bar, stderr


class _Main(click.Group):
    """Turns domain errors into one clear line, never a traceback: exit code 1 for a job that
    failed or was cancelled, 2 for bad input. ``antdt simulate`` is imported only when run (the
    simulator imports the controller and Dask: a quarter of a second of every command)."""

    LAZY = {"simulate": "pipeline.cli.simulate"}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.LAZY})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.LAZY:
            command = importlib.import_module(self.LAZY[cmd_name]).command
            assert isinstance(command, click.Command)
            return command
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (JobFailed, JobCancelled) as exc:
            stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            sys.exit(1)
        except AntdtError as exc:
            stderr.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            sys.exit(2)


@click.group(name="antdt", cls=_Main)
@click.option("-v", "--verbose", count=True,
              help="Show the libraries' logs and warnings: -v info, -vv debug.")
def cli(verbose: int) -> None:
    """antdt: straggler-tolerant training of ranking models on Dask."""
    terminal.configure(verbose)


@cli.group()
def data() -> None:
    """Generate and validate Parquet datasets."""


@data.command("synth")
@click.argument("out")
@click.option("--rows", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="Rows in all, over all days.")
@click.option("--days", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--row-group-rows", type=click.IntRange(min=1), default=65536, show_default=True)
@click.option("--files-per-day", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--drift", is_flag=True,
              help="Make the click model move from day to day (rotating weights, new ids, a "
                   "weekly cycle, one abrupt shift); the settings used are printed and saved in "
                   "oracle.json. The --drift-* options tune it (default: data.drift.Drift's).")
@click.option("--drift-rotate", type=float, default=None,
              help="Radians a day the first-order weights turn towards a fresh draw.")
@click.option("--drift-new-ids", type=float, default=None,
              help="Share of a feature's traffic the day's new ids take on their first day.")
@click.option("--drift-id-half-life", type=float, default=None,
              help="Half-life, in days, of the new ids' share of traffic.")
@click.option("--drift-weekly", type=float, default=None,
              help="Amplitude of the weekly cycle of the bias, in logit units.")
@click.option("--drift-shift-day", type=int, default=None,
              help="Day of the abrupt shift (default: the middle day).")
@click.option("--drift-shift", type=float, default=None,
              help="Share of the features whose weights flip sign on the shift day.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary.")
def data_synth(out: str, rows: int, days: int, seed: int, row_group_rows: int,
               files_per_day: int, drift: bool, drift_rotate: float | None,
               drift_new_ids: float | None, drift_id_half_life: float | None,
               drift_weekly: float | None, drift_shift_day: int | None,
               drift_shift: float | None, as_json: bool) -> None:
    """Write Criteo-like synthetic data with a hidden true model to OUT (plus schema and oracle)."""
    from data.drift import Drift
    from data.synth import generate

    tuning = {"rotate": drift_rotate, "new_ids": drift_new_ids,
              "id_half_life_days": drift_id_half_life, "weekly": drift_weekly,
              "shift": drift_shift}
    given = {name: value for name, value in tuning.items() if value is not None}
    if (given or drift_shift_day is not None) and not drift:
        raise click.UsageError("the --drift-* options need --drift")
    settings = Drift(shift_day=drift_shift_day, **given) if drift else None
    with progress_bar("synthesising rows", rows, enabled=not as_json) as bar:
        result = generate(out, rows=rows, days=days, seed=seed, row_group_rows=row_group_rows,
                          files_per_day=files_per_day, drift=settings, progress=bar.advance)
    oracle_auc = {d: v["auc"] for d, v in result.oracle["per_day"].items()}
    if as_json:
        summary = {"out": out, "rows": result.rows, "files": len(result.files),
                   "oracle_auc": oracle_auc}
        if "drift" in result.oracle:
            summary["drift"] = result.oracle["drift"]
        click.echo(json.dumps(summary, sort_keys=True))
    else:
        click.echo(f"wrote {result.rows:,} rows in {len(result.files)} files to {out}")
        if "drift" in result.oracle:
            shown = ", ".join(f"{k}={v}" for k, v in result.oracle["drift"].items())
            click.echo(f"  drifting: {shown}")
        for day, auc in oracle_auc.items():
            click.echo(f"  {day}: oracle AUC {auc:.4f}")


@data.command("validate")
@click.argument("paths", nargs=-1, required=True)
@click.option("--schema", "schema_path", required=True, help="The schema YAML.")
@click.option("--json", "as_json", is_flag=True, help="Print the problems as JSON.")
def data_validate(paths: tuple[str, ...], schema_path: str, as_json: bool) -> None:
    """Check every file's schema, readability and label values; exit 1 when any is bad."""
    from data.files import expand
    from data.schema import Schema
    from data.validate import validate

    schema = Schema.from_yaml(schema_path)
    files = expand(list(paths))
    report = validate(files, schema)
    if as_json:
        click.echo(json.dumps({"ok": report.ok, "files": len(files),
                               "good_rows": report.good_rows, "bad_rows": report.bad_rows,
                               "problems": [p._asdict() for p in report.problems]},
                              sort_keys=True))
    else:
        for problem in report.problems:
            click.echo(str(problem), err=True)
        verdict = "ok" if report.ok else f"{len(report.problems)} problem(s)"
        click.echo(f"{len(files)} file(s), {report.good_rows:,} good rows, "
                   f"{report.bad_rows:,} bad rows: {verdict}")
    sys.exit(0 if report.ok else 1)


@cli.command()
@click.argument("job_path", metavar="JOB.yaml")
@click.option("--mode", type=click.Choice(["async", "sync", "local"]), default=None,
              help="async: a Dask cluster, one replica per worker (default: the job's "
                   "train.mode, async); sync: a Dask cluster, one model sharded across the "
                   "workers, synchronous steps; local: this process, the reference path.")
@click.option("--local", "local_alias", is_flag=True, help="Alias of --mode local.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Workers of the LocalCluster to start (default: the job's train.workers).")
@cluster_options
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set train.epochs=2 (repeatable).")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: the job's, "
              "else MLflow's default store).")
@click.option("--job-id", default=None, help="The job's id (async mode).")
@resume_option
@init_from_option
@register_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def train(job_path: str, mode: str | None, local_alias: bool, workers: int | None,
          cluster: Cluster, overrides: tuple[str, ...], tracking_uri: str | None,
          job_id: str | None, resume: str | None, init_from: str | None, register: str | None,
          as_json: bool) -> None:
    """Train the model of JOB.yaml, evaluate it and track the run in MLflow: on a new
    LocalCluster, or on the Dask cluster at --scheduler (the same as ``antdt submit``). With
    -v, where the command's seconds went follows the summary (``--json``: ``phases``)."""
    from pipeline.job.config import load_job
    from pipeline.job.phases import Phases

    phases = Phases()
    phases.mark("start")
    scheduler = cluster.given
    if local_alias and mode not in (None, "local"):
        raise click.UsageError(f"--local contradicts --mode {mode}")
    if workers is not None and scheduler is not None:
        raise click.UsageError("--workers starts a LocalCluster; with --scheduler the "
                               "cluster's own workers train: give one or the other")
    if tracking_uri:
        overrides = (*overrides, f"mlflow.tracking_uri={tracking_uri}")
    if local_alias or mode is not None:
        overrides = (*overrides, f"train.mode={'local' if local_alias else mode}")
    job = initialising(registering(load_job(job_path, overrides), register), init_from)
    chosen = job.train.mode
    if chosen == "local" and (workers is not None or scheduler is not None
                              or resume is not None):
        raise click.UsageError("--workers/--scheduler/--resume need --mode async or sync")
    if chosen == "local":
        from pipeline.training.local import train_local

        with progress_bar("training (local)", enabled=not as_json) as bar:
            summary = train_local(job, progress=bar, phases=phases)
        click.echo(summary.to_json() if as_json else "\n".join(summary.lines()))
        _phases(summary.phases, as_json)
        return
    from pipeline.training.local_cluster import starting, worker_modules

    label = f"training ({chosen})"
    with contextlib.ExitStack() as stack:
        # a LocalCluster starts at once, its processes importing the stack while this one
        # validates the data (bad data is still refused before the job is submitted)
        client = None if scheduler is not None else stack.enter_context(
            starting(workers or job.train.workers, worker_modules(job)))
        from antdt.jobs import JobClient
        from pipeline.training.cluster import job_spec

        spec = job_spec(job)
        if resume is not None:
            spec, job_id = resume_spec(job, spec, resume, job_id)
        phases.mark("prepare")
        if client is None:
            jobs = stack.enter_context(cluster.jobs())
        else:
            jobs = stack.enter_context(JobClient(client()))
            phases.mark("cluster")
        submitted = jobs.submit(spec, job_id=job_id)["job"]["job_id"]
        summary = follow_and_report(jobs, submitted, scheduler, as_json, label, phases)
    if client is not None:
        phases.mark("shutdown")
    report = phases.report(summary.train_s)
    if as_json:
        click.echo(json.dumps({**summary.to_dict(), "job_id": submitted, "phases": report},
                              sort_keys=True))
    _phases(report, as_json)


def _phases(report: dict[str, float], as_json: bool) -> None:
    """Where a command's seconds went, on stderr with -v (``--json`` carries them anyway)."""
    if not as_json and logging.getLogger("pipeline").isEnabledFor(logging.INFO):
        from pipeline.job.phases import lines

        for line in lines(report):
            stderr.print(line, highlight=False, markup=False, soft_wrap=True)


for command in (bench, *JOB_COMMANDS, *EXPERIMENT_COMMANDS):
    cli.add_command(command)


def main() -> None:
    """Console-script entry point. The command's work done, the process leaves without
    tearing the interpreter down: after the threads it started (idle thread pools' too) and
    its exit handlers (MLflow's, Dask's, logging's), freeing every module of torch, TorchRec
    and MLflow takes about two seconds of a core that nobody needs."""
    try:
        cli()
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if not isinstance(code, int):  # what sys.exit(message) does
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    # as the interpreter's own exit does: the threading module's exit calls first (they tell
    # idle thread pools' workers to end: a library's pool kept by a global would otherwise be
    # waited for for ever), then every other non-daemon thread joined, then the exit handlers
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
