"""Jobs that start from yesterday's model (``train.init_from``), end to end: a chain of days on a
LocalCluster of Nanny workers, each day's job started from the version the day before
registered, with real Parquet, TorchRec and an MLflow store; and a model of other shapes
refused in one line before anything starts, in each mode."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import dask.config
import mlflow
import pytest
from distributed import LocalCluster

from antdt.errors import ConfigError
from data.synth import SynthResult
from pipeline.job.config import load_job
from pipeline.tracking.init_from import TAG, locate
from pipeline.training.cluster import job_spec, train_async
from pipeline.training.local import train_local
from waits import bounded

DAY_ROWS = 8_000
FAST = {"antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with dask.config.set(FAST), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                             dashboard_address=":0") as local:
        local.wait_for_workers(2)
        yield local


def day(small_data: SynthResult, n: int) -> str:
    return str(Path(small_data.out) / f"date=2026-11-0{n}")


def test_each_day_continues_the_day_befores_model_with_exact_rows(
        cluster: LocalCluster, cluster_job: Path, small_data: SynthResult) -> None:
    """Three days in async mode, the first from the seed, each next one from the version the
    day before registered: every day trains its own rows once, and its run names its start."""
    runs: list[str] = []
    for n in (1, 2, 3):
        overrides = [f"data.train={day(small_data, n)}", "mlflow.registered_model=daily"]
        if n > 1:
            overrides.append(f"train.init_from=models:/daily/{n - 1}")
        job = load_job(cluster_job, overrides)
        summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)
        assert (summary.rows_trained, summary.rows_lost, summary.rows_retrained) == \
            (DAY_ROWS, 0, 0)
        assert summary.registered_version == str(n)
        runs.append(summary.run_id)
        tags = mlflow.MlflowClient(job.mlflow.tracking_uri).get_run(summary.run_id).data.tags
        if n == 1:
            assert TAG not in tags
        else:
            assert tags[TAG] == f"models:/daily/{n - 1}"
            assert tags[f"{TAG}.version"] == str(n - 1)
            assert tags[f"{TAG}.run_id"] == runs[-2]
            assert f"{TAG}.left" not in tags  # all of it taken, optimisers too
    assert summary.auc > 0.6


@pytest.mark.parametrize("mode", ["async", "sync", "local"])
def test_a_model_of_other_shapes_is_refused_before_anything_starts(
        cluster_job: Path, small_data: SynthResult, mode: str, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    source = train_local(load_job(cluster_job, ["train.mode=local",
                                                "mlflow.registered_model=shapes"]))
    ref = "models:/shapes/1"
    wider = ["model.embedding_dim=4", "model.dense_arch=[16, 4]", f"train.mode={mode}",
             f"train.init_from={ref}"]
    job = load_job(cluster_job, wider)
    with pytest.raises(ConfigError) as refused:
        train_local(job) if mode == "local" else job_spec(job)
    assert str(refused.value) == (
        f"train.init_from {ref}: does not fit this job: table C1 has dimension 8 there, 4 "
        "here (model.embedding_dim); set train.init_from_partial: true to take what fits")
    runs = mlflow.MlflowClient(job.mlflow.tracking_uri).search_runs(
        [source.experiment_id])
    assert [r.info.run_id for r in runs] == [source.run_id]  # nothing else started

    partial = load_job(cluster_job, [*wider, "train.init_from_partial=true"])
    with caplog.at_level(logging.WARNING, logger="pipeline.tracking.init_from"):
        spec = job_spec(partial) if mode != "local" else None
        if spec is None:
            train_local(partial)
    said = [r.getMessage() for r in caplog.records if r.name == "pipeline.tracking.init_from"]
    assert len(said) == 1 and said[0].startswith(f"train.init_from {ref}: left at their initial "
                                                 "values: table C1, table C2")
    assert said[0].endswith("optimisers' state (a dense layer did not fit)")


def test_a_registered_version_that_names_no_run_is_refused_naming_it(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path}/m.db"
    client = mlflow.MlflowClient(uri)
    client.create_registered_model("orphan")
    client.create_model_version("orphan", source=str(tmp_path / "model"))
    with pytest.raises(ConfigError) as refused:
        locate("models:/orphan/1", uri)
    assert str(refused.value) == ("train.init_from models:/orphan/1: version 1 of orphan names no "
                                  "run that logged it; give the model's run (runs:/RUN_ID)")
