"""The shard ledger: unit tests and a hypothesis state machine for exactly-once."""

from __future__ import annotations

import os
import tracemalloc
from collections import Counter
from dataclasses import dataclass

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from antdt.errors import LedgerError
from antdt.sharding import (Claim, CommitEvent, Finished, JobState, Lease, Revoked, RowState,
                            ShardLedger, Stop, Wait)
from ledgers import GROUPS, FakeClock, drain, make, train_lease


def all_rows(groups: list[tuple[str, int, int]], epochs: int) -> Counter:
    return Counter((e, p, g, r) for e in range(epochs) for p, g, n in groups for r in range(n))


# ---- unit tests -------------------------------------------------------------------------------


def test_one_epoch_trains_every_row_once_in_shards_within_row_groups() -> None:
    ledger = make(epochs=2)
    assert ledger.num_shards == 3 + 2 + 2
    rows: Counter = Counter()
    shards = []
    while isinstance(lease := ledger.lease("w"), Lease):
        assert lease.stop - lease.start <= 4 and lease.start % 4 == 0
        shards.append((lease.epoch, lease.path, lease.row_group, lease.start))
        train_lease(ledger, lease, rows)
    assert isinstance(lease, Stop) and lease.reason == "finished"
    assert rows == all_rows(GROUPS, 2)
    assert [s[0] for s in shards] == [0] * 7 + [1] * 7
    assert ledger.state is JobState.FINISHED
    assert ledger.summary()["rows_trained"] == 44 and ledger.rows_retrained == 0
    ledger.check_invariants()


def test_shuffle_is_reproducible_per_seed_and_epoch() -> None:
    groups = [("f", g, 100) for g in range(20)]

    def order(seed: int) -> list[tuple[int, int, int]]:
        ledger = make(row_groups=groups, shard_rows=10, epochs=2, seed=seed)
        out = []
        while isinstance(lease := ledger.lease("w"), Lease):  # leases stay live: no requeue
            out.append((lease.epoch, lease.row_group, lease.start))
        return out

    first, again, other = order(1), order(1), order(2)
    assert first == again
    assert first != other
    epoch0 = [(g, s) for e, g, s in first if e == 0]
    epoch1 = [(g, s) for e, g, s in first if e == 1]
    assert sorted(epoch0) == sorted(epoch1) and epoch0 != epoch1


def test_claims_grow_by_whole_batches_capped() -> None:
    ledger = make(row_groups=[("f", 0, 100)], shard_rows=100, batch_rows=4, max_claim_rows=20)
    lease = ledger.lease("w", claim_rows=9)
    assert isinstance(lease, Lease) and lease.claim_stop == 12
    reply = ledger.commit(lease.lease_id, lease.token, 4, 4, claim_rows=1000)
    assert reply == Claim(lease.lease_id, 24)
    reply = ledger.commit(lease.lease_id, lease.token, 8, 8)
    assert reply == Claim(lease.lease_id, 24)  # a claim never shrinks
    with pytest.raises(LedgerError, match="max_claim_rows"):
        make(batch_rows=4, max_claim_rows=3)


def test_the_last_leases_shrink_so_the_workers_run_out_of_rows_together() -> None:
    """Two workers at 1 row/s take 100 rows in shards of 20: with whole shards to the end one
    of them trains the last shard alone (60 s against 40 s); with the guided end (the default)
    the last leases shrink towards one batch and both are done at 50 s. A lone worker leases
    whole shards to the end."""
    def finish_times(guided_end: bool) -> tuple[dict[str, float], list[int]]:
        ledger = make(row_groups=[("f", 0, 100)], shard_rows=20, batch_rows=2,
                      guided_end=guided_end)
        free = {"a": 0.0, "b": 0.0}  # when each worker asks for its next lease
        done: dict[str, float] = {}
        rows: Counter = Counter()
        sizes = []
        while free:
            worker = min(free, key=lambda w: (free[w], w))
            lease = ledger.lease(worker)
            if not isinstance(lease, Lease):
                done[worker] = free.pop(worker)
                continue
            sizes.append(lease.stop - lease.start)
            train_lease(ledger, lease, rows)
            free[worker] += lease.stop - lease.start
        assert ledger.state is JobState.FINISHED and len(rows) == 100
        assert set(rows.values()) == {1}
        ledger.check_invariants()
        return done, sizes

    assert finish_times(guided_end=False)[0] == {"a": 60.0, "b": 40.0}
    done, sizes = finish_times(guided_end=True)
    assert done == {"a": 50.0, "b": 50.0}
    assert sizes[:2] == [20, 20] and all(size % 2 == 0 for size in sizes) and sizes[-1] == 2
    lone = make(row_groups=[("f", 0, 100)], shard_rows=20, batch_rows=2)
    leases = [lone.lease("w") for _ in range(5)]
    assert [lease.stop - lease.start for lease in leases if isinstance(lease, Lease)] == [20] * 5


