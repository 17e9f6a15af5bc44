"""The simulator at small scale: speed profiles, the ideal makespan, exact row accounting, and
AntDT against the static and pull baselines."""

from __future__ import annotations

import gc
import json
import math
from collections.abc import Iterator
from functools import partial

import pytest
from click.testing import CliRunner

from antdt.controller import Action, ControllerPolicy, ReassignStragglers, SplitTail, Tick
from antdt.simulator import (MIXES, Mix, Profile, Scenario, _Events, _Worker, ideal_seconds,
                             profiles, simulate, static_makespan)
from pipeline.cli.simulate import command

QUIET = MIXES["none"]


def test_profile_work_and_its_inverse_step_over_a_hang() -> None:
    profile = Profile([0.0, 10.0, 20.0], [100.0, 0.0, 50.0], deaths=[])
    assert profile.work(5.0) == 500.0 and profile.work(15.0) == 1000.0
    assert profile.work(30.0) == 1500.0
    assert profile.time_at(500.0) == 5.0
    assert profile.time_at(1000.0) == 20.0  # the hang: the 1000th row is done only after it
    assert profile.time_at(1250.0) == 25.0
    stopped = Profile([0.0, 10.0], [100.0, 0.0], deaths=[])
    assert stopped.time_at(2000.0) == math.inf


def test_worker_keeps_its_step_and_answers_as_its_profile() -> None:
    # steps, a hang, and a final stop (time_at beyond it is inf)
    profile = Profile([0.0, 10.0, 20.0, 35.0, 50.0], [100.0, 0.0, 50.0, 200.0, 0.0], deaths=[])
    worker = _Worker(0, 0, profile, 0.0)
    for t in [k * 0.7 for k in range(90)]:
        done = worker.move(t)
        assert done == profile.work(t)
        for ahead in (t + 1.0, t + 17.0):
            assert worker.work(ahead) == profile.work(ahead)
        for rows in (done, done + 50.0, done + 999.0, done + 5000.0):
            assert worker.time_at(rows) == profile.time_at(rows)


