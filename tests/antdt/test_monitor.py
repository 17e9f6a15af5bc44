"""The Monitor on a virtual clock: windows, verdicts, hang timeouts, configuration."""

from __future__ import annotations

from collections.abc import Callable

import dask.config
import pytest

from antdt.errors import ConfigError
from antdt.monitor import Monitor, MonitorSettings, WorkerState
from antdt.sharding import CommitEvent

SETTINGS = MonitorSettings(window_s=10.0, history=3, slow_factor=1.5, persistent_windows=3,
                           hang_factor=4.0, hang_floor_s=5.0, warm_up_batches=0)
"""Workers judged from their first window (the warm-up has its own test)."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(monitor: Monitor, clock: Clock, seconds: int, rows: dict[str, int],
        holders: list[str] | None = None) -> None:
    """Every worker in ``rows`` commits that many rows each second for ``seconds``; the
    monitor is updated every second (as a controller tick)."""
    for _ in range(seconds):
        clock.now += 1.0
        for worker, n in rows.items():
            monitor.observe(CommitEvent(worker, 0, 0, n, {}, clock.now))
        monitor.update(holders if holders is not None else list(rows))


def test_slow_worker_goes_transient_then_persistent_then_recovers() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    speeds = {"a": 100, "b": 100, "c": 90, "slow": 40}
    monitor.update(list(speeds))
    run(monitor, clock, 10, speeds)
    slow = monitor.health("slow")
    assert slow is not None and slow.state is WorkerState.TRANSIENT and slow.streak == 1
    assert slow.median == pytest.approx(0.1)  # of a, b, c's BPTs = 1 s per commit / (rows / 10)
    assert slow.bpt == pytest.approx(0.25) and slow.window == 0
    assert monitor.health("c").state is WorkerState.OK  # 1.05x the median is not slow
    run(monitor, clock, 20, speeds)
    slow = monitor.health("slow")
    assert slow.state is WorkerState.PERSISTENT and slow.streak == 3 and slow.window == 2
    assert [h.worker for h in monitor.flagged()] == ["slow"]
    assert monitor.rate("slow") == pytest.approx(40.0)
    run(monitor, clock, 10, {**speeds, "slow": 100})
    assert monitor.health("slow").state is WorkerState.OK
    assert monitor.flagged() == []


def test_a_worker_is_judged_against_the_others() -> None:
    """Two workers, one at twice the other's BPT: 1.33x the median of both (under the slow
    factor) but 2x its only peer's, so it is flagged, and persistently."""
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    speeds = {"fast": 100, "contended": 50}
    monitor.update(list(speeds))
    run(monitor, clock, 30, speeds)
    contended, fast = monitor.health("contended"), monitor.health("fast")
    assert contended.state is WorkerState.PERSISTENT and contended.streak == 3
    assert contended.median == pytest.approx(0.1) and contended.bpt == pytest.approx(0.2)
    assert fast.state is WorkerState.OK and fast.median == pytest.approx(0.2)
    assert monitor.median_bpt == pytest.approx(0.15)
    assert [h.worker for h in monitor.flagged()] == ["contended"]


def test_a_lone_worker_gets_no_verdict() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    run(monitor, clock, 30, {"only": 10})
    only = monitor.health("only")
    assert only.state is WorkerState.OK and only.median is None and only.window is None
    assert monitor.median_bpt == pytest.approx(1.0)


def test_agent_stats_take_precedence_over_commit_gaps() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    monitor.update(["a", "b", "c"])
    for _ in range(10):
        clock.now += 1.0
        for worker in ("a", "b"):
            monitor.observe(CommitEvent(worker, 0, 0, 100, {"busy_s": 0.5, "batches": 5},
                                        clock.now))
        # c commits as often and as much, but reports 4 s of training per 5 batches
        monitor.observe(CommitEvent("c", 0, 0, 100, {"busy_s": 4.0, "batches": 5}, clock.now))
        monitor.update(["a", "b", "c"])
    c = monitor.health("c")
    assert c.state is WorkerState.TRANSIENT
    assert c.bpt == pytest.approx(0.8) and c.median == pytest.approx(0.1)
    assert monitor.rate("a") == pytest.approx(200.0)


