"""`antdt bench retrain`: three ways of retraining a ranking model day by day on drifting data,
measured in the same run on the same days.

The data is synthetic with :class:`data.drift.Drift`'s defaults (``--drift`` changes them):
each day's hidden click model moves (its weights turn, new ids arrive, the click rate follows a
weekly cycle, a share of the features flips on the middle day), and ``oracle.json`` holds each
day's own model's AUC and click rate. As the
daily DAG does it (:mod:`pipeline.workflows.retrain`), the model of logical day ``D`` trains on
the ``--train-days`` days before ``D`` and is scored on ``D``'s rows: its *next-day* AUC. The
first ``--train-days`` days build the first window; the ``--days`` days after it are evaluated.

- ``frozen``: the model trained on the first window, scored on every evaluated day;
- ``window``: each day a fresh model on the last ``--train-days`` days (the DAG's ``window``);
- ``incremental``: each day :func:`pipeline.workflows.incremental.choose` decides, as the DAG's
  ``incremental`` way does: continue the previous model (``train.init_from=runs:/<its run>``:
  its tables, dense layers and both optimisers' state) for one pass over the new day, or train
  the window from scratch (no model yet, every ``--refresh-every`` days). Its "champion" is its
  previous model: the DAG's promotion (a new version takes ``champion`` only when it beats it)
  and its day check (every synthetic day passes it) are not part of this benchmark.

Every model trains in this process with :func:`pipeline.training.local.train_local` (the
reference trainer, one thread), tracked in a temporary MLflow store. Training is deterministic
(same data, same seed, same weights), so a model two ways share is trained once and counted for
both: the frozen model is the window's of the first evaluated day, and a refresh of the
incremental chain is the window's model of that day. Each model is then read back from its run
and scored on day ``D`` for its AUC, log loss and calibration (its mean predicted click rate
over the observed one). A model is calibrated to the days it trained on, so with the weekly cycle
of the click rate (``--drift weekly=0`` turns it off) a next-day calibration moves with the
base rate from those days to ``D``: the output lists each day's observed click rate (``ctr``).

The data is sized by time: a calibration run measures the training rate and the fixed costs of
a run here and ``--seconds`` sets the rows per day (``--rows-per-day`` instead sets them). A
day's AUC on ``n`` rows has a standard error near ``0.0016 * sqrt(1e6 / n)``, so the verdict
is on the paired mean of the daily differences, with its standard error over the days.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import click
import numpy as np
import torch

from data.drift import Drift
from data.files import expand, row_groups
from data.reader import ShardReader
from data.schema import Schema
from data.synth import START_DATE, generate
from models.evaluate import auc, logloss
from models.train_step import TrainStep
from pipeline.bench import emit
from pipeline.bench.jobs import SET_HELP, echo
from pipeline.job.config import JobConfig, apply_override, job_from_dict
from pipeline.job.report import JobSummary
from pipeline.training.local import iterate_batches, start_from_init, train_local
from pipeline.workflows.incremental import Chain, Choice, chain_of, choose

Way = Literal["frozen", "window", "incremental"]
WAYS: tuple[Way, ...] = ("frozen", "window", "incremental")

EXPERIMENT = "antdt-bench-retrain"
CALIBRATION_ROWS_PER_DAY = 50_000
"""Rows a day of the calibration run's data (it trains on one window of them)."""

AUC_MEAN_TOLERANCE = 0.001
"""The incremental way's mean next-day AUC may be at most this below the window's (paired)."""
AUC_DAY_TOLERANCE = 0.003
"""No day of the incremental way may be more than this below the window's."""
CALIBRATION_TOLERANCE = 0.05
"""The incremental way's calibration within this of 1 every day."""
COST_RATIO = 0.3
"""The incremental way trains at most this share of the window's rows and seconds."""


@dataclass(frozen=True)
class Data:
    """The drifting dataset: its folder, its days (``YYYY-MM-DD``), its schema and each day's
    oracle (``auc``, ``ctr``, ``rows``) from ``oracle.json``."""

    folder: str
    days: tuple[str, ...]
    schema: str
    oracle: dict[str, dict[str, float]]

    @classmethod
    def make(cls, folder: str, rows_per_day: int, days: int, seed: int, drift: Drift) -> Data:
        generate(folder, rows=rows_per_day * days, days=days, seed=seed, files_per_day=2,
                 row_group_rows=16_384, drift=drift)
        with open(os.path.join(folder, "oracle.json")) as f:
            oracle = json.load(f)["per_day"]
        dates = tuple((START_DATE + dt.timedelta(days=d)).isoformat() for d in range(days))
        return cls(folder, dates, os.path.join(folder, "schema.yaml"), oracle)

    def path(self, day: str) -> str:
        return os.path.join(self.folder, f"date={day}")

    def digest(self) -> str:
        """The schema's digest, as the chains record it."""
        with open(self.schema, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]


