"""The Controller and its policies on a real ShardLedger with a virtual clock (no Dask)."""

from __future__ import annotations

import logging
import textwrap
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import dask.config
import pytest

from antdt.controller import (ActionRecord, AdjustBatch, BalanceBatch, Controller,
                              ControllerPolicy, Evidence, PaceStragglers, Reassign,
                              ReassignStragglers, Retire, RetireHung, RetirePersistent, Revoke,
                              RevokeHung, Split, SplitTail, Tick, load_policies)
from antdt.errors import ConfigError
from antdt.monitor import BATCHES, BUSY, CPU, Monitor, MonitorSettings
from antdt.sharding import (Claim, CommitEvent, JobState, Lease, Revoked, ShardLedger,
                            shares)

SETTINGS = MonitorSettings(window_s=10.0, history=3, slow_factor=1.5, persistent_windows=3,
                           hang_factor=4.0, hang_floor_s=5.0, warm_up_batches=0)
"""Workers judged from their first window."""


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rig:
    """A ledger, its monitor and a controller; workers train ``speed`` rows a second and commit
    once a second (claiming two seconds ahead); the controller ticks every second."""

    def __init__(self, workers: str, policies: list[ControllerPolicy], *, rows: int = 1000,
                 shard_rows: int = 100, batch_rows: int = 10, min_workers: int = 1,
                 guided_end: bool = True) -> None:
        self.clock = Clock()
        self.ledger = ShardLedger([("f.parquet", 0, rows)], shard_rows=shard_rows,
                                  batch_rows=batch_rows, clock=self.clock, guided_end=guided_end)
        self.monitor = Monitor(self.clock, batch_rows=batch_rows, settings=SETTINGS)
        self.ledger.subscribe(self.monitor.observe)
        self.workers = set(workers)
        self.retired: list[tuple[str, str]] = []
        self.emitted: list[ActionRecord] = []
        self.controller = Controller(self.ledger, self.monitor, clock=self.clock,
                                     retire=self._retire, workers=lambda: set(self.workers),
                                     policies=policies, min_workers=min_workers,
                                     emit=self.emitted.append, max_records=100)
        self.held: dict[str, list] = {}
        self.leases: list[Lease] = []
        self.applied: list[ActionRecord] = []
        self.trained: Counter[int] = Counter()
        self.cpu: dict[str, float] = {}
        """Per worker, the CPU seconds of each of its seconds of training (1: all)."""

    def _retire(self, worker: str, stimulus_id: str) -> None:
        self.retired.append((worker, stimulus_id))
        self.workers.discard(worker)
        self.held.pop(worker, None)
        self.ledger.remove_worker(worker)

    def run(self, seconds: int, speeds: dict[str, int]) -> None:
        for _ in range(seconds):
            if self.ledger.state is not JobState.RUNNING:
                return
            self.clock.now += 1.0
            for worker, speed in speeds.items():
                if worker in self.workers:
                    self._work(worker, speed)
            self.applied.extend(self.controller.tick())

    def _work(self, worker: str, speed: int) -> None:
        held = self.held.get(worker)
        if held is None:
            reply = self.ledger.lease(worker, claim_rows=2 * speed or None)
            if not isinstance(reply, Lease):
                return
            self.leases.append(reply)
            held = self.held[worker] = [reply, reply.start, reply.claim_stop]
        lease, offset, claim = held
        if speed == 0:
            return
        end = min(claim, offset + speed)
        self.trained.update(range(offset, end))
        stats = {CPU: self.cpu[worker]} if worker in self.cpu else None
        answer = self.ledger.commit(lease.lease_id, lease.token, end, end, stats=stats,
                                    claim_rows=2 * speed)
        if isinstance(answer, Claim) or (isinstance(answer, Revoked) and end < answer.stop):
            held[1], held[2] = end, answer.stop
        else:
            del self.held[worker]


