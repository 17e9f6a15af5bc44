"""The daily retraining of a ranking model, step by step: what each task of the Airflow DAG
``dags/retrain_ranking.py`` does, as plain functions that take settings and return plain data
(paths, ids, figures; never rows), so the DAG stays a thin file Airflow parses fast and every
step runs, and is tested, without Airflow::

    partition_files      the sensor: the logical date's partition has its Parquet files
      ─► check_window    every partition of the window is there; the new one validated
                         (a bad file fails the run by name, or is quarantined)
      ─► train           incremental (the default: the champion continued over the days
                         since its data, normally one) or the window from scratch
                         (:mod:`pipeline.workflows.incremental` chooses: first day, no
                         champion, every ``refresh_every`` days, a schema change or a day
                         that fails its check train the window); the job on the Dask cluster
                         through JobClient, as a job id derived from the DAG run: a retried
                         task attaches to the job its first try started; a day already
                         trained with the same job and data trains nothing and gives the
                         version it registered
      ─► promote         registry.promote on the validation day: the new version takes
                         ``champion`` only when it beats the champion there, with no worse a
                         logloss and its calibration within ``calibration`` (the replaced
                         champion keeps ``champion_prev``)
      ─► report          the decision, both AUCs, the rows, the MLflow run, for the task log
                         and the asset event downstream DAGs read

The data layout is one folder per day under a root (``date=2026-11-07``; the ``partition``
setting spells it). The models are scored on the *validation day* (default: the logical date,
the newest partition, held out from training) and trained on the ``train_days`` daily partitions
before it. Each step imports what it needs (torch, Dask, MLflow) when it runs, so the sensor's
pokes stay light.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import posixpath
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from antdt.errors import AntdtError, ConfigError, DataError
from pipeline.job.config import JobConfig, OnBadData, check_model_name, load_job
from pipeline.workflows.incremental import WAYS, Chain, Choice, Way, chain_of, check_day, choose

logger = logging.getLogger(__name__)

FINAL_FAILED = ("failed", "cancelled")
"""Job states after which a retried task starts a new job instead of attaching."""
PROGRESS_STEPS = 10
"""How many progress lines a followed job writes to the task log."""


class RetrainError(AntdtError):
    """A retraining setting or step cannot be done as asked (the message names the setting,
    the partition or the version)."""


BAD_INPUT: tuple[type[AntdtError], ...] = (ConfigError, DataError, RetrainError)
"""What a retry cannot fix: bad data, a bad job file, a bad param (each names the file,
column, key or value). The DAG fails such a task at once, without retries."""


# ---- settings and the data window -------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """One run's settings: the DAG's params, checked, with relative paths made absolute
    against ``base`` (the project folder: an Airflow task's working directory is Airflow's)
    and the logical date as ``day``."""

    day: str
    base: str
    job_file: str
    data_root: str
    partition: str
    train_days: int
    validation_day: str
    schema: str | None
    scheduler: str | None
    tracking_uri: str
    experiment: str
    model: str
    on_bad_data: OnBadData
    min_gain: float
    overrides: tuple[str, ...] = ()
    mode: str = ""
    """``async`` or ``sync`` (the training mode), or empty: the job file's."""
    retrain: Way = "incremental"
    """How a day trains (:mod:`pipeline.workflows.incremental`): ``incremental`` continues the
    champion over the days since its data, ``window`` trains the window from scratch."""
    refresh_every: int = 7
    """An incremental chain trains the window from scratch again after this many days."""
    calibration: float = 0.05
    """A new version takes the champion only with its mean prediction within this share of the
    validation day's click rate (and no worse a logloss)."""

    @classmethod
    def from_params(cls, params: Mapping[str, Any], day: str, base: str) -> Settings:
        """The settings of the run of logical date ``day`` (``YYYY-MM-DD``) from the DAG's
        ``params``; a bad value raises :class:`RetrainError` naming the param."""
        def text(key: str) -> str:
            value = params.get(key)
            if not isinstance(value, str):
                raise RetrainError(f"param {key!r}: expected a string, found {value!r}")
            return value.strip()

        def path(key: str) -> str:
            value = text(key)
            if not value:
                raise RetrainError(f"param {key!r}: expected a path, found nothing")
            return _absolute(value, base)

        def number(key: str, kind: type, low: float) -> Any:
            value = params.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or (kind is int and not float(value).is_integer()) or value < low:
                raise RetrainError(f"param {key!r}: expected a {kind.__name__} >= {low}, found "
                                   f"{value!r}")
            return kind(value)

        on_bad = text("on_bad_data")
        if on_bad not in ("fail", "quarantine"):
            raise RetrainError(f"param 'on_bad_data': expected 'fail' or 'quarantine', found "
                               f"{on_bad!r}")
        partition = text("partition")
        if "{date}" not in partition:
            raise RetrainError(f"param 'partition': expected a folder name holding '{{date}}', "
                               f"found {partition!r}")
        overrides = params.get("overrides") or []
        if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
            raise RetrainError(f"param 'overrides': expected a list of KEY=VALUE strings, found "
                               f"{overrides!r}")
        mode = text("mode") if "mode" in params else ""
        if mode not in ("", "async", "sync"):
            raise RetrainError(f"param 'mode': expected 'async', 'sync' or nothing (the job "
                               f"file's), found {mode!r}")
        way = text("retrain") if "retrain" in params else "incremental"
        if way not in WAYS:
            raise RetrainError(f"param 'retrain': expected one of {list(WAYS)}, found {way!r}")
        validation = text("validation_day") or day
        for key, value in (("logical date", day), ("validation_day", validation)):
            _date(value, key)
        model = text("registered_model")
        try:
            check_model_name(model, "param 'registered_model'")
        except AntdtError as exc:
            raise RetrainError(str(exc)) from exc
        tracking = text("tracking_uri")
        if not tracking:
            raise RetrainError("param 'tracking_uri': expected an MLflow tracking URI, found "
                               "nothing")
        return cls(day=day, base=base, job_file=path("job_file"), data_root=path("data_root"),
                   partition=partition, train_days=number("train_days", int, 1),
                   validation_day=validation,
                   schema=path("schema") if text("schema") else None,
                   scheduler=text("scheduler") or None,
                   tracking_uri=_local_store(tracking, base), experiment=text("experiment"),
                   model=model, on_bad_data=on_bad,  # type: ignore[arg-type]  # checked
                   min_gain=number("min_gain", float, 0.0), overrides=tuple(overrides),
                   mode=mode, retrain=way,  # type: ignore[arg-type]  # checked
                   refresh_every=number("refresh_every", int, 1) if "refresh_every" in params
                   else 7,
                   calibration=number("calibration", float, 0.0) if "calibration" in params
                   else 0.05)

    def partition_path(self, day: str) -> str:
        """The folder of ``day``'s partition."""
        return posixpath.join(self.data_root, self.partition.format(date=day))


