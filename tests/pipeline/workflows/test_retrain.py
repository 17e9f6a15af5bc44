"""The daily retraining's steps (:mod:`pipeline.workflows.retrain`) without Airflow: its
settings, its window, the new partition's validation, and train on a real LocalCluster (a retry
after a failed job, a re-run that trains nothing). The DAG itself: ``tests/dags``."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from distributed import Client
from mlflow import MlflowClient

from antdt.errors import DataError
from antdt.jobs import JobClient
from broken_files import break_label
from data.synth import SynthResult
from pipeline.bench.processes import DaskProcesses
from pipeline.training.cluster import job_spec
from pipeline.workflows import retrain
from pipeline.workflows.retrain import RetrainError, Settings
from waits import bounded


def params(**changed: Any) -> dict[str, Any]:
    """The DAG's default params with ``changed``."""
    return {"job_file": "jobs/synthetic.yaml", "data_root": "demo-data/synthetic",
            "partition": "date={date}", "train_days": 6, "validation_day": "", "schema": "",
            "scheduler": "", "tracking_uri": "sqlite:///mlflow.db", "experiment": "antdt-retrain",
            "registered_model": "ranking", "on_bad_data": "fail", "min_gain": 0.0,
            "mode": "", "overrides": [], **changed}


def test_settings_resolve_relative_paths_against_the_project_folder() -> None:
    settings = Settings.from_params(params(), "2026-11-07", "/srv/antdt")
    assert settings.job_file == "/srv/antdt/jobs/synthetic.yaml"
    assert settings.partition_path("2026-11-07") == "/srv/antdt/demo-data/synthetic/date=2026-11-07"
    assert settings.tracking_uri == "sqlite:////srv/antdt/mlflow.db"
    assert settings.validation_day == "2026-11-07" and settings.scheduler is None
    remote = Settings.from_params(params(data_root="s3://logs/ctr",
                                         tracking_uri="http://mlflow:5000"), "2026-11-07", "/srv")
    assert remote.data_root == "s3://logs/ctr" and remote.tracking_uri == "http://mlflow:5000"


@pytest.mark.parametrize("changed, named", [
    ({"on_bad_data": "skip"}, "param 'on_bad_data': expected 'fail' or 'quarantine', found 'skip'"),
    ({"partition": "day"}, "param 'partition': expected a folder name holding '{date}'"),
    ({"train_days": 0}, "param 'train_days': expected a int >= 1, found 0"),
    ({"validation_day": "7 Nov"}, "validation_day '7 Nov': expected a date as YYYY-MM-DD"),
    ({"registered_model": "a/b"}, "param 'registered_model'"),
    ({"min_gain": -0.1}, "param 'min_gain': expected a float >= 0.0, found -0.1"),
    ({"overrides": "train.epochs=2"}, "param 'overrides': expected a list of KEY=VALUE"),
    ({"job_file": " "}, "param 'job_file': expected a path, found nothing"),
    ({"mode": "dd"}, "param 'mode': expected 'async', 'sync' or nothing (the job file's), "
                     "found 'dd'"),
])
def test_a_bad_param_is_refused_by_name(changed: dict[str, Any], named: str) -> None:
    with pytest.raises(RetrainError) as caught:
        Settings.from_params(params(**changed), "2026-11-07", "/srv/antdt")
    assert named in str(caught.value)


def test_the_mode_param_chooses_the_training_mode_or_leaves_the_job_files(
        tmp_path: Path, cluster_job: Path) -> None:
    window = retrain.Window(train_days=("2026-11-06",), validation_day="2026-11-07",
                            train=("x",), validation="y")
    chosen = Settings.from_params(params(job_file=str(cluster_job), mode="sync"), "2026-11-07",
                                  str(tmp_path))
    assert retrain.retrain_job(chosen, window).train.mode == "sync"
    kept = Settings.from_params(params(job_file=str(cluster_job)), "2026-11-07", str(tmp_path))
    assert retrain.retrain_job(kept, window).train.mode == "async"  # the job file's


def test_a_fixed_validation_day_is_left_out_of_the_training_window() -> None:
    settings = Settings.from_params(params(train_days=3, validation_day="2026-11-06"),
                                    "2026-11-07", "/d")
    window = retrain.window(settings)
    assert window.train_days == ("2026-11-04", "2026-11-05", "2026-11-07")
    assert window.validation == "/d/demo-data/synthetic/date=2026-11-06"


@pytest.fixture
def days(tmp_path: Path, small_data: SynthResult) -> Path:
    """A copy of ``small_data`` (2026-11-01..03, 8,000 rows a day) to break."""
    shutil.copytree(small_data.out, tmp_path / "data")
    return tmp_path / "data"


def day_settings(days: Path, cluster_job: Path, **changed: Any) -> Settings:
    return Settings.from_params(params(job_file=str(cluster_job), data_root=str(days),
                                       train_days=2, tracking_uri=f"sqlite:///{days.parent}/m.db",
                                       **changed), "2026-11-03", "/")