def test_hung_lease_is_revoked_then_its_worker_retired() -> None:
    rig = Rig("abc", [RevokeHung(), RetireHung(after_s=8.0)])
    rig.run(3, {"a": 10, "b": 10, "c": 10})
    hung = rig.held["c"][0]  # c trained 30 rows of its shard and claims 20 more
    rig.run(7, {"a": 10, "b": 10, "c": 0})  # c silent 6 s > timeout max(5, 4 x 1 s) at t=9
    (revoke,) = rig.applied
    assert revoke["action"] == "revoke" and revoke["policy"] == "RevokeHung"
    assert revoke["worker"] == "c" and revoke["lease_id"] == hung.lease_id
    assert revoke["time"] == 9.0 and revoke["silent_s"] == pytest.approx(6.0)
    assert "timeout 5.0s" in revoke["reason"]
    status = rig.ledger.lease_status(hung.lease_id)
    assert status is not None and status.revoked and status.stop == status.claim_stop == hung.start + 50
    assert revoke["rows"] == 50
    rig.run(1, {"a": 10, "b": 10, "c": 0})  # a or b pulls the revoked rows from the front
    assert any((lease.start, lease.stop) == (hung.start + 50, hung.stop) and lease.worker != "c"
               for lease in rig.leases), rig.leases
    rig.run(100, {"a": 10, "b": 10, "c": 0})
    assert [w for w, _ in rig.retired] == ["c"]
    assert rig.controller.counts == {"revoke": 1, "retire": 1}
    assert rig.ledger.state is JobState.FINISHED
    assert rig.ledger.rows_done == 1000 and rig.ledger.rows_retrained == 0
    assert sorted(rig.trained) == list(range(1000)) and set(rig.trained.values()) == {1}
    assert rig.emitted == list(rig.controller.records)


def test_a_hung_worker_is_retired_before_the_tail_when_the_end_nears() -> None:
    """With short shards the others would run out of rows while the hung worker still holds
    its claim: it is retired once they have about ``lead_s`` seconds of other rows left."""
    rig = Rig("abc", [RevokeHung(), RetireHung(after_s=1000.0, lead_s=2.0)], shard_rows=20)
    rig.run(3, {"a": 10, "b": 10, "c": 10})
    rig.run(100, {"a": 10, "b": 10, "c": 0})
    (retire,) = [record for record in rig.applied if record["action"] == "retire"]
    assert retire["worker"] == "c" and "hung near the end" in retire["reason"]  # not the tail
    assert rig.ledger.state is JobState.FINISHED and rig.ledger.rows_done == 1000
    assert sorted(rig.trained) == list(range(1000))


def test_straggler_rows_are_reassigned_with_evidence() -> None:
    rig = Rig("abcd", [ReassignStragglers()], rows=10_000)
    rig.run(10, {"a": 20, "b": 20, "c": 20, "d": 5})
    (record,) = rig.applied
    assert record["action"] == "reassign" and record["worker"] == "d"
    # 9 s of training per window: a worker's first commit has no earlier one to time it from
    assert record["bpt"] == pytest.approx(1.8) and record["median"] == pytest.approx(0.45)
    assert record["window"] == 0 and "transient straggler" in record["reason"]
    status = rig.ledger.lease_status(record["lease_id"])
    assert status is not None and status.revoked
    rig.run(1, {"a": 20, "b": 20, "c": 20, "d": 5})
    assert len(rig.applied) == 1  # d's lease is revoked already: nothing more to move


