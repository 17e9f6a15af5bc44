"""``antdt compare``: MLflow runs side by side, the data each one trained on included.

A ranking model can look better because it saw less data: an async run that lost a worker's
rows, a run that quarantined a bad file, a job over one day fewer. MLflow's own run comparison
shows the params and metrics, not that; this table does, next to the metrics, so such a run
stands out before its AUC is believed.

Which runs (:func:`compare`):

* ``--runs ID,ID,...``: those runs, in that order; a run with child runs (tag
  ``mlflow.parentRunId`` on them, e.g. a sweep's parent) stands for its children, in the order
  they started (a sweep's trial order). Only one level is expanded; a run named twice (or also
  as a child) is shown once, where it comes first.
* otherwise the newest ``--last`` runs of ``--experiment`` (newest first), sweep parents (tag
  ``antdt.sweep`` = ``parent``) left out since their trials are the runs; then ranked by the
  chosen metric, best first, runs without it last.

What a run shows (:class:`RunView`): its name and short id, status, mode (tag ``antdt.mode``),
workers (the ``workers`` metric; 1 for a local run, else the ``train.workers`` param while the
run has no summary yet), the model it started from where one did (``from``: tags
``antdt.init_from*``, a registry version as ``ranking v7``), the params whose values differ between the shown runs, the summary
metrics and the rows. A run's params are its job config flattened (``train.batch_size``,
``train.sparse_lr``, ``data.train``, ...); four are never shown as params because they are
noise here: ``mlflow.tracking_uri`` (where the run was written: the store being read, only
spelled differently by different jobs), ``train.mode``, ``train.workers`` and
``train.init_from`` (the config's, which a local run ignores or an alias hides: the mode,
workers and from columns show what ran).

Highlights (:class:`Comparison`): the best value of AUC, logloss, wall time, samples/s and the
chosen metric (:func:`higher_is_better` says which way is better), when at least two runs have
it and not all alike (ties are all best); and the data side: a run that trained fewer distinct
rows (``rows_trained - rows_retrained``) than the most any shown run trained, or that lost,
retrained or quarantined rows. In plain text (a pipe, a log) the highlights are the markers
``*`` and ``!``, explained in the line under the table.

MLflow (and matplotlib, for ``--plot``) are imported here: :mod:`pipeline.cli.experiments`
imports this module only when the command runs.
"""

from __future__ import annotations

import math
import os
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from matplotlib import colormaps
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import EngFormatter
from mlflow import MlflowClient
from mlflow.entities import Run
from mlflow.exceptions import MlflowException
from rich.table import Table
from rich.text import Text

from antdt.errors import AntdtError
from pipeline.job.report import higher_is_better
from pipeline.tracking.uris import redact

DEFAULT_EXPERIMENT = "antdt"
"""The experiment of a job config that names none (:class:`pipeline.job.config.MlflowConfig`):
compared when the store has no runs to say which experiment was used last."""
DEFAULT_LAST = 10

SWEEP_TAG = "antdt.sweep"
PARENT_TAG = "mlflow.parentRunId"
IGNORED_PARAMS = frozenset({"mlflow.tracking_uri", "train.mode", "train.workers",
                            "train.init_from"})
"""Params never shown as differing (see the module docstring)."""

RANKED = ("auc", "logloss", "wall_s", "samples_per_s")
"""The metrics whose best value is highlighted, besides the chosen one."""
ROWS = ("rows_trained", "rows_lost", "rows_retrained", "rows_quarantined", "rows_replayed")
METRICS = ("auc", "logloss", "oracle_auc", "wall_s", "train_s", "samples_per_s",
           "straggler_actions")
"""The summary metrics a run shows (``--json``: under ``metrics``; the rows under ``rows``)."""

ISSUES = {"fewer_rows_trained": "fewer rows trained", "rows_lost": "rows lost",
          "rows_retrained": "rows retrained", "rows_quarantined": "rows quarantined"}
"""The data issues a run can have (:meth:`Comparison.issues`), and how a person reads them."""


class CompareError(AntdtError):
    """Runs cannot be compared as asked: an unknown run, experiment, store or metric."""


def ranked_metrics(metric: str) -> tuple[str, ...]:
    """The metrics whose best value is highlighted: :data:`RANKED` and ``metric``."""
    return RANKED + (() if metric in RANKED else (metric,))