def test_commit_is_idempotent_and_bad_commits_change_nothing() -> None:
    ledger = make(row_groups=[("f", 0, 22)])
    lease = ledger.lease("w")
    assert isinstance(lease, Lease)
    first = ledger.commit(lease.lease_id, lease.token, lease.start + 2, lease.start + 1)
    before = ledger.summary()
    assert ledger.commit(lease.lease_id, lease.token, lease.start + 2, lease.start + 1) == first
    assert ledger.summary() == before
    claim_stop = ledger.leases()[0].claim_stop
    bad = [
        ((lease.lease_id, lease.token, lease.start + 1, lease.start + 1), "backwards"),
        ((lease.lease_id, lease.token, claim_stop + 1, lease.start + 1), "beyond the claim"),
        ((lease.lease_id, lease.token, lease.start + 2, lease.start + 3), "beyond offset"),
        ((lease.lease_id, lease.token, lease.start + 2, lease.start), "synced_offset .* backwards"),
        ((lease.lease_id, "0" * 32, lease.start + 2, lease.start + 2), "wrong token"),
        ((lease.lease_id + 5, lease.token, 0, 0), "never issued"),
        ((lease.lease_id, lease.token, 2.0, 2), "must be an int"),
        ((lease.lease_id, lease.token, True, 0), "must be an int"),
    ]
    for args, message in bad:
        with pytest.raises(LedgerError, match=message):
            ledger.commit(*args)  # type: ignore[arg-type]
        assert ledger.summary() == before
    ledger.check_invariants()


def test_revoke_moves_only_unclaimed_rows_to_the_front() -> None:
    ledger = make(row_groups=[("f", 0, 20)], shard_rows=20, batch_rows=2, guided_end=False)
    lease = ledger.lease("slow")
    assert isinstance(lease, Lease)
    assert ledger.commit(lease.lease_id, lease.token, 2, 2) == Claim(lease.lease_id, 4)
    assert ledger.revoke(lease.lease_id) == (0, 0, 4, 20)
    assert ledger.revoke(lease.lease_id) is None
    fast = ledger.lease("fast")
    assert isinstance(fast, Lease) and (fast.start, fast.stop) == (4, 20)
    assert ledger.commit(lease.lease_id, lease.token, 3, 3) == Revoked(lease.lease_id, 4, False)
    assert ledger.commit(lease.lease_id, lease.token, 4, 4) == Revoked(lease.lease_id, 4, True)
    train_lease(ledger, fast)
    assert ledger.state is JobState.FINISHED and ledger.rows_trained == 20
    summary = ledger.summary()  # a lease revoked twice counts once
    assert (summary["leases_granted"], summary["leases_revoked"]) == (2, 1)
    ledger.check_invariants()


