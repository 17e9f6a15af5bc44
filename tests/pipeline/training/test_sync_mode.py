"""The synchronous mode (AntDT-DD) end to end: a LocalCluster of Nanny-managed worker processes,
one gloo rank per worker, the tables sharded across them, real Parquet, TorchRec and MLflow; a
rank's process killed for real, a rank hung in a collective."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import dask.config
import mlflow
import pytest
import yaml
from distributed import Client, LocalCluster

from antdt.jobs import JobClient
from pipeline.job.config import load_job
from pipeline.training.cluster import train_async
from waits import bounded

TRAIN_ROWS = 16_000
"""Rows of the two training days of ``small_data``."""

FAST = {"antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms",
        "antdt.controller.interval": "200ms", "antdt.monitor.window": "500ms",
        "antdt.sync-steps.collective-timeout": "10s"}
"""Quicker end of job, progress reports and controller than the defaults (tiny data), and a
hung rank found within 10 s (the workers take it when the cluster starts)."""


@pytest.fixture
def sync_job(cluster_job: Path, tmp_path: Path) -> Iterator[Path]:
    """``cluster_job`` in the synchronous mode, with checkpoints every 1,024 rows."""
    raw = yaml.safe_load(cluster_job.read_text())
    raw["train"].update(mode="sync", batch_size=256, shard_rows=1024,
                        checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=1024)
    raw["train"].pop("sync_period")
    cluster_job.write_text(yaml.safe_dump(raw))
    yield cluster_job


def with_faults(path: Path, faults: list[dict[str, object]], **train: object) -> Path:
    raw = yaml.safe_load(path.read_text())
    raw["faults"] = faults
    raw["train"].update(train)
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    """Two single-thread Nanny workers, shared by the module's jobs (a killed one restarts)."""
    with dask.config.set(FAST), LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                             dashboard_address=":0") as local:
        local.wait_for_workers(2)
        yield local


@pytest.mark.slow
def test_a_sync_job_trains_every_row_once_and_gives_a_slow_rank_a_smaller_batch(
        cluster: LocalCluster, sync_job: Path) -> None:
    """Two epochs, rank 1 four times slower: every row trained once, the run tracked in sync
    mode, and the controller's batch policy moved rows of each global batch from the slow rank
    to the other (rank 0 makes the sizes sum to the global batch: ``shares``)."""
    job = load_job(with_faults(sync_job, [{"worker": 1, "slowdown": 4.0}], epochs=2))
    with dask.config.set(FAST):
        summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)
    assert summary.mode == "sync" and summary.workers == 2
    assert summary.rows_trained == 2 * TRAIN_ROWS
    assert summary.rows_lost == summary.rows_retrained == summary.rows_quarantined == 0
    assert summary.auc > 0.6
    client = mlflow.MlflowClient(summary.tracking_uri)
    assert client.get_run(summary.run_id).data.tags["antdt.mode"] == "sync"
    actions = yaml.safe_load(Path(client.download_artifacts(
        summary.run_id, "straggler_actions.yaml")).read_text())
    last = {a["worker"]: a["size"] for a in actions if a["action"] == "adjust_batch"}
    assert len(last) == 2, actions
    slow, fast = sorted(last)[1], sorted(last)[0]  # faults name workers in address order
    assert last[slow] < 256 < last[fast], last


def trained_rows(jobs: JobClient) -> int:
    """Rows the cluster's running job trained so far (0 before it started)."""
    return max((int((r.get("rows") or {}).get("trained", 0)) for r in jobs.status()
                if r["state"] == "running"), default=0)


@pytest.mark.slow
def test_a_killed_rank_forms_the_group_again_from_the_checkpoint(cluster: LocalCluster,
                                                                  sync_job: Path) -> None:
    """Rank 1's process is SIGKILLed once the job trained 4,096 rows: rank 0's next collective
    fails, the master forms the group again from the last checkpoint on the workers there (the
    nanny restarts the dead one), and the job ends with every row trained and none lost."""
    job = load_job(sync_job, ["train.epochs=2"])
    with dask.config.set(FAST):
        run = bounded.start(train_async, job, scheduler=cluster.scheduler_address)
        with Client(cluster.scheduler_address) as client, JobClient(client) as jobs:
            pids = client.run(os.getpid)
            bounded.until(lambda: trained_rows(jobs) >= 4096, "4,096 rows trained")
            os.kill(pids[sorted(pids)[1]], signal.SIGKILL)
        summary = run.result()
    assert summary.rows_lost == 0 and summary.rows_quarantined == 0
    assert summary.rows_replayed > 0
    assert summary.rows_trained >= 2 * TRAIN_ROWS
    assert not math.isnan(summary.auc) and summary.auc > 0.55


@pytest.mark.slow
def test_a_hung_rank_breaks_the_step_within_the_timeout_and_the_job_ends(
        cluster: LocalCluster, sync_job: Path) -> None:
    """Rank 0 stops making progress after 2,048 rows: rank 1's collective times out, the
    master stops both and forms the group again; the job does not hang and loses no row."""
    job = load_job(with_faults(sync_job, [{"worker": 0, "hang_after_rows": 2048}]))
    with dask.config.set(FAST):
        summary = bounded.call(train_async, job, scheduler=cluster.scheduler_address)
    assert summary.rows_lost == 0
    assert summary.rows_replayed > 0