@dataclass(frozen=True)
class RunView:
    """One MLflow run as the comparison shows it."""

    run_id: str
    name: str
    experiment: str
    """The name of the run's experiment."""
    status: str
    """MLflow's: ``RUNNING``, ``FINISHED``, ``FAILED``, ``KILLED``, ``SCHEDULED``."""
    mode: str | None
    workers: int | None
    params: Mapping[str, str]
    metrics: Mapping[str, float]
    """The latest value of each of the run's metrics (a summary metric's only value, logged at
    step 0); never NaN."""
    started_from: str | None = None
    """The model the run started from (``train.init_from``): a registry model's name and
    version, a run's short id or a folder; None: from the seed."""

    @property
    def label(self) -> str:
        """Name and short id: runs of one job share their name."""
        return f"{self.name} ({self.run_id[:8]})"

    def value(self, metric: str) -> float | None:
        return self.metrics.get(metric)

    @classmethod
    def of(cls, run: Run, experiment: str) -> RunView:
        tags, params = run.data.tags, run.data.params
        metrics = {k: float(v) for k, v in run.data.metrics.items() if not math.isnan(v)}
        mode = tags.get("antdt.mode")
        workers: int | None = None
        if "workers" in metrics:
            workers = int(metrics["workers"])
        elif mode == "local":
            workers = 1
        elif params.get("train.workers", "").isdigit():
            workers = int(params["train.workers"])
        return cls(run_id=run.info.run_id, name=run.info.run_name or run.info.run_id,
                   experiment=experiment, status=run.info.status, mode=mode, workers=workers,
                   params=dict(params), metrics=metrics, started_from=_started_from(tags))


@dataclass(frozen=True)
class Comparison:
    """The shown runs in their order, the metric they are ranked by, and what stands out."""

    runs: tuple[RunView, ...]
    metric: str
    title: str
    """What the runs are, for people: ``experiment 'tests'`` or ``runs given by id``."""
    as_given: bool
    """The runs are in the order ``--runs`` gave them, not ranked by :attr:`metric`."""
    tracking_uri: str
    """The store read (with any password: never print it, see :attr:`store`)."""
    differing: tuple[str, ...]
    """The params whose values differ between the runs (a missing param counts as a value;
    runs without params are left out), by name."""
    best: Mapping[str, frozenset[str]]
    """For each ranked metric, the ids of the runs best at it (absent: no best, see the module
    docstring)."""
    most_rows: float | None
    """The most distinct rows (trained, not counting rows trained again) any shown run trained."""

    @property
    def store(self) -> str:
        return redact(self.tracking_uri)

    def issues(self, run: RunView) -> list[str]:
        """What is off on ``run``'s data side, keys of :data:`ISSUES`."""
        found = []
        distinct = _distinct_rows(run)
        if distinct is not None and self.most_rows is not None and distinct < self.most_rows:
            found.append("fewer_rows_trained")
        found += [key for key in ISSUES if key.startswith("rows_") and (run.value(key) or 0) > 0]
        return found

    def to_json(self) -> list[dict[str, Any]]:
        """One object a run, in the table's order (``--json``)."""
        return [{
            "run_id": run.run_id, "name": run.name, "experiment": run.experiment,
            "status": run.status, "mode": run.mode, "workers": run.workers,
            "started_from": run.started_from, "params": {key: run.params.get(key) for key in self.differing},
            "metrics": {key: run.value(key) for key in dict.fromkeys((*METRICS, self.metric))},
            "rows": {key.removeprefix("rows_"): _integer(run.value(key)) for key in ROWS},
            "best": [key for key in ranked_metrics(self.metric)
                     if run.run_id in self.best.get(key, ())],
            "data_issues": self.issues(run),
        } for run in self.runs]