def test_a_missing_partition_of_the_window_is_named(days: Path, cluster_job: Path) -> None:
    shutil.rmtree(days / "date=2026-11-01")
    with pytest.raises(DataError) as caught:
        retrain.check_window(day_settings(days, cluster_job))
    assert f"{days}/date=2026-11-01" in str(caught.value)


def test_a_broken_new_partition_fails_or_is_quarantined(days: Path, cluster_job: Path) -> None:
    broken = sorted((days / "date=2026-11-03").glob("*.parquet"))[1]
    break_label(str(broken), 2048)
    with pytest.raises(DataError) as caught:
        retrain.check_window(day_settings(days, cluster_job))
    assert f"{broken} row group 0 column 'label': expected 0/1, found 2" in str(caught.value)
    checked = retrain.check_window(day_settings(days, cluster_job, on_bad_data="quarantine"))
    assert checked["quarantined"] == [[str(broken), 0, "expected 0/1, found 2 (1 row)"]]
    assert checked["quarantined_rows"] == 2048 and checked["rows"] == 8_000 - 2048
    assert checked["window"]["train_days"] == ["2026-11-01", "2026-11-02"]


@pytest.fixture
def local_cluster(process_cluster: DaskProcesses) -> str:
    """The suite's long-lived cluster of worker processes: its scheduler's address."""
    return process_cluster.address


@pytest.mark.slow
def test_a_retry_after_a_cancelled_job_starts_the_next_and_a_rerun_trains_nothing(
        days: Path, cluster_job: Path, local_cluster: str) -> None:
    """The run's job id names a cancelled job (an earlier try's): train starts ``ID-2`` and
    registers version 1. Trained again with the same job and data, it finds version 1 and
    starts no job."""
    settings = day_settings(days, cluster_job, scheduler=local_cluster)
    job_id = "retrain-test-2026-11-03"
    spec = job_spec(retrain.retrain_job(settings, retrain.window(settings)))
    with Client(local_cluster, set_as_default=False) as client, JobClient(client) as jobs:
        jobs.submit(spec, job_id=job_id)
        jobs.cancel(job_id)
        assert bounded.call(jobs.follow, job_id)["state"] == "cancelled"

        result = bounded.call(retrain.train, settings, job_id)
        assert (result["job_id"], result["version"], result["reused"]) == (
            f"{job_id}-2", "1", False)
        assert result["rows_trained"] == 16_000 and result["rows_lost"] == 0
        known = {j["job_id"] for j in jobs.status()}

        again = bounded.call(retrain.train, settings, job_id)
        assert (again["version"], again["reused"], again["run_id"]) == (
            "1", True, result["run_id"])
        assert {j["job_id"] for j in jobs.status()} == known
    client = MlflowClient(settings.tracking_uri)
    assert [str(v.version) for v in client.search_model_versions("name = 'ranking'")] == ["1"]


def test_the_next_day_continues_the_champion_over_its_new_day_only(
        days: Path, cluster_job: Path, local_cluster: str) -> None:
    """Day 2026-11-02 has no champion: it trains its window from scratch, version 1, the
    champion. Day 2026-11-03 (a window of two days) continues version 1 over the one day it
    has not seen: 8,000 rows, its run named for both. Re-running either day trains nothing."""
    def settings(day: str, train_days: int) -> Settings:
        return Settings.from_params(params(
            job_file=str(cluster_job), data_root=str(days), train_days=train_days,
            scheduler=local_cluster, tracking_uri=f"sqlite:///{days.parent}/m.db"), day, "/")

    first = settings("2026-11-02", 1)
    result = bounded.call(retrain.train, first, "incremental-test-1")
    assert (result["version"], result["way"], result["days_trained"]) == (
        "1", "window", ["2026-11-01"])
    assert retrain.promote(first, result)["outcome"] == "first"

    second = settings("2026-11-03", 2)
    following = bounded.call(retrain.train, second, "incremental-test-2")
    assert (following["version"], following["way"], following["days_trained"]) == (
        "2", "incremental", ["2026-11-02"])
    assert following["rows_trained"] == 8_000 and following["rows_lost"] == 0
    assert following["started_from"] == "1"
    assert following["run_name"] == "retrain 2026-11-03: version 1 + 2026-11-02"
    decision = retrain.promote(second, following)
    assert decision["champion"] == "1" and decision["outcome"] in ("promoted", "kept")
    assert set(decision["guards"]) == {"logloss", "calibration"}
    run = MlflowClient(second.tracking_uri).get_run(following["run_id"]).data.tags
    assert run["antdt.retrain.refreshed"] == "2026-11-02"  # the chain's last full refresh
    assert run["antdt.init_from"] == "models:/ranking/1"

    for day, version in ((second, "2"), (first, "1")):
        again = bounded.call(retrain.train, day, "incremental-test-again")
        assert (again["version"], again["reused"]) == (version, True)
