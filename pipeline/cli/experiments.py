"""The ``antdt`` commands for experiments in MLflow: ``compare`` (runs side by side, data
included), ``promote`` (the registry's ``champion`` alias, moved only by a better score on the
same validation data) and ``sweep`` (a grid of trials on the Dask cluster, nested under one
run). Thin over :mod:`pipeline.tracking.compare`, :mod:`pipeline.tracking.registry` and
:mod:`pipeline.workflows.sweep`, which import MLflow only when a command runs.
"""

from __future__ import annotations

import json
import sys
from typing import TYPE_CHECKING

import click
from rich.table import Table

from pipeline.cli.jobs import Cluster, cluster_options
from pipeline.terminal import print_whole, progress_bar

if TYPE_CHECKING:
    from pipeline.workflows.sweep import SweepResult


@click.command()
@click.option("--experiment", default=None, metavar="NAME",
              help="Compare the newest runs of this experiment (default: the experiment of "
                   "the store's newest run).")
@click.option("--runs", "run_ids", default=None, metavar="ID,ID,...",
              help="Compare these runs, in this order; a run with child runs (a sweep's "
                   "parent) stands for its children.")
@click.option("--last", type=click.IntRange(min=1), default=None, metavar="N",
              help="How many of the experiment's newest runs (default: 10).")
@click.option("--metric", default="auc", show_default=True,
              help="The summary metric runs are ranked and plotted by (e.g. logloss, wall_s).")
@click.option("--plot", "plot_path", default=None, metavar="OUT.png",
              type=click.Path(dir_okay=False),
              help="Also draw the metric per run and the runs' training curves to a PNG.")
@click.option("--json", "as_json", is_flag=True, help="Print the runs as a JSON list.")
@click.option("--tracking-uri", default=None,
              help="MLflow tracking URI (default: MLflow's default store as it resolves here).")
def compare(experiment: str | None, run_ids: str | None, last: int | None, metric: str,
            plot_path: str | None, as_json: bool, tracking_uri: str | None) -> None:
    """Compare MLflow runs side by side: the params that differ, the metrics, and the rows each
    run trained, lost, retrained or quarantined (a better model that saw less data stands
    out)."""
    import mlflow

    from pipeline.terminal import stderr
    from pipeline.tracking import compare as comparing

    ids = None if run_ids is None else [i.strip() for i in run_ids.split(",") if i.strip()]
    if ids is not None and not ids:
        raise click.UsageError("--runs names no run: give run ids separated by commas")
    comparison = comparing.compare(tracking_uri or mlflow.get_tracking_uri(),
                                   experiment=experiment, run_ids=ids, last=last, metric=metric)
    if as_json:
        click.echo(json.dumps(comparison.to_json()))
    elif not comparison.runs:
        click.echo(f"no runs in {comparison.title} ({comparison.store})")
    else:
        print_whole(comparing.table(comparison))
        click.echo(comparing.legend(comparison))
    if plot_path is not None:
        if not comparison.runs:
            stderr.print(f"no plot: no runs in {comparison.title}", highlight=False)
            return
        drawn = comparing.plot(comparison, plot_path)
        stderr.print(f"wrote {drawn.path}", highlight=False, markup=False)


def _paths(values: tuple[str, ...]) -> list[str] | None:
    """``--on`` values: each comma-separated, the option repeatable (None: not given)."""
    paths = [p.strip() for value in values for p in value.split(",") if p.strip()]
    return paths or None


@click.command()
@click.argument("name")
@click.option("--version", "version", type=click.IntRange(min=1), default=None,
              help="The candidate version (default: the newest).")
@click.option("--metric", default="auc", show_default=True,
              help="What to compare: auc (higher is better) or logloss (lower is better).")
@click.option("--on", "on", multiple=True, metavar="PATHS",
              help="The validation data both models score: Parquet files, folders or globs, "
                   "comma-separated or the option repeated (default: the candidate's "
                   "validation paths, from its antdt.data.validation tag).")
@click.option("--min-gain", type=float, default=0.0, show_default=True,
              help="How much better the candidate must score to replace the champion.")
@click.option("--no-worse", "no_worse", multiple=True, metavar="METRIC",
              help="A metric the candidate must also be no worse at (e.g. logloss; "
                   "repeatable).")
@click.option("--calibration", type=click.FloatRange(min=0), default=None,
              help="Promote only if the candidate's mean prediction is within this share of "
                   "the observed click rate (0.05: within 5%).")
@click.option("--rollback", is_flag=True,
              help="Make the previous champion (alias champion_prev) the champion again; "
                   "nothing is scored.")
@click.option("--tracking-uri", default=None,
              help="MLflow tracking URI (default: MLflow's default store as it resolves here).")