def compare(tracking_uri: str, *, experiment: str | None = None,
            run_ids: Sequence[str] | None = None, last: int | None = None,
            metric: str = "auc") -> Comparison:
    """The runs to compare in the store at ``tracking_uri`` (see the module docstring): the
    runs ``run_ids`` (their children for a parent), else the newest ``last`` runs of
    ``experiment``. Raises :class:`CompareError` naming an unknown run, experiment or store,
    or a ``metric`` no shown run has; no runs at all is an empty comparison."""
    if run_ids is not None and (experiment is not None or last is not None):
        raise CompareError("--runs names the runs by id: leave out --experiment and --last")
    _check_store(tracking_uri)
    client = MlflowClient(tracking_uri)
    names = _ExperimentNames(client)
    if run_ids is not None:
        found = _given_runs(client, run_ids, tracking_uri)
        title = "runs given by id"
    else:
        experiment = experiment or _latest_experiment(client, names)
        found = _newest_runs(client, experiment, last or DEFAULT_LAST, tracking_uri)
        title = f"experiment {experiment!r}"
    runs = [RunView.of(run, names[run.info.experiment_id]) for run in found]
    if runs and not any(metric in run.metrics for run in runs):
        plain = sorted({key for run in runs for key in run.metrics if "." not in key})
        raise CompareError(f"no shown run has the metric {metric!r}; they have: "
                           f"{', '.join(plain) or 'no summary metrics'}")
    if run_ids is None:
        runs = _ranked_by(runs, metric)
    best = {key: ids for key in ranked_metrics(metric) if (ids := _best_of(runs, key))}
    distinct = [rows for run in runs if (rows := _distinct_rows(run)) is not None]
    return Comparison(runs=tuple(runs), metric=metric, title=title,
                      as_given=run_ids is not None, tracking_uri=tracking_uri,
                      differing=_differing(runs), best=best,
                      most_rows=max(distinct) if distinct else None)


# ---- finding the runs ---------------------------------------------------------------------


class _ExperimentNames(dict[str, str]):
    """Experiment id -> name, read from the store once each."""

    def __init__(self, client: MlflowClient) -> None:
        super().__init__()
        self._client = client

    def __missing__(self, experiment_id: str) -> str:
        name = str(self._client.get_experiment(experiment_id).name)
        self[experiment_id] = name
        return name


def _latest_experiment(client: MlflowClient, names: _ExperimentNames) -> str:
    """The experiment of the store's newest run: what a person just trained (``make demo``'s
    runs go to ``antdt-synthetic``, a job config's default is ``antdt``)."""
    newest = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                order_by=["attributes.start_time DESC"], max_results=1)
    return names[newest[0].info.experiment_id] if newest else DEFAULT_EXPERIMENT


def _check_store(tracking_uri: str) -> None:
    """A local SQLite store must exist: MLflow would make an empty one where none is (and the
    comparison would say "no experiment" of a store nobody meant)."""
    if not tracking_uri.startswith("sqlite:///"):
        return
    path = urllib.parse.unquote(tracking_uri.removeprefix("sqlite:///").partition("?")[0])
    if path and path != ":memory:" and not os.path.exists(path):
        raise CompareError(f"no MLflow store at {tracking_uri} ({os.path.abspath(path)} does "
                           "not exist): give --tracking-uri, or run where mlflow.db is")


def _given_runs(client: MlflowClient, run_ids: Sequence[str], tracking_uri: str
                ) -> list[Run]:
    runs: list[Run] = []
    for run_id in run_ids:
        try:
            run = client.get_run(run_id)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise CompareError(f"no run {run_id!r} in {redact(tracking_uri)}") from exc
        children = _search(client, [run.info.experiment_id],
                           f"tags.`{PARENT_TAG}` = '{run_id}'", "attributes.start_time ASC")
        runs += children or [run]
    return list({run.info.run_id: run for run in runs}.values())  # a run named twice: once


def _newest_runs(client: MlflowClient, experiment: str, last: int, tracking_uri: str
                 ) -> list[Run]:
    found = client.get_experiment_by_name(experiment)
    if found is None:
        known = sorted(e.name for e in client.search_experiments())
        raise CompareError(f"no experiment {experiment!r} in {redact(tracking_uri)}; it has: "
                           f"{', '.join(known) or 'none'}")
    runs: list[Run] = []
    token = None
    while len(runs) < last:
        page = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"],
                                  max_results=min(last, 1000), page_token=token)
        runs += [run for run in page if run.data.tags.get(SWEEP_TAG) != "parent"]
        token = page.token
        if not token:
            break
    return runs[:last]


