"""``antdt sweep``: trials on a real LocalCluster, nested MLflow runs in a real store, real
training; a failing trial made of a real broken Parquet file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import dask.config
import pytest
import yaml
from click.testing import CliRunner
from mlflow import MlflowClient

from antdt.errors import ConfigError
from broken_files import break_label
from data.synth import SynthResult
from pipeline.cli.main import cli
from pipeline.job.config import load_job
from pipeline.workflows.sweep import Grid, plan_trials
from waits import bounded

FAST = {"antdt.jobs.tick": "200ms", "antdt.jobs.metrics-interval": "200ms"}


def sweep(*args: str) -> dict[str, Any]:
    result = bounded.call(CliRunner().invoke, cli, ["sweep", *args, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def children(uri: str, parent: str) -> dict[str, Any]:
    """The parent's nested runs by run id."""
    client = MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments, f"tags.`mlflow.parentRunId` = '{parent}'")
    return {run.info.run_id: run for run in runs}


def test_a_grid_is_every_combination_or_a_reproducible_sample() -> None:
    grid = Grid.parse(["train.sparse_lr=0.01,0.05,0.1", "model.dense_arch=[64,32],[32]"])
    every = grid.trials()
    assert len(every) == 6 and len({tuple(t.items()) for t in every}) == 6
    assert {t["model.dense_arch"] for t in every} == {"[64,32]", "[32]"}
    sample = grid.trials(sample=4, seed=3)
    assert len(sample) == 4 and all(t in every for t in sample)
    assert grid.trials(sample=4, seed=3) == sample
    assert grid.trials(sample=10) == every


@pytest.mark.parametrize("specs, message", [
    (["train.sparse_lr"], "--grid expects key.path=value1,value2"),
    (["train.sparse_lr=0.1,"], "--grid expects key.path=value1,value2"),
    (["train.sparse_lr=0.1", "train.sparse_lr=0.2"], "--grid train.sparse_lr is given twice"),
    ([], "a sweep needs at least one --grid"),
])
def test_malformed_grids_are_refused(specs: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Grid.parse(specs)


def test_a_bad_grid_key_is_refused_by_name_before_anything_runs(job_file: Path) -> None:
    result = CliRunner().invoke(cli, ["sweep", str(job_file), "--grid", "train.sparse_lr=0.1,1",
                                      "--grid", "train.epochz=1,2"])
    assert result.exit_code == 2
    assert "--grid train.epochz=1" in result.output and "unknown key(s) ['epochz']" in \
        result.output
    assert not (job_file.parent / "mlflow.db").exists()  # not even the parent run
    bad_metric = CliRunner().invoke(cli, ["sweep", str(job_file), "--grid", "train.seed=1,2",
                                          "--metric", "auc2"])
    assert bad_metric.exit_code == 2 and "--metric 'auc2': expected a figure" in \
        bad_metric.output
    assert not (job_file.parent / "mlflow.db").exists()
    with pytest.raises(ConfigError, match="--grid model.arch=transformer"):
        plan_trials(str(job_file), [], Grid.parse(["model.arch=dlrm,transformer"]))


def test_four_trials_run_as_nested_runs_and_the_best_is_named(job_file: Path) -> None:
    out = sweep(str(job_file), "--grid", "train.sparse_lr=0.01,0.1",
                "--grid", "train.batch_size=256,1024", "--workers", "2",
                "--register", "swept", "--set", "mlflow.registered_model=every-trial")

    uri = load_job(job_file).mlflow.tracking_uri
    assert uri is not None
    runs = children(uri, out["parent_run_id"])
    assert len(runs) == 4 == len(out["trials"])
    assert {run.info.status for run in runs.values()} == {"FINISHED"}
    for trial in out["trials"]:
        run = runs[trial["run_id"]]
        assert trial["state"] == "finished"
        assert {k: run.data.params[k] for k in trial["values"]} == trial["values"]
        assert run.data.metrics["auc"] == pytest.approx(trial["metric"])
        assert run.data.tags["antdt.sweep.trial"] == str(trial["trial"])
    best = max(runs.values(), key=lambda run: run.data.metrics["auc"])
    assert out["best"]["run_id"] == best.info.run_id
    parent = MlflowClient(uri).get_run(out["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["antdt.sweep.best_run"] == best.info.run_id
    assert parent.data.metrics["best_auc"] == pytest.approx(best.data.metrics["auc"])
    assert parent.data.params["sweep.train.batch_size"] == "256,1024"
    # antdt compare of the sweep's run shows every trial
    compared = CliRunner().invoke(cli, ["compare", "--runs", out["parent_run_id"],
                                        "--tracking-uri", uri, "--json"])
    assert compared.exit_code == 0, compared.output
    assert {run["run_id"] for run in json.loads(compared.stdout)} == set(runs)
    # the best trial's model, and only it, became a version
    assert out["registered"] == {"model": "swept", "version": "1"}
    versions = MlflowClient(uri).search_model_versions()
    assert [(v.name, v.run_id) for v in versions] == [("swept", best.info.run_id)]
    assert float(versions[0].tags["antdt.auc"]) == pytest.approx(best.data.metrics["auc"])


@pytest.mark.slow
def test_a_failing_trial_is_recorded_and_the_others_complete(
        tmp_path: Path, job_file: Path, tiny_data: SynthResult) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(Path(tiny_data.out) / "date=2026-11-03", broken)
    bad_file = sorted(broken.glob("*.parquet"))[0]
    break_label(str(bad_file), 4096)
    good = yaml.safe_load(job_file.read_text())["data"]["validation"]
    result = bounded.call(CliRunner().invoke, cli, [
        "sweep", str(job_file), "--grid", f"data.validation={good},{broken}", "--workers", "2",
        "--json"])

    assert result.exit_code == 0, result.output  # one trial finished: the sweep did its work
    out = json.loads(result.stdout.strip().splitlines()[-1])
    finished, failed = out["trials"]
    assert (finished["state"], failed["state"]) == ("finished", "failed")
    assert str(bad_file) in failed["error"] and failed["metric"] is None
    assert out["best"]["trial"] == finished["trial"]
    uri = load_job(job_file).mlflow.tracking_uri
    assert uri is not None
    runs = children(uri, out["parent_run_id"])
    assert runs[failed["run_id"]].info.status == "FAILED"
    assert str(bad_file) in runs[failed["run_id"]].data.tags["antdt.error"]
    assert runs[failed["run_id"]].data.params["data.validation"] == f"['{broken}']"
    assert runs[finished["run_id"]].info.status == "FINISHED"


@pytest.mark.slow
def test_async_trials_run_as_cluster_jobs_on_their_train_workers(cluster_job: Path) -> None:
    with dask.config.set(FAST):
        out = sweep(str(cluster_job), "--set", "train.workers=1",
                    "--grid", "train.sparse_lr=0.02,0.2", "--workers", "2")

    uri = load_job(cluster_job).mlflow.tracking_uri
    assert uri is not None
    runs = children(uri, out["parent_run_id"])
    assert [t["state"] for t in out["trials"]] == ["finished", "finished"]
    for trial in out["trials"]:
        summary, run = trial["summary"], runs[trial["run_id"]]
        assert summary["mode"] == "async" and summary["workers"] == 1
        assert summary["rows_lost"] == summary["rows_retrained"] == 0
        assert run.data.params["train.workers"] == "1"
        assert run.data.tags["mlflow.parentRunId"] == out["parent_run_id"]