def test_a_straggler_that_waits_off_the_cpu_is_said_to_wait() -> None:
    """d is as slow, but its training thread is on the CPU a tenth of its time (its rows come
    over a slow link): the reason says so; a straggler that computes slowly gets no such word."""
    rig = Rig("abcd", [ReassignStragglers()], rows=10_000)
    rig.cpu = {"a": 0.9, "b": 0.9, "c": 0.9, "d": 0.1}
    rig.run(10, {"a": 20, "b": 20, "c": 20, "d": 5})
    (record,) = rig.applied
    assert record["worker"] == "d" and "90% of its batch time off the CPU" in record["reason"]
    assert rig.monitor.health("d").waiting == pytest.approx(0.9)
    computing = Rig("abcd", [ReassignStragglers()], rows=10_000)
    computing.cpu = {"a": 0.9, "b": 0.9, "c": 0.9, "d": 0.9}
    computing.run(10, {"a": 20, "b": 20, "c": 20, "d": 5})
    assert "off the CPU" not in computing.applied[0]["reason"]


def test_tail_is_split_so_the_job_ends_sooner() -> None:
    """A 10x straggler's whole shard holds the job's end; the SplitTail policy cuts it, and so
    does the ledger's guided end on its own (it never deals the straggler a whole shard)."""
    def makespan(policies: list[ControllerPolicy], guided_end: bool) -> tuple[float, Rig]:
        rig = Rig("abcd", policies, rows=400, guided_end=guided_end)
        rig.run(200, {"a": 20, "b": 20, "c": 20, "d": 2})
        assert rig.ledger.state is JobState.FINISHED and rig.ledger.rows_done == 400
        assert set(rig.trained.values()) == {1} and len(rig.trained) == 400
        return rig.clock.now, rig

    plain, _ = makespan([], guided_end=False)
    guided, _ = makespan([], guided_end=True)
    split, rig = makespan([SplitTail()], guided_end=False)
    assert plain == 50.0
    assert split <= 15.0 and guided <= 15.0
    first = rig.applied[0]
    assert first["action"] == "split" and first["worker"] == "d" and first["parts"] == 8
    assert first["time"] == 10.0  # the first window gave the rates
    assert "target 2.0s" in first["reason"]


def test_a_paced_straggler_does_not_hold_the_end_of_the_job() -> None:
    """Without a pace the 4x straggler leases again until the end and trains the job's last
    rows; paced, its leases shrink as the rows run out (by halves, each applied once), it gets
    none at the end and finishes before the others."""
    def last_lease_ends(policies: list[ControllerPolicy]) -> tuple[dict[str, float], Rig]:
        rig = Rig("abcd", policies, rows=4000)
        ends: dict[str, float] = {}
        leases_when_stopped = None  # d's leases when its pace fell to 0
        while rig.ledger.state is JobState.RUNNING:
            rig.run(1, {"a": 20, "b": 20, "c": 20, "d": 5})
            ends.update((worker, rig.clock.now) for worker in rig.held)
            if leases_when_stopped is None and rig.ledger.paces.get("d") == 0:
                leases_when_stopped = [lease for lease in rig.leases if lease.worker == "d"]
        assert rig.ledger.rows_done == 4000 and set(rig.trained.values()) == {1}
        if leases_when_stopped is not None:
            assert [lease for lease in rig.leases if lease.worker == "d"] == leases_when_stopped
        return ends, rig

    plain, _ = last_lease_ends([ReassignStragglers(), SplitTail()])
    assert plain["d"] >= max(plain[w] for w in "abc")
    paced, rig = last_lease_ends([ReassignStragglers(), PaceStragglers(), SplitTail()])
    assert paced["d"] < min(paced[w] for w in "abc")
    paces = [(r["worker"], r["size"]) for r in rig.applied if r["action"] == "pace"]
    assert paces == [("d", 80), ("d", 40), ("d", 20), ("d", 10), ("d", 0)]
    first = next(r for r in rig.applied if r["action"] == "pace")
    assert first["policy"] == "PaceStragglers" and "at most 80 rows" in first["reason"]
    assert rig.ledger.paces == {"d": 0}


