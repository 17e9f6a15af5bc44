"""The exactly-once promise held against the model itself (``antdt bench chaos``): jobs on real
``dask scheduler`` and ``dask worker`` processes, workers killed for real, the final model's
count of every row against the ledger."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.bench.chaos import SCENARIOS, audit, chaos


def test_the_audit_finds_a_row_missing_a_row_twice_and_counters_that_disagree() -> None:
    rows = {"done": 8, "lost": 0, "trained": 10, "retrained": 2}
    assert audit(np.full(4, 2.0), 2, rows)["discrepancies"] == 0
    counts = np.array([2.0, 1.0, 3.0, 2.0])
    assert audit(counts, 2, rows) == {"rows_checked": 8, "missing": 1, "extra": 1,
                                      "discrepancies": 2, "counters": 0}
    for bad in ({**rows, "trained": 11}, {**rows, "lost": 1}, {**rows, "done": 7}):
        assert audit(np.full(4, 2.0), 2, bad) == {"rows_checked": 8, "missing": 0, "extra": 0,
                                                  "discrepancies": 1, "counters": 1}


@pytest.mark.slow
def test_every_row_done_is_in_the_final_model_once_per_epoch_whatever_died(
        tmp_path: Path) -> None:
    """One run of each scenario (seeded): workers SIGKILLed, killed with their nannies, hung and
    retired, a lone worker killed the moment its joiner trained, the scheduler lost and the job
    resumed from its checkpoint. Every row is in the final model exactly once per epoch.
    (Reverting any of the fixes this holds makes it fail: the lone scenario then misses the
    rows the lone worker trained, the others hold a dead worker's last rows twice.)"""
    result = chaos(0, seed=7, folder=tmp_path, job_s=6.0)
    runs = {run["scenario"]: run for run in result["runs"]}
    assert sorted(runs) == sorted(SCENARIOS) and result["scenarios_run"] == len(SCENARIOS)
    assert result["unfinished"] == 0, result["runs"]
    assert result["discrepancies"] == 0, result["runs"]
    assert all(run["rows_checked"] == run["rows"]["expected"] for run in runs.values())
    assert runs["kill"]["kills"] >= 1 and runs["hang"]["hangs"] == 1
    assert runs["lone"]["kills"] == 2 and runs["scheduler"]["kills"] == 2
    assert runs["scheduler"]["rows_replayed"] > 0  # trained past the checkpoint, then lost
    assert sum(run["rows"]["retrained"] for run in runs.values()) > 0
    assert all(run["rows"]["done"] == run["rows"]["expected"] for run in runs.values())
