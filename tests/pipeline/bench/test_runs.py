"""Tiny runs of the benchmarks that have no test of their own arithmetic: each prints its JSON
fields, and its baseline ran in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import dask.config
import pytest
import torch
from click.testing import CliRunner

from pipeline.cli.main import cli
from waits import bounded


def bench(args: list[str]) -> dict[str, Any]:
    result = bounded.call(CliRunner().invoke, cli, ["bench", *args, "--json"])
    assert result.exit_code == 0, result.output
    out: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return out


def test_bench_data_measures_the_reader_and_bare_pyarrow() -> None:
    out = bench(["data", "--rows", "20000", "--row-group-rows", "5000", "--batch-size", "1000",
                 "--repeats", "2"])
    assert (out["rows"], out["row_group_rows"], out["batch_size"], out["repeats"]) == \
        (20_000, 5_000, 1_000, 2)
    assert out["rows_per_s"] > 0 and out["pyarrow_rows_per_s"] > 0
    assert out["ratio"] == pytest.approx(out["rows_per_s"] / out["pyarrow_rows_per_s"], abs=2e-3)


def test_bench_train_measures_the_framework_and_a_plain_torchrec_loop() -> None:
    out = bench(["train", "--rows", "8192", "--batch-size", "1024", "--repeats", "1",
                 "--arch", "dcn"])
    assert (out["rows"], out["batch_size"], out["arch"], out["torch_threads"]) == \
        (8192, 1024, "dcn", 1)
    assert out["framework_samples_per_s"] > 0 and out["torchrec_loop_samples_per_s"] > 0
    assert out["ratio"] == pytest.approx(
        out["framework_samples_per_s"] / out["torchrec_loop_samples_per_s"], abs=2e-3)


def test_bench_sync_times_a_round_and_ends_with_identical_replicas() -> None:
    out = bench(["sync", "--target-s", "0.1", "--tables", "3", "--categories", "1000",
                 "--dim", "4", "--dense", "10", "--batch-size", "64", "--period", "2"])
    assert list(out["devices"]) == ["cpu"] and out["rows"] == 2 * (10 + 100 + 1000)
    by_dtype = out["devices"]["cpu"]
    assert set(by_dtype) == {"float32", "bfloat16"}
    for cpu in by_dtype.values():
        assert cpu["rounds"] >= 3
        assert cpu["identical"] is True  # the final copy left the replicas equal, bit for bit
        assert 0 < cpu["rows_per_round"] <= 3 * 2 * 64 and 0 < cpu["final_rows"] <= out["rows"]
        assert set(cpu["ms"]) == {"cut", "serve", "wire", "merge"}
        assert cpu["round_ms"] == pytest.approx(sum(cpu["ms"].values()), abs=0.01)
    # a row's pull: an int32 id and 4 values, 12 bytes in bfloat16 against 20 in float32
    assert by_dtype["bfloat16"]["bytes_per_round"] < 0.8 * by_dtype["float32"]["bytes_per_round"]
    assert out["bfloat16_over_float32"]["cpu"]["bytes"] == pytest.approx(
        by_dtype["bfloat16"]["bytes_per_round"] / by_dtype["float32"]["bytes_per_round"],
        abs=1e-3)


def test_bench_sync_refuses_a_delta_dtype_it_does_not_know() -> None:
    result = CliRunner().invoke(cli, ["bench", "sync", "--delta-dtype", "float32,float64"])
    assert result.exit_code != 0 and "'float64': expected one of bfloat16, float16, float32" \
        in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal needs a machine without a GPU")
def test_bench_sync_refuses_cuda_without_a_gpu() -> None:
    result = CliRunner().invoke(cli, ["bench", "sync", "--device", "cpu,cuda"])
    assert result.exit_code != 0 and "no usable GPU" in result.output


@pytest.mark.slow
def test_bench_quality_trains_the_reference_and_the_async_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default store, in the working directory
    out = bench(["quality", "--rows", "10000", "--data", str(tmp_path / "data"),
                 "--workers", "2", "--repeats", "2", "--tolerance", "0.5"])
    assert 0.5 < out["reference_auc"] <= 1.0 and out["reference_samples_per_s"] > 0
    assert out["rows"] == 7_500 and out["repeats"] == 2  # three of four synthetic days train
    (two,) = out["async"]
    assert two["workers"] == 2 and len(two["runs"]) == 2
    for run in two["runs"]:
        assert run["rows_trained"] == out["rows"]
        assert run["rows_lost"] == run["rows_retrained"] == 0
        assert run["gap"] == pytest.approx(out["reference_auc"] - run["auc"], abs=2e-4)
    gaps = [run["gap"] for run in two["runs"]]
    assert two["worst_gap"] == max(gaps)
    assert two["median_gap"] == pytest.approx(sum(gaps) / 2, abs=1e-4)
    assert two["passed"] is out["passed"] is True
    assert (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_bench_quality_sync_trains_the_reference_and_both_local_batch_ways(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = bench(["quality", "--mode", "sync", "--rows", "10000", "--data", str(tmp_path / "data"),
                 "--workers", "2", "--set", "train.batch_size=512",
                 "--set", "train.shard_rows=1024", "--tolerance", "0.5",
                 "--pair-tolerance", "0.5"])
    assert out["mode"] == "sync" and out["rows"] == 7_500 and out["pair_tolerance"] == 0.5
    (two,) = out["sync"]
    assert two["workers"] == 2 and two["slowdown"] == 4.0
    for way in ("fixed", "adaptive"):
        (run,) = two[way]["runs"]
        assert run["rows_trained"] == out["rows"]
        assert run["rows_lost"] == run["rows_retrained"] == 0
        assert run["gap"] == pytest.approx(out["reference_auc"] - run["auc"], abs=2e-4)
        assert two[way]["median_auc"] == run["auc"] and len(run["batch_rows"]) == 2
    assert two["fixed"]["runs"][0]["batch_rows"] == [None, None]  # equal local batches
    assert two["fixed_adaptive_difference"] == pytest.approx(
        abs(two["fixed"]["median_auc"] - two["adaptive"]["median_auc"]), abs=2e-4)
    assert two["passed"] is out["passed"] is True


@pytest.mark.slow
def test_bench_submit_runs_both_ways_on_one_cluster(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = bench(["submit", "--rows", "10000", "--data", str(tmp_path / "data"),
                 "--workers", "2", "--repeats", "1"])
    assert out["rows"] == 7_500 and out["workers"] == 2
    assert set(out["cold"]) == set(out["runs"]) == {"client_driven", "submitted"}
    for way in ("client_driven", "submitted"):
        (run,) = out["runs"][way]
        assert run["first_batch_s"] > 0 and run["samples_per_s"] > 0
        assert out[f"{way}_samples_per_s"] == run["samples_per_s"]
    assert out["samples_per_s_ratio"] == pytest.approx(
        out["submitted_samples_per_s"] / out["client_driven_samples_per_s"])
    runs = mlflow_runs(tmp_path)
    assert sorted(runs.values()) == ["FINISHED"] * 4  # each way opened and closed its runs


def mlflow_runs(folder: Path) -> dict[str, str]:
    """Run id -> status of every run in ``folder``'s default MLflow store."""
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{folder / 'mlflow.db'}")
    return {run.info.run_id: run.info.status
            for experiment in client.search_experiments()
            for run in client.search_runs([experiment.experiment_id])}


