"""A job watched as an operator's Prometheus watches it: real ``dask scheduler`` and ``dask
worker`` processes, the job ``antdt submit`` would submit (built and submitted in this process:
the command's own start would double the test's time), real Parquet and TorchRec, the
scheduler's ``/metrics`` scraped over HTTP while a straggler trains, and after the job's end."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import pytest
from distributed import Client, Event
from prometheus_client.samples import Sample

from antdt.jobs import JobClient
from pipeline.bench.processes import DaskProcesses, wait_for_workers
from pipeline.job.config import load_job
from pipeline.training.cluster import job_spec
from scrapes import scrape, value
from waits import bounded

TRAIN_ROWS = 16_000
"""Rows of the two training days of ``small_data``."""

FORGET_S = 20.0
"""A finished job's series stay this long: far longer than one scrape takes on a loaded
machine, so the scrape right after the end surely sees them."""

FAST = {"DASK_ANTDT__SHARDING__LEASE_WAIT": "200ms",
        "DASK_ANTDT__SHARDING__COMMIT_INTERVAL": "200ms",
        "DASK_ANTDT__AGENT__REPORT_INTERVAL": "200ms",
        "DASK_ANTDT__CONTROLLER__INTERVAL": "200ms", "DASK_ANTDT__MONITOR__WINDOW": "300ms",
        "DASK_ANTDT__MONITOR__WARM_UP_BATCHES": "2",
        "DASK_ANTDT__JOBS__TICK": "200ms", "DASK_ANTDT__WATCH__FORGET_AFTER": f"{FORGET_S}s"}
"""Quicker commits, reports, controller, monitor windows and ticks than the defaults (tiny data),
a warm-up of two batches (the straggler is judged after its second), and a finished job
forgotten on ``/metrics`` after :data:`FORGET_S`."""

FLAGGED = ("transient", "persistent")


@pytest.mark.slow
def test_metrics_show_a_running_jobs_rows_and_its_straggler_then_forget_it(
        cluster_job: Path, tmp_path: Path) -> None:
    """Worker 1 is 4x slower. Worker 0 pauses, holding no lease, once it trained half the
    job's rows, until the test saw the flag: the job cannot end before. A straggler is judged
    against its peers' batch times in windows of time (the product's rule), so the evidence
    must come while both train: by then worker 0 trained about four times the straggler's
    batches, two of them warm-up, plus a few windows' worth, far from half the job's rows. A
    paused worker and a peerless one keep their verdicts, so the flag, once seen, stays."""
    folder = tmp_path / "cluster"
    folder.mkdir()
    gate = f"flag-seen-{uuid.uuid4().hex[:8]}"
    with DaskProcesses(folder, env=FAST) as cluster:
        cluster.add_workers(2)
        wait_for_workers(cluster.address, 2)
        job_id = f"watched-{os.getpid()}"
        job = load_job(cluster_job, [
            "train.epochs=3", "train.batch_size=256",
            f"faults=[{{worker: 0, pause_after_rows: {3 * TRAIN_ROWS // 2}, "
            f"pause_until: {gate}}}, {{worker: 1, slowdown: 4.0}}]"])
        with Client(cluster.address) as client, JobClient(client) as jobs:
            jobs.submit(job_spec(job), job_id=job_id)
            dashboard = client.dashboard_link

            def straggler_flagged() -> list[Sample] | None:
                samples = scrape(dashboard)
                flagged = any(value(samples, "worker_state", job_id=job_id, agent="worker1",
                                    state=state) == 1 for state in FLAGGED)
                ok = value(samples, "worker_state", job_id=job_id, agent="worker0", state="ok")
                return samples if flagged and ok == 1 else None

            samples = bounded.until(straggler_flagged, "worker1 flagged, worker0 ok",
                                    timeout_s=180)
            Event(gate, client=client).set()
            assert value(samples, "job_state", job_id=job_id, state="running") == 1
            assert value(samples, "job_rows_expected", job_id=job_id) == 3 * TRAIN_ROWS
            done = value(samples, "job_rows_done", job_id=job_id)
            assert done is not None and 0 <= done <= 3 * TRAIN_ROWS
            rows = [value(samples, "worker_rows_total", job_id=job_id, agent=f"worker{i}")
                    for i in (0, 1)]
            assert all(r is not None and r > 0 for r in rows), rows
            pace = [value(samples, "worker_rows_per_second", job_id=job_id, agent=f"worker{i}")
                    for i in (0, 1)]
            # which pace is higher is timing (worker 0 may already be paused, and the machine is
            # shared), so the test holds that both series are there and the straggler's is live
            assert pace[0] is not None and pace[0] >= 0, pace
            assert pace[1] is not None and pace[1] > 0, pace

            record = bounded.until(lambda: (r := jobs.status(job_id))["state"] in
                                   ("finished", "failed", "cancelled") and r, "the job's end",
                                   timeout_s=300)
            assert record["state"] == "finished", record["error"]
            ended = scrape(dashboard)  # within FORGET_S of the end
            assert value(ended, "job_state", job_id=job_id, state="finished") == 1
            assert value(ended, "job_rows_done", job_id=job_id) == 3 * TRAIN_ROWS
            assert value(ended, "job_rows_lost", job_id=job_id) == 0
            bounded.until(lambda: not [s for s in scrape(dashboard)
                                       if s.labels.get("job_id") == job_id],
                          "the finished job's series gone", timeout_s=FORGET_S + 120)
            # forgotten by the rule, not before (a lower bound: no machine's load breaks it)
            assert time.time() - record["ended_at"] >= FORGET_S
