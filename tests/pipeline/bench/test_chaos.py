"""The exactly-once promise held against the model itself (``antdt bench chaos``): jobs on real
``dask scheduler`` and ``dask worker`` processes, workers killed for real, the final model's
count of every row against the ledger.

One test per scenario: ``scheduler`` (the scheduler and every worker lost, the job resumed from
its checkpoint, a worker killed again) runs in the default tier, the others in the full tier.
Every harm comes at a moment the job cannot end before (see :mod:`pipeline.bench.chaos`), so
each scenario's harm is asserted, not hoped for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.bench.chaos import SCENARIOS, chaos
from pipeline.bench.chaos_run import audit

JOB_S = {"kill": 6.0, "hang": 6.0, "lone": 6.0, "scheduler": 3.0}
"""The size of each scenario's job (rows from the counting model's constant step time, not a
measured speed); the default tier's scenario takes the smaller one."""

HARM: dict[str, dict[str, Any]] = {
    "kill": {"kills": 2, "hangs": 0},
    "hang": {"kills": 0, "hangs": 1},
    "lone": {"kills": 2, "hangs": 0},
    "scheduler": {"kills": 2, "hangs": 0},
}
"""What each scenario does to its job, every time."""


def test_the_audit_finds_a_row_missing_a_row_twice_and_counters_that_disagree() -> None:
    rows = {"done": 8, "lost": 0, "trained": 10, "retrained": 2}
    assert audit(np.full(4, 2.0), 2, rows)["discrepancies"] == 0
    counts = np.array([2.0, 1.0, 3.0, 2.0])
    assert audit(counts, 2, rows) == {"rows_checked": 8, "missing": 1, "extra": 1,
                                      "discrepancies": 2, "counters": 0}
    for bad in ({**rows, "trained": 11}, {**rows, "lost": 1}, {**rows, "done": 7}):
        assert audit(np.full(4, 2.0), 2, bad) == {"rows_checked": 8, "missing": 0, "extra": 0,
                                                  "discrepancies": 1, "counters": 1}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scenario", [
    pytest.param(scenario, marks=() if scenario == "scheduler" else pytest.mark.slow)
    for scenario in SCENARIOS])
def test_every_row_done_is_in_the_final_model_once_per_epoch_whatever_died(
        scenario: str, tmp_path: Path) -> None:
    """One seeded run of the scenario: workers SIGKILLed, killed with their nannies, hung and
    retired, a lone worker killed the moment its joiner trained, or the scheduler lost and the
    job resumed from its checkpoint. Every row is in the final model exactly once per epoch.
    (Reverting any of the fixes this holds makes it fail: the lone scenario then misses the
    rows the lone worker trained, the others hold a dead worker's last rows twice.)"""
    result = chaos(0, seed=0, folder=tmp_path, scenarios=(scenario,), job_s=JOB_S[scenario])
    (run,) = result["runs"]
    assert run["scenario"] == scenario and result["scenarios_run"] == 1
    assert run["finished"], run
    assert run["discrepancies"] == 0, run
    assert run["rows_checked"] == run["rows"]["expected"] == run["rows"]["done"]
    assert {harm: run[harm] for harm in HARM[scenario]} == HARM[scenario]
    if scenario == "scheduler":
        # the checkpoint it resumed from held rows in flight, and rows were trained past it
        assert run["rows"]["retrained"] > 0
        assert run["rows_replayed"] > 0
