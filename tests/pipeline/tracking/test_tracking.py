"""The MLflow run of a job (``pipeline.tracking.tracking``), in a real SQLite store."""

from __future__ import annotations

import importlib
from pathlib import Path

import mlflow
import pytest

from pipeline.job.config import load_job
from pipeline.tracking.tracking import Tracker
from pipeline.training.cluster import job_spec


def test_the_fluent_uri_is_restored_unset_so_the_default_follows_the_working_directory(
        cluster_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job = load_job(cluster_job)
    assert not mlflow.is_tracking_uri_set()
    tracker = Tracker.start(job, mode="async")
    with tracker.active():
        mlflow.log_param("inside", "yes")
    assert not mlflow.is_tracking_uri_set()  # not pinned to this store for later jobs
    monkeypatch.chdir(tmp_path)
    assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"

    run = mlflow.MlflowClient(job.mlflow.tracking_uri).get_run(tracker.run_id)
    assert run.data.params["inside"] == "yes" and run.info.status == "FINISHED"



def test_a_job_has_its_workers_import_its_tracking_store_before_training(
        cluster_job: Path, tmp_path: Path) -> None:
    """The metrics task runs on a worker beside an agent: the store's imports (about a second)
    happen in the job's preload, before training starts, not in its first call."""
    job = load_job(cluster_job, [f"mlflow.tracking_uri=sqlite:///{tmp_path}/mlflow.db"])
    preload = job_spec(job).plan.preload
    assert preload[0] == "pipeline.training.recipes"
    assert "mlflow.store.tracking.sqlalchemy_store" in preload
    for module in preload:  # what the master has every worker import
        importlib.import_module(module)
