"""The job config: typed, validated, unknown keys rejected by their full name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from antdt.errors import ConfigError
from pipeline.config import load_job

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
    ("data.on_bad_data=skip", "on_bad_data: expected 'fail' or 'quarantine', found 'skip'"),
    ("model.arch=bert", "bert"),
    ("mlflow.experiment=", "mlflow.experiment: expected a non-empty string"),
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
