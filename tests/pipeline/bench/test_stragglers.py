"""The straggler benchmark's arithmetic: the ideal time of perfect sharing and the faults of each
scenario (the runs themselves are what ``antdt bench stragglers`` measures)."""

from __future__ import annotations

import math

import pytest

from pipeline.bench.jobs import Outcome
from pipeline.bench.stragglers import (SCENARIOS, ideal_seconds, median_run, others_rate,
                                       scenario_faults)
from pipeline.job.config import FaultConfig
from pipeline.job.report import JobSummary
from pipeline.training.following import AgentRecord


def outcome(*slots: AgentRecord, first: dict[str, float] | None = None) -> Outcome:
    summary = JobSummary(run_id="r", mode="async", workers=len(slots), auc=0.5, logloss=0.7,
                         oracle_auc=None, rows_trained=0, rows_lost=0, rows_retrained=0,
                         rows_quarantined=0, wall_s=1.0, samples_per_s=0.0)
    return Outcome(summary, list(slots),
                   first if first is not None else {s.worker: s.started for s in slots}, None,
                   None)


def slot(index: int, rows: int, busy_s: float, *, started: float = 0.0,
         ended: float | None = 10.0, dead: bool = False, join: bool = False) -> AgentRecord:
    return AgentRecord(f"w{index}", index, join=join, started=started, ended=ended, rows=rows,
                       busy_s=busy_s, dead=dead)


def test_ideal_shares_the_rows_at_the_measured_rates() -> None:
    # 100 and 300 rows/s from t=0: 400 rows take 1 s
    assert ideal_seconds(outcome(slot(0, 100, 1.0), slot(1, 300, 1.0)), 400, []) == \
        pytest.approx(1.0)
    # the second worker starts at 0.5 s: 100 t + 300 (t - 0.5) = 400 -> t = 1.375
    late = outcome(slot(0, 100, 1.0), slot(1, 300, 1.0), first={"w0": 0.0, "w1": 0.5})
    assert ideal_seconds(late, 400, []) == pytest.approx(1.375)


def test_ideal_stops_a_hung_or_dead_worker() -> None:
    hang = [FaultConfig(worker=0, hang_after_rows=50)]
    # worker 0 trained 50 rows in 0.5 busy seconds, then hung: 50 + 100 t = 250 -> t = 2
    assert ideal_seconds(outcome(slot(0, 50, 0.5), slot(1, 100, 1.0)), 250, hang) == \
        pytest.approx(2.0)
    # worker 0 died at 1 s: 100 + 100 t = 300 -> t = 2
    dead = outcome(slot(0, 100, 1.0, ended=1.0, dead=True), slot(1, 100, 1.0))
    assert ideal_seconds(dead, 300, []) == pytest.approx(2.0)
    assert math.isnan(ideal_seconds(outcome(slot(0, 0, 0.0)), 10, []))


def test_others_rate_leaves_worker_zero_and_joiners_out() -> None:
    run = outcome(slot(0, 1000, 1.0), slot(1, 400, 1.0, ended=4.0),
                  slot(2, 900, 1.0, started=1.0, ended=4.0),
                  slot(3, 50, 1.0, started=2.0, ended=3.0, join=True))
    assert others_rate(run) == pytest.approx(100 + 300)


def test_every_scenario_faults_worker_zero_only() -> None:
    for name in SCENARIOS:
        faults = scenario_faults(name, share=1000, slowdown=4.0)
        assert [f.worker for f in faults] == ([] if name in ("none", "contention") else [0])
    assert scenario_faults("hang", 1000, 4.0)[0].hang_after_rows == 200
    assert scenario_faults("transient", 1000, 4.0)[0].slow_for_rows == 250
    assert scenario_faults("crash", 1000, 4.0)[0].crash_after_rows == 300


def test_a_way_reports_its_median_run_and_every_run_s_efficiency_and_fixed_costs() -> None:
    runs = [{"efficiency": 0.9, "run_id": "a", "start_s": 0.3, "tail_s": 0.4},
            {"efficiency": 0.7, "run_id": "b", "start_s": 0.9, "tail_s": 0.5},
            {"efficiency": 0.8, "run_id": "c", "start_s": 0.2, "tail_s": 0.6}]
    assert median_run(runs) == {**runs[2], "efficiencies": [0.9, 0.7, 0.8],
                                "fixed_costs": [[0.3, 0.4], [0.9, 0.5], [0.2, 0.6]]}
    # an even count takes the lower middle run, a real run rather than an average
    assert median_run(runs[:2])["run_id"] == "b"
    assert median_run(runs[:1]) == {**runs[0], "efficiencies": [0.9],
                                    "fixed_costs": [[0.3, 0.4]]}