def test_split_keeps_the_first_part_and_queues_the_rest_in_order() -> None:
    ledger = make(row_groups=[("f", 0, 30)], shard_rows=30, batch_rows=2, guided_end=False)
    lease = ledger.lease("w")
    assert isinstance(lease, Lease)
    pieces = ledger.split(lease.lease_id, 3)
    assert pieces == [(0, 0, 10, 20), (0, 0, 20, 30)]
    assert ledger.leases()[0].stop == 10
    nxt = ledger.lease("v")
    assert isinstance(nxt, Lease) and (nxt.start, nxt.stop) == (10, 20)
    # a split never takes claimed rows: with 2 unclaimed rows only one piece can be made
    short = make(row_groups=[("f", 0, 4)], shard_rows=4, batch_rows=2)
    lease = short.lease("w")
    assert isinstance(lease, Lease)
    assert short.split(lease.lease_id, 5) == [(0, 0, 2, 4)]
    with pytest.raises(LedgerError, match="parts"):
        short.split(lease.lease_id, 1)
    assert short.split(lease.lease_id, 2) == []  # nothing unclaimed left: not a split
    assert (ledger.leases_split, short.leases_split, short.leases_granted) == (1, 1, 1)


def test_a_paced_worker_leases_at_most_its_pace_and_none_at_zero() -> None:
    ledger = make(row_groups=[("a", 0, 12)], shard_rows=12, batch_rows=2, max_claim_rows=8,
                  guided_end=False)
    ledger.pace("slow", 4)
    lease = ledger.lease("slow", claim_rows=8)
    assert isinstance(lease, Lease) and (lease.start, lease.stop, lease.claim_stop) == (0, 4, 4)
    other = ledger.lease("fast", claim_rows=2)  # the rest of the shard stayed at the front
    assert isinstance(other, Lease) and (other.start, other.stop, other.claim_stop) == (4, 12, 6)
    ledger.commit(other.lease_id, other.token, 6, 6, claim_rows=2)
    ledger.pace("fast", 0)  # its next commit revokes the unclaimed rows
    reply = ledger.commit(other.lease_id, other.token, 8, 8, claim_rows=8)
    assert isinstance(reply, Revoked) and reply.stop == 8
    assert ledger.leases_revoked == 1
    assert isinstance(ledger.lease("fast"), Wait)
    ledger.pace("fast", None)
    assert ledger.paces == {"slow": 4}
    again = ledger.lease("fast")
    assert isinstance(again, Lease) and (again.start, again.stop) == (8, 12)
    with pytest.raises(LedgerError, match="whole batches of 2 rows, found 3"):
        ledger.pace("slow", 3)
    ledger.remove_worker("slow")
    assert ledger.paces == {}


def test_a_lease_asked_for_at_most_some_rows_leaves_the_rest_at_the_front() -> None:
    """A sync rank asks for a few of its local batches, whatever the job's batch: 3 rows of a
    12-row shard, the rest leased next, in order; the bound is any number of rows >= 1."""
    ledger = make(row_groups=[("a", 0, 12)], shard_rows=12, batch_rows=4, guided_end=False)
    small = ledger.lease("slow", max_rows=3)
    assert isinstance(small, Lease) and (small.start, small.stop) == (0, 3)
    rest = ledger.lease("fast", max_rows=100)
    assert isinstance(rest, Lease) and (rest.start, rest.stop) == (3, 12)
    with pytest.raises(LedgerError, match=r"max_rows must be in \[1, 2147483647\], found 0"):
        ledger.lease("slow", max_rows=0)


def test_removed_worker_requeues_claim_and_unsynced_rows_counted_retrained() -> None:
    ledger = make(row_groups=[("f", 0, 8)], shard_rows=8, batch_rows=2)
    lease = ledger.lease("dead")
    assert isinstance(lease, Lease)
    ledger.commit(lease.lease_id, lease.token, 2, 2)
    ledger.commit(lease.lease_id, lease.token, 4, 2)  # rows 2..3 trained, not synced
    assert ledger.rows_by_state()[RowState.DONE] == 2
    assert ledger.remove_worker("dead") == 6
    assert ledger.remove_worker("dead") == 0
    assert ledger.rows_retrained == 2 and ledger.leases() == []
    with pytest.raises(LedgerError, match="no longer live"):
        ledger.commit(lease.lease_id, lease.token, 6, 6)
    rows: Counter = Counter()
    drain(ledger, rows=rows)
    assert sorted(r for *_, r in rows) == [2, 3, 4, 5, 6, 7]
    assert ledger.rows_trained == 8 + ledger.rows_retrained == 10
    assert ledger.rows_lost == 0


