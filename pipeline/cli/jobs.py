"""The ``antdt`` commands for jobs on a long-lived Dask cluster: ``submit``, ``follow``,
``status``, ``logs`` and ``cancel`` (also as ``dask antdt ...``), thin over
:class:`antdt.jobs.JobClient`. ``antdt train`` follows a job the same way.

Every command takes the scheduler's address (``--scheduler``, default Dask's
``scheduler-address`` setting, e.g. ``DASK_SCHEDULER_ADDRESS``) and Dask's TLS options; without
them Dask's own ``distributed.comm.tls`` settings apply.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import click
import dask.config
from rich.table import Table

from antdt.errors import AntdtError
from pipeline.terminal import print_whole, progress_bar, stderr

if TYPE_CHECKING:
    from antdt.jobs import JobSpec
    from pipeline.job.config import JobConfig
    from pipeline.job.phases import Phases
    from pipeline.job.report import JobSummary

F = TypeVar("F", bound=Callable[..., Any])

DETACHED_EXIT = 130
"""Exit status after Ctrl-C while following: detached, the job goes on."""


class Cluster:
    """The ``--scheduler`` and TLS options of a command, and the client they make."""

    def __init__(self, scheduler: str | None, ca_file: str | None, cert: str | None,
                 key: str | None) -> None:
        self.given = scheduler
        """The --scheduler given on the command line (None: not given)."""
        self.scheduler = scheduler or dask.config.get("scheduler-address", None)
        self.ca_file, self.cert, self.key = ca_file, cert, key

    def security(self) -> Any:
        """Dask security from the TLS options, or None (Dask's config applies)."""
        if not (self.ca_file or self.cert or self.key):
            return None
        if not (self.ca_file and self.cert and self.key):
            raise click.UsageError("TLS needs all of --tls-ca-file, --tls-cert and --tls-key")
        from distributed.security import Security

        return Security(tls_ca_file=self.ca_file, tls_client_cert=self.cert,
                        tls_client_key=self.key, require_encryption=True)

    def address(self) -> str:
        if not self.scheduler:
            raise click.UsageError("no scheduler: give --scheduler ADDR (or set "
                                   "DASK_SCHEDULER_ADDRESS)")
        return str(self.scheduler)

    @contextmanager
    def jobs(self, register: bool = True) -> Iterator[Any]:
        """A :class:`antdt.jobs.JobClient` of the scheduler; ``register=False`` for a command
        that only reads or cancels (it starts in about a second: no torch, no MLflow)."""
        from antdt.jobs import JobClient

        address = self.address()
        try:
            client = JobClient(address, security=self.security(), register=register)
        except OSError as exc:
            raise AntdtError(f"cannot reach the scheduler at {address}: {exc}") from exc
        with client:
            yield client


def cluster_options(command: F) -> F:
    """``--scheduler`` and the TLS options, passed to the command as ``cluster``."""
    options = [
        click.option("--scheduler", default=None, metavar="ADDR",
                     help="The Dask scheduler (default: Dask's scheduler-address setting)."),
        click.option("--tls-ca-file", default=None, type=click.Path(exists=True),
                     help="TLS: the CA certificate the scheduler's certificate is signed by."),
        click.option("--tls-cert", default=None, type=click.Path(exists=True),
                     help="TLS: this client's certificate."),
        click.option("--tls-key", default=None, type=click.Path(exists=True),
                     help="TLS: this client's private key."),
    ]

    def wrapper(scheduler: str | None, tls_ca_file: str | None, tls_cert: str | None,
                tls_key: str | None, **kwargs: Any) -> Any:
        return command(cluster=Cluster(scheduler, tls_ca_file, tls_cert, tls_key), **kwargs)

    wrapper = functools.wraps(command)(wrapper)  # keeps the command's own click options
    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper  # type: ignore[return-value]


# ---- following ------------------------------------------------------------------------------


def follow_and_report(jobs: Any, job_id: str, address: str | None, as_json: bool,
                      label: str, phases: Phases | None = None) -> JobSummary:
    """Follow ``job_id`` with a progress bar, then print its summary (``--json``: unless
    ``phases`` times the command, whose caller prints it with them); return it. A failed or
    cancelled job exits non-zero. On a long-lived cluster (``address``) Ctrl-C detaches and
    says how to re-attach; on a LocalCluster it ends the job with the process."""
    from pipeline.training.following import follow, outcome

    if not as_json:
        announce_page(jobs, job_id)
    try:
        with progress_bar(label, enabled=not as_json) as bar:
            record = follow(jobs, job_id, bar)
    except KeyboardInterrupt:
        if address is None:
            raise
        where = f" --scheduler {address}"
        stderr.print(f"detached from job {job_id}; it goes on. Re-attach with: "
                     f"antdt follow {job_id}{where}", highlight=False, soft_wrap=True)
        sys.exit(DETACHED_EXIT)
    summary = outcome(record)
    if phases is not None:
        phases.cluster_job(record, summary.phases)
    if not as_json:
        for line in summary.lines():
            click.echo(line)
    elif phases is None:
        click.echo(json.dumps({**summary.to_dict(), "job_id": job_id}, sort_keys=True))
    return summary


def announce_page(jobs: Any, job_id: str) -> None:
    """Say where the job's live page is, on stderr (stdout stays the job's id or summary)."""
    page = jobs.page(job_id)
    if page is not None:
        stderr.print(f"job page: {page}", highlight=False, markup=False, soft_wrap=True)


resume_option = click.option(
    "--resume", default=None, metavar="JOB_ID|PATH",
    help="Continue a job from its newest good checkpoint (a job id under the job's "
         "train.checkpoint_dir, or a checkpoint path), in the same MLflow run.")
"""``--resume`` of ``antdt submit`` and ``antdt train``."""

register_option = click.option(
    "--register", default=None, metavar="NAME",
    help="Register the trained model as a new version of NAME in the MLflow model registry, "
         "tagged with the run's figures and data window (default: the job's "
         "mlflow.registered_model).")
"""``--register`` of ``antdt submit`` and ``antdt train``."""


init_from_option = click.option(
    "--init-from", default=None, metavar="MODEL",
    help="Start from this model instead of the seed's: models:/NAME@ALIAS, "
         "models:/NAME/VERSION, runs:/RUN_ID, a checkpoint or a model folder (the job's "
         "train.init_from); a model of other shapes is refused unless "
         "train.init_from_partial is true.")
"""``--init-from`` of ``antdt submit`` and ``antdt train``."""


def initialising(job: JobConfig, ref: str | None) -> JobConfig:
    """``job`` starting from the model ``ref`` names (None: as its job file says)."""
    if ref is None:
        return job
    return dataclasses.replace(job, train=dataclasses.replace(job.train, init_from=ref))


def registering(job: JobConfig, name: str | None) -> JobConfig:
    """``job`` registering its model as ``name`` (None: as its job file says, checked when it
    was loaded), the name checked before anything trains."""
    from pipeline.job.config import check_model_name

    if name is None:
        return job
    return dataclasses.replace(job, mlflow=dataclasses.replace(
        job.mlflow, registered_model=check_model_name(name)))


def resume_spec(job: JobConfig, spec: JobSpec, ref: str, job_id: str | None
                ) -> tuple[JobSpec, str]:
    """``spec`` resuming from the checkpoint ``ref`` names, and the job's id (the id of the
    job that wrote it); skipped torn or corrupt checkpoints are warned about on stderr."""
    from pipeline.training.cluster import resume_point, resumed

    manifest = resume_point(job, spec, ref, warn=lambda message: stderr.print(
        f"warning: {message}", highlight=False, markup=False, soft_wrap=True))
    if job_id is not None and job_id != manifest.job_id:
        raise click.UsageError(f"--job-id {job_id} contradicts --resume {ref}: the checkpoint "
                               f"belongs to job {manifest.job_id}")
    stderr.print(f"resuming job {manifest.job_id} from {manifest.path} "
                 f"({manifest.rows['done']:,} of {manifest.rows['expected']:,} rows done)",
                 highlight=False, markup=False, soft_wrap=True)
    return resumed(spec, manifest), manifest.job_id


# ---- the commands ---------------------------------------------------------------------------


@click.command()
@click.argument("job_path", metavar="JOB.yaml")
@cluster_options
@click.option("--mode", type=click.Choice(["async", "sync"]), default=None,
              help="async: one replica per worker; sync: one model sharded across the "
                   "workers, synchronous steps (default: the job's train.mode).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value, e.g. --set train.epochs=2 (repeatable).")
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: the job's, "
              "else MLflow's default store as it resolves here).")