def test_hang_timeout_comes_from_own_history_with_a_floor() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    monitor.update(["fast", "slow"])
    for t in range(1, 31):  # fast commits every second, slow every 3 s
        clock.now = float(t)
        monitor.observe(CommitEvent("fast", 0, 0, 10, {}, clock.now))
        if t % 3 == 0:
            monitor.observe(CommitEvent("slow", 1, 0, 10, {}, clock.now))
        monitor.update(["fast", "slow"])
    assert monitor.health("fast").timeout_s == pytest.approx(5.0)  # floor beats 4 x 1 s
    assert monitor.health("slow").timeout_s == pytest.approx(12.0)  # 4 x its 3 s gap
    clock.now = 36.0  # both silent for 6 s
    monitor.update(["fast", "slow"])
    assert monitor.health("fast").state is WorkerState.HUNG
    assert monitor.health("fast").silent_s == pytest.approx(6.0)
    assert monitor.health("slow").state is not WorkerState.HUNG
    clock.now = 43.0
    monitor.update(["fast", "slow"])
    assert monitor.health("slow").state is WorkerState.HUNG
    assert [h.worker for h in monitor.flagged()] == ["fast", "slow"]
    monitor.observe(CommitEvent("fast", 0, 0, 10, {}, clock.now))
    monitor.update(["fast", "slow"])
    assert monitor.health("fast").state is not WorkerState.HUNG


def test_only_holders_still_training_can_hang() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    monitor.update(["a", "b", "c"])
    for worker in ("a", "b", "c"):
        monitor.observe(CommitEvent(worker, 0, 0, 10, {}, 0.5))
    clock.now = 8.0
    draining = {"b"}  # b only waits for its synced offset
    monitor.update(["a", "b"], training=lambda w: w not in draining)  # c holds no lease
    assert monitor.health("a").state is WorkerState.HUNG
    assert monitor.health("b").state is WorkerState.OK
    assert monitor.health("c").state is WorkerState.OK
    monitor.update(["b"], training=lambda w: True)  # a gave its lease up: no longer hung
    assert monitor.health("a").state is WorkerState.OK
    assert monitor.health("b").state is WorkerState.HUNG


def test_no_holder_is_hung_while_the_scheduler_hears_none_of_them() -> None:
    """Every worker silent at once, unheard by the scheduler (its own link cut for a moment):
    none is hung, so the controller retires none. Once it hears one (a's heartbeats), the
    silent holders are hung: a's process is alive and not committing, b is cut off from a
    cluster the scheduler reaches."""
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    monitor.update(["a", "b"])
    for worker in ("a", "b"):
        monitor.observe(CommitEvent(worker, 0, 0, 10, {}, 0.5))
    clock.now = 8.0
    unheard = {"a": 7.5, "b": 7.5}
    monitor.update(["a", "b"], unheard=unheard.__getitem__)
    assert monitor.health("a").state is WorkerState.OK
    assert monitor.health("b").state is WorkerState.OK
    unheard["a"] = 0.4  # its heartbeats arrive: alive, reachable, and not committing
    monitor.update(["a", "b"], unheard=unheard.__getitem__)
    assert monitor.health("a").state is WorkerState.HUNG
    assert monitor.health("b").state is WorkerState.HUNG


def test_new_holder_is_timed_from_when_it_leased() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    monitor.observe(CommitEvent("a", 0, 0, 10, {}, 0.0))
    clock.now = 60.0  # idle (no lease) for a minute, then it leases again
    monitor.update(["a"])
    assert monitor.health("a").silent_s == 0.0
    assert monitor.health("a").state is WorkerState.OK


def test_silent_holder_is_slow_in_the_window() -> None:
    clock = Clock()
    settings = MonitorSettings(window_s=10.0, persistent_windows=2, hang_floor_s=100.0,
                               warm_up_batches=0)
    monitor = Monitor(clock, batch_rows=10, settings=settings)
    monitor.update(["a", "b", "stuck"])
    monitor.observe(CommitEvent("stuck", 0, 0, 10, {}, 0.0))  # one batch, then nothing
    run(monitor, clock, 20, {"a": 10, "b": 10}, holders=["a", "b", "stuck"])
    stuck = monitor.health("stuck")
    assert stuck.state is WorkerState.PERSISTENT and stuck.streak == 2
    assert stuck.bpt == pytest.approx(20.0)  # evidence: silent since its commit at 0
    idle = Monitor(clock, batch_rows=10, settings=settings)
    idle.observe(CommitEvent("waiting", 0, 0, 10, {}, clock.now))  # then holds no lease
    run(idle, clock, 20, {"a": 10, "b": 10}, holders=["a", "b"])
    waiting = idle.health("waiting")
    assert waiting.state is WorkerState.OK and waiting.bpt is None  # no evidence either way
    assert idle.windows == 2