def test_draining_lease_lives_until_synced() -> None:
    ledger = make(row_groups=[("f", 0, 2)], shard_rows=2, batch_rows=2)
    lease = ledger.lease("w")
    assert isinstance(lease, Lease)
    assert ledger.commit(lease.lease_id, lease.token, 2, 0) == Finished(lease.lease_id, 2, False)
    assert ledger.lease("w") == Wait(unsynced=2)  # the rows may still come back, once synced
    assert ledger.state is JobState.RUNNING
    assert ledger.commit(lease.lease_id, lease.token, 2, 2) == Finished(lease.lease_id, 2, True)
    assert ledger.lease("w") == Stop("finished")


def test_registration_quarantine_rows_are_never_leased() -> None:
    quarantine = [("a.parquet", 1, "label not 0/1"), ("b.parquet", None, "schema mismatch"),
                  ("gone.parquet", None, "cannot open")]
    ledger = make(epochs=2, quarantine=quarantine)
    assert ledger.rows_quarantined == (7 + 5) * 2
    rows: Counter = Counter()
    drain(ledger, rows=rows)
    assert {(p, g) for _, p, g, _ in rows} == {("a.parquet", 0)}
    assert ledger.rows_trained == 20
    assert ledger.rows_trained == ledger.rows_expected - ledger.rows_quarantined
    records = ledger.quarantine_records
    assert [(r.path, r.rows, r.reason) for r in records] == [
        ("a.parquet", 14, "label not 0/1"), ("b.parquet", 10, "schema mismatch"),
        ("gone.parquet", 0, "cannot open")]
    with pytest.raises(LedgerError, match="row group 9 of a.parquet"):
        make(quarantine=[("a.parquet", 9, "x")])


def test_runtime_quarantine_records_rows_and_requeues_the_rest() -> None:
    ledger = make(row_groups=[("f", 3, 10)], shard_rows=10, batch_rows=2)
    lease = ledger.lease("w", claim_rows=6)
    assert isinstance(lease, Lease)
    ledger.commit(lease.lease_id, lease.token, 2, 2)
    reply = ledger.quarantine(lease.lease_id, lease.token, 5, "corrupt page")
    assert reply == Revoked(lease.lease_id, 2, True)
    assert ledger.rows_quarantined == 3
    record = ledger.quarantine_records[-1]
    assert (record.path, record.row_group, record.epoch, record.start, record.stop) == \
        ("f", 3, 0, 2, 5)
    rest = ledger.lease("w")
    assert isinstance(rest, Lease) and (rest.start, rest.stop) == (5, 10)
    train_lease(ledger, rest)
    assert ledger.state is JobState.FINISHED and ledger.rows_trained == 7
    with pytest.raises(LedgerError, match="no longer live"):
        ledger.quarantine(lease.lease_id, lease.token, 6, "x")


def test_stop_counts_lost_rows() -> None:
    ledger = make(row_groups=[("f", 0, 22)])
    lease = ledger.lease("w")
    assert isinstance(lease, Lease)
    ledger.commit(lease.lease_id, lease.token, lease.start + 2, lease.start + 1)
    lost = ledger.stop("cancelled by user")
    assert lost == 22 - 1 and ledger.rows_lost == 21
    assert ledger.rows_retrained == 1
    assert ledger.state is JobState.STOPPED
    assert ledger.lease("w") == Stop("cancelled by user")
    assert ledger.commit(lease.lease_id, lease.token, 0, 0) == Stop("cancelled by user")
    assert ledger.rows_trained == ledger.rows_expected - ledger.rows_lost + ledger.rows_retrained
    ledger.check_invariants()


def test_listeners_get_commit_events() -> None:
    clock = FakeClock()
    ledger = make(row_groups=[("f", 0, 22)], clock=clock)
    events: list[CommitEvent] = []
    ledger.subscribe(events.append)
    lease = ledger.lease("w")
    assert isinstance(lease, Lease)
    clock.now = 3.5
    ledger.commit(lease.lease_id, lease.token, lease.start + 2, lease.start + 2,
                  stats={"rows": 2, "seconds": 0.1})
    ledger.commit(lease.lease_id, lease.token, lease.start + 2, lease.start + 2)
    assert events == [CommitEvent("w", lease.lease_id, 0, 2, {"rows": 2, "seconds": 0.1}, 3.5)]
    assert ledger.leases()[0].committed_at == 3.5


