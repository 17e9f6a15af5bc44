"""A worker cut from its peers but not from the scheduler, in the async mode, on the cluster of hosts
on one machine (:class:`~pipeline.bench.network.NetworkCluster`): its sync rounds fail within
``antdt.sync.pull-timeout``, the pairs are re-grouped without it, it reaches no peer, so the
monitor calls it partitioned and the controller retires it; its unsynced rows are trained again
by the others, and every row is in the final model exactly once per epoch
(:func:`~pipeline.bench.chaos_run.audit`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from antdt.jobs import JobClient
from pipeline.bench.chaos import AsyncRun
from pipeline.bench.chaos_run import EPOCHS, audit
from pipeline.bench.network import NetworkCluster, namespaces_available
from pipeline.bench.runs_net import controller_actions

WHY_NOT = namespaces_available()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")

ENV = {"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "5s",
       "DASK_DISTRIBUTED__COMM__TIMEOUTS__TCP": "12s",  # Dask's least: 11 s
       "DASK_ANTDT__SYNC__PULL_TIMEOUT": "1s", "DASK_ANTDT__MONITOR__HANG_FLOOR": "10s"}
"""A cut link fails a pull within a second, and a worker is hung only after 10 s without a
commit (the chaos runs': 2 s): the rounds with the cut worker, which hold each side's training
up to the pull's timeout before the cut is known, make none of them look hung first, on a
machine as busy as it may be (2 cores, every process of the cluster)."""

JOB_S = 6.0
"""The job's size (rows from the counting model's constant step time, not a measured speed)."""


def retired(jobs: JobClient, job_id: str, worker: str) -> list[dict[str, Any]]:
    """The job's retirements of ``worker`` so far (every action the scheduler logged: a record
    shows only the newest ten)."""
    return [action for action in controller_actions(jobs.client, job_id)
            if action["action"] == "retire" and action["worker"] == worker]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_worker_cut_from_its_peers_is_retired_and_the_model_stays_exact(
        tmp_path: Path) -> None:
    run = AsyncRun("peer-partition", 0, tmp_path / "run", JOB_S)
    gate = run.gate(0.3, run.released)  # each trains at most 30% of the rows before the cut
    (tmp_path / "net").mkdir()
    with NetworkCluster(tmp_path / "net", workers=3, env={**run.env, **ENV}) as net, \
            JobClient(net.address) as jobs:
        jobs.submit(run.spec(faults={index: gate for index in range(3)}), job_id=run.job_id)
        assert run.at_share(jobs, 0.15)["state"] == "running"
        victim = net.workers[2]
        net.cut(2, from_="peers")
        assert run.until(jobs, lambda: retired(jobs, run.job_id, victim),
                         f"the controller to retire {victim}"), net.logs()
        run.release(jobs)
        record = run.end(jobs)
        (action,) = retired(jobs, run.job_id, victim)
    assert record["state"] == "finished", record.get("error")
    assert action["policy"] == "RetireHung" and action["reason"].startswith(
        "partitioned: reaches no sync peer (2 unreachable"), action
    found = audit(np.load(run.folder / f"{run.job_id}.npy"), EPOCHS, record["rows"])
    assert found["discrepancies"] == 0, found
    assert record["rows"]["done"] == run.rows * EPOCHS