def test_a_holder_before_its_first_commit_is_not_judged_by_its_silence() -> None:
    """A cold worker's first batch (imports, first kernels, first row group) is slow: no
    verdict until it commits, but a worker that never commits is hung after its timeout."""
    clock = Clock()
    settings = MonitorSettings(window_s=1.0, persistent_windows=2, hang_floor_s=5.0,
                               warm_up_batches=0)
    monitor = Monitor(clock, batch_rows=10, settings=settings)
    monitor.update(["a", "b", "cold"])
    run(monitor, clock, 4, {"a": 10, "b": 10}, holders=["a", "b", "cold"])
    cold = monitor.health("cold")
    assert cold.state is WorkerState.OK and cold.bpt is None and monitor.flagged() == []
    run(monitor, clock, 2, {"a": 10, "b": 10}, holders=["a", "b", "cold"])
    assert monitor.health("cold").state is WorkerState.HUNG  # silent 6 s > the 5 s floor
    assert [h.worker for h in monitor.flagged()] == ["cold"]


def feed(monitor: Monitor, clock: Clock, seconds: range,
         batches: Callable[[int], dict[str, int]], holders: list[str]) -> None:
    """Each second, every worker in ``batches(second)`` commits 1 s of training in that many
    batches (none for 0), then a controller tick sees ``holders``."""
    for second in seconds:
        clock.now = float(second)
        for worker, n in batches(second).items():
            if n:
                monitor.observe(CommitEvent(worker, 0, 0, 10 * n, {"busy_s": 1.0, "batches": n},
                                            clock.now))
        monitor.update(holders)


def test_a_worker_is_not_judged_by_its_warm_up_batches() -> None:
    """A healthy worker whose first batches are cold (5x its later BPT) for two windows is not
    a persistent straggler; a worker slow throughout is, once its warm-up is over."""
    holders = ["a", "b", "cold", "slow"]

    def batches(second: int) -> dict[str, int]:
        return {"a": 10, "b": 10, "cold": 2 if second <= 2 else 10, "slow": 3}

    # with the warm-up, slow's first three commits (9 batches) are not measured and windows
    # 3 and 4 judge it; without, windows 0 to 4 do
    for warm_up, cold_start, streak in ((8, WorkerState.OK, 2), (0, WorkerState.PERSISTENT, 5)):
        clock = Clock()
        monitor = Monitor(clock, batch_rows=10, settings=MonitorSettings(
            window_s=1.0, persistent_windows=2, hang_floor_s=100.0, warm_up_batches=warm_up))
        monitor.update(holders)
        feed(monitor, clock, range(1, 3), batches, holders)  # cold's BPT 0.5 s, the others' 0.1
        cold = monitor.health("cold")
        assert cold is not None and cold.state is cold_start, warm_up
        feed(monitor, clock, range(3, 6), batches, holders)
        cold, slow = monitor.health("cold"), monitor.health("slow")
        assert cold is not None and cold.state is WorkerState.OK and cold.window == 4, warm_up
        assert slow is not None and slow.state is WorkerState.PERSISTENT and slow.window == 4
        assert slow.streak == streak and [h.worker for h in monitor.flagged()] == ["slow"]
        assert monitor.median_bpt == pytest.approx(0.1)


def test_no_worker_is_measured_while_a_peer_warms_up() -> None:
    """A worker that joins takes its peers' CPU on a shared machine until its warm-up ends: a
    peer slowed down (2x) meanwhile is not a straggler."""
    holders = ["a", "b", "c", "joiner"]

    def batches(second: int) -> dict[str, int]:  # joiner leases at 2, trains from 5
        return {"a": 10, "b": 10, "c": 5 if 3 <= second <= 4 else 10,
                "joiner": 10 if second >= 5 else 0}

    for warm_up, contended in ((8, WorkerState.OK), (0, WorkerState.PERSISTENT)):
        clock = Clock()
        monitor = Monitor(clock, batch_rows=10, settings=MonitorSettings(
            window_s=1.0, persistent_windows=2, hang_floor_s=100.0, warm_up_batches=warm_up))
        monitor.update(holders[:3])
        feed(monitor, clock, range(1, 2), batches, holders[:3])
        feed(monitor, clock, range(2, 5), batches, holders)
        c = monitor.health("c")
        assert c is not None and c.state is contended, warm_up
        feed(monitor, clock, range(5, 8), batches, holders)
        c = monitor.health("c")
        assert c is not None and c.state is WorkerState.OK and c.window == 6
        assert monitor.flagged() == []


