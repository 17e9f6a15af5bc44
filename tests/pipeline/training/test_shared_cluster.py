"""Jobs sharing one cluster are isolated from each other: a job's controller acts on its own
agents only (a worker another job trains on is never closed), and a job file with faults runs
only on a cluster that allows them (``antdt.jobs.allow-faults``)."""

from __future__ import annotations

import uuid
from pathlib import Path

import dask.config
import pytest
from distributed import Client, Event, LocalCluster

from antdt.errors import JobError
from antdt.jobs import JobClient
from commands import antdt
from pipeline.job.config import load_job
from pipeline.training.cluster import train_async
from waits import bounded

TRAIN_ROWS = 16_000
"""Rows of the two training days of ``small_data``."""

EPOCHS = 30
"""The healthy job's epochs: it trains about ten seconds, long enough for the faulty job (of
:data:`FAULTY_EPOCHS`), released as it begins, to hang and be acted on beside it."""
FAULTY_EPOCHS = 3

SHARED = {
    "antdt.sharding.lease-wait": "200ms", "antdt.agent.report-interval": "200ms",
    "antdt.jobs.tick": "200ms",
    "antdt.monitor.hang-floor": "1s", "antdt.monitor.warm-up-batches": 2,
    "antdt.controller.policies": [
        {"class": "antdt.controller.RevokeHung"},
        {"class": "antdt.controller.RetireHung", "after_s": 2},
        {"class": "antdt.controller.ReassignStragglers"},
        {"class": "antdt.controller.PaceStragglers"},
        {"class": "antdt.controller.SplitTail"}],
}
"""A hung agent is judged hung after its third batch (two batches of warm-up) and a second
without a commit, and acted on within seconds (its controller would retire its worker after
2 s): the faulty job's agent hangs while the healthy job trains. The healthy job runs alone and
beside the faulty one under the same settings."""


def cluster_workers(address: str) -> list[str]:
    with Client(address) as client:
        return sorted(client.sync(client.scheduler.identity, n_workers=-1)["workers"])


def running(jobs: JobClient, job_id: str) -> bool:
    """Whether the job was submitted and its agents started."""
    try:
        return bool(jobs.status(job_id)["state"] == "running")
    except JobError:  # not submitted yet
        return False


@pytest.mark.slow
def test_a_job_beside_one_with_a_hung_and_a_crashing_worker_finishes_as_if_alone(
        cluster_job: Path, tmp_path: Path) -> None:
    """Two jobs on every worker of one cluster; the faulty one hangs on the first worker (its
    controller stops its own agent there: the worker stays, the healthy job trains on) and
    crashes the second (its process exits: both jobs lose their agent there and the nanny's
    replacement joins them). The healthy job trains every row exactly once more than it lost,
    to the AUC it reaches alone."""
    healthy_id, faulty_id, gate = (f"{name}-{uuid.uuid4().hex[:8]}"
                                   for name in ("healthy", "faulty", "gate"))
    healthy = load_job(cluster_job, ["train.workers=3", f"train.epochs={EPOCHS}"])
    faulty = load_job(cluster_job, [
        "name=faulty", "train.workers=3", f"train.epochs={FAULTY_EPOCHS}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'faulty.db'}",
        # every agent waits for the healthy job to train beside it (the gate), then the first
        # hangs and the second's process exits
        f"faults=[{{worker: 0, hang_after_rows: 1536, pause_until: {gate}}}, "
        f"{{worker: 1, crash_after_rows: 3072, pause_until: {gate}}}, "
        f"{{worker: 2, pause_until: {gate}}}]"])
    with dask.config.set(SHARED), LocalCluster(n_workers=3, threads_per_worker=1,
                                               processes=True, dashboard_address=":0") as local:
        local.wait_for_workers(3)
        address = local.scheduler_address
        alone = bounded.call(train_async, healthy, scheduler=address)
        hung, crashed, _ = cluster_workers(address)
        faulty_run = bounded.start(train_async, faulty, scheduler=address, job_id=faulty_id)
        beside_run = bounded.start(train_async, healthy, scheduler=address, job_id=healthy_id)
        with Client(address) as client, JobClient(client, register=False) as jobs:
            bounded.until(lambda: running(jobs, healthy_id) and running(jobs, faulty_id),
                          "both jobs' agents to start")
            Event(gate, client=client).set()
            beside = beside_run.result()
            faulty_summary = faulty_run.result()
            healthy_record, faulty_record = jobs.status(healthy_id), jobs.status(faulty_id)
        survivors = cluster_workers(address)

    print(f"AUC alone {alone.auc:.4f}, beside the faulty job {beside.auc:.4f}; "
          f"faulty job {faulty_summary.auc:.4f}")
    # the healthy job: exact accounting, the AUC of the job alone
    assert beside.rows_lost == 0 and beside.rows_quarantined == 0
    assert beside.rows_trained == EPOCHS * TRAIN_ROWS + beside.rows_retrained
    assert alone.rows_trained == EPOCHS * TRAIN_ROWS + alone.rows_retrained
    assert abs(beside.auc - alone.auc) <= 0.005
    # the faulty job's controller acted on the hung worker without closing it
    retired = [a for a in faulty_record["actions"] if a["action"] == "retire"]
    assert [a["worker"] for a in retired] == [hung], faulty_record["actions"]
    assert retired[0]["reason"].endswith(
        f"{hung} also trains job(s) {healthy_id}: stopped this job's agent there, the worker "
        "stays")
    assert hung in survivors and crashed not in survivors  # only the crash took a worker
    on_hung = [a for a in healthy_record["agents"] if a["worker"] == hung]
    assert [a["outcome"] for a in on_hung] == ["finished"]
    stopped = [a for a in faulty_record["agents"] if a["worker"] == hung]
    assert [a["outcome"] for a in stopped] == ["cancelled"]
    # both lost their agent on the crashed worker, and both finished
    assert [a["outcome"] for a in healthy_record["agents"] if a["worker"] == crashed] == ["dead"]
    assert faulty_summary.rows_lost == 0
    assert faulty_summary.rows_trained == \
        FAULTY_EPOCHS * TRAIN_ROWS + faulty_summary.rows_retrained


def test_a_job_file_with_faults_is_refused_in_one_line_where_the_cluster_does_not_allow_them(
        cluster_job: Path, tmp_path: Path) -> None:
    """``antdt train`` on its own LocalCluster, as a user runs it (faults not allowed): the job
    fails before any agent starts, saying which setting allows faults."""
    result = antdt("train", str(cluster_job), "--workers", "2", "--set",
                   "faults=[{worker: 0, hang_after_rows: 1024}]", cwd=tmp_path, check=False,
                   env={"DASK_ANTDT__JOBS__ALLOW_FAULTS": "false"})
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: job ") and last.endswith(
        " failed: the job injects faults, which this cluster does not allow: drop them, or set "
        "antdt.jobs.allow-faults: true in a test cluster's dask config "
        "(DASK_ANTDT__JOBS__ALLOW_FAULTS=true)"), result.stderr
    assert "injected" not in result.stderr  # no agent started, no fault fired
