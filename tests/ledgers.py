"""Shard ledgers for tests (``from ledgers import make``): a hand-moved clock, a small job, and
workers that train a lease, or lease until there is nothing left for them."""

from __future__ import annotations

from collections import Counter

from antdt.sharding import Claim, Finished, Lease, Revoked, ShardLedger, Stop, Wait


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


GROUPS = [("a.parquet", 0, 10), ("a.parquet", 1, 7), ("b.parquet", 0, 5)]


def make(**kwargs: object) -> ShardLedger:
    options: dict = {"shard_rows": 4, "batch_rows": 2, "clock": FakeClock()}
    options.update(kwargs)
    return ShardLedger(options.pop("row_groups", GROUPS), **options)


def train_lease(ledger: ShardLedger, lease: Lease, rows: Counter | None = None) -> None:
    """Train a lease to its end, syncing at once, and count the rows trained."""
    offset, stop = lease.start, lease.claim_stop
    while True:
        if rows is not None:
            rows.update((lease.epoch, lease.path, lease.row_group, r) for r in range(offset, stop))
        reply = ledger.commit(lease.lease_id, lease.token, stop, stop)
        if not isinstance(reply, Claim):
            assert isinstance(reply, (Finished, Revoked)) and reply.retired
            return
        offset, stop = stop, reply.stop


def drain(ledger: ShardLedger, worker: str = "drainer", rows: Counter | None = None) -> None:
    """Lease and train until the ledger says stop (or, static, until the worker's slot is
    empty)."""
    while True:
        lease = ledger.lease(worker)
        if isinstance(lease, Stop) or (ledger.static is not None and isinstance(lease, Wait)):
            return
        assert isinstance(lease, Lease), lease
        train_lease(ledger, lease, rows)