def test_a_worker_stuck_in_its_warm_up_is_hung_and_then_its_peers_are_judged() -> None:
    """Stuck after two batches, a worker is not judged by its silence (its warm-up) and holds
    its peers' measurements back only until it is hung."""
    holders = ["a", "b", "slow", "stuck"]

    def batches(second: int) -> dict[str, int]:
        return {"a": 10, "b": 10, "slow": 3, "stuck": 2 if second == 1 else 0}

    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=MonitorSettings(
        window_s=1.0, persistent_windows=2, hang_factor=2.0, hang_floor_s=3.5, warm_up_batches=8))
    monitor.update(holders)
    feed(monitor, clock, range(1, 5), batches, holders)
    stuck, slow = monitor.health("stuck"), monitor.health("slow")
    assert stuck is not None and stuck.state is WorkerState.OK and stuck.window is None
    assert slow is not None and slow.window is None and monitor.flagged() == []
    feed(monitor, clock, range(5, 8), batches, holders)  # hung at 5: silent 4 s > 3.5 s
    stuck, slow = monitor.health("stuck"), monitor.health("slow")
    assert stuck is not None and stuck.state is WorkerState.HUNG and stuck.window is None
    assert slow is not None and slow.state is WorkerState.PERSISTENT and slow.window == 6
    assert slow.bpt == pytest.approx(1 / 3) and slow.median == pytest.approx(0.1)
    assert [h.worker for h in monitor.flagged()] == ["stuck", "slow"]


def test_forget_drops_the_worker() -> None:
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    run(monitor, clock, 30, {"a": 10, "b": 10, "slow": 2})
    assert [h.worker for h in monitor.flagged()] == ["slow"]
    monitor.forget("slow")
    assert monitor.health("slow") is None and monitor.flagged() == []
    assert set(monitor.summary()["workers"]) == {"a", "b"}


def test_settings_come_from_dask_config() -> None:
    with dask.config.set({"antdt.monitor.slow-factor": 5.0, "antdt.monitor.window": "4s",
                          "antdt.monitor.persistent-windows": 1,
                          "antdt.monitor.warm-up-batches": 0}):
        settings = MonitorSettings.from_config()
    assert (settings.slow_factor, settings.window_s, settings.persistent_windows,
            settings.warm_up_batches) == (5.0, 4.0, 1, 0)
    assert MonitorSettings.from_config().warm_up_batches == MonitorSettings().warm_up_batches
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=settings)
    run(monitor, clock, 8, {"a": 10, "b": 10, "slow": 3})  # 3.3x slower: not slow at 5x
    assert monitor.windows == 2 and monitor.flagged() == []
    with dask.config.set({"antdt.monitor.slow-factor": "fast"}):
        with pytest.raises(ConfigError, match="antdt.monitor.slow-factor.*'fast'"):
            MonitorSettings.from_config()
    with pytest.raises(ConfigError, match="slow_factor > 1"):
        MonitorSettings(slow_factor=0.5)
    with dask.config.set({"antdt.monitor.warm-up-batches": 2.5}):
        with pytest.raises(ConfigError, match="antdt.monitor.warm-up-batches.*2.5"):
            MonitorSettings.from_config()


def test_impossible_stats_do_not_keep_a_worker_in_warm_up_or_hide_it() -> None:
    """A commit whose ``batches`` is negative (or not a number) counts the batches its rows
    make, so a worker reporting them still leaves its warm-up and is judged: here a slow
    worker, reporting ``batches: -1000`` with every commit, is a persistent straggler."""
    holders = ["a", "b", "liar"]
    clock = Clock()
    monitor = Monitor(clock, batch_rows=10, settings=MonitorSettings(
        window_s=1.0, persistent_windows=2, hang_floor_s=100.0, warm_up_batches=8))
    monitor.update(holders)
    for second in range(1, 8):
        clock.now = float(second)
        for worker in ("a", "b"):
            monitor.observe(CommitEvent(worker, 0, 0, 100, {"busy_s": 1.0, "batches": 10},
                                        clock.now))
        monitor.observe(CommitEvent("liar", 0, 0, 30, {"busy_s": 1.0, "batches": -1000},
                                    clock.now))
        monitor.observe(CommitEvent("liar", 0, 0, 0, {"busy_s": float("nan")}, clock.now))
        monitor.update(holders)
    liar = monitor.health("liar")
    assert liar is not None and liar.state is WorkerState.PERSISTENT
    assert liar.bpt == pytest.approx(1 / 3) and [h.worker for h in monitor.flagged()] == ["liar"]
