"""`antdt bench hybrid` at toy scale: the reference, the sharded quality runs and the speed pairs
all run, and the JSON carries the promised figures (no timing target is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeline.bench.hybrid import command
from waits import bounded


@pytest.mark.slow
def test_bench_hybrid_measures_sharded_tables_against_both_baselines(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default store, in the working directory
    result = bounded.call(CliRunner().invoke, command, [
        "--rows", "10000", "--data", str(tmp_path / "data"), "--workers", "2,3",
        "--repeats", "1", "--tolerance", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert {"job", "reference_auc", "reference_samples_per_s", "rows", "repeats", "tolerance",
            "quality", "speed", "passed", "sizing"} <= out.keys()
    assert 0.5 < out["reference_auc"] <= 1.0 and out["reference_samples_per_s"] > 0
    assert out["rows"] == 7_500 and out["repeats"] == 1  # three of four synthetic days train
    assert [q["workers"] for q in out["quality"]] == [2, 3]
    for quality in out["quality"]:
        (run,) = quality["runs"]
        assert run["rows_trained"] == out["rows"]
        assert run["rows_lost"] == run["rows_retrained"] == 0
        assert run["gap"] == pytest.approx(out["reference_auc"] - run["auc"], abs=2e-4)
        assert quality["min_gap"] == quality["worst_gap"] == quality["median_gap"] == run["gap"]
        assert quality["passed"] is True
        (replicated,) = quality["replicated_aucs"]  # the same count with replicated tables
        assert 0.5 < replicated <= 1.0
    speed = out["speed"]
    assert speed["workers"] == 2 and speed["target"] == 0.8
    assert speed["sharded_samples_per_s"] > 0 and speed["replicated_samples_per_s"] > 0
    assert len(speed["replicated_aucs"]) == 1 and 0.5 < speed["replicated_aucs"][0] <= 1.0
    assert speed["ratio"] > 0 and speed["ratio"] == pytest.approx(
        speed["sharded_samples_per_s"] / speed["replicated_samples_per_s"], abs=2e-3)
    # the 2-worker quality run is the speed pair's sharded run
    assert speed["sharded_runs"] == [out["quality"][0]["runs"][0]["samples_per_s"]]
    assert out["passed"] is (speed["passed"] and all(q["passed"] for q in out["quality"]))
