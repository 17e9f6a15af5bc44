"""`antdt bench sharding` at toy scale: it runs end to end and prints the promised keys."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from pipeline.bench.sharding import command


def test_bench_sharding_prints_the_figures() -> None:
    result = CliRunner().invoke(command, ["--workers", "10", "--shards", "1000", "--ops", "2000",
                                          "--rpc-ops", "40", "--group-asks", "500",
                                          "--view-leases", "30000", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert {"workers", "shards", "ops_per_s", "us_per_op_p50", "us_per_op_p99",
            "bytes_per_shard", "rpc_ops_per_s", "group_asks_per_s", "us_per_group_ask_p50",
            "us_per_group_ask_p99"} <= figures.keys()
    assert figures["workers"] == 10 and figures["shards"] == 1000
    assert figures["ops_per_s"] > 0 and figures["rpc_ops_per_s"] > 0
    assert figures["rpc_ops_per_s_scraped"] > 0 and figures["scrapes"] >= 1
    assert figures["rpc_scraped_ratio"] == pytest.approx(
        figures["rpc_ops_per_s_scraped"] / figures["rpc_ops_per_s"], abs=0.01)
    assert 0 < figures["ms_per_scrape"] < 30_000
    assert figures["group_asks"] == 500 and figures["group_asks_per_s"] > 0
    assert 0 < figures["us_per_op_p50"] <= figures["us_per_op_p99"]
    assert 0 < figures["us_per_group_ask_p50"] <= figures["us_per_group_ask_p99"]
    assert 0 < figures["bytes_per_shard"] < 300 * 10  # 10 live leases on only 1,000 shards
    # a page view of a job of 30,000 leases: the whole job in at most 2,000 bars, rows exact
    assert figures["view_leases"] == 30_000 and 0 < figures["view_bars"] <= 2000
    assert figures["view_rows_exact"] is True
    assert 0 < figures["ms_per_view_on_loop"] and 0 < figures["ms_per_view_drawn"]


def test_bench_sharding_stops_when_every_shard_is_done() -> None:
    result = CliRunner().invoke(command, ["--workers", "4", "--shards", "20", "--ops", "5000",
                                          "--rpc-ops", "10", "--view-leases", "10",
                                          "--shard-rows", "64",
                                          "--batch-rows", "32", "--json"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert 20 <= figures["ops"] < 5000