def _search(client: MlflowClient, experiment_ids: list[str], filter_string: str,
            order: str) -> list[Run]:
    """Every run that matches, all pages."""
    runs: list[Run] = []
    token = None
    while True:
        page = client.search_runs(experiment_ids, filter_string, order_by=[order],
                                  page_token=token)
        runs += page
        token = page.token
        if not token:
            return runs


# ---- what stands out ----------------------------------------------------------------------


def _ranked_by(runs: list[RunView], metric: str) -> list[RunView]:
    """Best first by ``metric``; runs without it last, each group in its given order."""
    sign = -1.0 if higher_is_better(metric) else 1.0

    def key(run: RunView) -> tuple[bool, float]:
        value = run.value(metric)
        return value is None, 0.0 if value is None else sign * value

    return sorted(runs, key=key)


def _best_of(runs: Iterable[RunView], metric: str) -> frozenset[str]:
    values = {run.run_id: value for run in runs if (value := run.value(metric)) is not None}
    if len(values) < 2 or len(set(values.values())) == 1:
        return frozenset()
    top = (max if higher_is_better(metric) else min)(values.values())
    return frozenset(run_id for run_id, value in values.items() if value == top)


def _distinct_rows(run: RunView) -> float | None:
    trained = run.value("rows_trained")
    return None if trained is None else trained - (run.value("rows_retrained") or 0)


def _differing(runs: Sequence[RunView]) -> tuple[str, ...]:
    """The params that differ between the runs that have params: a run without any (made
    by hand, or failed before it logged them) would make every param differ."""
    with_params = [run for run in runs if set(run.params) - IGNORED_PARAMS]
    if len(with_params) < 2:
        return ()
    keys = sorted({key for run in with_params for key in run.params} - IGNORED_PARAMS)
    return tuple(key for key in keys if len({run.params.get(key) for run in with_params}) > 1)


def _started_from(tags: Mapping[str, str]) -> str | None:
    """What a run's ``antdt.init_from`` tags say it started from, short."""
    ref = tags.get("antdt.init_from")
    if ref is None:
        return None
    if "antdt.init_from.version" in tags:
        return f"{tags['antdt.init_from.model']} v{tags['antdt.init_from.version']}"
    if "antdt.init_from.run_id" in tags:
        return f"run {tags['antdt.init_from.run_id'][:8]}"
    return ref


def _integer(value: float | None) -> int | None:
    return None if value is None else int(value)


# ---- the table ----------------------------------------------------------------------------

_COLUMNS = {"auc": "AUC", "logloss": "logloss", "wall_s": "wall s", "samples_per_s": "samples/s",
            "straggler_actions": "straggler\nactions"}
_ROW_COLUMNS = {"rows_trained": "rows\ntrained", "rows_lost": "rows\nlost",
                "rows_retrained": "rows\nretrained", "rows_quarantined": "rows\nquarantined"}
_STATUS_STYLE = {"FINISHED": "green", "FAILED": "bold red", "KILLED": "red",
                 "RUNNING": "yellow"}


def table(comparison: Comparison) -> Table:
    """One row a run: who it is, the differing params, the metrics, the rows (see the module
    docstring for the highlights)."""
    metric = comparison.metric
    order = "in the order given" if comparison.as_given else \
        f"best {metric} first ({'higher' if higher_is_better(metric) else 'lower'} is better)"
    count = len(comparison.runs)
    out = Table(title=f"{comparison.title}: {count} run{'s' * (count != 1)}, {order}")
    lineage = any(run.started_from for run in comparison.runs)
    for header in ("run", "id", "status", "mode", "workers", *["from"] * lineage):
        out.add_column(header, no_wrap=header in ("id", "status"))
    for key in comparison.differing:
        out.add_column(key)
    metrics = dict(_COLUMNS)
    if metric not in metrics and metric not in _ROW_COLUMNS:
        metrics[metric] = metric
    for header in (*metrics.values(), *_ROW_COLUMNS.values()):
        out.add_column(header, justify="right")
    for run in comparison.runs:
        issues = comparison.issues(run)
        cells: list[Text | str] = [
            Text(run.name, style="bold yellow" if issues else ""), run.run_id[:8],
            Text(run.status, style=_STATUS_STYLE.get(run.status, "")), run.mode or "-",
            "-" if run.workers is None else str(run.workers),
            *[run.started_from or "-"] * lineage,
            *(run.params.get(key, "-") for key in comparison.differing)]
        for key in metrics:
            best = run.run_id in comparison.best.get(key, ())
            cells.append(Text(_shown(key, run.value(key)) + " *" * best,
                              style="bold green" if best else ""))
        for key in _ROW_COLUMNS:
            off = key in issues or (key == "rows_trained" and "fewer_rows_trained" in issues)
            cells.append(Text(_shown(key, run.value(key)) + " !" * off,
                              style="bold red" if off else ""))
        out.add_row(*cells)
    return out