def _absolute(path: str, base: str) -> str:
    return path if "://" in path else os.path.normpath(os.path.join(base, path))


def job_id(dag_id: str, day: str, run_id: str) -> str:
    """The id of the job a DAG run trains: the same for every try of the run's train task.

    >>> job_id("retrain_ranking", "2026-11-07", "manual__2026-11-07T00:00:00+00:00")
    'retrain_ranking-2026-11-07-65a0f641'
    """
    return f"{dag_id}-{day}-{hashlib.sha256(run_id.encode()).hexdigest()[:8]}"


def quiet_libraries() -> None:
    """Keep a task's log to antdt's own lines: Dask's, MLflow's and torch's chatter, what
    FBGEMM logs to the root logger, and the Python warnings of this process and of the worker
    processes it starts are left out (their warnings and errors stay)."""
    from pipeline.terminal import QUIET_ENVIRONMENT

    for key, value in {**QUIET_ENVIRONMENT, "DASK_LOGGING__DISTRIBUTED": "warning"}.items():
        os.environ.setdefault(key, value)
    warnings.simplefilter("ignore")
    for name in ("distributed", "mlflow", "torch", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    root = logging.getLogger()
    if _library_info not in root.filters:
        root.addFilter(_library_info)


def _library_info(record: logging.LogRecord) -> bool:
    """Drops INFO records logged to the root logger itself (FBGEMM's "Successfully loaded"
    and table banners); records of named loggers are not filtered here."""
    return record.levelno >= logging.WARNING


def _date(value: str, what: str) -> dt.date:
    try:
        return dt.date.fromisoformat(value)
    except ValueError:
        raise RetrainError(f"{what} {value!r}: expected a date as YYYY-MM-DD") from None


def _local_store(uri: str, base: str) -> str:
    """A relative ``sqlite:///`` store made absolute against ``base`` (a task's working
    directory is Airflow's, not the project's)."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri[len(prefix):].startswith("/"):
        return prefix + os.path.join(base, uri[len(prefix):])
    return uri


@dataclass(frozen=True)
class Window:
    """The days one run trains and scores on, and their partitions' folders."""

    train_days: tuple[str, ...]
    validation_day: str
    train: tuple[str, ...]
    validation: str

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "train_days": list(self.train_days),
                "train": list(self.train)}


