"""The single-process reference trainer, end to end: real Parquet, TorchRec, MLflow store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from antdt.errors import DataError
from broken_files import break_label
from data.files import expand, row_groups
from data.reader import ShardReader
from data.synth import SynthResult
from models.evaluate import auc, evaluate
from models.train_step import TrainStep
from pipeline.cli.main import cli
from pipeline.job.config import load_job
from pipeline.training.local import iterate_batches, prepare_data, train_local


def test_local_training_learns_counts_rows_and_tracks_the_run(job_file: Path) -> None:
    job = load_job(job_file)
    data = prepare_data(job)
    untrained = TrainStep(data.schema, job.model, job.train.optim, seed=job.train.seed)
    reader = ShardReader(data.schema)
    before = evaluate(untrained.predict, iterate_batches(reader, data.validation, 1024))

    summary = train_local(job)

    assert summary.rows_trained == sum(g.num_rows for g in data.train)
    assert summary.rows_lost == summary.rows_retrained == summary.rows_quarantined == 0
    assert summary.auc > before["auc"] + 0.05
    assert summary.oracle_auc is not None and summary.oracle_auc > summary.auc - 0.2

    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    run = mlflow.get_run(summary.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["auc"] == pytest.approx(summary.auc)
    assert run.data.metrics["rows_trained"] == summary.rows_trained
    # the summary figures are the job's own; the series over time have their own names
    assert run.data.metrics["samples_per_s"] == pytest.approx(summary.samples_per_s)
    assert run.data.params["train.batch_size"] == "512"
    assert (run.data.params["train.mode"], run.data.params["train.workers"]) == ("local", "1")
    artifacts = {a.path for a in mlflow.MlflowClient().list_artifacts(summary.run_id)}
    assert {"job.yaml", "schema.yaml"} <= artifacts
    history = mlflow.MlflowClient().get_metric_history(summary.run_id, "train.loss")
    assert len(history) >= 2


def test_logged_model_scores_raw_rows_like_the_trainer(job_file: Path) -> None:
    job = load_job(job_file)
    summary = train_local(job)
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    model = mlflow.pyfunc.load_model(f"runs:/{summary.run_id}/model")
    validation = expand(list(job.data.validation))
    frame = pq.read_table(validation).to_pandas()
    scores = model.predict(frame)
    assert len(scores) == len(frame)
    assert ((scores > 0) & (scores < 1)).all()
    assert auc(frame["label"].to_numpy(), scores) == pytest.approx(summary.auc, abs=1e-4)


def test_cli_train_json_prints_the_summary(job_file: Path) -> None:
    result = CliRunner().invoke(cli, ["train", str(job_file), "--local", "--json",
                                      "--set", "train.batch_size=1024"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"auc", "logloss", "oracle_auc", "rows_trained", "wall_s", "samples_per_s",
            "run_id"} <= set(summary)
    assert summary["samples_per_s"] > 0
    phases = summary["phases"]
    steps = {"start", "prepare", "training", "evaluate", "metrics", "model"}
    assert set(phases) == steps | {"total_s", "outside_s"}
    assert sum(phases[step] for step in steps) == pytest.approx(phases["total_s"], abs=0.01)
    assert phases["training"] >= summary["train_s"] - 0.001 > 0  # phases: to the ms
    # the override took effect: the run trained batches of 1,024 rows (metrics every 10 steps)
    job = load_job(job_file)
    batches = sum(-(-g.num_rows // 1024) for g in prepare_data(job).train)
    mlflow.set_tracking_uri(job.mlflow.tracking_uri)
    assert mlflow.get_run(summary["run_id"]).data.params["train.batch_size"] == "1024"
    steps = [m.step for m in mlflow.MlflowClient().get_metric_history(summary["run_id"],
                                                                   "train.loss")]
    assert max(steps) == batches - batches % job.train.log_every


def test_cli_reports_config_errors_in_one_line(job_file: Path) -> None:
    result = CliRunner().invoke(cli, ["train", str(job_file), "--set", "train.epochz=2"])
    assert result.exit_code == 2
    assert "unknown key(s) ['epochz']" in result.output
    assert "Traceback" not in result.output


def test_bad_file_fails_or_is_quarantined(tmp_path: Path, job_file: Path,
                                          tiny_data: SynthResult) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(tiny_data.out, copy)
    raw = yaml.safe_load(job_file.read_text())
    raw["data"]["train"] = [str(copy / "date=2026-11-01"), str(copy / "date=2026-11-02")]
    raw["data"]["validation"] = str(copy / "date=2026-11-03")
    raw["data"]["schema"] = str(copy / "schema.yaml")
    bad = sorted(expand(str(copy / "date=2026-11-01")))[0]
    break_label(bad, 4096)
    bad_group_rows = row_groups([bad])[0].num_rows
    job_file.write_text(yaml.safe_dump(raw))

    with pytest.raises(DataError) as info:
        train_local(load_job(job_file))
    assert Path(bad).name in str(info.value) and "label" in str(info.value)

    job = load_job(job_file, ["data.on_bad_data=quarantine"])
    total = sum(g.num_rows for g in row_groups(expand(list(job.data.train))))
    summary = train_local(job)
    assert summary.rows_quarantined == bad_group_rows
    assert summary.rows_trained == total - bad_group_rows