@dataclass(frozen=True)
class Trained:
    """One model: its run, the days it trained (``start``: the run it continued, None: from
    scratch), rows and seconds (the training loop's and the whole call's)."""

    run_id: str
    days: tuple[str, ...]
    start: str | None
    rows: int
    train_s: float
    wall_s: float
    auc: float
    """Its AUC on the day it was trained for, as :func:`train_local` evaluated it."""


@dataclass(frozen=True)
class Scored:
    """A model on one day's rows: AUC, log loss, calibration (mean predicted click rate over
    the observed one) and the rows scored."""

    auc: float
    logloss: float
    calibration: float
    rows: int


def drift_of(settings: Sequence[str]) -> Drift:
    """data.drift's defaults with ``KEY=VALUE`` ``settings``.

    >>> drift_of(["weekly=0", "shift_day=3"]).weekly, drift_of(["shift_day=3"]).shift_day
    (0.0, 3)
    """
    fields = {f.name for f in dataclasses.fields(Drift)}
    values: dict[str, Any] = {}
    for item in settings:
        key, _, value = item.partition("=")
        if key not in fields or not value:
            raise click.BadParameter(f"expected KEY=VALUE with KEY one of {sorted(fields)}, "
                                     f"found {item!r}", param_hint="--drift")
        try:
            values[key] = int(value) if key == "shift_day" else float(value)
        except ValueError:
            raise click.BadParameter(f"{key}: expected a number, found {value!r}",
                                     param_hint="--drift") from None
    return Drift(**values)


def plan_incremental(days: Sequence[str], train_days: int, refresh_every: int,
                     schema: str) -> list[Choice]:
    """What the incremental way trains on each evaluated day (``days[train_days:]``), decided
    by :func:`choose` with the previous day's model as the champion; a version is named by
    its logical day (the run loop maps it to the run).

    >>> days = [f"2026-11-{d:02d}" for d in range(1, 12)]
    >>> [(c.way, len(c.days), c.start) for c in plan_incremental(days, 3, 4, "s")][:5]
    ... # doctest: +NORMALIZE_WHITESPACE
    [('window', 3, None), ('incremental', 1, '2026-11-04'), ('incremental', 1, '2026-11-05'),
     ('incremental', 1, '2026-11-06'), ('window', 3, None)]
    """
    choices: list[Choice] = []
    champion: Chain | None = None
    for k in range(train_days, len(days)):
        day, window = days[k], days[k - train_days:k]
        choice = choose("incremental", day, window, champion, refresh_every, schema)
        choices.append(choice)
        champion = chain_of(choice, day, day, champion, schema)
    return choices


def day_job(base: dict[str, Any], data: Data, train: Sequence[str], day: str,
            start: str | None) -> JobConfig:
    """The local job training ``train``'s days (from run ``start``'s model when given) and
    validating on ``day``."""
    raw = json.loads(json.dumps(base))
    raw["data"] = {"train": [data.path(d) for d in train], "validation": data.path(day),
                   "schema": data.schema}
    if start is not None:
        raw["train"]["init_from"] = f"runs:/{start}"
    return job_from_dict(raw, source=f"retrain benchmark job of {day}")


def base_job(tracking_uri: str, overrides: Sequence[str]) -> dict[str, Any]:
    """The benchmark's job settings (the default job's model; local mode) with ``overrides``;
    its data is filled in per day."""
    raw: dict[str, Any] = {
        "name": "bench-retrain",
        "data": {},
        "model": {"arch": "dlrm", "embedding_dim": 16},
        "train": {"batch_size": 4096, "seed": 0, "epochs": 1, "mode": "local"},
        "mlflow": {"experiment": EXPERIMENT, "tracking_uri": tracking_uri},
    }
    for item in overrides:
        apply_override(raw, item)
    return raw


