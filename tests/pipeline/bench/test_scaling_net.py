"""`antdt bench scaling --network`: the async job on links at a rate beside loopback, with what
its sync rounds cost there."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from pipeline.bench.network import namespaces_available
from pipeline.bench.scaling_net import LOOPBACK, medians
from pipeline.cli.main import cli
from waits import bounded

WHY_NOT = namespaces_available()


def test_a_figure_s_median_leaves_out_the_runs_without_it() -> None:
    runs: list[dict[str, Any]] = [{"samples_per_s": 10, "link_mbit_per_s": None},
                                  {"samples_per_s": 30, "link_mbit_per_s": 2.0},
                                  {"samples_per_s": 20, "link_mbit_per_s": 4.0}]
    assert medians(runs) == {"samples_per_s": 20, "link_mbit_per_s": 3.0}
    assert medians([{"bytes_per_round": None}]) == {"bytes_per_round": None}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces: {WHY_NOT}")
def test_the_rounds_on_a_link_are_reported_beside_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # MLflow's default store, in the working directory
    result = bounded.call(CliRunner().invoke, cli, [
        "bench", "scaling", "--network", "--link-rate", "100mbit", "--workers", "2",
        "--rows", "40000", "--data", str(tmp_path / "data"), "--set", "train.batch_size=512",
        "--set", "train.shard_rows=2048", "--set", "model.embedding_dim=4",
        "--set", "model.dense_arch=[16,4]", "--json"], timeout_s=540)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert (out["network"], out["workers"], out["train_rows"]) == (True, 2, 30_000)
    assert set(out["configs"]) == {LOOPBACK, "100mbit"}
    for label, config in out["configs"].items():
        assert config["samples_per_s"] > 0 and config["exchanges"] > 0, (label, config)
        assert config["bytes_per_round"] > 0 and config["rounds_per_s"] > 0, (label, config)
        assert config["sync_wait_s"] >= 0, (label, config)
    link = out["configs"]["100mbit"]
    assert link["link_mbit_per_s"] > 0 and link["data_bytes"] > 0, link
    assert "link_mbit_per_s" not in out["configs"][LOOPBACK]
    assert link["of_loopback"] == pytest.approx(
        link["samples_per_s"] / out["configs"][LOOPBACK]["samples_per_s"], abs=1e-3)
    assert [sorted(run) for run in out["per_repeat"]] == [sorted([LOOPBACK, "100mbit"])]