def test_checkpoint_roundtrip_resumes_from_synced_offsets(tmp_path: os.PathLike) -> None:
    ledger = make(epochs=2, seed=7, quarantine=[("b.parquet", 0, "bad")])
    rows: Counter = Counter()
    for _ in range(3):
        lease = ledger.lease("w")
        assert isinstance(lease, Lease)
        train_lease(ledger, lease, rows)
    live = ledger.lease("w")
    assert isinstance(live, Lease)
    end = live.claim_stop
    rows.update((live.epoch, live.path, live.row_group, r) for r in range(live.start, end))
    ledger.commit(live.lease_id, live.token, end, live.start + 1)
    path = os.path.join(tmp_path, "ckpt", "ledger.bin")
    size = ledger.save(path)
    assert size == os.path.getsize(path) < 2000
    assert os.listdir(os.path.dirname(path)) == ["ledger.bin"]
    restored = ShardLedger.load(path, clock=FakeClock())
    restored.check_invariants()
    assert restored.rows_retrained == end - live.start - 1
    assert restored.leases() == [] and restored.rows_trained == ledger.rows_trained
    nxt = restored.lease("new")
    assert isinstance(nxt, Lease) and (nxt.start, nxt.stop) == (live.start + 1, live.stop)
    assert nxt.lease_id > live.lease_id
    train_lease(restored, nxt, rows)
    drain(restored, rows=rows)
    expected = all_rows([g for g in GROUPS if g[0] != "b.parquet"], 2)
    assert set(rows) == set(expected)
    assert sum(rows.values()) == restored.rows_trained
    assert restored.rows_trained == (restored.rows_expected - restored.rows_quarantined
                                     + restored.rows_retrained)


def test_checkpoint_rejects_other_files_and_versions(tmp_path: os.PathLike) -> None:
    with pytest.raises(LedgerError, match="not an antdt ledger"):
        ShardLedger.from_bytes(b"PAR1xxxxxxxxxxxx", clock=FakeClock())
    data = bytearray(make().to_bytes())
    at = data.index(b'"version": 2')
    data[at:at + 12] = b'"version": 9'
    with pytest.raises(LedgerError, match="version 9"):
        ShardLedger.from_bytes(bytes(data), clock=FakeClock())
    with pytest.raises(LedgerError, match="does not exist"):
        ShardLedger.load(os.path.join(tmp_path, "missing.bin"), clock=FakeClock())


def test_bad_registration_is_refused() -> None:
    with pytest.raises(LedgerError, match="listed twice"):
        make(row_groups=[("f", 0, 3), ("f", 0, 4)])
    with pytest.raises(LedgerError, match=r"row_groups\[0\] \(f\) num_rows"):
        make(row_groups=[("f", 0, -1)])
    with pytest.raises(LedgerError, match="non-empty str"):
        make(row_groups=[(3, 0, 1)])
    with pytest.raises(LedgerError, match="shard_rows"):
        make(shard_rows=0)


def test_memory_per_shard_is_small() -> None:
    groups = [(f"part-{f:04d}.parquet", g, 1000) for f in range(100) for g in range(100)]
    tracemalloc.start()
    try:
        ledger = make(row_groups=groups, shard_rows=100, batch_rows=50)
        for w in range(100):
            ledger.lease(f"w{w}")
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert ledger.num_shards == 100_000
    assert current / ledger.num_shards < 300


# ---- property-based: any interleaving keeps exactly-once --------------------------------------


@dataclass
class ModelLease:
    lease: Lease
    offset: int
    synced: int
    claim_stop: int


WORKERS = ["w0", "w1", "w2"]