@click.option("--job-id", default=None, help="The job's id; if it exists, attach to that job "
              "instead of starting another (a retried submit).")
@click.option("--no-wait", is_flag=True, help="Print the job id and return at once.")
@resume_option
@init_from_option
@register_option
@click.option("--json", "as_json", is_flag=True, help="Print the summary (or the id) as JSON.")
def submit(job_path: str, cluster: Cluster, mode: str | None, overrides: tuple[str, ...],
           tracking_uri: str | None, job_id: str | None, no_wait: bool, resume: str | None,
           init_from: str | None, register: str | None, as_json: bool) -> None:
    """Run JOB.yaml on the Dask cluster; follow it to its end (exit 0 when it finished)."""
    from pipeline.job.config import load_job
    from pipeline.training.cluster import job_spec

    if tracking_uri:
        overrides = (*overrides, f"mlflow.tracking_uri={tracking_uri}")
    if mode is not None:
        overrides = (*overrides, f"train.mode={mode}")
    job = initialising(registering(load_job(job_path, overrides), register), init_from)
    if job.train.mode == "local":
        raise click.UsageError("submit runs a job on a Dask cluster: train.mode must be async "
                               "or sync (antdt train --mode local trains in this process)")
    address = cluster.address()
    spec = job_spec(job)  # a bad job file or bad data is refused here, before the cluster
    if resume is not None:
        spec, job_id = resume_spec(job, spec, resume, job_id)
    with cluster.jobs() as jobs:
        reply = jobs.submit(spec, job_id=job_id)
        record = reply["job"]
        job_id = str(record["job_id"])
        if no_wait:
            if as_json:
                click.echo(json.dumps({"job_id": job_id, "attached": reply["attached"],
                                       "state": record["state"], "page": jobs.page(job_id)}))
            else:
                announce_page(jobs, job_id)
                click.echo(job_id)
            return
        if not as_json:
            verb = "attached to" if reply["attached"] else "submitted"
            stderr.print(f"{verb} job {job_id} on {address}", highlight=False)
        follow_and_report(jobs, job_id, address, as_json, f"training ({job_id})")