def window(settings: Settings) -> Window:
    """The ``train_days`` most recent days up to the logical date, the validation day left out
    (by default the validation day *is* the logical date: training takes the days before it).

    >>> s = Settings(day="2026-11-07", base="/", job_file="job.yaml", data_root="/data",
    ...              partition="date={date}", train_days=2, validation_day="2026-11-07",
    ...              schema=None, scheduler=None, tracking_uri="sqlite:///m.db",
    ...              experiment="e", model="ranking", on_bad_data="fail", min_gain=0.0)
    >>> w = window(s)
    >>> w.train_days, w.validation
    (('2026-11-05', '2026-11-06'), '/data/date=2026-11-07')
    """
    day = _date(settings.day, "logical date")
    days: list[str] = []
    while len(days) < settings.train_days:
        if day.isoformat() != settings.validation_day:
            days.append(day.isoformat())
        day -= dt.timedelta(days=1)
    days.reverse()
    return Window(train_days=tuple(days), validation_day=settings.validation_day,
                  train=tuple(settings.partition_path(d) for d in days),
                  validation=settings.partition_path(settings.validation_day))


# ---- the sensor and the validation ------------------------------------------------------------


def partition_files(path: str) -> list[str]:
    """The Parquet files of the partition at ``path``; empty while it is not there."""
    from data.files import expand

    try:
        return expand(path)
    except DataError:
        return []


def check_window(settings: Settings) -> dict[str, Any]:
    """Check that every partition of the run's window holds Parquet files and validate the
    logical date's partition (the one that just arrived) against the schema: with
    ``on_bad_data`` ``fail`` a problem raises :class:`DataError` naming the file, row group and
    column; with ``quarantine`` the bad units are listed (the job sets them aside and counts
    their rows). Returns the window, the new partition's files, rows and bad units."""
    from data.schema import Schema
    from data.validate import validate

    days = window(settings)
    missing = [p for p in (*days.train, days.validation) if not partition_files(p)]
    if missing:
        raise DataError(f"{len(missing)} partition(s) of the window {list(days.train_days)} "
                        f"+ validation {days.validation_day} hold no Parquet file: "
                        f"{', '.join(missing)}")
    new = settings.partition_path(settings.day)
    files = partition_files(new)
    job = retrain_job(settings, days)
    report = validate(files, Schema.from_yaml(job.data.schema))
    if settings.on_bad_data == "fail":
        report.raise_if_bad()
    bad = [list(unit) for unit in report.bad_units()]
    for path, group, reason in bad:
        logger.warning("quarantined %s%s: %s", path,
                       "" if group is None else f" row group {group}", reason)
    logger.info("partition %s: %d file(s), %s good rows, %s rows quarantined", new, len(files),
                f"{report.good_rows:,}", f"{report.bad_rows:,}")
    return {"window": days.to_dict(), "partition": new, "files": files,
            "rows": report.good_rows, "quarantined_rows": report.bad_rows, "quarantined": bad}


def retrain_job(settings: Settings, days: Window, start: str | None = None) -> JobConfig:
    """The job file with the run's window, schema (the job file's, relative to the project
    folder, unless the settings name one), bad-data rule, tracking store, experiment and
    registered model, in the settings' mode (if they name one), after the ``overrides``
    (``--set`` style); starting from version ``start`` of the registered model if given."""
    modes = (f"train.mode={settings.mode}",) if settings.mode else ()
    job = load_job(settings.job_file, (*settings.overrides, *modes))
    schema = settings.schema or _absolute(job.data.schema, settings.base)
    data = dataclasses.replace(job.data, train=days.train, validation=(days.validation,),
                               schema=schema,
                               on_bad_data=settings.on_bad_data)
    tracking = dataclasses.replace(job.mlflow, tracking_uri=settings.tracking_uri,
                                   experiment=settings.experiment or job.mlflow.experiment,
                                   registered_model=settings.model)
    train = job.train if start is None else dataclasses.replace(
        job.train, init_from=f"models:/{settings.model}/{start}")
    return dataclasses.replace(job, data=data, mlflow=tracking, train=train)