def test_events_come_out_in_time_order_first_in_first_out() -> None:
    events = _Events()
    made = {name: partial(str, name) for name in ("a", "b", "c", "d", "late")}
    for t, name in ((2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b")):
        events.put(t, made[name])
    t, due = events.pop()
    assert t == 1.0 and due == [made["a"], made["b"]]
    events.put(1.0, made["late"])  # put for the time being carried out: comes out next
    assert events.pop() == (1.0, [made["late"]])
    assert events.pop() == (2.0, [made["c"], made["d"]])
    assert not events


def test_simulation_leaves_garbage_collection_as_it_was() -> None:
    scenario = Scenario(workers=5, shards=50, mix=QUIET)
    assert gc.isenabled()
    simulate(scenario, strategies=("antdt",))
    assert gc.isenabled()
    gc.disable()
    try:
        simulate(scenario, strategies=("antdt",))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_ideal_is_total_rows_over_the_summed_rates() -> None:
    same = [Profile([0.0], [100.0], []) for _ in range(4)]
    assert ideal_seconds(40_000, same) == pytest.approx(100.0)
    # one of them stops at 50 s: 4 x 100 rows/s for 50 s, then 3 x 100 rows/s
    stopping = [*same[:3], Profile([0.0, 50.0], [100.0, 0.0], [])]
    assert ideal_seconds(40_000, stopping) == pytest.approx(50.0 + 20_000 / 300)


def test_quiet_cluster_is_ideal_and_static_is_too() -> None:
    result = simulate(Scenario(workers=20, shards=400, mix=QUIET))
    assert result["ideal_s"] == pytest.approx(20.0)  # 20 shards x 1000 rows at 1000 rows/s
    assert result["efficiency"]["static"] == pytest.approx(1.0)
    assert result["efficiency"]["pull"] == pytest.approx(1.0)
    assert result["efficiency"]["antdt"] == pytest.approx(1.0)
    assert result["runs"]["antdt"]["rows_done"] == 400_000
    # one RPC a shard (a second: the final commit rides on the next lease), plus each worker's
    # first lease and the commits of its first claim, one batch long before a rate is measured,
    # plus the job's end, where the last 40 shards' leases shrink towards a batch (guided end)
    assert 1.0 <= result["rpc_per_worker_per_s"] <= 1.5
    whole = simulate(Scenario(workers=20, shards=400, mix=QUIET, guided_end=False))
    assert whole["efficiency"]["antdt"] == pytest.approx(1.0)
    assert 1.0 <= whole["rpc_per_worker_per_s"] <= 1.2


@pytest.mark.slow
def test_accounting_is_exact_with_stragglers_hangs_and_deaths() -> None:
    mix = Mix(transient_per_hour=120.0, persistent_fraction=0.1, hang_fraction=0.05,
              death_fraction=0.1, restart_s=5.0)
    result = simulate(Scenario(workers=60, shards=3000, mix=mix, seed=3),
                      strategies=("pull", "antdt"))
    for strategy in ("pull", "antdt"):
        run = result["runs"][strategy]
        assert run["rows_done"] == run["rows_expected"] == 3_000_000
        assert run["rows_lost"] == 0 and run["rows_todo"] == run["rows_leased"] == 0
        # synced at every commit (local mode): a death loses no committed row
        assert run["rows_trained"] == run["rows_done"] and run["rows_retrained"] == 0
        assert 0 < result["efficiency"][strategy] <= 1.0
    assert result["efficiency"]["antdt"] > result["efficiency"]["pull"]


@pytest.mark.slow
def test_antdt_beats_static_and_pull_under_stragglers() -> None:
    result = simulate(Scenario(workers=100, shards=10_000, mix=MIXES["default"], seed=1))
    efficiency = result["efficiency"]
    assert efficiency["antdt"] > 0.9
    assert efficiency["antdt"] > efficiency["pull"] > 0 and efficiency["antdt"] > \
        efficiency["static"]
    assert result["control_us_per_op"] > 0
    assert result["runs"]["antdt"]["rows_done"] == 10_000_000


def test_same_seed_same_cluster_other_seed_other_cluster() -> None:
    scenario = Scenario(workers=50, shards=500, mix=MIXES["stragglers"], seed=7).resolved()
    first, again = profiles(scenario), profiles(scenario)
    assert [p.rates for p in first] == [p.rates for p in again]
    other = profiles(Scenario(workers=50, shards=500, mix=MIXES["stragglers"],
                              seed=8).resolved())
    assert [p.rates for p in first] != [p.rates for p in other]
    slow = sum(p.rates[0] < 500 for p in first)  # persistent: 3x slower than 1000 rows/s
    assert 1 <= slow <= 15
    assert static_makespan(scenario, first) >= ideal_seconds(scenario.total_rows, first)


class CountTicks(ControllerPolicy):
    """A test-only policy that proposes nothing and counts the ticks it saw."""

    def __init__(self) -> None:
        self.ticks = 0

    def run(self, tick: Tick) -> Iterator[Action]:
        self.ticks += 1
        yield from ()


def test_policies_can_be_passed_in() -> None:
    scenario = Scenario(workers=30, shards=600, mix=MIXES["stragglers"], seed=2)
    idle = CountTicks()
    result = simulate(scenario, strategies=("pull", "antdt"), policies=[idle])
    # the only policy ran every tick and proposed nothing: the controlled run is a pull run
    assert idle.ticks > 0 and result["runs"]["antdt"]["actions"] == {}
    assert result["makespan_s"]["antdt"] == result["makespan_s"]["pull"]

    result = simulate(scenario, strategies=("antdt",), policies=[ReassignStragglers(),
                                                                  SplitTail()])
    assert set(result["efficiency"]) == {"antdt"}
    assert result["runs"]["antdt"]["rows_done"] == 600_000
    actions = result["runs"]["antdt"]["actions"]
    assert actions and set(actions) <= {"reassign", "split"}  # not the default policies


def test_mix_is_validated() -> None:
    with pytest.raises(Exception, match="mix out of range"):
        Mix(persistent_fraction=1.5)
    with pytest.raises(Exception, match="scenario needs"):
        Scenario(workers=0, shards=10)


def test_cli_prints_json() -> None:
    out = CliRunner().invoke(command, ["--workers", "10", "--shards", "200", "--mix",
                                       "stragglers", "--seed", "4", "--processes", "1",
                                       "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert set(result["efficiency"]) == {"static", "pull", "antdt"}
    assert {"control_us_per_op", "rpc_per_worker_per_s", "sim_wall_s"} <= set(result)
    assert result["mix"] == "stragglers" and result["workers"] == 10
