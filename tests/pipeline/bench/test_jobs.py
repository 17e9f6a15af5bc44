"""The job the distributed benchmarks train, with the user's ``--set`` overrides, and the
scaling benchmark's bare trainers (the machine's own ceiling, and Dask's)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from antdt.errors import ConfigError
from antdt.sync import SyncPeriod
from pipeline.bench.jobs import Outcome, run_async, synthetic_job, with_train
from pipeline.bench.scaling import bare_run, dask_run
from pipeline.bench.sizing import CALIBRATION_ROWS, capacity, rows_for, sized_job, train_rows
from pipeline.bench.stragglers import ideal_seconds
from pipeline.job.config import FaultConfig, JobConfig, load_job
from pipeline.training.local import prepare_data


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
def test_both_ceilings_train_every_row_once_over_their_processes(job_file: Path) -> None:
    """The bare processes (the machine's ceiling) and the bare trainers on Dask workers (Dask's)
    each train their share of the row groups, every row once per epoch over all of them."""
    job = load_job(str(job_file))
    groups = prepare_data(job).train
    # three shares: with two, this data's even and odd row groups hold the same number of rows
    shares = [sum(g.num_rows for g in groups[share::3]) * job.train.epochs for share in range(3)]
    assert len(set(shares)) > 1
    bare = bare_run(job, 3)
    hosted = dask_run(job, 3)
    assert [rows for rows, _ in bare] == [rows for rows, _, _ in hosted] == shares
    assert sum(shares) == sum(g.num_rows for g in groups) * job.train.epochs
    assert all(seconds > 0 for _, seconds in bare)
    assert all(end > start for _, start, end in hosted)


@pytest.mark.slow
def test_a_calibrated_job_is_sized_for_its_target_at_the_rate_its_calibration_measured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The calibration run (the async job on the same LocalCluster size) measures this
    machine's capacity, and the dataset is sized from it: at that rate, perfect sharing trains
    the sized rows in the target time (within the rounding of the rows to two digits); the
    sized job then trains every one of its rows. Held against the rate the calibration run
    measured, not against how long the sized job took: the machine's speed changes between the
    two (other processes come and go: a job calibrated for 6 s trained in 4.7 s on a shared
    2-core machine). A sizing off by a factor still fails."""
    monkeypatch.chdir(tmp_path)  # the synthetic data and MLflow's default store go here
    target = 6.0
    calibrations: list[tuple[JobConfig, Outcome]] = []

    def calibration(job: JobConfig, workers: int) -> Outcome:
        outcome = run_async(job, workers)
        calibrations.append((job, outcome))
        return outcome

    job, sizing = sized_job(2, target, None, None, (), quiet=True, run=calibration)
    ((measured_job, measured),) = calibrations
    assert (measured_job.train.mode, measured_job.train.sharding) == ("async", "pull")
    assert train_rows(measured_job) == CALIBRATION_ROWS * 3 // 4
    rate = capacity(measured)
    assert sizing.calibration is not None and sizing.calibration.samples_per_s == rate > 0
    assert sizing.rows == sizing.calibration.rows == rows_for(rate, target)
    assert sizing.train_rows == train_rows(job) == sizing.rows * 3 // 4
    # perfect sharing of the measured capacity, every agent from the start
    from_start = dataclasses.replace(measured, first_lease={s.worker: 0.0 for s in measured.slots})
    assert ideal_seconds(from_start, sizing.train_rows, []) == pytest.approx(target, rel=0.05)
    run = run_async(job, 2)
    assert run.summary.rows_trained == sizing.train_rows
    overhead = run.overhead()
    assert overhead["start_s"] is not None and overhead["tail_s"] is not None
    assert 0 < overhead["start_s"] < run.summary.train_s and overhead["tail_s"] >= 0
    assert run.last_row is not None and run.last_row <= run.summary.train_s
    # the training threads' CPU: within their busy seconds, and what a row cost them
    assert all(0 < slot.cpu_s <= slot.busy_s for slot in run.slots)
    training = run.training_cpu()
    assert 0 < training["cpu_share"] <= 1
    cpu_s = sum(slot.cpu_s for slot in run.slots)
    assert training["cpu_us_per_row"] == pytest.approx(cpu_s / sizing.train_rows * 1e6, rel=1e-3)


def test_rows_for_a_target_round_to_two_digits() -> None:
    assert rows_for(76_432.0, 15.0) == 1_500_000
    assert rows_for(10.0, 1.0) == 10_000  # never below the smallest synthetic job
    assert rows_for(1e6, 60.0) == 80_000_000
