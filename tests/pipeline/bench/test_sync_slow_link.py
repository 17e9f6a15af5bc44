"""A sync rank behind a slow link (issue 61): two ranks on the namespaced cluster, the data over
HTTP from the host, rank 0's link at 8 Mbit/s, its CPU free. Every row is trained once, and the
controller sizes each rank's local batch by its own step time. Which rank trains more is not
held: the collectives' bytes cross the slow link for both ranks alike, so their step times differ
by less than their noise (``docs/partitions.md``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.bench.jobs import synthetic_job, with_train
from pipeline.bench.network import namespaces_available
from pipeline.bench.runs_net import run_on_network

WHY_NOT = namespaces_available()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
def test_a_sync_rank_behind_a_slow_link_has_its_batch_sized_by_its_own_step_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default store, in the working directory
    job = synthetic_job(str(tmp_path / "data"), rows=120_000, overrides=[
        "train.batch_size=2048", "train.shard_rows=4096", "model.embedding_dim=4",
        "model.dense_arch=[16,4]"])
    (tmp_path / "net").mkdir()
    run = run_on_network(with_train(job, mode="sync", adaptive_batch=True), 2, ["8mbit", None],
                         env={"DASK_ANTDT__MONITOR__WINDOW": "500ms"}, folder=tmp_path / "net")
    summary = run.outcome.summary
    # the training days' rows, once each; the agents trained again only what a lost model held
    # (a worker that died finishing the job: its group formed again, rows replayed)
    assert summary.rows_lost == summary.rows_retrained == 0
    assert summary.rows_trained == 90_000
    trained = sum(agent.rows for agent in run.outcome.slots)  # every agent's, restarted ones too
    assert trained == 90_000 + summary.rows_replayed
    # each rank's local batch was set by its own step time (every action the scheduler logged)
    assert all(actions.get("adjust_batch", 0) > 0 for actions in run.actions), run.actions