def test_a_pace_is_lifted_when_the_worker_recovers() -> None:
    rig = Rig("abcd", [ReassignStragglers(), PaceStragglers(fraction=0.01)], rows=100_000)
    rig.run(10, {"a": 20, "b": 20, "c": 20, "d": 5})
    assert rig.ledger.paces == {"d": 40}  # 1% of the job's 1,500 s at 5 rows/s: 7 batches
    rig.run(20, {"a": 20, "b": 20, "c": 20, "d": 20})
    lifted = rig.applied[-1]
    assert lifted["action"] == "pace" and lifted["size"] is None
    assert lifted["reason"] == "pace lifted: the worker is ok" and rig.ledger.paces == {}


def test_persistent_stragglers_retire_slowest_first_never_below_min_workers(
        caplog: pytest.LogCaptureFixture) -> None:
    rig = Rig("abcd", [RetirePersistent(max_fraction=1.0)], rows=100_000, min_workers=3)
    with caplog.at_level(logging.INFO, logger="antdt.controller"):
        rig.run(40, {"a": 40, "b": 40, "c": 10, "d": 8})
    assert [w for w, _ in rig.retired] == ["d"]
    (record,) = rig.applied
    assert record["time"] == 30.0 and "slow for 3 windows" in record["reason"]
    assert "not retiring c" in caplog.text and "min_workers 3" in caplog.text


class Propose(ControllerPolicy):
    """Test policy: yields what ``make(tick)`` returns."""

    def __init__(self, make: Callable[[Tick], list]) -> None:
        self.make = make

    def run(self, tick: Tick) -> Iterator:
        yield from self.make(tick)


def test_conflicts_are_resolved_before_anything_is_applied() -> None:
    clock = Clock()
    ledger = ShardLedger([("f.parquet", 0, 300)], shard_rows=100, batch_rows=10, clock=clock,
                         guided_end=False)  # whole shards: b's lease has 100 rows to split
    held = {w: ledger.lease(w) for w in "abc"}
    status = {w: ledger.lease_status(lease.lease_id) for w, lease in held.items()}
    why = Evidence("test")
    retired: list[str] = []
    first = Propose(lambda t: [Split(status["a"], 2, why), Reassign(status["a"], why)])
    second = Propose(lambda t: [
        Revoke(status["a"], why), Split(status["b"], 3, why), Retire("c", why),
        Revoke(status["c"], why), Retire("c", why), AdjustBatch("a", 32, why),
        AdjustBatch("a", 64, why), AdjustBatch("c", 8, why)])
    monitor = Monitor(clock, batch_rows=10, settings=SETTINGS)
    controller = Controller(ledger, monitor, clock=clock, retire=lambda w, s: retired.append(w),
                            workers=lambda: {"a", "b", "c"}, policies=[first, second],
                            min_workers=1)
    applied = controller.tick()
    assert [(r["action"], r["worker"], r["policy"]) for r in applied] == [
        ("retire", "c", "Propose"), ("revoke", "a", "Propose"), ("split", "b", "Propose"),
        ("adjust_batch", "a", "Propose")]
    assert retired == ["c"]
    assert ledger.lease_status(held["a"].lease_id).revoked
    assert not ledger.lease_status(held["c"].lease_id).revoked
    assert applied[1]["rows"] == 90 and applied[2]["rows"] == 66 and applied[2]["parts"] == 3
    assert controller.batch_sizes == {"a": 32}
    assert len({r["stimulus_id"] for r in applied}) == 1
    assert applied[0]["stimulus_id"].startswith("antdt-controller-job-1-")
    assert controller.actions(since=2) == {
        "count": 4, "counts": {"retire": 1, "revoke": 1, "split": 1, "adjust_batch": 1},
        "batch_sizes": {"a": 32}, "records": applied[2:]}
    again = controller.tick()  # a's lease is revoked already: no lease action for it again
    assert ("split", "b") in [(r["action"], r["worker"]) for r in again]
    assert not [r for r in again if r["worker"] == "a" and r["lease_id"] is not None]


