"""Daily retraining of the antdt ranking model (Airflow 3, ``airflow.sdk`` TaskFlow).

Every day, once the day's Parquet partition has arrived: validate it, train the model on a
Dask cluster (by default incrementally: yesterday's champion continued over the day it has not
seen; the whole window from scratch on the first day and every ``refresh_every`` days), let the
new version take the registry alias ``champion`` only when it beats the champion on that day's
rows without a worse logloss or calibration, and report the outcome in the task log and as an
event of the asset ``antdt_ranking_model`` (a serving deploy can be scheduled on it)::

    wait_for_partition ─► validate_partition ─► train ─► promote ─► report

The steps are antdt's (:mod:`pipeline.workflows.retrain`); this file only wires them, and
imports nothing heavy (torch, Dask, MLflow) while Airflow parses it. Tasks pass paths, ids and figures, never
rows. A run is re-runnable: the train task's job id comes from the DAG run (a retried task
attaches to the job its first try started), and a day already trained by the same job on the
same data trains nothing and keeps the decision made then. Relative paths in the params resolve
against the antdt project folder, the parent of ``dags/``. See ``dags/README.md``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import (Asset, CronDataIntervalTimetable, Param, PokeReturnValue, dag,
                         get_current_context, task)
from airflow.sdk.exceptions import AirflowFailException

if TYPE_CHECKING:
    from pipeline.workflows.retrain import Settings

logger = logging.getLogger(__name__)

PROJECT = Path(__file__).resolve().parents[1]
"""The antdt project folder: relative paths in the params resolve against it."""

MODEL = Asset(name="antdt_ranking_model", uri="x-antdt://retrain_ranking/champion")
"""Updated by every run's report; the event's ``extra`` holds the decision and its figures."""

PARAMS = {
    "job_file": Param("jobs/synthetic.yaml", type="string",
                      description="The antdt job file: model, training settings, schema."),
    "data_root": Param("demo-data/synthetic", type="string",
                       description="The folder (or fsspec URL) holding one partition per day."),
    "partition": Param("date={date}", type="string",
                       description="A day's partition folder under data_root; {date} is the "
                                   "day as YYYY-MM-DD."),
    "train_days": Param(6, type="integer", minimum=1,
                        description="Days of training data: the N most recent daily partitions "
                                    "up to the logical date, the validation day left out."),
    "validation_day": Param("", type="string", pattern=r"^(\d{4}-\d{2}-\d{2})?$",
                            description="The day (YYYY-MM-DD) whose partition scores the new "
                                        "version and the champion; empty: the logical date."),
    "schema": Param("", type="string",
                    description="The data's schema YAML; empty: the job file's."),
    "scheduler": Param("", type="string",
                       description="The Dask scheduler to train on (tcp://host:8786, "
                                   "tls://...); empty: a LocalCluster for this run."),
    "tracking_uri": Param("", type="string",
                          description="The MLflow tracking URI (a relative sqlite path is "
                                      "relative to the project folder); empty: the "
                                      "MLFLOW_TRACKING_URI of the Airflow worker running the "
                                      "task where it is set, else sqlite:///mlflow.db in the "
                                      "project folder. Resolved when the task runs."),
    "experiment": Param("antdt-retrain", type="string",
                        description="The MLflow experiment of the training runs."),
    "registered_model": Param("ranking", type="string",
                              description="The registered model the new version joins."),
    "on_bad_data": Param("fail", enum=["fail", "quarantine"],
                         description="A broken file or row group: fail the run, or set it "
                                     "aside and count its rows."),
    "min_gain": Param(0.0, type="number", minimum=0,
                      description="The AUC gain over the champion needed to take its place."),
    "retrain": Param("incremental", enum=["incremental", "window"],
                     description="incremental: continue the champion over the days since its "
                                 "data (normally one); window: train the train_days window "
                                 "from scratch every day."),
    "refresh_every": Param(7, type="integer", minimum=1,
                           description="An incremental chain trains the window from scratch, "
                                       "with fresh optimiser state, every this many days."),
    "calibration": Param(0.05, type="number", minimum=0,
                         description="A new version takes the champion only with its mean "
                                     "prediction within this share of the validation day's "
                                     "click rate (and a logloss no worse than the champion's)."),
    "mode": Param("", enum=["", "async", "sync"],
                  description="The training mode: async (a replica per worker, for shared "
                              "clusters), sync (tables sharded across the workers, for "
                              "dedicated ones), or empty: the job file's."),
    "overrides": Param([], type="array", items={"type": "string"},
                       description="Job settings to change, KEY=VALUE as antdt's --set "
                                   "(train.sparse_lr=0.02)."),
}


def tracking_store(param: str) -> str:
    """The MLflow tracking URI of this run, in MLflow's own order: the ``tracking_uri`` param
    when given, else ``MLFLOW_TRACKING_URI`` (how a deployment points its workers at its
    tracking server), else the project folder's ``mlflow.db``, the demo's store. Called when a
    task runs, never while Airflow parses this file: the environment that counts is the one of
    the worker running the task, not the DAG processor's."""
    return (param.strip() or os.environ.get("MLFLOW_TRACKING_URI", "").strip()
            or f"sqlite:///{PROJECT / 'mlflow.db'}")