@click.command("follow")
@click.argument("job_id")
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def follow_command(job_id: str, cluster: Cluster, as_json: bool) -> None:
    """Re-attach to JOB_ID: follow it to its end and print its summary."""
    with cluster.jobs(register=False) as jobs:
        follow_and_report(jobs, job_id, cluster.scheduler, as_json, f"training ({job_id})")


@click.command()
@click.argument("job_id", required=False)
@cluster_options
@click.option("--json", "as_json", is_flag=True, help="Print the job records as JSON.")
def status(job_id: str | None, cluster: Cluster, as_json: bool) -> None:
    """Every job on the cluster (running, finished, failed, cancelled), or JOB_ID in detail."""
    with cluster.jobs(register=False) as jobs:
        found = jobs.status(job_id)
        pages = {r["job_id"]: jobs.page(r["job_id"]) for r in
                 (found if job_id is None else [found])}
        listing = jobs.page()
    if as_json:
        click.echo(json.dumps([{**r, "page": pages[r["job_id"]]} for r in found]
                              if job_id is None else {**found, "page": pages[job_id]},
                              sort_keys=True, default=str))
        return
    if job_id is None:
        print_whole(jobs_table(found) if found else "no jobs on this cluster")
        if found and listing is not None:
            click.echo(f"job pages: {listing}")
        return
    print_whole(*job_details(found, pages[job_id]))


@click.command()
@click.argument("job_id")
@cluster_options
@click.option("--follow", "tail", is_flag=True, help="Keep printing until the job ends.")
def logs(job_id: str, cluster: Cluster, tail: bool) -> None:
    """JOB_ID's events and its agents' warnings and errors, in time order."""
    with cluster.jobs(register=False) as jobs:
        records = jobs.tail(job_id) if tail else iter(jobs.logs(job_id))
        for record in records:
            click.echo(log_line(record))


@click.command()
@click.argument("job_id")
@cluster_options
@click.option("--reason", default="cancelled by a client", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the job's record as JSON.")
def cancel(job_id: str, cluster: Cluster, reason: str, as_json: bool) -> None:
    """Stop JOB_ID: its agents stop at their next batch, its MLflow run ends as KILLED."""
    with cluster.jobs(register=False) as jobs:
        reply = jobs.cancel(job_id, reason)
    record = reply["job"]
    if as_json:
        click.echo(json.dumps(reply, sort_keys=True, default=str))
    elif reply["cancelled"]:
        click.echo(f"cancelling job {job_id}: {reason}")
    else:
        click.echo(f"job {job_id} is {record['state']}: nothing to cancel")


JOB_COMMANDS = (submit, follow_command, status, logs, cancel)


# ---- rendering ------------------------------------------------------------------------------


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds).strftime("%H:%M:%S")


def _rows(record: Mapping[str, Any]) -> str:
    rows = record.get("rows") or {}
    if not rows:
        return "-"
    return f"{rows['done'] + rows['quarantined']:,}/{rows['expected']:,}"


def _rate(record: Mapping[str, Any]) -> float:
    return sum(w["samples_per_s"] for w in record["workers"])