def test_retirement_budget_and_no_op_actions() -> None:
    clock = Clock()
    ledger = ShardLedger([("f.parquet", 0, 300)], shard_rows=100, batch_rows=10, clock=clock)
    lease = ledger.lease("a", claim_rows=100)  # claims its whole shard
    ledger.lease("b")
    why = Evidence("test")
    retired: list[str] = []
    policy = Propose(lambda t: [Retire("b", why), Retire("a", why), Retire("gone", why),
                                Split(ledger.lease_status(lease.lease_id), 4, why)])
    controller = Controller(ledger, Monitor(clock, batch_rows=10, settings=SETTINGS),
                            clock=clock, retire=lambda w, s: retired.append(w),
                            workers=lambda: ["a", "b"], policies=[policy], min_workers=1)
    applied = controller.tick()
    assert retired == ["b"]  # one retirement leaves min_workers; "gone" is not a worker
    assert [r["action"] for r in applied] == ["retire"]  # a's split had nothing unclaimed
    assert controller.count == 1


def test_user_policy_is_loaded_by_dotted_path_from_dask_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_policies.py").write_text(textwrap.dedent("""
        from antdt.controller import ControllerPolicy, Evidence, Revoke

        class RevokeEverything(ControllerPolicy):
            def __init__(self, worker):
                self.worker = worker

            def run(self, tick):
                for lease in tick.leases(self.worker):
                    yield Revoke(lease, Evidence("told to"))
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    clock = Clock()
    ledger = ShardLedger([("f.parquet", 0, 200)], shard_rows=100, batch_rows=10, clock=clock)
    lease = ledger.lease("w1")
    ledger.lease("w2")
    spec = [{"class": "my_policies.RevokeEverything", "worker": "w1"}]
    with dask.config.set({"antdt.controller.policies": spec}):
        controller = Controller(ledger, Monitor(clock, batch_rows=10, settings=SETTINGS),
                                clock=clock, retire=lambda w, s: None, workers=lambda: ["w1"])
    assert [type(p).__name__ for p in controller.policies] == ["RevokeEverything"]
    (record,) = controller.tick()
    assert (record["action"], record["worker"], record["policy"], record["reason"]) == (
        "revoke", "w1", "RevokeEverything", "told to")
    assert ledger.lease_status(lease.lease_id).revoked


def test_default_policies_and_config_errors() -> None:
    policies = load_policies()
    assert [repr(p) for p in policies] == ["RevokeHung()", "RetireHung()",
                                           "ReassignStragglers()", "PaceStragglers()", "SplitTail()"]
    assert policies[1].after_s == 30  # RetirePersistent is opt-in (see antdt.yaml)
    (retire,) = load_policies([{"class": "antdt.controller.RetirePersistent",
                                "max_fraction": 0.1}])
    assert isinstance(retire, RetirePersistent) and retire.max_fraction == 0.1
    with pytest.raises(ConfigError, match="cannot import 'antdt.controller.Nope'"):
        load_policies([{"class": "antdt.controller.Nope"}])
    with pytest.raises(ConfigError, match="is not a ControllerPolicy subclass"):
        load_policies([{"class": "antdt.monitor.Monitor"}])
    with pytest.raises(ConfigError, match="SplitTail.*unexpected keyword"):
        load_policies([{"class": "antdt.controller.SplitTail", "parts": 3}])
    with pytest.raises(ConfigError, match=r"policies\[0\] must be a mapping"):
        load_policies(["antdt.controller.SplitTail"])


