"""Which way a day retrains (:mod:`pipeline.workflows.incremental`): the policy's rules one by
one, the chain a version records, and the day check on real Parquet days."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from data.synth import SynthResult
from pipeline.workflows.incremental import (Chain, DayStats, chain_of, check_day, choose,
                                            day_stats)

WINDOW = ["2026-11-02", "2026-11-03", "2026-11-04", "2026-11-05", "2026-11-06", "2026-11-07"]
CHAMPION = Chain("6", "incremental", ("2026-11-06",), "2026-11-03", "schema-a")


def test_a_day_continues_the_champion_over_the_days_it_has_not_seen() -> None:
    choice = choose("incremental", "2026-11-08", WINDOW, CHAMPION, 7, "schema-a")
    assert (choice.way, choice.days, choice.start) == ("incremental", ("2026-11-07",), "6")
    chain = chain_of(choice, "7", "2026-11-08", CHAMPION, "schema-a")
    assert chain == Chain("7", "incremental", ("2026-11-07",), "2026-11-03", "schema-a")
    assert Chain.from_tags("7", chain.tags()) == chain
    behind = dataclasses.replace(CHAMPION, days=("2026-11-04", "2026-11-05"))
    assert choose("incremental", "2026-11-08", WINDOW, behind, 7, "schema-a").days == (
        "2026-11-06", "2026-11-07")  # two days missed: both, from the champion


@pytest.mark.parametrize("asked, champion, schema, check, reason", [
    ("window", CHAMPION, "schema-a", None, "retrain=window"),
    ("incremental", None, "schema-a", None, "no champion yet"),
    ("incremental", CHAMPION, "schema-a", "day 2026-11-07: 10 rows", "the day check failed: day "
                                                                     "2026-11-07: 10 rows"),
    ("incremental", CHAMPION, "schema-b", None, "the schema changed since the champion trained"),
    ("incremental", dataclasses.replace(CHAMPION, refreshed="2026-11-01"), "schema-a", None,
     "refresh: the chain was last trained from scratch on 2026-11-01, 7 days ago "
     "(refresh_every 7)"),
    ("incremental", dataclasses.replace(CHAMPION, days=("2026-11-07",)), "schema-a", None,
     "the champion (version 6) trained every day of the window already"),
    ("incremental", dataclasses.replace(CHAMPION, days=("2026-10-30",), refreshed="2026-11-07"),
     "schema-a", None, "the champion's data ends on 2026-10-30, before the window"),
])
def test_the_window_trains_from_scratch_when_the_chain_cannot_go_on(
        asked: str, champion: Chain | None, schema: str, check: str | None,
        reason: str) -> None:
    choice = choose(asked, "2026-11-08", WINDOW, champion, 7, schema, check)  # type: ignore
    assert (choice.way, choice.days, choice.start, choice.reason) == (
        "window", tuple(WINDOW), None, reason)
    assert chain_of(choice, "7", "2026-11-08", champion, schema).refreshed == "2026-11-08"


def test_a_chain_ending_a_day_before_the_window_goes_on() -> None:
    edge = dataclasses.replace(CHAMPION, days=("2026-11-01",), refreshed="2026-11-02")
    choice = choose("incremental", "2026-11-08", WINDOW, edge, 7, "schema-a")
    assert choice.way == "incremental" and choice.days == tuple(WINDOW)


def test_a_version_without_a_chain_records_none() -> None:
    assert Chain.from_tags("3", {"antdt.retrain.day": "2026-11-02"}) is None
    assert Chain.from_tags("3", {**CHAMPION.tags(), "antdt.retrain.way": "weekly"}) is None


def test_the_day_check_compares_rows_click_rate_and_nulls_with_the_recent_days(
        small_data: SynthResult, tmp_path: Path) -> None:
    out = Path(small_data.out)
    days = [day_stats([str(out / f"date=2026-11-0{n}")], "label") for n in (1, 2, 3)]
    assert [d.rows for d in days] == [8_000] * 3
    assert all(0.1 < d.ctr < 0.4 for d in days) and "I1" in days[0].nulls
    assert check_day(days[2], days[:2]) is None
    assert check_day(days[2], []) is None

    thin = tmp_path / "thin"  # a day that lost most of its rows: one file of two, sliced
    thin.mkdir()
    first = sorted((out / "date=2026-11-03").glob("*.parquet"))[0]
    pq.write_table(pq.read_table(first).slice(0, 1_000), thin / "part.parquet")
    found = check_day(day_stats([str(thin)], "label"), days[:2])
    assert found == "1,000 rows, the recent days' median is 8,000"

    clicks = dataclasses.replace(days[2], ctr=days[2].ctr * 2)
    assert check_day(clicks, days[:2]).startswith(f"click rate {clicks.ctr:.3f}")
    nulls = dataclasses.replace(days[2], nulls={**days[2].nulls, "C1": 0.5})
    assert check_day(nulls, days[:2]).startswith("column C1 is 50.0% null, at most")
    shutil.rmtree(thin)


def test_day_stats_of_no_rows_say_so() -> None:
    assert check_day(DayStats(0, 0.0, {}), [DayStats(10, 0.2, {})]) == \
        "0 rows, the recent days' median is 10"