@pytest.mark.slow
def test_bench_checkpoint_runs_with_and_without_checkpoints(
        cluster_job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with dask.config.set({"antdt.jobs.tick": "100ms"}):  # the master checks 10x a second
        # jobs of three epochs of 16,000 rows, a checkpoint due every 4,000 (not sized by the
        # warm-up's speed): many ticks see rows to go
        out = bench(["checkpoint", "--job", str(cluster_job), "--every", "4000",
                     "--epochs", "3", "--repeats", "1", "--scale", "2"])
    assert out["every"] == "4000" and out["epochs"] == 3 and out["rows"] == 3 * 16_000
    assert len(out["runs"]["none"]) == len(out["runs"]["checkpoints"]) == 1
    assert out["checkpoints_per_job"][0] >= 1
    assert out["samples_per_s_ratio"] == pytest.approx(
        out["samples_per_s_checkpoints"] / out["samples_per_s_none"])
    default, larger = out["sizes"]["default"], out["sizes"]["tables_x2"]
    assert 0 < default["bytes"] < larger["bytes"] < 2 * default["bytes"] + 1_000_000
    assert larger["write_s"] > 0 and larger["disk_s"] > 0 and larger["copy_s"] > 0
    assert not list(tmp_path.glob("antdt-bench-checkpoint-*"))  # its files are gone


@pytest.mark.slow
def test_bench_overhead_times_each_command_from_outside_and_by_phase(tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[3]  # this checkout, again as --tree
    out = bench(["overhead", "--rows", "20000", "--modes", "async,local,peer", "--repeats", "1",
                 "--folder", str(tmp_path), "--tree", str(root)])
    assert set(out["legs"]) == {"async", "local", "peer", "before async", "before local"}
    for leg, figures in out["legs"].items():
        assert figures["wall_s"] > figures["train_s"] > 0, leg
        assert figures["outside_s"] == pytest.approx(figures["wall_s"] - figures["train_s"],
                                                     abs=2e-3)
        assert figures["samples_per_s"] > 0
    async_phases = out["legs"]["async"]["phases"]
    assert {"start", "prepare", "cluster", "training", "evaluate", "model", "shutdown",
            "exit"} <= set(async_phases)
    # what the command said of itself adds up to what was timed from outside
    assert async_phases["total_s"] + async_phases["exit"] == pytest.approx(
        out["legs"]["async"]["wall_s"], abs=2e-3)
    assert out["ratios"]["async wall / peer"] == pytest.approx(
        out["legs"]["async"]["wall_s"] / out["legs"]["peer"]["wall_s"], abs=2e-3)
    assert "local outside / before" in out["ratios"]