@click.option("--json", "as_json", is_flag=True, help="Print the decision as JSON.")
def promote(name: str, version: int | None, metric: str, on: tuple[str, ...], min_gain: float,
            no_worse: tuple[str, ...], calibration: float | None, rollback: bool,
            tracking_uri: str | None, as_json: bool) -> None:
    """Score a version of the registered model NAME and its champion (the version the
    champion alias names) on the same validation data, both loaded from the registry as a
    server would; move the alias to the candidate only if it scores better by at least
    --min-gain and passes the guards asked for (with no champion yet, it becomes the
    champion). The champion it replaces keeps the alias champion_prev. The decision and both
    scores are recorded on the candidate version and its run."""
    from pipeline.tracking.registry import promote as promoting
    from pipeline.tracking.registry import rollback as rolling_back

    if rollback:
        if version is not None or on or no_worse or calibration is not None:
            raise click.UsageError("--rollback scores nothing: give it alone")
        was, now = rolling_back(name, tracking_uri)
        click.echo(json.dumps({"model": name, "from": was, "champion": now}) if as_json else
                   f"{name}: the champion is version {now} again (was {was}; "
                   f"antdt promote {name} --rollback undoes it)")
        return
    decision = promoting(name, version=version, metric=metric, on=_paths(on),
                         min_gain=min_gain, tracking_uri=tracking_uri, no_worse=no_worse,
                         calibration=calibration)
    if as_json:
        click.echo(json.dumps(decision.to_dict(), sort_keys=True))
    else:
        for line in decision.lines():
            click.echo(line)


@click.command()
@click.argument("job_path", metavar="JOB.yaml")
@click.option("--grid", "grid_specs", multiple=True, required=True, metavar="KEY=V1,V2",
              help="A setting and the values it takes, e.g. --grid train.sparse_lr=0.01,0.05"
                   " (repeatable: every combination is a trial).")
@click.option("--sample", type=click.IntRange(min=1), default=None,
              help="Run this many combinations drawn at random instead of all of them.")
@click.option("--seed", type=int, default=0, show_default=True, help="The seed of --sample.")
@click.option("--metric", default="auc", show_default=True,
              help="The summary metric that picks the best trial (logloss, wall_s... lower is "
                   "better; others higher).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config value of every trial (repeatable).")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Workers of the LocalCluster to start (default: this machine's cores, at "
                   "least the widest trial's train.workers).")
@cluster_options
@click.option("--tracking-uri", default=None, help="MLflow tracking URI (default: the job's, "
              "else MLflow's default store).")
@click.option("--register", default=None, metavar="NAME",
              help="Register the best trial's model as a new version of NAME (trials "
                   "themselves never register one).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sweep(job_path: str, grid_specs: tuple[str, ...], sample: int | None, seed: int,
          metric: str, overrides: tuple[str, ...], workers: int | None, cluster: Cluster,
          tracking_uri: str | None, register: str | None, as_json: bool) -> None:
    """Train JOB.yaml once per combination of the --grid values, every trial an MLflow run
    nested under the sweep's run, side by side on the Dask cluster at --scheduler (default: a
    new LocalCluster); report the best trial. A failed trial is recorded and the others go
    on; exit 1 only when none finished."""
    from pipeline.job.config import check_model_name
    from pipeline.workflows.sweep import Grid, check_metric, plan_trials, run_sweep

    if workers is not None and cluster.given is not None:
        raise click.UsageError("--workers starts a LocalCluster; with --scheduler the "
                               "cluster's own workers train: give one or the other")
    if tracking_uri:
        overrides = (*overrides, f"mlflow.tracking_uri={tracking_uri}")
    if register is not None:
        check_model_name(register)
    check_metric(metric)
    grid = Grid.parse(grid_specs)
    trials = plan_trials(job_path, overrides, grid, sample=sample, seed=seed)
    scheduler = cluster.address() if cluster.given is not None else None
    with progress_bar(f"sweep ({len(trials)} trials)", enabled=not as_json) as bar:
        result = run_sweep(trials, grid, metric=metric, workers=workers, scheduler=scheduler,
                           security=cluster.security(), progress=bar, register=register)
    if as_json:
        click.echo(json.dumps(result.to_dict(), sort_keys=True))
    else:
        print_whole(sweep_table(result))
        for line in sweep_lines(result):
            click.echo(line)
    if result.best is None:
        sys.exit(1)


def sweep_table(result: SweepResult) -> Table:
    """One row a trial: its values, how it ended, the metric (the best in bold green)."""
    keys = [key for key in result.trials[0].values] if result.trials else []
    table = Table(title=f"sweep {result.parent_run_id} ({len(result.trials)} trials)")
    for column in ("trial", *keys, "state", result.metric, "run"):
        table.add_column(column, justify="right" if column in ("trial", result.metric)
                         else "left", overflow="fold")
    for trial in result.trials:
        value = trial.to_dict(result.metric)["metric"]
        shown = "-" if value is None else f"{value:.4f}"
        if trial is result.best:
            shown = f"[bold green]{shown}[/]"
        state = trial.state if trial.error is None else f"[red]{trial.state}[/]: {trial.error}"
        table.add_row(str(trial.index), *(trial.values[key] for key in keys), state, shown,
                      (trial.run_id or "-")[:8])
    return table


def sweep_lines(result: SweepResult) -> list[str]:
    """The best trial and how to look at every trial."""
    lines = []
    if result.best is None:
        lines.append(f"no trial finished with a {result.metric}")
    else:
        value = result.best.to_dict(result.metric)["metric"]
        lines.append(f"best     {result.best.name}, {result.metric} {value:.4f}, "
                     f"run {result.best.run_id}")
    if result.registered is not None:
        model, version = result.registered
        lines.append(f"registered {model} version {version}: antdt promote {model} --version "
                     f"{version} --tracking-uri {result.tracking_uri}")
    lines.append(f"compare  antdt compare --runs {result.parent_run_id} "
                 f"--tracking-uri {result.tracking_uri}")
    return lines


EXPERIMENT_COMMANDS: list[click.Command] = [compare, promote, sweep]
"""The commands of this module, added to ``antdt`` by :mod:`pipeline.cli.main`."""