def jobs_table(records: list[Mapping[str, Any]]) -> Table:
    table = Table(title="antdt jobs")
    for column in ("job", "name", "state", "rows done", "rows/s", "workers", "flagged",
                   "actions", "MLflow run", "submitted"):
        table.add_column(column)
    for r in records:
        live = [w for w in r["workers"] if w["state"] == "running"]
        flagged = [w for w in live if w["health"] in ("straggler", "hung")]
        table.add_row(r["job_id"], r["name"], r["state"], _rows(r), f"{_rate(r):,.0f}",
                      str(len(live)), str(len(flagged)), str(r["actions_total"]),
                      (r["run"] or {}).get("run_id", "-"), _when(r["submitted_at"]))
    return table


def job_details(r: Mapping[str, Any], page: str | None = None) -> list[Any]:
    """JOB_ID's record as ``antdt status JOB_ID`` prints it, with its live ``page``."""
    rows = r.get("rows") or {}
    sync = r.get("mode") == "sync"
    lines = [f"job {r['job_id']} ({r['name']}, {r.get('mode', 'async')} mode): {r['state']}",
             f"submitted {_when(r['submitted_at'])}, training from {_when(r['started_at'])}, "
             f"ended {_when(r['ended_at'])}"]
    if rows:
        per_epoch = ", ".join(f"epoch {e}: {done:,}" for e, done in
                              enumerate(rows["done_by_epoch"]))
        lines.append(f"rows done {_rows(r)} ({per_epoch}); trained {rows['trained']:,}, "
                     f"lost {rows['lost']:,}, retrained {rows['retrained']:,}, "
                     f"quarantined {rows['quarantined']:,}")
    if page is not None:
        lines.append(f"page {page}")
    run = r.get("run") or {}
    if run:
        lines.append(f"MLflow run {run['run_id']} (experiment {run['experiment_id']}, "
                     f"{run['tracking_uri']})")
    if r.get("checkpoint"):
        lines.append(f"last checkpoint {r['checkpoint']} ({r['checkpoints']['written']} written "
                     f"by this master; resumed {r['resumes']} time(s), "
                     f"{r['rows_replayed']:,} rows replayed)")
    if r.get("refused"):
        lines.append("refused from workers removed meanwhile (zombies): " + ", ".join(
            f"{count:,} {kind}" for kind, count in sorted(r["refused"].items())))
    if r["error"]:
        lines.append(f"error: {r['error']}")
    if r["stopped"]:
        lines.append(f"stopped: {r['stopped']}")
    tables = r.get("tables")
    if tables:
        lines.append(f"tables sharded: {tables['rows']:,} rows in {tables['buckets']} buckets "
                     f"(map epoch {tables['epoch']}, {tables['moves']} copied"
                     + (f", {len(tables['lost'])} LOST" if tables["lost"] else "") + ")")
    workers = Table(title="workers (ranks in address order)" if sync else "workers")
    for column in ("agent", "address", "state", "rows", "rows/s", "health") + \
            (("local batch",) if sync else ()) + \
            (("buckets (primary+backup)", "pull ms", "push ms") if tables else ()):
        workers.add_column(column)
    for w in r["workers"]:
        batch = (f"{w.get('batch_rows') or r['batch_rows']:,}",) if sync else ()
        workers.add_row(w["label"], w["worker"], w["state"], f"{w['rows']:,}",
                        f"{w['samples_per_s']:,.0f}", w["health"], *batch,
                        *(_tables_columns(tables, w) if tables else ()))
    actions = Table(title=f"controller actions ({r['actions_total']} in all, the last "
                          f"{len(r['actions'])})")
    for column in ("time", "action", "worker", "rows", "reason"):
        actions.add_column(column)
    for a in r["actions"]:
        actions.add_row(_when(a["time"]), a["action"], a["worker"],
                        "-" if a["rows"] is None else f"{a['rows']:,}", a["reason"])
    return ["\n".join(lines), workers, actions]


def _tables_columns(tables: Mapping[str, Any], w: Mapping[str, Any]) -> tuple[str, ...]:
    """A worker's buckets and what its trainer saw of the sharded tables."""
    held = tables["held"].get(w["worker"])
    seen = w.get("tables") or {}
    return (f"{held['primary']}+{held['backup']}" if held else "-",
            f"{seen['pull_ms']:.1f}" if "pull_ms" in seen else "-",
            f"{seen['push_ms']:.1f}" if "push_ms" in seen else "-")


def log_line(record: Mapping[str, Any]) -> str:
    return (f"{_when(record['time'])} {record['level'].upper():7} {record['source']}: "
            f"{record['message']}")
