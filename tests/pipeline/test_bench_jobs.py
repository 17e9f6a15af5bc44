"""The job the distributed benchmarks train, with the user's ``--set`` overrides."""

from __future__ import annotations

from pathlib import Path

import pytest

from antdt.errors import ConfigError
from antdt.sync import SyncPeriod
from pipeline.bench.jobs import synthetic_job, with_train
from pipeline.config import FaultConfig


def test_overrides_reach_the_benchmark_job_and_injected_faults_survive(tmp_path: Path) -> None:
    folder = str(tmp_path / "data")
    job = synthetic_job(folder, rows=10_000, overrides=[
        "train.sync_period=0.5", "faults=[{worker: 1, slowdown: 2.0}]"])
    assert job.train.sync_period == SyncPeriod(seconds=0.5)
    assert job.faults == (FaultConfig(worker=1, slowdown=2.0),)
    assert with_train(job, mode="local").faults == job.faults  # kept unless replaced
    assert with_train(job, faults=()).faults == ()
    with pytest.raises(ConfigError, match="sync_period"):
        synthetic_job(folder, rows=10_000, overrides=["train.sync_period=-1"])
