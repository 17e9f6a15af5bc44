"""The job config: typed, validated, unknown keys rejected by their full name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from antdt.errors import ConfigError
from antdt.sync import SyncPeriod
from pipeline.job.config import load_job

MINIMAL = {"data": {"train": "d/train/*.parquet", "validation": ["d/val"], "schema": "d/schema.yaml"}}


def write(tmp_path: Path, raw: object) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_defaults_and_paths(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, MINIMAL))
    assert job.name == "job"
    assert job.data.train == ("d/train/*.parquet",)
    assert job.data.validation == ("d/val",)
    assert job.data.on_bad_data == "fail"
    assert job.train.batch_size == 4096 and job.train.epochs == 1
    assert job.model.arch == "dlrm"
    assert job.mlflow.tracking_uri is None


def test_overrides_parse_values_as_yaml(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, MINIMAL), ["train.epochs=3", "model.arch=dcn",
                                              "train.dense_lr=0.01", "mlflow.experiment=x"])
    assert job.train.epochs == 3
    assert job.model.arch == "dcn"
    assert job.train.optim.dense_lr == pytest.approx(0.01)
    assert job.mlflow.experiment == "x"


def test_round_trip_through_to_dict(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, MINIMAL), ["train.sparse_lr=0.2", "name=daily"])
    again = load_job(write(tmp_path, job.to_dict()))
    assert again.to_dict() == job.to_dict()
    assert again.name == "daily"


@pytest.mark.parametrize(("override", "message"), [
    ("train.bach_size=10", "unknown key(s) ['bach_size']"),
    ("train.epochs=0", "train.epochs: expected an integer >= 1, found 0"),
    ("train.epochs=1000000", "train.epochs: expected an integer <= 1,000, found 1,000,000"),
    ("train.batch_size=4294967296", "train.batch_size: expected an integer <= 2,147,483,647"),
    ("train.shard_rows=4294967296", "train.shard_rows: expected an integer <= 2,147,483,647"),
    ("data.on_bad_data=skip", "on_bad_data: expected 'fail' or 'quarantine', found 'skip'"),
    ("model.arch=bert", "bert"),
    ("mlflow.experiment=", "mlflow.experiment: expected a non-empty string"),
    ("mlflow.registered_model=team/ranker", "mlflow.registered_model 'team/ranker': expected a "
                                            "non-empty name without '/'"),
    ("colour=red", "unknown key(s) ['colour']"),
])
def test_bad_values_name_the_key(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(write(tmp_path, MINIMAL), [override])
    assert message in str(info.value)
    assert "job.yaml" in str(info.value)


def test_missing_data_section_and_bad_override(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing section 'data'"):
        load_job(write(tmp_path, {"train": {}}))
    with pytest.raises(ConfigError, match="key.path=value"):
        load_job(write(tmp_path, MINIMAL), ["epochs"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_job(tmp_path / "nope.yaml")


def test_distributed_defaults_and_faults(tmp_path: Path) -> None:
    job = load_job(write(tmp_path, MINIMAL), ["train.batch_size=256"])
    assert (job.train.mode, job.train.workers, job.train.sync_period) == \
        ("async", 2, SyncPeriod(peer_batches=4))
    assert job.train.shard_rows == 8 * 256
    assert job.train.sharding == "antdt"
    assert job.faults == ()
    faulty = load_job(write(tmp_path, MINIMAL), [
        "faults=[{worker: 1, slowdown: 2.5}, {worker: 0, crash_after_rows: 100}]",
        "train.shard_rows=1000", "train.mode=local", "train.sharding=static",
        "train.sync_period=4 batches"])
    assert [(f.worker, f.slowdown, f.crash_after_rows) for f in faulty.faults] == \
        [(1, 2.5, None), (0, 1.0, 100)]
    assert (faulty.train.shard_rows, faulty.train.mode, faulty.train.sharding) == \
        (1000, "local", "static")
    assert faulty.train.sync_period == SyncPeriod(batches=4)
    again = load_job(write(tmp_path, faulty.to_dict()))
    assert again.to_dict() == faulty.to_dict()


@pytest.mark.parametrize(("override", "message"), [
    ("train.mode=dd", "train.mode: expected one of ['async', 'sync', 'local'], found 'dd'"),
    ("train.workers=0", "train.workers: expected an integer >= 1, found 0"),
    ("train.sharding=random", "train.sharding: expected one of ['antdt', 'pull', 'static'], "
                              "found 'random'"),
    ("train.sync_period=0", "train.sync_period: expected seconds > 0 (0.5, '500ms'), "
                            "batches ('4 batches') or peer batches ('4 peer batches'), found 0"),
    ("train.sync_period=0 batches", "('4 peer batches'), found '0 batches'"),
    ("train.sync_period=0 peer batches", "('4 peer batches'), found '0 peer batches'"),
    ("train.sync_period=soon", "train.sync_period: expected seconds > 0 (0.5, '500ms'), "
                               "batches ('4 batches') or peer batches ('4 peer batches'), "
                               "found 'soon'"),
    ("train.shard_rows=-5", "train.shard_rows: expected an integer >= 1, found -5"),
    ("train.checkpoint_every=soon", "train.checkpoint_every: expected rows (an int >= 1) or a "
                                    "duration such as '60s', '5m', found 'soon'"),
    ("train.checkpoint_every=0", "train.checkpoint_every: expected rows (an int >= 1) or a "
                                 "duration such as '60s', '5m', found 0"),
    ("train.checkpoint_dir=''", "train.checkpoint_dir: expected a path or fsspec URL, found ''"),
    ("train.checkpoint_keep=0", "train.checkpoint_keep: expected an integer >= 1, found 0"),
    ("faults={worker: 0}", "faults: expected a list"),
    ("faults=[{slowdown: 2}]", "faults[0]: missing key 'worker'"),
    ("faults=[{worker: 0, slowdown: 0.5}]", "faults[0].slowdown: expected a finite number >= 1.0"),
    ("faults=[{worker: 0, hang_after_rows: -1}]", "faults[0].hang_after_rows: expected an "
                                                  "integer >= 0, found -1"),
    ("faults=[{worker: 0, crash: 5}]", "faults[0]: unknown key(s) ['crash']"),
    ("faults=[{worker: 0}]", "faults[0]: expected at least one of slowdown > 1"),
    ("faults=[{worker: 0, slowdown: 2}, {worker: 0, hang_after_rows: 3}]",
     "faults[1]: worker 0 already has a faults entry"),
])
def test_bad_distributed_values_name_the_key(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_job(write(tmp_path, MINIMAL), [override])
    assert message in str(info.value)
