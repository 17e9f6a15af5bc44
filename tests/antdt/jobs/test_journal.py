"""A job's journal (:class:`Journal`): agents' events and controller actions in, the job's log,
record, report and metrics out; a virtual clock, no cluster."""

from __future__ import annotations

import math
from typing import Any

from antdt.agent import AgentReport
from antdt.jobs.journal import LAST_ACTIONS, SERIES, Journal
from antdt.jobs.placement import Slot

LEDGER = {"rows_expected": 100, "rows_done": 40, "rows_trained": 50, "rows_todo": 50,
          "rows_leased": 10, "rows_lost": 0, "rows_retrained": 5, "rows_quarantined": 0,
          "epoch": 0, "epochs": 1, "rows_done_by_epoch": [40], "leases_granted": 6,
          "leases_revoked": 1, "leases_split": 2}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, log_length: int = 100) -> None:
        self.clock = Clock()
        self.changes = 0
        self.journal = Journal("job-1", self.clock, self._changed, log_length=log_length)
        self.slots = [Slot("tcp://a", 0, join=False, started=0.0),
                      Slot("tcp://b", 1, join=False, started=0.0)]
        self.journal.read_ledger(LEDGER)

    def _changed(self) -> None:
        self.changes += 1


def action(seq: int, kind: str, worker: str = "tcp://b", lease_id: int | None = 7,
           at: float = 1003.0) -> dict[str, Any]:
    return {"seq": seq, "time": at, "action": kind, "worker": worker, "lease_id": lease_id,
            "rows": 20, "reason": f"why {seq}"}


