"""`antdt bench retrain` at toy scale, run as a user runs it: every way is scored on every
evaluated day, the frozen model trains once, the incremental way refreshes as the policy says and
trains fewer rows than the window's, and the JSON carries the promised figures (no timing or
quality target is asserted: the AUCs of a few thousand rows are noise)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from commands import antdt
from pipeline.bench.retrain import plan_incremental

ROWS = 5_000


@pytest.mark.slow
def test_bench_retrain_scores_every_way_on_every_day_and_follows_the_policy(
        tmp_path: Path) -> None:
    result = antdt("bench", "retrain", "--days", "4", "--train-days", "2", "--refresh-every",
                   "3", "--rows-per-day", str(ROWS), "--json", cwd=tmp_path)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(tmp_path.iterdir()) == []  # its data and MLflow store were temporary
    assert {"days", "train_days", "refresh_every", "rows_per_day", "drift", "oracle_auc",
            "ways", "incremental_minus_window", "ratios", "checks", "passed", "per_day",
            "models_trained"} <= out.keys()
    days = ["2026-11-03", "2026-11-04", "2026-11-05", "2026-11-06"]
    assert list(out["oracle_auc"]) == days
    per_day = out["per_day"]
    assert set(per_day) == {"frozen", "window", "incremental"}
    for way, rows in per_day.items():
        assert [r["day"] for r in rows] == days, way
        for row in rows:
            assert 0.0 < row["auc"] <= 1.0 and row["logloss"] > 0 and row["calibration"] > 0

    # the frozen model is the first window's, trained once
    assert [r["rows_trained"] for r in per_day["frozen"]] == [2 * ROWS, 0, 0, 0]
    assert [r["trained"] for r in per_day["frozen"]] == ["window", "none", "none", "none"]
    assert per_day["frozen"][0]["auc"] == per_day["window"][0]["auc"]
    # the window way trains the two days before each day from scratch
    assert [r["rows_trained"] for r in per_day["window"]] == [2 * ROWS] * 4
    # incremental: no model yet, then one new day a day, then a refresh 3 days after the first
    incremental = per_day["incremental"]
    assert [r["trained"] for r in incremental] == ["window", "incremental", "incremental",
                                                   "window"]
    assert [r["rows_trained"] for r in incremental] == [2 * ROWS, ROWS, ROWS, 2 * ROWS]
    assert incremental[3]["reason"].startswith("refresh:")
    for k in (0, 3):  # a refresh is the window's model of that day
        assert incremental[k]["auc"] == per_day["window"][k]["auc"]
    assert out["models_trained"] == 4 + 2

    ways = out["ways"]
    assert ways["incremental"]["rows_trained"] == 6 * ROWS < ways["window"]["rows_trained"]
    assert ways["frozen"]["trainings"] == 1 and ways["incremental"]["refreshes"] == 2
    assert out["ratios"]["rows_trained"] == pytest.approx(6 / 8, abs=1e-3)
    diffs = [i["auc"] - w["auc"] for i, w in zip(incremental, per_day["window"])]
    assert out["incremental_minus_window"]["mean"] == pytest.approx(sum(diffs) / 4, abs=1e-4)
    assert out["incremental_minus_window"]["min"] == pytest.approx(min(diffs), abs=1e-5)
    assert set(out["checks"]) == {"mean_auc_within_window", "no_day_below_window",
                                  "calibration_within", "above_frozen", "rows_ratio",
                                  "seconds_ratio"}
    assert out["passed"] == all(out["checks"].values())
    assert out["checks"]["rows_ratio"] is False  # 0.75 of the window's rows


def test_the_incremental_plan_refreshes_every_refresh_every_days() -> None:
    days = [f"2026-11-{d:02d}" for d in range(1, 21)]
    plan = plan_incremental(days, 6, 7, "s")
    assert len(plan) == 14
    assert [k for k, c in enumerate(plan) if c.way == "window"] == [0, 7]
    assert all(c.days == (days[5 + k],) and c.start == days[5 + k]
               for k, c in enumerate(plan) if c.way == "incremental")