def test_batch_sizes_reach_equal_step_times_when_a_step_has_a_fixed_part() -> None:
    """Each worker's step has a part that its local batch does not change (its share of the
    global batch's lookups), c's steps are 4x slower. Sizes in proportion to the rates get
    there by a fraction per window (c's share 78, then 57: its steps still 19% longer); the
    fitted step times balance them at the second window (within the policy's tolerance)."""
    clock = Clock()
    monitor = Monitor(clock, batch_rows=200, settings=MonitorSettings(
        window_s=1.0, history=1, warm_up_batches=0, hang_floor_s=100.0))
    ledger = ShardLedger([("f.parquet", 0, 1000)], shard_rows=100, batch_rows=200, clock=clock)
    policy = BalanceBatch(global_batch=600)
    steps = {"a": (0.01, 1e-4), "b": (0.01, 1e-4), "c": (0.02, 4e-4)}
    sizes = dict.fromkeys(steps, 200)
    for window in range(2):
        for _ in range(5):
            for worker, (fixed, per_row) in steps.items():
                monitor.observe(CommitEvent(worker, 0, 0, sizes[worker], {
                    BUSY: fixed + per_row * sizes[worker], BATCHES: 1.0}, clock.now))
            clock.now += 0.1
        clock.now = window + 1.0
        monitor.update(steps)
        for action in policy.run(Tick(window, clock.now, ledger, monitor, list(steps),
                                      dict(sizes))):
            assert isinstance(action, AdjustBatch)
            sizes[action.worker] = action.size
    local = dict(zip(steps, shares(list(sizes.values()), 600)))  # as rank 0 sends them
    assert local["c"] < 50 < 250 < local["a"]
    times = [fixed + per_row * local[worker] for worker, (fixed, per_row) in steps.items()]
    assert max(times) / min(times) < 1.06, (local, times)


def test_batch_sizes_follow_the_rates() -> None:
    rig = Rig("abc", [BalanceBatch(global_batch=50)], rows=10_000)
    rig.run(10, {"a": 20, "b": 20, "c": 10})
    assert sorted((r["worker"], r["size"]) for r in rig.applied) == [
        ("a", 20), ("b", 20), ("c", 10)]
    rig.run(10, {"a": 20, "b": 20, "c": 10})
    assert len(rig.applied) == 3  # within tolerance: no change
    assert rig.controller.batch_sizes == {"a": 20, "b": 20, "c": 10}


def test_a_rank_whose_core_becomes_shared_is_priced_slower_per_row_too() -> None:
    """a's step is half b's until a busy process comes to a's core: then a is as slow as b,
    its rows as much as its fixed part, and equal sizes balance the steps. Its fitted line
    scaled to its new step time gets there in one adjustment; moving the line's level alone
    (its slope kept) priced a's rows at their old cost and gave it 245 rows of 600."""
    clock = Clock()
    monitor = Monitor(clock, batch_rows=300, settings=MonitorSettings(
        window_s=1.0, history=1, warm_up_batches=0, hang_floor_s=100.0))
    ledger = ShardLedger([("f.parquet", 0, 1000)], shard_rows=100, batch_rows=300, clock=clock)
    policy = BalanceBatch(global_batch=600)
    slow = (0.04, 2e-4)
    steps = {"a": (0.02, 1e-4), "b": slow}
    sizes = dict.fromkeys(steps, 300)

    def window() -> None:
        start = clock.now
        for step in range(5):
            clock.now = start + 0.1 * step
            for worker, (fixed, per_row) in steps.items():
                monitor.observe(CommitEvent(worker, 0, 0, sizes[worker], {
                    BUSY: fixed + per_row * sizes[worker], BATCHES: 1.0}, clock.now))
        clock.now = start + 1.0
        monitor.update(steps)
        for action in policy.run(Tick(0, clock.now, ledger, monitor, list(steps),
                                      dict(sizes))):
            assert isinstance(action, AdjustBatch)
            sizes[action.worker] = action.size

    for _ in range(6):  # settled, and its last samples all at the settled sizes
        window()
    assert sizes == {"a": 466, "b": 134}  # 0.02 + 1e-4 x 467 = 0.04 + 2e-4 x 133
    steps["a"] = slow
    window()
    assert 285 <= sizes["a"] <= 315, sizes