class Runs:
    """Trains and scores the models of the three ways; a model asked for twice (the same days
    from the same start) is trained once, and each (model, day) is scored once."""

    def __init__(self, base: dict[str, Any], data: Data) -> None:
        self.base, self.data = base, data
        self._trained: dict[tuple[tuple[str, ...], str | None], Trained] = {}
        self._scored: dict[tuple[str, str], Scored] = {}
        self._loaded: dict[str, TrainStep] = {}
        self.schema = Schema.from_yaml(data.schema)

    def train(self, days: tuple[str, ...], day: str, start: str | None) -> Trained:
        key = (days, start)
        if key not in self._trained:
            began = time.perf_counter()
            summary: JobSummary = train_local(day_job(self.base, self.data, days, day, start),
                                              run_name=f"{day} {len(days)}d"
                                              f"{' cont.' if start else ''}")
            self._trained[key] = Trained(summary.run_id, days, start, summary.rows_trained,
                                         summary.train_s, time.perf_counter() - began,
                                         summary.auc)
        return self._trained[key]

    def score(self, run_id: str, day: str) -> Scored:
        key = (run_id, day)
        if key not in self._scored:
            self._scored[key] = self._score(self._step(run_id, day), day)
        return self._scored[key]

    def score_own_day(self, trained: Trained, day: str) -> Scored:
        """``trained`` scored on ``day``, the day it validated on: the model read back must
        score as the trained one did."""
        scored = self.score(trained.run_id, day)
        assert abs(scored.auc - trained.auc) < 1e-6, (trained, scored)
        return scored

    def _step(self, run_id: str, day: str) -> TrainStep:
        """The model run ``run_id`` logged, read back as a warm start reads it."""
        if run_id in self._loaded:  # the most recently used last
            self._loaded[run_id] = self._loaded.pop(run_id)
            return self._loaded[run_id]
        job = day_job(self.base, self.data, (day,), day, run_id)
        step = TrainStep(self.schema, job.model, job.train.optim, seed=job.train.seed)
        start_from_init(job, self.schema, step)  # what train_local does with train.init_from
        if len(self._loaded) == 3:  # a day scores three models, the frozen one every day
            del self._loaded[next(iter(self._loaded))]
        self._loaded[run_id] = step
        return step

    def _score(self, step: TrainStep, day: str) -> Scored:
        groups = row_groups(expand([self.data.path(day)]))
        probs: list[torch.Tensor] = []
        labels: list[torch.Tensor] = []
        for batch in iterate_batches(ShardReader(self.schema), groups,
                                     int(self.base["train"]["batch_size"])):
            probs.append(step.predict(batch).float().cpu())
            labels.append(batch.labels.cpu())
        y, p = torch.cat(labels).double().numpy(), torch.cat(probs).double().numpy()
        return Scored(auc(y, p), logloss(y, p), float(np.mean(p) / np.mean(y)), int(y.size))

    def trainings(self) -> int:
        return len(self._trained)


def day_row(day: str, scored: Scored, trained: Trained | None, how: str) -> dict[str, Any]:
    """One way's figures on one day (``trained`` None: it trained nothing that day)."""
    return {"day": day, "auc": round(scored.auc, 5), "logloss": round(scored.logloss, 5),
            "calibration": round(scored.calibration, 4), "trained": how,
            "rows_trained": trained.rows if trained else 0,
            "train_s": round(trained.train_s, 2) if trained else 0.0,
            "wall_s": round(trained.wall_s, 2) if trained else 0.0,
            "train_days": len(trained.days) if trained else 0,
            "run_id": trained.run_id if trained else None}


def run_days(runs: Runs, data: Data, train_days: int, choices: Sequence[Choice],
             quiet: bool) -> dict[Way, list[dict[str, Any]]]:
    """Each evaluated day of each way: train what the way trains that day, score on the day."""
    evaluated = data.days[train_days:]
    rows: dict[Way, list[dict[str, Any]]] = {way: [] for way in WAYS}
    frozen: Trained | None = None
    incremental_run: dict[str, str] = {}  # logical day -> the incremental model's run
    for k, (day, choice) in enumerate(zip(evaluated, choices)):
        echo(f"day {k + 1}/{len(evaluated)} ({day}): the window; incremental: {choice.reason}",
             quiet)
        window = runs.train(data.days[k:k + train_days], day, None)
        if frozen is None:
            frozen = window
        start = None if choice.start is None else incremental_run[choice.start]
        incremental = runs.train(choice.days, day, start)
        incremental_run[day] = incremental.run_id
        rows["frozen"].append(day_row(day, runs.score(frozen.run_id, day),
                                      frozen if k == 0 else None,
                                      "window" if k == 0 else "none"))
        rows["window"].append(day_row(day, runs.score_own_day(window, day),
                                      window, "window"))
        rows["incremental"].append({**day_row(day,
                                              runs.score_own_day(incremental, day),
                                              incremental, choice.way),
                                    "reason": choice.reason})
    return rows