def settings() -> Settings:
    """This run's settings, from its params and logical date."""
    from pipeline.workflows.retrain import Settings

    context = get_current_context()
    params = context["params"]
    resolved = {**params, "tracking_uri": tracking_store(params["tracking_uri"])}
    return Settings.from_params(resolved, context["ds"], str(PROJECT))


@contextlib.contextmanager
def failing_at_once(what: str) -> Iterator[None]:
    """Bad data, a bad job file or a bad param fails the task without retries (a retry would
    find them as they are); the error, naming the file, column or value, goes to the log."""
    from pipeline.workflows.retrain import BAD_INPUT

    try:
        yield
    except BAD_INPUT as exc:
        logger.error("%s", exc)
        raise AirflowFailException(f"{what}: {exc}") from exc


@task.sensor(poke_interval=300, timeout=12 * 3600, mode="reschedule")
def wait_for_partition() -> PokeReturnValue:
    """Wait for the logical date's partition to hold Parquet files."""
    from pipeline.workflows.retrain import partition_files

    run = settings()
    path = run.partition_path(run.day)
    files = partition_files(path)
    if not files:
        logger.info("waiting for %s", path)
    return PokeReturnValue(is_done=bool(files), xcom_value=path)


@task
def validate_partition(partition: str) -> dict[str, Any]:
    """Check the window's partitions and validate the new one: bad data fails the run here,
    naming the file, row group and column, unless on_bad_data=quarantine sets it aside."""
    from pipeline.workflows.retrain import check_window

    with failing_at_once(partition):
        return check_window(settings())


@task(execution_timeout=dt.timedelta(hours=8))
def train(checked: dict[str, Any]) -> dict[str, Any]:
    """Train the window on the Dask cluster, or attach to the job an earlier try started, or
    find the version the same job on the same data registered."""
    from pipeline.workflows import retrain

    retrain.quiet_libraries()
    context = get_current_context()
    run = settings()
    job_id = retrain.job_id(context["dag"].dag_id, run.day, context["run_id"])
    with failing_at_once(run.day):
        return retrain.train(run, job_id, run_tags={"antdt.retrain.dag_run": context["run_id"]})


@task
def promote(trained: dict[str, Any], checked: dict[str, Any]) -> dict[str, Any]:
    """Score the new version and the champion on the validation day; move ``champion`` only
    for a better AUC (by at least min_gain)."""
    from pipeline.workflows import retrain

    retrain.quiet_libraries()
    return retrain.promote(settings(), trained, checked["quarantined"])


@task(outlets=[MODEL])
def report(trained: dict[str, Any], decision: dict[str, Any]) -> dict[str, Any]:
    """The decision, both AUCs, the rows and the MLflow run: in the task log and as the
    asset event's extra."""
    from pipeline.workflows.retrain import report as retrain_report

    lines, extra = retrain_report(settings(), trained, decision)
    for line in lines:
        logger.info("%s", line)
    get_current_context()["outlet_events"][MODEL].extra = extra
    return extra


@dag(
    schedule=CronDataIntervalTimetable("@daily", timezone="UTC"),
    start_date=dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc),
    catchup=False,
    max_active_runs=1,
    default_args={"retries": 2, "retry_delay": dt.timedelta(minutes=2),
                  "retry_exponential_backoff": 2.0, "max_retry_delay": dt.timedelta(minutes=30)},
    params=PARAMS,
    tags=["antdt"],
    doc_md=__doc__,
)
def retrain_ranking() -> None:
    checked = validate_partition(wait_for_partition())
    trained = train(checked)
    report(trained, promote(trained, checked))


retrain_ranking()