def legend(comparison: Comparison) -> str:
    """The line under the table: what ``*`` and ``!`` mean."""
    most = "" if comparison.most_rows is None else f" ({comparison.most_rows:,.0f})"
    return (f"* best of these runs   ! data differs: fewer rows trained than the most here{most}"
            ", or rows lost, retrained or quarantined; its metrics are not like for like")


def _shown(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric in ("auc", "logloss", "oracle_auc"):
        return f"{value:.4f}"
    if metric in ("wall_s", "train_s"):
        return f"{value:,.1f}"
    if metric == "samples_per_s" or value.is_integer():
        return f"{value:,.0f}"
    return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.1f}"


# ---- the plot -----------------------------------------------------------------------------

_DPI = 100
_WIDTH_IN = 14.0
_BAR_IN = 0.45
_MIN_HEIGHT_IN = 4.5


@dataclass(frozen=True)
class Plotted:
    """What :func:`plot` drew, for its caller and for tests: the PNG's path, the runs with a
    bar (by label, top to bottom), the runs with a training curve and those without."""

    path: str
    bars: tuple[str, ...]
    curves: tuple[str, ...]
    no_curve: tuple[str, ...]
    series: str
    """The series drawn over rows trained: ``train.loss``, or ``train.<metric>``."""


def plot(comparison: Comparison, path: str) -> Plotted:
    """Write the comparison's PNG to the local file ``path`` (its folder made if missing):
    left the chosen metric per run, right the runs' training curves over rows trained, one
    colour a run in both. The curves are read from the store (``get_metric_history``)."""
    runs = comparison.runs
    if not runs:
        raise CompareError(f"no runs to plot in {comparison.title}")
    series = f"train.{comparison.metric}"
    if not any(series in run.metrics for run in runs):
        series = "train.loss"
    client = MlflowClient(comparison.tracking_uri)
    curves = {run.run_id: _curve(client, run, series) for run in runs}
    colours = _colours(len(runs))

    height = max(_MIN_HEIGHT_IN, _BAR_IN * len(runs) + 1.8)
    fig = Figure(figsize=(_WIDTH_IN, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    count = len(runs)
    experiments = sorted({run.experiment for run in runs})
    fig.suptitle(f"experiment {', '.join(map(repr, experiments))}: "
                 f"{count} run{'s' * (count != 1)}", fontsize=13)
    bars_ax, curves_ax = fig.subplots(1, 2, width_ratios=[1.0, 1.15])
    bars = _draw_bars(bars_ax, comparison, colours)
    drawn, missing = _draw_curves(curves_ax, runs, curves, colours, series, comparison.metric)

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    fig.clear()
    return Plotted(path=path, bars=bars, curves=drawn, no_curve=missing, series=series)


def _colours(n: int) -> list[Any]:
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["viridis"](i / (n - 1)) for i in range(n)]


def _curve(client: MlflowClient, run: RunView, series: str
           ) -> tuple[list[float], list[float]] | None:
    """``series`` over ``train.rows_trained``, joined by step (the last value of a step logged
    twice, e.g. after a resume); None when the run has either series empty."""
    if series not in run.metrics or "train.rows_trained" not in run.metrics:
        return None
    by_step = {m.step: m.value for m in sorted(client.get_metric_history(run.run_id, series),
                                                key=lambda m: m.timestamp)}
    rows = {m.step: m.value for m in sorted(
        client.get_metric_history(run.run_id, "train.rows_trained"), key=lambda m: m.timestamp)}
    steps = sorted(step for step in by_step if step in rows and not math.isnan(by_step[step]))
    if not steps:
        return None
    return [rows[step] for step in steps], [by_step[step] for step in steps]


def _draw_bars(ax: Axes, comparison: Comparison, colours: Sequence[Any]) -> tuple[str, ...]:
    metric = comparison.metric
    best = comparison.best.get(metric, frozenset())
    labels = [run.label for run in comparison.runs]
    values = [run.value(metric) for run in comparison.runs]
    present = [v for v in values if v is not None]
    low, high = min(present), max(present)
    span = high - low or max(abs(high) * 0.01, 0.001)
    left = low - 0.25 * span
    ax.set_xlim(left, high + 0.45 * span)  # room on the right for the values
    for i, (run, value) in enumerate(zip(comparison.runs, values)):
        status = "" if run.status == "FINISHED" else f" ({run.status.lower()})"
        if value is None:
            ax.text(left, i, f"  no {metric}{status}", va="center", fontsize=9, color="0.4")
            continue
        is_best = run.run_id in best
        note = _data_note(comparison, run)
        ax.barh(i, value - left, left=left, height=0.7, color=colours[i],
                edgecolor="black" if is_best else "white", linewidth=2.5 if is_best else 0.5,
                hatch="///" if note else None)
        ax.text(value, i, f" {_shown(metric, value)}{status}" + "  best" * is_best,
                va="bottom" if note else "center", fontsize=9,
                fontweight="bold" if is_best else "normal")
        if note:
            ax.text(value, i, f" {note}", va="top", fontsize=8, color="#B00000")
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.set_ylim(len(labels) - 0.5, -0.5)
    direction = "higher" if higher_is_better(metric) else "lower"
    ax.set_title(f"{metric} per run ({direction} is better)", fontsize=11)
    ax.set_xlabel(f"{metric} (axis starts at {_shown(metric, left)}, not 0)")
    ax.grid(axis="x", color="0.85", linewidth=0.5)
    ax.set_axisbelow(True)
    keys = []
    if best:
        keys.append(Patch(facecolor="white", edgecolor="black", linewidth=2.5, label="best"))
    if any(comparison.issues(run) for run in comparison.runs):
        keys.append(Patch(facecolor="white", edgecolor="0.3", hatch="///",
                          label="data differs (fewer rows trained, or rows lost, "
                                "retrained or quarantined)"))
    if keys:  # below the axes: it never covers a bar
        ax.legend(handles=keys, loc="upper center", bbox_to_anchor=(0.5, -0.16),
                  ncols=len(keys), fontsize=8, frameon=False)
    return tuple(label for label, value in zip(labels, values) if value is not None)


def _data_note(comparison: Comparison, run: RunView) -> str:
    """What is off on ``run``'s data side, in a few words ("" when nothing is)."""
    notes = []
    for issue in comparison.issues(run):
        if issue == "fewer_rows_trained":
            notes.append(f"{_distinct_rows(run):,.0f} of {comparison.most_rows:,.0f} rows")
        else:
            notes.append(f"{run.value(issue):,.0f} {ISSUES[issue]}")
    return ", ".join(notes)


def _draw_curves(ax: Axes, runs: Sequence[RunView],
                 curves: Mapping[str, tuple[list[float], list[float]] | None],
                 colours: Sequence[Any], series: str, metric: str
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    handles = []
    drawn, missing = [], []
    for run, colour in zip(runs, colours):
        curve = curves[run.run_id]
        if curve is None:
            missing.append(run.label)
            handles.append(Line2D([], [], color=colour, linestyle=":",
                                  label=f"{run.label} (no curve)"))
            continue
        drawn.append(run.label)
        (line,) = ax.plot(*curve, color=colour, linewidth=1.5, label=run.label)
        handles.append(line)
    if series == "train.loss":
        title = "training loss over rows trained"
    else:
        title = f"{series} over rows trained (the series of {metric})"
    ax.set_title(title, fontsize=11)
    ax.set_xlabel("rows trained")
    ax.set_ylabel("training loss (train.loss)" if series == "train.loss" else series)
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # 500k, 1M, 1.5M: never run together
    ax.grid(color="0.85", linewidth=0.5)
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.16), fontsize=8,
              ncols=2, frameon=False)
    if not drawn:
        ax.text(0.5, 0.5, "no training curves", transform=ax.transAxes, ha="center",
                va="center", fontsize=16, color="0.4")
    return tuple(drawn), tuple(missing)