def window_key(job: JobConfig) -> str:
    """What makes two runs the same: the fingerprint of the job's data files and the job's
    settings other than where it is tracked and the model it starts from (a day's chain is
    pinned by its days). A run with the key of a registered version trains nothing."""
    from pipeline.tracking.registry import data_window

    settings = {k: v for k, v in job.to_dict().items() if k != "mlflow"}
    settings["train"] = {k: v for k, v in settings["train"].items()
                         if k not in ("init_from", "init_from_partial")}
    text = json.dumps({"data": data_window(job.data).fingerprint, "job": settings},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def schema_digest(job: JobConfig) -> str:
    """A digest of the job's schema: a chain trains on while it stays the same."""
    from data.schema import Schema

    text = json.dumps(Schema.from_yaml(job.data.schema).to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def days_window(settings: Settings, days: Window, train_days: Sequence[str]) -> Window:
    """``days`` training on ``train_days`` instead."""
    return dataclasses.replace(days, train_days=tuple(train_days),
                               train=tuple(settings.partition_path(d) for d in train_days))


# ---- training ---------------------------------------------------------------------------------


def train(settings: Settings, job_id: str, run_tags: Mapping[str, str] | None = None
          ) -> dict[str, Any]:
    """Train the run's day as a new version of the registered model (the way
    :func:`plan` chooses), or find the version a run of the same day, job and data registered
    (nothing is trained then).

    The job goes to the Dask scheduler at ``settings.scheduler`` (none: a LocalCluster of the
    job's ``train.workers`` for this call) as ``job_id``. When a job of that id is running or
    finished there (a retried task), this call attaches to it; when it failed or was
    cancelled, the retry starts ``job_id-2`` (then ``-3``...). Returns :func:`trained` of the
    version."""
    from antdt.jobs import JobClient
    from pipeline.training.cluster import job_spec
    from pipeline.training.local_cluster import connect
    from pipeline.training.following import follow, outcome
    from pipeline.training.local import prepare_data

    days = window(settings)
    found = registered_for_day(settings, days)  # footers only: a re-run decodes no data page
    if found is not None:
        logger.info("day %s was trained by the same job on the same data already: %s version "
                    "%s (run %s); nothing to train", settings.day, settings.model,
                    found["version"], found["run_id"])
        return {**found, "reused": True, "attached": False}
    choice, chain = plan(settings, days)
    job = retrain_job(settings, days_window(settings, days, choice.days), choice.start)
    data = prepare_data(job)  # every day trained, as every job: an older day may have changed
    tags = {"antdt.retrain.key": window_key(job), "antdt.retrain.day": settings.day,
            "antdt.retrain.reason": choice.reason, **chain.tags(), **(run_tags or {})}
    spec = job_spec(job, data, run_tags=tags, run_name=run_name(settings.day, choice))
    workers = job.train.workers if settings.scheduler is None else None
    with connect(workers, settings.scheduler) as client, JobClient(client) as jobs:
        known = {record["job_id"]: record["state"] for record in jobs.status()}
        chosen, n = job_id, 1
        while known.get(chosen) in FINAL_FAILED:
            n += 1
            chosen = f"{job_id}-{n}"
        submitted = jobs.submit(spec, job_id=chosen)
        logger.info("%s job %s on %s", "attached to" if submitted["attached"] else "submitted",
                    chosen, settings.scheduler or f"a LocalCluster of {workers} workers")
        record = follow(jobs, chosen, on_change=_ProgressLog(chosen))
    summary = outcome(record)
    for line in summary.lines():
        logger.info("%s", line)
    if summary.registered_version is None:
        raise RetrainError(f"job {chosen} finished but registered no version of "
                           f"{settings.model}")
    result = trained(settings.tracking_uri, settings.model, summary.registered_version)
    return {**result, "job_id": chosen, "reused": False, "attached": bool(submitted["attached"])}


def plan(settings: Settings, days: Window) -> tuple[Choice, Chain]:
    """How the run's day trains (:func:`pipeline.workflows.incremental.choose`, against the
    champion's chain and the day check of the days it would add) and the chain its version
    will end."""
    from data.schema import Schema

    job = retrain_job(settings, days)
    schema = schema_digest(job)
    champion = champion_chain(settings)
    check = None
    if settings.retrain == "incremental" and champion is not None:
        label = Schema.from_yaml(job.data.schema).label
        check = day_check(settings, [d for d in days.train_days if d > max(champion.days)],
                          champion.days[-3:], label)
    choice = choose(settings.retrain, settings.day, days.train_days, champion,
                    settings.refresh_every, schema, check)
    logger.info("day %s trains %s %s: %s", settings.day, choice.way, list(choice.days),
                choice.reason)
    return choice, chain_of(choice, "", settings.day, champion, schema)


def champion_chain(settings: Settings) -> Chain | None:
    """The chain the registered model's champion ends (None: no champion, or one that
    records no chain, e.g. promoted by hand from another job)."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    try:
        version = MlflowClient(settings.tracking_uri).get_model_version_by_alias(
            settings.model, "champion")
    except MlflowException:
        return None
    chain = Chain.from_tags(str(version.version), version.tags)
    if chain is None:
        logger.info("the champion, %s version %s, records no chain: the window trains",
                    settings.model, version.version)
    return chain


def day_check(settings: Settings, new: Sequence[str], recent: Sequence[str], label: str
              ) -> str | None:
    """Why one of the ``new`` days looks unlike the days before it (the ``recent`` days the
    champion trained, then the new days checked already); None when none does."""
    from pipeline.workflows.incremental import day_stats

    seen = [day_stats([settings.partition_path(d)], label) for d in recent
            if partition_files(settings.partition_path(d))]
    for day in new:
        stats = day_stats([settings.partition_path(day)], label)
        problem = check_day(stats, seen)
        if problem is not None:
            return f"day {day}: {problem}"
        seen.append(stats)
    return None


def run_name(day: str, choice: Choice) -> str:
    """A version's run name: the version it started from and the days it added, or the
    window it trained from scratch.

    >>> run_name("2026-11-08", Choice("incremental", ("2026-11-07",), "6", "..."))
    'retrain 2026-11-08: version 6 + 2026-11-07'
    >>> run_name("2026-11-08", Choice("window", ("2026-11-01", "2026-11-07"), None, "..."))
    'retrain 2026-11-08: window 2026-11-01..2026-11-07 from scratch'
    """
    if choice.start is not None:
        return f"retrain {day}: version {choice.start} + {', '.join(choice.days)}"
    span = choice.days[0] if len(choice.days) == 1 else f"{choice.days[0]}..{choice.days[-1]}"
    return f"retrain {day}: window {span} from scratch"


class _ProgressLog:
    """Writes a followed job's progress to the log every tenth of its rows."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._logged = -1

    def __call__(self, record: Mapping[str, Any]) -> None:
        rows = record.get("rows") or {}
        if not rows or not rows.get("expected"):
            return
        done = rows["done"] + rows["quarantined"]
        step = done * PROGRESS_STEPS // rows["expected"]
        if step > self._logged:
            self._logged = step
            logger.info("job %s: %s of %s rows (%d%%), %s", self.job_id, f"{done:,}",
                        f"{rows['expected']:,}", 100 * done // rows["expected"],
                        record["state"])


def registered_for_day(settings: Settings, days: Window) -> dict[str, Any] | None:
    """:func:`trained` of the version a run of the settings' day registered with the same job
    on the same data (its days' files as they are now); None when there is none (or no such
    model yet)."""
    from mlflow import MlflowClient

    client = MlflowClient(settings.tracking_uri)
    versions = client.search_model_versions(
        f"name = '{settings.model}' and tags.`antdt.retrain.day` = '{settings.day}'")
    for version in sorted(versions, key=lambda v: int(v.version)):
        recorded = version.tags.get("antdt.retrain.days")
        trained_days = recorded.split(",") if recorded else days.train_days
        job = retrain_job(settings, days_window(settings, days, trained_days))
        if window_key(job) == version.tags.get("antdt.retrain.key"):
            return trained(settings.tracking_uri, settings.model, str(version.version))
    return None


FIGURES = ("auc", "logloss", "oracle_auc", "rows_trained", "rows_lost", "rows_retrained",
           "rows_quarantined", "samples_per_s", "wall_s")
"""The figures of a version's run that a retraining reports (from the version's tags)."""


def trained(tracking_uri: str, model: str, version: str) -> dict[str, Any]:
    """What the report needs of a registered version, from its tags and its run: the model,
    version, run, job, its figures (:data:`FIGURES`, None when not tagged) and the run's
    page."""
    from mlflow import MlflowClient

    from pipeline.job.report import run_page
    from pipeline.tracking.uris import redact

    client = MlflowClient(tracking_uri)
    found = client.get_model_version(model, version)
    if not found.run_id:
        raise RetrainError(f"{model} version {version} names no MLflow run; expected a version "
                           "an antdt job registered")
    run = client.get_run(found.run_id)
    figures = {name: _number(found.tags.get(f"antdt.{name}")) for name in FIGURES}
    days = found.tags.get("antdt.retrain.days")
    return {"model": model, "version": str(found.version), "run_id": found.run_id,
            "job_id": run.data.tags.get("antdt.job_id"), "run_name": run.info.run_name,
            "way": found.tags.get("antdt.retrain.way"),
            "days_trained": days.split(",") if days else None,
            "started_from": run.data.tags.get("antdt.init_from.version"),
            "experiment_id": run.info.experiment_id, **figures,
            "tracking_uri": redact(tracking_uri),
            "run_page": run_page(redact(tracking_uri), run.info.experiment_id, found.run_id)}


def _number(text: str | None) -> float | int | None:
    if text is None:
        return None
    value = float(text)
    return int(value) if value.is_integer() and "." not in text else value


# ---- promotion and the report -----------------------------------------------------------------


def promote(settings: Settings, result: Mapping[str, Any],
            quarantined: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
    """:func:`pipeline.tracking.registry.promote` of the version ``result`` names against the
    champion, both scored on the validation day's partition (its files with a quarantined unit left out).
    A version a re-run found rather than trained keeps the decision recorded when it was
    promoted (a re-run of an old day never moves the champion again); returns the decision as
    plain data."""
    from pipeline.tracking.registry import promote as promote_version
    from pipeline.tracking.registry import recorded_decision

    if result["reused"]:
        recorded = recorded_decision(settings.model, result["version"], settings.tracking_uri)
        if recorded is not None:
            logger.info("%s version %s was judged when it was trained: %s", settings.model,
                        result["version"], recorded.outcome.value)
            return {**recorded.to_dict(), "recorded": True}
    days = window(settings)
    bad = {str(unit[0]) for unit in quarantined}
    files = [f for f in partition_files(days.validation) if f not in bad]
    if not files:
        raise RetrainError(f"validation day {days.validation_day}: no readable file in "
                           f"{days.validation} to score the models on")
    decision = promote_version(settings.model, version=int(result["version"]), metric="auc",
                               on=files, min_gain=settings.min_gain,
                               tracking_uri=settings.tracking_uri, no_worse=("logloss",),
                               calibration=settings.calibration)
    for line in decision.lines():
        logger.info("%s", line)
    return {**decision.to_dict(), "recorded": False}


def report(settings: Settings, result: Mapping[str, Any], decision: Mapping[str, Any]
           ) -> tuple[list[str], dict[str, Any]]:
    """The run's report: lines for the task log, and the asset event's ``extra`` (plain
    data: the model, the version, whether it is the champion now, both AUCs, the rows, the
    run)."""
    champion_now = decision["candidate"] if decision["promoted"] else decision["champion"]
    extra = {
        "day": settings.day, "model": settings.model, "version": result["version"],
        "decision": decision["outcome"], "promoted": bool(decision["promoted"]),
        "champion_version": champion_now,
        "candidate_auc": decision["candidate_score"], "champion_auc": decision["champion_score"],
        "gain": decision["gain"], "validation_rows": decision["rows"],
        "run_auc": result["auc"], "rows_trained": result["rows_trained"],
        "rows_lost": result["rows_lost"], "rows_quarantined": result["rows_quarantined"],
        "run_id": result["run_id"], "run_page": result["run_page"],
        "job_id": result.get("job_id"), "trained": not result["reused"],
        "way": result.get("way"), "days_trained": result.get("days_trained"),
        "started_from": result.get("started_from"),
    }

    def score(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    how = "trained" if not result["reused"] else "found (the same job and data, trained before)"
    lines = [
        f"retrain {settings.day}: {settings.model} version {result['version']} {how}",
        f"  decision   {decision['outcome']}: the champion is version {champion_now}",
        f"  auc        candidate {score(decision['candidate_score'])}, champion "
        f"{score(decision['champion_score'])}"
        + (f", gain {decision['gain']:+.4f}" if decision["gain"] is not None else "")
        + (f" on {decision['rows']:,} validation rows" if decision["rows"] else ""),
        f"  trained    {result.get('run_name') or result.get('way') or 'n/a'}",
        f"  rows       trained {_count(result['rows_trained'])}, lost "
        f"{_count(result['rows_lost'])}, quarantined {_count(result['rows_quarantined'])}",
        f"  run        {result['run_page']}",
    ]
    return lines, extra


def _count(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"
