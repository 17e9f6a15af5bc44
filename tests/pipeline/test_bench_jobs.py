"""The job the distributed benchmarks train, with the user's ``--set`` overrides, and the
scaling benchmark's bare processes (the machine's own ceiling)."""

from __future__ import annotations

from pathlib import Path

import pytest

from antdt.errors import ConfigError
from antdt.sync import SyncPeriod
from pipeline.bench.jobs import synthetic_job, with_train
from pipeline.bench.scaling import bare_run
from pipeline.config import FaultConfig, load_job
from pipeline.local import prepare_data


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


@pytest.mark.slow
def test_the_machine_ceiling_trains_every_row_once_over_its_processes(job_file: Path) -> None:
    job = load_job(str(job_file))
    train_rows = sum(g.num_rows for g in prepare_data(job).train)
    results = bare_run(job, 2)
    assert len(results) == 2
    assert sum(rows for rows, _ in results) == train_rows * job.train.epochs
    assert all(rows > 0 and seconds > 0 for rows, seconds in results)
