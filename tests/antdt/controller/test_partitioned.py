"""A worker the model sync finds reaching no peer: the monitor's verdict is partitioned while the
sync says so, over every other verdict, and the controller retires it at once (or, where the
budget forbids a retirement, revokes its leases), its reason in the record."""

from __future__ import annotations

from antdt.controller import Controller, RetireHung, RevokeHung
from antdt.monitor import Monitor, MonitorSettings, WorkerState
from antdt.sharding import Lease, ShardLedger

WHY = "reaches no sync peer (2 unreachable: a, b)"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def job(workers: str, min_workers: int = 1) -> tuple[ShardLedger, Monitor, Controller,
                                                      list[str]]:
    """A ledger whose ``workers`` each hold a lease and committed a batch, its monitor, and a
    controller with the hang policies; the list collects the retired workers."""
    clock = Clock()
    ledger = ShardLedger([("f.parquet", 0, 1000)], shard_rows=100, batch_rows=10, clock=clock)
    monitor = Monitor(clock, batch_rows=10, settings=MonitorSettings(warm_up_batches=0))
    ledger.subscribe(monitor.observe)
    retired: list[str] = []

    def retire(worker: str, stimulus_id: str) -> None:
        retired.append(worker)
        ledger.remove_worker(worker)

    controller = Controller(ledger, monitor, clock=clock, retire=retire,
                            workers=lambda: [w for w in workers if w not in retired],
                            policies=[RevokeHung(), RetireHung(after_s=1000.0)],
                            min_workers=min_workers)
    clock.now = 1.0
    for worker in workers:
        lease = ledger.lease(worker, claim_rows=20)
        assert isinstance(lease, Lease)
        ledger.commit(lease.lease_id, lease.token, lease.start + 10, lease.start + 10,
                      claim_rows=20)
    return ledger, monitor, controller, retired


def test_a_partitioned_worker_is_retired_at_once_with_its_reason() -> None:
    ledger, monitor, controller, retired = job("abc")
    monitor.partitions({"c": WHY})
    health = monitor.health("c")
    assert health is not None and health.state is WorkerState.PARTITIONED
    assert health.reason == WHY and [h.worker for h in monitor.flagged()] == ["c"]
    (record,) = controller.tick()  # no revoke beside the retirement: it requeues the rows
    assert record["action"] == "retire" and record["worker"] == "c"
    assert record["policy"] == "RetireHung" and record["reason"] == f"partitioned: {WHY}"
    assert retired == ["c"] and ledger.leases("c") == []
    monitor.partitions({})
    health = monitor.health("c")
    assert health is not None and health.state is WorkerState.OK and health.reason is None
    assert monitor.flagged() == []


def test_a_partitioned_worker_that_may_not_be_retired_has_its_leases_revoked() -> None:
    ledger, monitor, controller, retired = job("ab", min_workers=2)
    monitor.partitions({"b": WHY})
    (record,) = controller.tick()
    assert record["action"] == "revoke" and record["worker"] == "b"
    assert record["reason"] == f"partitioned: {WHY}" and retired == []
    assert all(lease.revoked for lease in ledger.leases("b"))
    monitor.partitions({"a": WHY})  # b reaches its peers again, a does not
    assert [h.worker for h in monitor.flagged()] == ["a"]