class Controller:
    """What the journal reads of a controller: its records with ``seq >= since`` and the local
    batches it set."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.since: list[int] = []
        self.batch_sizes: dict[str, int] = {}

    def actions(self, since: int) -> dict[str, Any]:
        self.since.append(since)
        new = [r for r in self.records if r["seq"] >= since]
        return {"records": new, "counts": {"split": sum(r["action"] == "split"
                                                         for r in self.records)},
                "batch_sizes": dict(self.batch_sizes)}


def test_the_log_numbers_its_records_keeps_the_newest_and_says_it_changed() -> None:
    rig = Rig(log_length=3)
    for i in range(5):
        rig.clock.now += 1
        rig.journal.log("info", f"m{i}")
    assert rig.changes == 5
    assert [r["seq"] for r in rig.journal.logs] == [3, 4, 5]
    assert rig.journal.log_records(4) == [
        {"seq": 4, "time": 1004.0, "level": "info", "source": "job", "message": "m3"},
        {"seq": 5, "time": 1005.0, "level": "info", "source": "job", "message": "m4"}]


def test_the_ledgers_counters_are_read_without_their_prefix() -> None:
    rows = Rig().journal.rows
    assert rows["expected"] == 100 and rows["done"] == 40 and rows["quarantined"] == 0
    assert rows["done_by_epoch"] == [40] and rows["epochs"] == 1
    assert Rig().journal.leases == {"granted": 6, "revoked": 1, "split": 2}


def test_controller_actions_are_read_once_logged_and_counted() -> None:
    rig = Rig()
    controller = Controller()
    controller.records = [action(0, "split"), action(1, "retire", lease_id=None)]
    health = {"tcp://a": {"state": "ok"}, "tcp://b": {"state": "hung"},
              "tcp://c": {"state": "persistent"}}
    assert rig.journal.read_controller(controller.actions, health) == {"split": 1}
    controller.records.append(action(2, "split"))
    assert rig.journal.read_controller(controller.actions, {}) == {"split": 2}
    assert controller.since == [0, 2] and len(rig.journal.actions) == 3
    assert [r["message"] for r in rig.journal.logs] == [
        "controller: split tcp://b lease 7 (why 0)", "controller: retire tcp://b (why 1)",
        "controller: split tcp://b lease 7 (why 2)"]
    assert rig.journal.read_controller(controller.actions, health) == {"split": 2}
    assert rig.journal.health == {"tcp://a": "normal", "tcp://b": "hung",
                                  "tcp://c": "straggler"}
    assert rig.journal.verdicts == health and rig.journal.action_counts == {"split": 2}


def test_progress_events_update_the_agents_and_make_the_ticks_metrics() -> None:
    rig = Rig()
    rig.journal.received({"kind": "progress", "worker": "tcp://a", "samples_per_s": 30.0,
                          "loss": 0.5, "rows": 12, "busy_s": 2.0, "cpu_s": 1.5})
    rig.journal.received({"kind": "progress", "worker": "tcp://b", "samples_per_s": 10.0,
                          "loss": 0.7, "rows": 4, "busy_s": 1.0, "cpu_s": 0.5})
    rig.journal.received({"kind": "progress", "worker": "tcp://a", "samples_per_s": 50.0,
                          "loss": None, "rows": 20, "busy_s": 3.0, "cpu_s": 2.5,
                          "exchanges": 3, "exchanged_bytes": 4096})
    metrics = rig.journal.read_events(rig.slots, {"split": 2})
    a, b = rig.slots
    assert (a.rows, a.busy_s, a.cpu_s, a.rate) == (20, 3.0, 2.5, 50.0)
    assert (a.exchanges, a.exchanged_bytes) == (3, 4096)
    assert (b.rows, b.rate, b.exchanges, b.exchanged_bytes) == (4, 10.0, 0, None)
    assert metrics == {
        f"{SERIES}rows_done": 40, f"{SERIES}rows_trained": 50, f"{SERIES}rows_retrained": 5,
        f"{SERIES}samples_per_s": 60.0, f"{SERIES}workers": 2,
        f"{SERIES}samples_per_s.worker0": 50.0, f"{SERIES}samples_per_s.worker1": 10.0,
        f"{SERIES}loss": 0.6, "controller.actions": 0, "controller.split": 2}
    assert rig.journal.read_events(rig.slots, {}) == {  # no events: no rates, no loss
        f"{SERIES}rows_done": 40, f"{SERIES}rows_trained": 50, f"{SERIES}rows_retrained": 5,
        f"{SERIES}samples_per_s": 60.0, f"{SERIES}workers": 2, "controller.actions": 0}


def test_a_returned_agents_own_counts_are_kept_and_it_is_no_longer_live() -> None:
    rig = Rig()
    a = rig.slots[0]
    a.report = AgentReport(worker="tcp://a", outcome="finished", rows=99, batches=9, leases=2,
                           seconds=5.0, busy_s=4.0, loss=math.nan, exchanges=3, device="cpu")
    a.rows = 99
    rig.journal.received({"kind": "progress", "worker": "tcp://a", "samples_per_s": 1.0,
                          "rows": 12, "busy_s": 2.0, "cpu_s": 1.5})
    metrics = rig.journal.read_events(rig.slots, {})
    assert a.rows == 99 and metrics[f"{SERIES}workers"] == 1
    assert metrics[f"{SERIES}samples_per_s"] == 0.0


def test_faults_and_logs_of_agents_go_to_the_log_under_their_worker() -> None:
    rig = Rig()
    rig.journal.received({"kind": "fault", "worker": "tcp://a", "fault": "hang", "rows": 40})
    rig.clock.now = 1002.0
    rig.journal.received({"kind": "log", "worker": "tcp://b", "level": "error",
                          "message": "bad row group"})
    rig.journal.received({"kind": "unknown", "worker": "tcp://b"})
    rig.clock.now = 1005.0
    rig.journal.read_events(rig.slots, {})
    assert [(r["time"], r["level"], r["source"], r["message"]) for r in rig.journal.logs] == [
        (1000.0, "warning", "tcp://a", "injected hang after 40 rows"),
        (1002.0, "error", "tcp://b", "bad row group"),
        (1005.0, "warning", "job", "dropped an agent's event (unknown kind 'unknown'): "
                                   "{'kind': 'unknown', 'worker': 'tcp://b'}")]
    assert rig.journal.events_dropped == 1


def lease(phase: str, worker: str, lease_id: int, at: float, **end: Any) -> dict[str, Any]:
    return {"kind": "lease", "phase": phase, "worker": worker, "lease_id": lease_id,
            "time": at, **end}


def test_lease_events_make_the_timeline_and_a_dead_workers_leases_end_lost() -> None:
    rig = Rig()
    rig.journal.began(1000.0)
    for msg in [lease("start", "tcp://a", 1, 1001.0), lease("start", "tcp://b", 2, 1002.0),
                lease("end", "tcp://a", 1, 1004.0, start=1001.0, rows=30, outcome="finished"),
                lease("start", "tcp://a", 3, 1004.0),
                lease("end", "tcp://a", 3, 1006.0, start=1004.0, rows=0, outcome="revoked"),
                lease("end", "tcp://a", 9, 1007.0, start=1000.0, rows=5, outcome="finished"),
                lease("start", "tcp://b", 4, 1008.0)]:
        rig.journal.received(msg)
    rig.journal.read_events(rig.slots, {})
    rig.clock.now = 1010.0
    rig.journal.lost("tcp://b")
    controller = Controller()
    controller.records = [action(0, "split", worker="tcp://a", lease_id=1, at=1003.0)]
    rig.journal.read_controller(controller.actions, {})
    b = rig.slots[1]
    b.dead, b.ended = True, 10.0
    rig.slots[0].ended = 7.0
    report = rig.journal.report(rig.slots)
    assert report["spans"] == [
        {"worker": "worker0", "lease_id": 1, "start": 1.0, "end": 4.0, "rows": 30,
         "outcome": "split"},
        {"worker": "worker0", "lease_id": 3, "start": 4.0, "end": 6.0, "rows": 0,
         "outcome": "revoked"},
        {"worker": "worker1", "lease_id": 2, "start": 2.0, "end": 10.0, "rows": 0,
         "outcome": "lost"},
        {"worker": "worker1", "lease_id": 4, "start": 8.0, "end": 10.0, "rows": 0,
         "outcome": "lost"}]
    assert report["marks"] == [{"time": 3.0, "worker": "worker0", "action": "split",
                                "rows": 20, "reason": "why 0"}]
    assert report["first_lease"] == {"tcp://a": 1.0, "tcp://b": 2.0}
    assert report["train_s"] == 10.0 and report["rows"]["done"] == 40
    assert [a["outcome"] for a in report["agents"]] == ["running", "dead"]
    assert rig.journal.record(rig.slots)["last_row"] == 4.0  # the last lease that trained


def test_train_s_is_the_elapsed_time_while_no_agent_ended() -> None:
    rig = Rig()
    assert rig.journal.elapsed() == 0.0  # training has not started
    rig.journal.began(1000.0)
    rig.clock.now = 1012.5
    assert rig.journal.report(rig.slots)["train_s"] == 12.5


def test_the_record_shows_the_last_actions_and_the_health_of_live_workers_only() -> None:
    rig = Rig()
    controller = Controller()
    controller.records = [action(i, "reassign") for i in range(LAST_ACTIONS + 2)]
    controller.batch_sizes = {"tcp://a": 300}
    rig.journal.read_controller(controller.actions, {"tcp://a": {"state": "transient"},
                                                     "tcp://b": {"state": "hung"}})
    a, b = rig.slots
    a.rate, b.rate, b.dead = 12.34, 9.0, True
    record = rig.journal.record(rig.slots)
    assert record["actions_total"] == LAST_ACTIONS + 2
    assert [r["seq"] for r in record["actions"]] == list(range(2, LAST_ACTIONS + 2))
    assert record["workers"] == [
        {"worker": "tcp://a", "label": "worker0", "rows": 0, "samples_per_s": 12.3,
         "state": "running", "health": "straggler", "batch_rows": 300, "tables": None},
        {"worker": "tcp://b", "label": "worker1", "rows": 0, "samples_per_s": 0.0,
         "state": "dead", "health": "-", "batch_rows": None, "tables": None}]
    assert rig.journal.read_events(rig.slots, {})[f"{SERIES}batch_rows.worker0"] == 300
    assert record["last_row"] is None and record["first_lease"] == {}
    assert record["rows"] == rig.journal.rows and record["rows"] is not rig.journal.rows