def summarise(rows: dict[Way, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per way the sums and means, and the incremental way against the window's: the paired
    daily AUC differences (mean, standard error, the lowest), the cost ratios and the
    checks."""
    ways = {way: {"mean_auc": round(statistics.fmean(r["auc"] for r in days), 5),
                  "mean_logloss": round(statistics.fmean(r["logloss"] for r in days), 5),
                  "max_calibration_error": round(max(abs(r["calibration"] - 1) for r in days), 4),
                  "rows_trained": sum(r["rows_trained"] for r in days),
                  "train_s": round(sum(r["train_s"] for r in days), 1),
                  "wall_s": round(sum(r["wall_s"] for r in days), 1),
                  "trainings": sum(r["trained"] != "none" for r in days),
                  "refreshes": sum(r["trained"] == "window" for r in days)}
            for way, days in rows.items()}
    diffs = [i["auc"] - w["auc"] for i, w in zip(rows["incremental"], rows["window"])]
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    inc, win, frozen = ways["incremental"], ways["window"], ways["frozen"]
    ratios = {key: round(inc[key] / win[key], 3) if win[key] else math.nan
              for key in ("rows_trained", "train_s", "wall_s")}
    checks = {
        "mean_auc_within_window": mean >= -AUC_MEAN_TOLERANCE,
        "no_day_below_window": min(diffs) >= -AUC_DAY_TOLERANCE,
        "calibration_within": inc["max_calibration_error"] <= CALIBRATION_TOLERANCE,
        "above_frozen": inc["mean_auc"] > frozen["mean_auc"],
        "rows_ratio": ratios["rows_trained"] <= COST_RATIO,
        "seconds_ratio": ratios["train_s"] <= COST_RATIO,
    }
    return {"ways": ways,
            "incremental_minus_window": {"mean": round(mean, 5), "se": round(se, 5),
                                         "min": round(min(diffs), 5),
                                         "min_day": rows["window"][diffs.index(min(diffs))]["day"]},
            "ratios": ratios, "checks": checks, "passed": all(checks.values())}


@dataclass(frozen=True)
class Sizing:
    """Rows per day for a time budget: the calibration run's training rate, fixed seconds a
    run and scoring rate."""

    samples_per_s: float
    run_fixed_s: float
    score_rows_per_s: float

    def rows_per_day(self, seconds: float, day_trainings: int, runs: int,
                     day_scorings: int) -> int:
        """Rows a day so that ``runs`` runs training ``day_trainings`` days and
        ``day_scorings`` scorings of a day take ``seconds``, to two significant digits."""
        per_row = day_trainings / self.samples_per_s + day_scorings / self.score_rows_per_s
        rows = max(1.0, seconds - runs * self.run_fixed_s) / per_row
        scale = 10 ** max(0, int(math.log10(rows)) - 1)
        return max(10_000, round(rows / scale) * scale)

    def as_dict(self) -> dict[str, float]:
        return {key: round(value, 2) for key, value in dataclasses.asdict(self).items()}


def calibrate(tmp: str, base: dict[str, Any], drift: Drift, days: int, train_days: int,
              seed: int, quiet: bool) -> Sizing:
    """One window of :data:`CALIBRATION_ROWS_PER_DAY` rows a day trained and scored here (on
    data of the benchmark's days, whose tables are as large)."""
    echo(f"calibrating: {train_days} days of {CALIBRATION_ROWS_PER_DAY:,} rows", quiet)
    data = Data.make(os.path.join(tmp, "calibration"), CALIBRATION_ROWS_PER_DAY, days, seed,
                     drift)
    runs = Runs(base, data)
    began = time.perf_counter()
    trained = runs.train(data.days[:train_days], data.days[train_days], None)
    wall = time.perf_counter() - began
    began = time.perf_counter()
    scored = runs.score(trained.run_id, data.days[train_days])
    score_s = time.perf_counter() - began
    score_rate = scored.rows / score_s
    fixed = max(0.0, wall - trained.train_s - scored.rows / score_rate)
    return Sizing(trained.rows / trained.train_s, fixed, score_rate)


def planned(choices: Sequence[Choice], train_days: int) -> tuple[int, int, int]:
    """Days trained, runs and day scorings of a benchmark whose incremental way makes
    ``choices`` (refreshes shared with the window way)."""
    own = [c for c in choices if c.way == "incremental"]
    runs = len(choices) + len(own)
    day_trainings = len(choices) * train_days + sum(len(c.days) for c in own)
    scorings = 2 * runs + 2 * len(choices)  # a run's validation and its scoring; frozen's
    return day_trainings, runs, scorings


@click.command("retrain")
@click.option("--days", type=click.IntRange(min=2), default=14, show_default=True,
              help="Evaluated days (after the first window).")
@click.option("--train-days", type=click.IntRange(min=1), default=6, show_default=True,
              help="Days of a window (the DAG's train_days).")
@click.option("--refresh-every", type=click.IntRange(min=1), default=7, show_default=True,
              help="The incremental chain trains the window from scratch every this many days.")
@click.option("--seconds", type=click.FloatRange(min=10.0), default=900.0, show_default=True,
              help="Time budget: the rows per day are sized for it by a calibration run.")
@click.option("--rows-per-day", type=click.IntRange(min=1_000), default=None,
              help="Rows a day instead of sizing them for --seconds.")
@click.option("--seed", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--drift", "drift_settings", multiple=True, metavar="KEY=VALUE",
              help="A drift setting instead of data.drift's default, e.g. --drift weekly=0 "
                   "(repeatable).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(days: int, train_days: int, refresh_every: int, seconds: float,
            rows_per_day: int | None, seed: int, drift_settings: tuple[str, ...],
            overrides: tuple[str, ...], as_json: bool) -> None:
    """Frozen, window and incremental retraining on drifting data, day by day (targets: the
    incremental way's paired mean next-day AUC >= the window's - 0.001, no day below it by
    more than 0.003, calibration within 5%, above the frozen model, at most 0.3x the window's
    rows and training seconds)."""
    began = time.perf_counter()
    drift = drift_of(drift_settings)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar a model read
    total_days = train_days + days
    dates = [(START_DATE + dt.timedelta(days=d)).isoformat() for d in range(total_days)]
    with tempfile.TemporaryDirectory(prefix="antdt-bench-retrain-") as tmp:
        from mlflow import MlflowClient

        uri = f"sqlite:///{tmp}/mlflow.db"
        MlflowClient(uri).create_experiment(EXPERIMENT,
                                            artifact_location=f"file://{tmp}/artifacts")
        base = base_job(uri, overrides)
        sizing = None
        if rows_per_day is None:
            sizing = calibrate(tmp, base, drift, total_days, train_days, seed, as_json)
            choices = plan_incremental(dates, train_days, refresh_every, "schema")
            rows_per_day = sizing.rows_per_day(seconds, *planned(choices, train_days))
        echo(f"{rows_per_day:,} rows a day, {total_days} days", as_json)
        data = Data.make(os.path.join(tmp, "data"), rows_per_day, total_days, seed, drift)
        choices = plan_incremental(data.days, train_days, refresh_every, data.digest())
        runs = Runs(base, data)
        rows = run_days(runs, data, train_days, choices, as_json)
        trainings = runs.trainings()
    evaluated = data.days[train_days:]
    for way_rows in rows.values():
        for row in way_rows:
            row.pop("run_id")
    emit({"days": days, "train_days": train_days, "refresh_every": refresh_every,
          "rows_per_day": rows_per_day, "drift": drift.for_days(total_days).as_dict(),
          "auc_se_per_day": round(0.0016 * math.sqrt(1e6 / rows_per_day), 4),
          "sizing": None if sizing is None else {"seconds": seconds, **sizing.as_dict()},
          "oracle_auc": {d: round(data.oracle[d]["auc"], 5) for d in evaluated},
          "ctr": {d: round(data.oracle[d]["ctr"], 5) for d in data.days},
          "mean_oracle_auc": round(statistics.fmean(data.oracle[d]["auc"] for d in evaluated), 5),
          **summarise(rows), "per_day": rows, "models_trained": trainings,
          "overrides": list(overrides), "wall_s": round(time.perf_counter() - began, 1)},
         as_json)
