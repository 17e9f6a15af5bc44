"""The straggler benchmark's arithmetic: the ideal time of perfect sharing and the faults of each
scenario (the runs themselves are what ``antdt bench stragglers`` measures); a tiny run of its
sync mode."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.bench.jobs import Outcome
from pipeline.cli.main import cli
from pipeline.bench import stragglers
from pipeline.bench.stragglers import (FAULT_FREE, SCENARIOS, ideal_seconds, median_by_rate,
                                       median_run, others_rate, run_sync_scenario,
                                       scenario_faults, sync_ratios)
from pipeline.job.config import FaultConfig
from pipeline.job.report import JobSummary
from pipeline.training.following import AgentRecord
from waits import bounded


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


def way(rate: int, steady: int | None = None) -> dict[str, int | None]:
    return {"samples_per_s": rate, "steady_samples_per_s": steady}


def test_the_sync_ideal_keeps_every_worker_s_capacity_but_the_slow_one_s() -> None:
    ways = {"fixed": way(1000, 1100), "adaptive": way(2000, 2420), "async": way(2500),
            FAULT_FREE: way(4000)}
    out = sync_ratios(ways, "persistent", workers=4, slowdown=4.0)
    assert out["adaptive_over_fixed"] == 2.0 and out["async_over_fixed"] == 2.5
    assert out["steady_adaptive_over_fixed"] == 2.2
    assert out["steady_async_over_fixed"] is None  # a run without a steady rate
    assert out["target"] == {"adaptive_over_fixed": 1.8, "met": True}
    # (3 + 1/4) / 4 of the fault-free rate; were fixed exactly 1/4 of it, 3.25x fixed
    assert out["ideal"] == {"fault_free_samples_per_s": 4000, "slowdown": 4.0, "share": 0.8125,
                            "samples_per_s": 3250, "over_fixed": 3.25,
                            "fluid_over_fixed": 3.25, "adaptive_of_ideal": 0.615,
                            "async_of_ideal": 0.769}


def test_under_contention_the_ideal_keeps_the_contended_rank_s_share_of_its_core() -> None:
    """Worker 0 kept half its core in the fixed run: it counts as 2x slower (the injected
    slowdown is not used), and the ideal is 3/4 of the run without the busy loop."""
    ways: dict[str, dict[str, Any]] = {
        "fixed": {**way(600), "cpu_shares": [0.5, 0.95]}, "adaptive": way(750),
        FAULT_FREE: way(1000)}
    out = sync_ratios(ways, "contention", workers=2, slowdown=4.0)
    assert out["adaptive_over_fixed"] == 1.25
    assert out["target"] == {"adaptive_over_fixed": 1.2, "met": True}
    assert out["ideal"] == {"fault_free_samples_per_s": 1000, "slowdown": 2.0, "share": 0.75,
                            "samples_per_s": 750, "over_fixed": 1.25, "fluid_over_fixed": 1.5,
                            "adaptive_of_ideal": 1.0}


def test_under_contention_every_way_shares_worker_zero_s_core_but_the_fault_free_base(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[tuple[str, bool]] = []

    def run(job: object, name: str, workers: int, faults: list[FaultConfig],
            contention: bool = False) -> dict[str, object]:
        assert faults == []  # contention is real, not injected
        ran.append((name, contention))
        rate = 750 if name == "adaptive" else 600 if contention else 1000
        return {**way(rate), "cpu_shares": [0.5, 0.95] if contention else [0.9, 0.9]}

    monkeypatch.setattr(stragglers, "run_sync_way", run)
    out = run_sync_scenario(None, "contention", ["fixed", "adaptive"], 2,  # type: ignore[arg-type]
                            [], 4.0, repeats=2, quiet=True)
    assert ran == [("fixed", True), ("adaptive", True), ("fixed", False)] * 2
    assert out["adaptive_over_fixed"] == 1.25 and out["ideal"]["slowdown"] == 2.0
    assert out[FAULT_FREE]["runs_samples_per_s"] == [1000, 1000]


def test_with_no_fault_the_fixed_way_is_the_ideal() -> None:
    out = sync_ratios({"fixed": way(1000), "adaptive": way(850)}, "none", 4, 4.0)
    assert out["adaptive_over_fixed"] == 0.85
    assert out["target"] == {"adaptive_over_fixed": 0.9, "met": False}
    assert out["ideal"]["samples_per_s"] == 1000 and out["ideal"]["over_fixed"] == 1.0
    assert out["ideal"]["fluid_over_fixed"] == 1.0
    # without the fixed way there is nothing to compare with
    assert sync_ratios({"adaptive": way(850)}, "none", 4, 4.0) == {}


def test_a_sync_way_reports_its_median_run_by_rate() -> None:
    runs = [{"samples_per_s": 30, "run_id": "a"}, {"samples_per_s": 10, "run_id": "b"},
            {"samples_per_s": 20, "run_id": "c"}, {"samples_per_s": 40, "run_id": "d"}]
    assert median_by_rate(runs) == {**runs[2], "runs_samples_per_s": [30, 10, 20, 40]}


@pytest.mark.slow
def test_the_sync_bench_runs_every_way_and_the_fault_free_base(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers, worker 0 4x slower: fixed and adaptive local batches and fixed without the
    fault each train every row once; the ratios come from their rates. (The async way is the
    async mode's job, which the async benches run.)"""
    monkeypatch.chdir(tmp_path)  # MLflow's default store, in the working directory
    result = bounded.call(CliRunner().invoke, cli, [
        "bench", "stragglers", "--mode", "sync", "--scenario", "persistent", "--workers", "2",
        "--rows", "10000", "--data", str(tmp_path / "data"), "--set", "train.batch_size=512",
        "--set", "train.shard_rows=1024", "--ways", "fixed,adaptive", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out["mode"], out["workers"], out["train_rows"], out["repeats"]) == \
        ("sync", 2, 7_500, 1)
    scenario = out["scenarios"]["persistent"]
    assert set(scenario) >= {"fixed", "adaptive", FAULT_FREE} and "async" not in scenario
    for name in ("fixed", "adaptive", FAULT_FREE):
        run = scenario[name]
        assert run["finished"] and run["rows_trained"] == 7_500, (name, run)
        assert run["rows_lost"] == run["rows_retrained"] == 0, (name, run)
        assert run["runs_samples_per_s"] == [run["samples_per_s"]] and run["samples_per_s"] > 0
        assert len(run["own_rates"]) == len(run["batch_rows"]) == 2
    fixed = scenario["fixed"]["samples_per_s"]
    assert scenario["adaptive_over_fixed"] == \
        pytest.approx(scenario["adaptive"]["samples_per_s"] / fixed, abs=1e-3)
    ideal = scenario["ideal"]
    assert ideal["fault_free_samples_per_s"] == scenario[FAULT_FREE]["samples_per_s"]
    assert ideal["share"] == 0.625 and ideal["fluid_over_fixed"] == 2.5  # (1 + 1/4) / 2
    assert scenario["target"]["adaptive_over_fixed"] == 1.8
