"""Small jobs are safe by default: an async job whose workers would each see only a few dozen
batches trains on fewer workers (``train.min_batches_per_worker``), says so, and ends as good
as the single-process run of the same job."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
import yaml

from commands import antdt
from data.synth import generate
from pipeline.job.config import load_job
from pipeline.training.cluster import job_spec
from pipeline.training.local import train_local

TOLERANCE = 0.005
"""The async mode's quality target next to the local run (``antdt bench quality``)."""


def small_job(folder: Path, *, rows: int, days: int, num_dense: int = 13,
              num_sparse: int = 26) -> Path:
    """A job with the default training settings (batch 4,096, two async workers) over
    ``rows`` synthetic rows: the last day validates, the others train."""
    data = folder / "data"
    generate(str(data), rows=rows, days=days, seed=3, row_group_rows=4096, files_per_day=1,
             num_dense=num_dense, num_sparse=num_sparse)
    found = sorted(p.name for p in data.iterdir() if p.name.startswith("date="))
    job = {"name": f"small-{rows}",
           "data": {"train": [str(data / day) for day in found[:-1]],
                    "validation": str(data / found[-1]), "schema": str(data / "schema.yaml")},
           "model": {"arch": "dlrm", "embedding_dim": 16},
           "train": {"mode": "async", "workers": 2},
           "mlflow": {"experiment": "small", "tracking_uri": f"sqlite:///{folder / 'mlflow.db'}"}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("shape", "shown"), [
    ({"rows": 50_000, "days": 5}, False),  # the default 13 dense and 26 categorical columns
    ({"rows": 30_000, "days": 3, "num_dense": 3, "num_sparse": 4}, True),
], ids=["50k-rows", "30k-rows-few-columns"])
def test_a_small_job_trains_on_fewer_workers_and_matches_the_local_run(
        tmp_path: Path, shape: dict[str, int], shown: bool) -> None:
    """``shown``: also train it once more without ``--json``, where a person reads why it
    trained on fewer workers (one of the shapes does: the same summary line)."""
    path = small_job(tmp_path, **shape)
    reference = train_local(load_job(path, ["train.mode=local"]))

    result = antdt("train", str(path), "--json", cwd=tmp_path)
    summary = json.loads(result.stdout.strip().splitlines()[-1])

    batches = -(-reference.rows_trained // 4096)
    assert batches < 2 * 128  # the job is small: two workers would see < 128 batches each
    assert summary["workers"] == 1
    assert summary["adapted"] == (
        f"{batches} batches of 4,096 rows: fewer than min_batches_per_worker (128) for each of "
        "2 workers; training on 1")
    assert summary["rows_trained"] == reference.rows_trained and summary["rows_lost"] == 0
    assert summary["auc"] >= reference.auc - TOLERANCE

    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'mlflow.db'}")
    run = mlflow.get_run(summary["run_id"])
    assert run.data.tags["antdt.adapted"] == summary["adapted"]
    assert (run.data.params["train.workers"],
            run.data.params["train.min_batches_per_worker"]) == ("1", "128")

    if shown:
        assert f"adapted  {summary['adapted']}" in antdt("train", str(path), cwd=tmp_path).stdout


def test_a_job_with_enough_batches_keeps_its_workers(tmp_path: Path) -> None:
    path = small_job(tmp_path, rows=30_000, days=3, num_dense=3, num_sparse=4)
    job = load_job(path, ["train.batch_size=64", "train.min_batches_per_worker=100"])
    plan = job_spec(job).plan
    assert plan.min_batches_per_worker == 100
    assert plan.fitted_workers(2) == (2, None)  # 313 batches: 156 a worker
    assert plan.fitted_workers(4)[0] == 3  # 4 workers would see 78 each
