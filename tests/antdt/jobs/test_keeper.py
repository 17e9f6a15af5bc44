"""Checkpoints of jobs on AntDT's master, with the counting model of ``fakes`` on a LocalCluster
whose workers run in this process: a checkpoint's model covers every row its ledger counts done;
a job resumes from one in the same tracking run; a job whose workers all vanish restarts from its
last checkpoint when new ones join, and fails naming it when none do."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dask.config
import pytest
from distributed import Client, Event, LocalCluster

from antdt.jobs import JobClient, checkpoints
from fakes import CALLS, SHARD_ROWS, TOTAL, calls, spec
from waits import bounded

SETTINGS = {"antdt.sharding.lease-wait": "100ms", "antdt.sharding.commit-interval": "100ms",
            "antdt.agent.report-interval": "50ms", "antdt.jobs.tick": "100ms",
            "antdt.jobs.metrics-interval": "100ms", "antdt.sync.max-wait": "50ms",
            "antdt.sharding.no-workers-timeout": "2s"}


@pytest.fixture
def cluster() -> Iterator[tuple[LocalCluster, JobClient]]:
    """One single-thread worker in this process (a test may close it and start others)."""
    with dask.config.set(SETTINGS), \
            LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as local, Client(local) as client:
        local.wait_for_workers(1)
        with JobClient(client) as jobs:
            yield local, jobs


def paused_job(jobs: JobClient, folder: Path, after_rows: int, **plan: Any) -> tuple[str, str]:
    """A 3-epoch job checkpointing every 16 rows whose agent pauses after ``after_rows`` rows
    until the returned Dask event is set; its id once a checkpoint was written."""
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    job_id = jobs.submit(spec(epochs=3, checkpoint_dir=str(folder), checkpoint_every="16",
                              faults={0: {"pause_until": gate, "pause_after_rows": after_rows}},
                              **plan))["job"]["job_id"]
    bounded.until(lambda: jobs.status(job_id)["checkpoint"] is not None, "a checkpoint")
    return job_id, gate


def close_every_worker(local: LocalCluster, jobs: JobClient) -> None:
    local.scale(0)
    bounded.until(lambda: not jobs.client.scheduler_info()["workers"], "every worker gone")


@contextlib.contextmanager
def opened_at_the_end(jobs: JobClient, gate: str) -> Iterator[None]:
    """Set the Dask event ``gate`` when the block ends (a paused agent on a closed worker
    leaves then, whatever the test's outcome)."""
    try:
        yield
    finally:
        Event(gate, client=jobs.client).set()


def test_a_checkpoint_covers_the_rows_its_ledger_counts_done(
        cluster: tuple[LocalCluster, JobClient], tmp_path: Path) -> None:
    _, jobs = cluster
    job_id, gate = paused_job(jobs, tmp_path, after_rows=64)
    Event(gate, client=jobs.client).set()
    record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished" and record["rows"]["lost"] == 0
    folder = checkpoints.job_folder(str(tmp_path), job_id)
    versions = checkpoints.versions(folder)
    assert 1 <= len(versions) <= 3  # the newest checkpoint_keep (3) stay
    for version in versions:
        manifest = checkpoints.verify(checkpoints.version_path(folder, version))
        table = checkpoints.load_model(manifest)["table"]
        # every row counted done has its updates in the model; it may hold the rows trained
        # after the ledger's copy (how many depends on timing), never a row twice
        assert manifest.rows["done"] <= table.sum() <= record["summary"]["rows_trained"]
        assert manifest.run == record["run"] and manifest.job_id == job_id
    note = checkpoints.read_note(folder)
    assert note is not None and note["state"] == "finished"
    assert note["rows"]["done"] == 3 * TOTAL
    assert record["summary"]["rows_trained"] == 3 * TOTAL


def test_a_job_resumes_from_a_checkpoint_in_the_same_run(
        cluster: tuple[LocalCluster, JobClient], tmp_path: Path) -> None:
    _, jobs = cluster
    job_id, gate = paused_job(jobs, tmp_path, after_rows=64)
    bounded.until(lambda: jobs.status(job_id)["checkpoint"] is not None, "a checkpoint")
    jobs.cancel(job_id, "the test stops it")
    Event(gate, client=jobs.client).set()
    stopped = bounded.call(jobs.follow, job_id)
    skipped: list[str] = []
    manifest = checkpoints.latest(checkpoints.job_folder(str(tmp_path), job_id), skipped.append)
    assert skipped == []  # a cancelled job's master finished the checkpoint it was writing
    assert stopped["state"] == "cancelled" and manifest is not None

    resumed = jobs.submit(spec(epochs=3, checkpoint_dir=str(tmp_path), checkpoint_every="16",
                               resume=manifest.path), job_id=job_id)
    assert not resumed["attached"]  # an ended job's id starts again when it resumes
    record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished" and record["run"] == stopped["run"]
    rows = record["rows"]
    assert rows["lost"] == 0 and rows["trained"] == 3 * TOTAL + rows["retrained"]
    made = calls(record)
    resume = [c for c in made if c[0] == "resume"]
    assert len(resume) == 1 and resume[0][3]["checkpoint"] == manifest.path
    assert resume[0][3]["step"] > manifest.step  # the run's series go on after the old ones
    _, table, report = made[-1]
    assert report["rows_trained_here"] == rows["trained"] - manifest.rows["trained"]
    # every row in every epoch reached the final model (the checkpoint's rows included)
    assert bool((table >= 3).all())
    assert record["resumes"] == 1
    # every update the model holds beyond one per row and epoch is accounted for
    assert table.sum() - 3 * TOTAL <= record["rows_replayed"] + rows["retrained"]


def test_every_worker_gone_and_none_joining_fails_naming_the_checkpoint(
        cluster: tuple[LocalCluster, JobClient], tmp_path: Path) -> None:
    local, jobs = cluster
    job_id, gate = paused_job(jobs, tmp_path, after_rows=40)
    with opened_at_the_end(jobs, gate):
        close_every_worker(local, jobs)
        record = bounded.call(jobs.follow, job_id)
    last = record["checkpoint"]
    assert record["state"] == "failed" and last is not None
    assert "no worker joined within 2s (antdt.sharding.no-workers-timeout)" in record["error"]
    assert f"last checkpoint is {last}" in record["error"]
    assert f"--resume {job_id}" in record["error"]
    assert checkpoints.read_note(checkpoints.job_folder(str(tmp_path), job_id))["state"] \
        == "failed"


def test_new_workers_restart_the_job_from_its_last_checkpoint(
        cluster: tuple[LocalCluster, JobClient], tmp_path: Path) -> None:
    local, jobs = cluster
    job_id, gate = paused_job(jobs, tmp_path, after_rows=40)
    # the new workers may take long to start on a loaded machine: the job waits for them
    with opened_at_the_end(jobs, gate), \
            dask.config.set({"antdt.sharding.no-workers-timeout": "120s"}):
        close_every_worker(local, jobs)
        local.scale(2)
        record = bounded.call(jobs.follow, job_id)

    assert record["state"] == "finished", record["error"]
    rows = record["rows"]
    assert rows["lost"] == 0 and rows["done"] == 3 * TOTAL
    # trained past the last checkpoint: at most its interval (16 rows) and a shard per worker
    assert record["resumes"] == 1 and 0 <= record["rows_replayed"] <= 16 + SHARD_ROWS
    made = calls(record)
    assert [c[0] for c in made].count("resume") == 1
    _, table, report = made[-1]
    assert bool((table >= 3).all())  # no row of any epoch missing from the final model
    assert table.sum() - 3 * TOTAL <= record["rows_replayed"] + rows["retrained"]
    assert report["rows_replayed"] == record["rows_replayed"]
    # this master trained the rows the ledger counts, and those the restart rolled back
    assert report["rows_trained_here"] == rows["trained"] + record["rows_replayed"]
    messages = [r["message"] for r in jobs.logs(job_id)]
    assert any(m.startswith("restarting from checkpoint ") for m in messages)


def test_no_checkpoint_no_wait(cluster: tuple[LocalCluster, JobClient]) -> None:
    local, jobs = cluster
    gate = f"gate-{uuid.uuid4().hex[:6]}"
    job_id = jobs.submit(spec(epochs=3, faults={0: {"pause_until": gate,
                                                    "pause_after_rows": 40}}))["job"]["job_id"]
    bounded.until(lambda: jobs.status(job_id)["rows"].get("done", 0) >= 40, "40 rows done")
    with opened_at_the_end(jobs, gate):
        close_every_worker(local, jobs)
        record = bounded.call(jobs.follow, job_id)
    assert record["state"] == "failed"
    assert "no checkpoint to restart from (set train.checkpoint_dir" in record["error"]
    assert [c[0] for c in CALLS[record["run"]["run_id"]]][0] == "start"
