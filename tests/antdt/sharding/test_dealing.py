"""The static baseline's dealing (:mod:`antdt.sharding.dealing`), through the ledger: fixed slots
per epoch, rows that never leave their slot, and a new worker that adopts a dead one's slot."""

from __future__ import annotations

from collections import Counter

import pytest

from antdt.errors import LedgerError
from antdt.sharding import JobState, Lease, Stop, Wait
from ledgers import drain, make, train_lease


def test_static_deals_each_epoch_to_fixed_slots_and_extra_workers_wait() -> None:
    groups = [("a.parquet", g, 8) for g in range(6)]
    ledger = make(row_groups=groups, shard_rows=4, batch_rows=4, static=3, epochs=2)
    dynamic = make(row_groups=groups, shard_rows=4, batch_rows=4, epochs=2)
    order = [dynamic.lease(f"d{i}") for i in range(24)]  # 12 shards an epoch
    got: dict[str, list[Lease]] = {}
    for worker in ["w0", "w1", "w2"]:
        while isinstance(lease := ledger.lease(worker), Lease):
            got.setdefault(worker, []).append(lease)
            train_lease(ledger, lease)
        assert isinstance(lease, Wait) if worker != "w2" else isinstance(lease, Stop)
    key = [(lease.epoch, lease.row_group, lease.start) for lease in order
           if isinstance(lease, Lease)]
    for k, worker in enumerate(["w0", "w1", "w2"]):
        # slot k gets positions k, k + 3, ... of each epoch's (shared) permutation
        want = [key[i] for e in range(2) for i in range(12 * e + k, 12 * e + 12, 3)]
        assert [(lease.epoch, lease.row_group, lease.start) for lease in got[worker]] == want
    assert ledger.state is JobState.FINISHED
    assert isinstance(make(row_groups=groups, shard_rows=4, batch_rows=4, static=1).lease("x"),
                      Lease)
    full = make(row_groups=groups, shard_rows=4, batch_rows=4, static=1)
    full.lease("x")
    assert isinstance(full.lease("y"), Wait), "a worker without a slot waits"
    ledger.check_invariants()


def test_static_rows_stay_in_their_slot_and_a_new_worker_adopts_a_dead_one() -> None:
    ledger = make(row_groups=[("a.parquet", 0, 8), ("a.parquet", 1, 8)], shard_rows=8,
                  batch_rows=2, static=2)
    first, other = ledger.lease("w0"), ledger.lease("w1")
    assert isinstance(first, Lease) and isinstance(other, Lease)
    ledger.commit(first.lease_id, first.token, 2, 2)
    ledger.revoke(first.lease_id)  # its unclaimed rows go back to w0's slot, not to w1
    train_lease(ledger, other)
    assert isinstance(ledger.lease("w1"), Wait)
    assert ledger.remove_worker("w0") == 2  # its claim [2, 4); the revoked [4, 8) is queued
    assert isinstance(ledger.lease("w1"), Wait), "w1 keeps its own slot"
    rows: Counter = Counter()
    drain(ledger, "w0-restarted", rows)
    assert sum(rows.values()) == 6 and ledger.state is JobState.FINISHED
    ledger.check_invariants()
    with pytest.raises(LedgerError, match="static"):
        ledger.to_bytes()