class LedgerMachine(RuleBasedStateMachine):
    """Workers lease and commit (syncing late), the controller revokes, splits and paces, workers die,
    rows get quarantined, the ledger is checkpointed and restored; at the end every row of every
    epoch was made effective (synced) or quarantined exactly once and the counters add up. The
    same holds for the static baseline (fewer slots than workers: some wait)."""

    @initialize(sizes=st.lists(st.integers(0, 9), min_size=1, max_size=4),
                 shard_rows=st.integers(1, 5), batch_rows=st.integers(1, 3),
                 epochs=st.integers(1, 2), seed=st.integers(0, 3), quarantine_first=st.booleans(),
                 static=st.none() | st.integers(1, 3))
    def setup(self, sizes: list[int], shard_rows: int, batch_rows: int, epochs: int, seed: int,
              quarantine_first: bool, static: int | None) -> None:
        self.groups = [(f"f{i % 2}", i, n) for i, n in enumerate(sizes)]
        quarantine = [("f0", 0, "bad")] if quarantine_first else []
        self.ledger = make(row_groups=self.groups, shard_rows=shard_rows, batch_rows=batch_rows,
                           epochs=epochs, seed=seed, quarantine=quarantine,
                           max_claim_rows=3 * batch_rows, static=static)
        self.epochs = epochs
        self.live: dict[int, ModelLease] = {}
        self.worker_of: dict[int, str] = {}
        self.trained: Counter = Counter()
        self.effective: set = set()
        self.paces: dict[str, int] = {}

    # the worker side

    @rule(worker=st.sampled_from(WORKERS), claim_rows=st.none() | st.integers(0, 8))
    def lease(self, worker: str, claim_rows: int | None) -> None:
        reply = self.ledger.lease(worker, claim_rows)
        pace = self.paces.get(worker)
        if pace == 0:
            assert not isinstance(reply, Lease)
        if isinstance(reply, Lease):
            assert reply.start < reply.claim_stop <= reply.stop
            assert pace is None or reply.stop - reply.start <= pace
            self.live[reply.lease_id] = ModelLease(reply, reply.start, reply.start,
                                                   reply.claim_stop)
            self.worker_of[reply.lease_id] = worker
        elif isinstance(reply, Stop):
            assert self.ledger.state is not JobState.RUNNING

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        m = self.live[lease_id]
        offset = data.draw(st.integers(m.offset, m.claim_stop))
        synced = data.draw(st.integers(m.synced, offset))
        claim_rows = data.draw(st.none() | st.integers(1, 8))
        reply = self.ledger.commit(lease_id, m.lease.token, offset, synced, claim_rows=claim_rows)
        key = (m.lease.epoch, m.lease.path, m.lease.row_group)
        self.trained.update((*key, r) for r in range(m.offset, offset))
        for r in range(m.synced, synced):
            assert (*key, r) not in self.effective, "a row became effective twice"
            self.effective.add((*key, r))
        m.offset, m.synced = offset, synced
        if isinstance(reply, Claim):
            assert reply.stop >= m.claim_stop
            m.claim_stop = reply.stop
        elif isinstance(reply, (Revoked, Finished)):
            assert reply.stop == m.claim_stop >= offset
            if reply.retired:
                assert synced == reply.stop
                del self.live[lease_id]
        else:
            raise AssertionError(f"unexpected reply {reply}")

    @precondition(lambda self: self.live)
    @rule(data=st.data(), kind=st.sampled_from(["backwards", "beyond", "token", "synced"]))
    def bad_commit(self, data: st.DataObject, kind: str) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        m = self.live[lease_id]
        args = {"backwards": (m.lease.token, m.offset - 1, m.synced),
                "beyond": (m.lease.token, m.claim_stop + 1, m.synced),
                "token": (m.lease.token[::-1] + "x", m.offset, m.synced),
                "synced": (m.lease.token, m.offset, m.offset + 1)}[kind]
        before = self.ledger.summary()
        status = self.ledger.lease_status(lease_id)
        with pytest.raises(LedgerError):
            self.ledger.commit(lease_id, *args)
        assert self.ledger.summary() == before and self.ledger.lease_status(lease_id) == status

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def quarantine(self, data: st.DataObject) -> None:
        candidates = sorted(i for i, m in self.live.items() if m.offset < m.claim_stop)
        if not candidates:
            return
        lease_id = data.draw(st.sampled_from(candidates))
        m = self.live[lease_id]
        stop = data.draw(st.integers(m.offset + 1, m.claim_stop))
        reply = self.ledger.quarantine(lease_id, m.lease.token, stop, "unreadable")
        assert isinstance(reply, Revoked) and reply.stop == m.offset
        m.claim_stop = m.offset
        if reply.retired:
            del self.live[lease_id]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        self.ledger.release(lease_id, self.live.pop(lease_id).lease.token)

    # the controller and the cluster

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        self.ledger.revoke(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), parts=st.integers(2, 4))
    def split(self, data: st.DataObject, parts: int) -> None:
        self.ledger.split(data.draw(st.sampled_from(sorted(self.live))), parts)

    @rule(worker=st.sampled_from(WORKERS), batches=st.none() | st.integers(0, 3))
    def pace(self, worker: str, batches: int | None) -> None:
        rows = None if batches is None else batches * self.ledger.batch_rows
        self.ledger.pace(worker, rows)
        self.paces.pop(worker, None)
        if rows is not None:
            self.paces[worker] = rows
        assert self.ledger.paces == self.paces

    @rule(worker=st.sampled_from(WORKERS))
    def remove_worker(self, worker: str) -> None:
        self.ledger.remove_worker(worker)
        self.paces.pop(worker, None)
        for lease_id in [i for i in self.live if self.worker_of[i] == worker]:
            del self.live[lease_id]

    @precondition(lambda self: self.ledger.static is None)
    @rule()
    def checkpoint_restore(self) -> None:
        self.ledger = ShardLedger.from_bytes(self.ledger.to_bytes(), clock=FakeClock())
        self.live.clear()
        self.paces.clear()

    @precondition(lambda self: self.ledger.state is JobState.RUNNING)
    @rule(probability=st.integers(0, 9))
    def stop(self, probability: int) -> None:
        if probability == 0:
            self.ledger.stop("test")
            self.live.clear()

    # invariants

    @invariant()
    def counters_add_up(self) -> None:
        self.ledger.check_invariants()
        assert self.ledger.rows_trained == sum(self.trained.values())
        assert self.ledger.rows_done == len(self.effective)

    @invariant()
    def no_row_in_two_live_leases(self) -> None:
        held: set = set()
        for status in self.ledger.leases():
            rows = {(status.epoch, status.path, status.row_group, r)
                    for r in range(status.synced, status.stop)}
            assert not rows & held and not rows & self.effective
            held |= rows

    def teardown(self) -> None:
        if not hasattr(self, "ledger"):
            return
        ledger = self.ledger
        for worker in WORKERS:
            ledger.remove_worker(worker)
        rows: Counter = Counter()
        for slot in range(ledger.static or 1):
            drain(ledger, f"drainer{slot}", rows=rows)
        assert ledger.state is not JobState.RUNNING
        self.trained.update(rows)
        effective = self.effective | set(rows)
        assert len(effective) == len(self.effective) + sum(rows.values())
        quarantined = set()
        for record in ledger.quarantine_records:
            epochs = range(self.epochs) if record.epoch is None else [record.epoch]
            groups = [g for g in self.groups if g[0] == record.path
                      and (record.row_group is None or g[1] == record.row_group)]
            for e in epochs:
                for path, group, n in groups:
                    start = 0 if record.start is None else record.start
                    stop = n if record.stop is None else record.stop
                    for r in range(start, stop):
                        assert (e, path, group, r) not in quarantined
                        quarantined.add((e, path, group, r))
        assert len(quarantined) == ledger.rows_quarantined
        assert not quarantined & effective
        universe = set(all_rows(self.groups, self.epochs))
        lost = universe - quarantined - effective
        assert len(lost) == ledger.rows_lost
        if ledger.state is JobState.FINISHED:
            assert not lost
        assert ledger.rows_trained == sum(self.trained.values())
        assert ledger.rows_trained == (ledger.rows_expected - ledger.rows_quarantined
                                       - ledger.rows_lost + ledger.rows_retrained)


TestLedgerMachine = LedgerMachine.TestCase
TestLedgerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])

