"""What a job's restarts cost (:class:`~antdt.jobs.recovery.Recovery`): the rows trained twice
over the job's life, counted from what the lost models held, and a job that keeps losing its
model before a newer checkpoint stops. No cluster: the counts are the master's arithmetic."""

from __future__ import annotations

import pytest

from antdt.errors import JobError
from antdt.jobs.checkpoints import Manifest
from antdt.jobs.recovery import Recovery


def point(version: int, trained: int) -> Manifest:
    return Manifest(job_id="j", version=version, path=f"/c/j/v{version:06d}", created=0.0,
                    files={}, rows={"done": trained, "trained": trained}, step=version,
                    run=None, fingerprint={}, worker="w", write_s=0.0)


def test_the_rows_a_surviving_rank_saw_count_though_the_ledger_was_not_told() -> None:
    """The group began at 100 rows; the ledger heard of 40 more before a rank died, the ranks
    left saw 64 steps' rows (its last commits were not sent): 64 are trained again."""
    recovery = Recovery()
    recovery.began(100)
    recovery.reported(60)
    recovery.reported(64)  # the largest report: a rank that saw one more step
    assert recovery.held(140) == 164
    assert recovery.restart(140, point(1, 100), "rank 1 died", None) == 64
    assert (recovery.rows_replayed, recovery.resumes) == (64, 1)


def test_replayed_rows_are_the_rows_trained_twice_whichever_point_each_restart_takes() -> None:
    """Model 1 trains 0 → 160 (checkpoints at 100 and, written late, 150); model 2 restarts
    from 100 and trains to 130; model 3 restarts from 150 (model 1's late checkpoint, the
    newest) and trains to the end at 200. Trained: 160 + 30 + 50 = 240 rows for 200 in the
    model: 40 twice (counting ``max(0, 130 - 150)`` for the second loss gave 60)."""
    recovery = Recovery()
    recovery.began(0)
    recovery.restart(160, point(1, 100), "lost", None)
    recovery.restart(130, point(2, 150), "lost", None)
    assert recovery.rows_replayed == 40 == (160 + 30 + 50) - 200


def test_a_model_lost_again_and_again_from_one_point_stops_the_job_naming_why() -> None:
    recovery = Recovery()
    assert recovery.limit == 3
    recovery.began(0)
    for _ in range(3):
        recovery.restart(50, point(1, 20), "rank 0 died", "checkpoint v000002 failed: slow")
    recovery.restart(50, point(2, 40), "rank 0 died", None)  # a newer point: counted anew
    recovery.restart(50, point(2, 40), "rank 0 died", None)
    recovery.restart(50, point(2, 40), "rank 0 died", None)
    with pytest.raises(JobError, match=r"rank 0 died; the job's model was lost 4 times with "
                                       r"checkpoint /c/j/v000002 its newest point.*"
                                       r"the last one: checkpoint v000003 failed"):
        recovery.restart(50, point(2, 40), "rank 0 died", "checkpoint v000003 failed")
