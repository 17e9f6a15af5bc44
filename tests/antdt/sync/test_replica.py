"""ReplicaSync without a cluster: replicas of one model, wired by an in-memory transport that
fails on demand, exchange in partial groups, lose and gain members, and end bit-identical."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

import dask.config
import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import antdt.errors
from antdt.device import HUGE_PAGE, huge_pages
from antdt.sync import (
    LeaderRows,
    PeerPayload,
    ReplicaSnapshot,
    ReplicaSync,
    SyncError,
    SyncScheduler,
)
from antdt.sync.replica import ReplicaLock, held_bytes, tensor_bytes
from pages import kernel_collapses, on_huge_pages
from sync_replicas import DIM, ROWS, make_dense, make_tables
from waits import bounded


class Cluster:
    """Replicas of one initial model wired by an in-memory transport that can fail on demand;
    their deltas are exact (in the tables' float64) unless ``delta_dtype`` rounds them."""

    def __init__(self, n: int, rows: int = ROWS,
                 delta_dtype: torch.dtype = torch.float64) -> None:
        self.names = [f"w{i}" for i in range(n)]
        self.initial_tables = make_tables(rows=rows)
        self.initial_dense = make_dense()
        self.delta_dtype = delta_dtype
        self.replicas = {
            name: ReplicaSync(name, [p.clone() for p in self.initial_dense],
                              {t: w.clone() for t, w in self.initial_tables.items()},
                              peers=self.names, delta_dtype=delta_dtype)
            for name in self.names}
        self.total = {t: torch.zeros_like(w) for t, w in self.initial_tables.items()}
        self.steps: list[tuple[str, int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = []
        """Every step: its worker, that worker's offset after it, its rows and deltas."""
        self.offsets = dict.fromkeys(self.names, 0)
        self.lose_reply = 0.0  # probability that a served reply never arrives
        self.rng = random.Random(0)
        self.dead: set[str] = set()
        self.total_lock = threading.Lock()  # trainers of different replicas share ``total``

    def add(self, name: str) -> ReplicaSync:
        """A new replica built from the initial model (a joiner before it bootstraps)."""
        self.names.append(name)
        self.offsets[name] = 0
        self.replicas[name] = ReplicaSync(name, [p.clone() for p in self.initial_dense],
                                          {t: w.clone() for t, w in self.initial_tables.items()},
                                          delta_dtype=self.delta_dtype)
        return self.replicas[name]

    def fetch_for(self, requester: str) -> Callable[[str, int, int], PeerPayload]:
        def fetch(peer: str, round: int, since_seq: int) -> PeerPayload:
            if peer in self.dead:
                raise ConnectionRefusedError(f"{peer} is dead")
            payload = self.replicas[peer].serve(requester, round, since_seq)
            if self.rng.random() < self.lose_reply:
                raise TimeoutError(f"reply from {peer} lost")
            return payload
        return fetch

    def train(self, name: str, gen: torch.Generator) -> None:
        """A training-like step: some rows of each table and the dense params move."""
        replica = self.replicas[name]
        touched = {}
        with replica.lock:
            for t, table in replica.tables.items():
                ids = torch.randperm(table.shape[0], generator=gen)[:5]
                delta = torch.randn(len(ids), DIM, generator=gen, dtype=table.dtype)
                table[ids] += delta
                with self.total_lock:
                    self.total[t][ids] += delta
                touched[t] = (ids, delta)
            for p in replica.dense:
                p += 0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            self.offsets[name] += 64
            replica.touch({t: ids for t, (ids, _) in touched.items()}, self.offsets[name])
        with self.total_lock:
            self.steps.append((name, self.offsets[name], touched))

    def expected_tables(self, synced: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
        """The initial tables plus every step, less the steps of each worker in ``synced``
        past its rows there (a departed worker's rows the ledger trains again)."""
        expected = {t: self.initial_tables[t] + self.total[t] for t in self.total}
        for name, offset, touched in self.steps:
            if synced is not None and name in synced and offset > synced[name]:
                for t, (ids, delta) in touched.items():
                    expected[t][ids] -= delta
        return expected


@pytest.mark.skipif(not kernel_collapses(), reason="the kernel moves no memory to huge pages")
def test_a_replica_s_page_steps_move_its_tables_and_its_base() -> None:
    storage = torch.randn(3 * (3 << 20) // 4)  # 9 MB of float32, as FBGEMM keeps its tables
    tables = {"a": storage[:(6 << 20) // 4].view(-1, 4), "b": storage[(6 << 20) // 4:].view(-1, 4)}
    replica = ReplicaSync("w", make_dense(), tables)
    moved = sum(replica.page_steps())
    # the tables' storage once (what it holds of whole huge pages), then the base (9 MB: 3+)
    assert moved >= huge_pages(storage) + 3 * HUGE_PAGE
    assert all(on_huge_pages(table) for table in replica.tables.values())


def test_a_round_prepares_from_the_cut_while_the_next_step_holds_the_lock() -> None:
    cluster = Cluster(2)
    replica = cluster.replicas["w0"]
    gen = torch.Generator().manual_seed(5)
    cluster.train("w0", gen)
    replica.cut()  # the training thread, between two steps
    at_cut = [p.clone() for p in replica.dense]
    in_step, step_may_end = threading.Event(), threading.Event()

    def next_step() -> None:
        with replica.lock.training():
            for p in replica.dense:
                p += 1.0
            in_step.set()
            step_may_end.wait(60.0)

    stepping = bounded.start(next_step)
    assert in_step.wait(60.0)
    snapshot = bounded.call(replica.prepare, 1, timeout_s=30.0)  # not waiting for the step
    payload = bounded.call(replica.serve, "w1", 1, 0, timeout_s=30.0)
    step_may_end.set()
    stepping.result()
    assert all(torch.equal(s, p) for s, p in zip(snapshot, at_cut))
    assert [e.seq for e in payload.entries] == [1]  # the cut published the first step's rows
    cluster.train("w0", gen)
    replica.cut()
    replica.drop_cut()  # training ended: the final round prepares from the replica as it is
    assert all(torch.equal(s, p) for s, p in zip(replica.prepare(2), replica.dense))


def run_round(cluster: Cluster, round: int, members: list[str], gen: torch.Generator,
              train_between: bool) -> None:
    order = members[:]
    cluster.rng.shuffle(order)
    for name in order:
        report = cluster.replicas[name].exchange(round, members, cluster.fetch_for(name))
        assert set(report.merged) | set(report.failed) == set(members) - {name}
        if train_between:
            cluster.train(cluster.rng.choice(cluster.names), gen)


def assert_identical(cluster: Cluster, names: list[str], synced: dict[str, int] | None = None,
                     dense: bool = True) -> None:
    """Every replica in ``names`` holds the expected tables (see
    :meth:`Cluster.expected_tables`) and, with ``dense``, the same dense parameters."""
    expected = cluster.expected_tables(synced)
    first = cluster.replicas[names[0]]
    for name in names:
        replica = cluster.replicas[name]
        for t, table in replica.tables.items():
            torch.testing.assert_close(table, expected[t], rtol=0, atol=1e-10)
        for p, q in zip(replica.dense, first.dense if dense else replica.dense):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_random_partial_groups_converge_to_initial_plus_all_deltas() -> None:
    cluster = Cluster(5)
    cluster.lose_reply = 0.2
    gen = torch.Generator().manual_seed(7)
    for round in range(1, 60):
        for _ in range(cluster.rng.randint(0, 3)):
            cluster.train(cluster.rng.choice(cluster.names), gen)
        members = cluster.rng.sample(cluster.names, cluster.rng.randint(2, 4))
        run_round(cluster, round, members, gen, train_between=True)
    assert any(len(r.log) for r in cluster.replicas.values())  # not everything acknowledged yet
    cluster.lose_reply = 0.0
    run_round(cluster, 1000, cluster.names, gen, train_between=False)
    assert_identical(cluster, cluster.names)
    # one more full round acknowledges everything: logs empty, every row counted as synced
    run_round(cluster, 1001, cluster.names, gen, train_between=False)
    for name, replica in cluster.replicas.items():
        assert len(replica.log) == 0
        assert replica.synced_offset() == cluster.offsets[name]
    assert_identical(cluster, cluster.names)


def test_rounded_deltas_carry_their_rounding_into_the_next_and_end_exact() -> None:
    """bfloat16 deltas: after a round in which everyone merged everyone, a replica lacks
    exactly what rounding left out of its peers' deltas (each peer's ``current - base``), not
    an error that grows with the rounds; once training ended, one round sends those rows
    exactly and every replica holds the exact sum."""
    cluster = Cluster(3, delta_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    for round in range(1, 30):
        for name in cluster.names:
            cluster.train(name, gen)
        run_round(cluster, round, cluster.names, gen, train_between=False)
        expected = cluster.expected_tables()
        owed = {name: {t: r.tables[t] - base for t, base in r.log.state(name).tables.items()}
                for name, r in cluster.replicas.items()}
        for name, replica in cluster.replicas.items():
            for t, table in replica.tables.items():
                peers_owed = sum(owed[peer][t] for peer in cluster.names if peer != name)
                torch.testing.assert_close(table + peers_owed, expected[t], rtol=0, atol=1e-10)
    lag = max((table - cluster.expected_tables()[t]).abs().max().item()
              for replica in cluster.replicas.values() for t, table in replica.tables.items())
    assert lag > 1e-6  # rounding happened: the replicas are not yet at the exact sum
    cluster.train("w0", gen)
    with cluster.replicas["w0"].lock:
        entry = cluster.replicas["w0"].log.publish(cluster.offsets["w0"])
    assert entry is not None and entry.deltas.dtype == torch.bfloat16
    for replica in cluster.replicas.values():
        replica.drop_cut()  # training ended
    run_round(cluster, 100, cluster.names, gen, train_between=False)
    assert_identical(cluster, cluster.names)


def test_dead_peer_is_skipped_and_forgotten() -> None:
    cluster = Cluster(3)
    gen = torch.Generator().manual_seed(1)
    for name in cluster.names:
        cluster.train(name, gen)
    run_round(cluster, 1, ["w0", "w1"], gen, train_between=False)
    cluster.dead.add("w2")
    report = cluster.replicas["w0"].exchange(2, cluster.names, cluster.fetch_for("w0"))
    assert report.failed == ["w2"] and report.merged == ["w1"]
    # the survivors forget w2; its rows after its synced offset go back to the ledger
    live = ["w0", "w1"]
    for name in live:
        cluster.replicas[name].set_peers(live)
    run_round(cluster, 3, live, gen, train_between=False)
    run_round(cluster, 4, live, gen, train_between=False)
    a, b = (cluster.replicas[n] for n in live)
    for t in a.tables:
        torch.testing.assert_close(a.tables[t], b.tables[t], rtol=0, atol=1e-12)
    assert cluster.replicas["w2"].synced_offset() == 0
    assert a.synced_offset() == cluster.offsets["w0"]


def assert_bit_identical(a: ReplicaSync, b: ReplicaSync) -> None:
    for t in a.tables:
        assert torch.equal(a.tables[t], b.tables[t]), t
    for p, q in zip(a.dense, b.dense):
        assert torch.equal(p, q)


def end_job(cluster: Cluster, names: list[str], round: int) -> tuple[str, dict[str, LeaderRows]]:
    """The final round as BackgroundSync.finish runs it: the scheduler names the leader, the
    leader pulls every other member and merges, each other member adopts the rows the leader
    sends for its changed rows. Returns the leader and what it sent to each member."""
    scheduler = SyncScheduler(group_size=len(names), max_wait_s=1.0)
    for name in names:
        scheduler.join(name)
    for _ in range(2):  # the last one forms the final group, the others pick it up
        for name in names:
            scheduler.ready(name, cluster.offsets[name], now=0.0, final=True)
    leader = scheduler.final_leader()
    assert leader is not None and scheduler.final_step(leader) == "gather"
    report = cluster.replicas[leader].exchange(round, names, cluster.fetch_for(leader))
    assert report.failed == [] and sorted(report.merged) == sorted(set(names) - {leader})
    scheduler.gathered(leader)
    sent = {}
    for name in names:
        if name != leader:
            assert scheduler.final_step(name) == "adopt"
            replica = cluster.replicas[name]
            sent[name] = cluster.replicas[leader].serve_rows(replica.changed_rows())
            replica.adopt_rows(sent[name])
            scheduler.adopted(name, leader)
    assert scheduler.final_done()
    return leader, sent


def test_a_dead_peer_s_rows_past_its_ledger_rows_leave_every_survivor() -> None:
    """w2's last entry reached w1 only, and the ledger never heard that its rows were synced:
    when w2 dies, w1 takes it out again, so both survivors hold w2's rows exactly up to the
    ledger's (which trains the rest again) and the final round leaves them bit-identical."""
    cluster = Cluster(3)
    gen = torch.Generator().manual_seed(2)
    for name in cluster.names:
        cluster.train(name, gen)
    run_round(cluster, 1, cluster.names, gen, train_between=False)
    run_round(cluster, 2, cluster.names, gen, train_between=False)  # acknowledges round 1
    cluster.train("w2", gen)
    w0, w1, w2 = (cluster.replicas[n] for n in cluster.names)
    w1.exchange(3, ["w1", "w2"], cluster.fetch_for("w1"))  # only w1 got w2's last entry
    late = w2.log.last_seq
    ledger = {"w2": w2.synced_offset()}  # what w2 reported last
    assert ledger["w2"] == cluster.offsets["w2"] - 64
    cluster.dead.add("w2")
    assert w1.log.applied_seq("w2") == late > w0.log.applied_seq("w2")
    survivors = ["w0", "w1"]
    for name in survivors:
        cluster.replicas[name].set_peers(survivors, departed=ledger)
    # neither holds w2's last step (its dense snapshot reached w1: averaged, not taken back)
    assert_identical(cluster, survivors, synced=ledger, dense=False)
    leader, _ = end_job(cluster, survivors, 4)
    assert leader == "w0"  # the smallest address: every survivor holds the same of w2
    assert_bit_identical(w0, w1)
    assert_identical(cluster, survivors, synced=ledger)
    run_round(cluster, 5, survivors, gen, train_between=False)
    assert_bit_identical(w0, w1)


def test_a_joiner_takes_out_what_its_snapshot_held_of_a_dead_peer() -> None:
    """The snapshot a joiner copies holds the provisional entries in its tables; when their
    source leaves, the joiner takes them out like every other member."""
    cluster = Cluster(3)
    gen = torch.Generator().manual_seed(3)
    for name in cluster.names:
        cluster.train(name, gen)
    run_round(cluster, 1, cluster.names, gen, train_between=False)
    cluster.train("w2", gen)
    run_round(cluster, 2, cluster.names, gen, train_between=False)
    joiner = cluster.add("j")
    snapshot = cluster.replicas["w0"].snapshot()
    assert snapshot.kept["w2"] and snapshot.kept["w0"]  # nothing was confirmed
    ledger = {"w2": 64}  # the ledger counts only w2's first step done
    cluster.dead.add("w2")
    joiner.adopt(snapshot)
    live = ["w0", "w1", "j"]
    for name in live:
        cluster.replicas[name].set_peers(live, departed=ledger)
    run_round(cluster, 3, live, gen, train_between=False)
    assert_identical(cluster, live, synced=ledger)


def test_a_lone_member_s_rows_are_in_the_snapshot_a_joiner_copies() -> None:
    """Down to one member (its peer died), a replica reports its trained rows synced only once
    they are published (``ledger_offset``): a joiner's snapshot holds every row the ledger
    counts done, so the lone member may die right after the snapshot without losing one."""
    cluster = Cluster(2)
    gen = torch.Generator().manual_seed(8)
    for name in cluster.names:
        cluster.train(name, gen)
    run_round(cluster, 1, cluster.names, gen, train_between=False)
    run_round(cluster, 2, cluster.names, gen, train_between=False)
    w0, w1 = (cluster.replicas[n] for n in cluster.names)
    ledger = {"w1": w1.ledger_offset()}
    assert ledger["w1"] == cluster.offsets["w1"]
    cluster.dead.add("w1")
    w0.set_peers(["w0"], departed=ledger)
    for _ in range(3):
        cluster.train("w0", gen)
    assert w0.ledger_offset() == cluster.offsets["w0"]  # alone: every trained row, published
    joiner = cluster.add("j")
    joiner.adopt(w0.snapshot())
    for t, table in joiner.tables.items():  # w0 may die now: j holds every row it reported
        torch.testing.assert_close(table, cluster.expected_tables()[t], rtol=0, atol=1e-10)


def test_the_final_round_copies_the_changed_rows_not_the_tables() -> None:
    """Big tables, few rows trained, partial groups that added deltas in different orders: the
    final round leaves every member bit-identical, and what the leader sends each member is the
    rows trained during the job (ids and values) and the dense parameters, far below the model
    that a whole-state copy would send."""
    cluster = Cluster(3, rows=50_000)
    gen = torch.Generator().manual_seed(11)
    for round in range(1, 30):
        cluster.train(cluster.rng.choice(cluster.names), gen)
        run_round(cluster, round, cluster.rng.sample(cluster.names, 2), gen, train_between=True)
    replicas = [cluster.replicas[name] for name in cluster.names]
    assert not all(torch.equal(replicas[0].tables[t], r.tables[t])
                   for r in replicas[1:] for t in r.tables)
    leader, sent = end_job(cluster, cluster.names, 100)
    for replica in replicas:
        assert_bit_identical(cluster.replicas[leader], replica)
    assert_identical(cluster, cluster.names)
    space = replicas[0].log.space
    trained = torch.cat([(cluster.total[t] != 0).any(1) for t in space.tables]).nonzero()
    dense_bytes = tensor_bytes(replicas[0].dense)
    model_bytes = tensor_bytes(space.tables.values()) + dense_bytes
    for rows in sent.values():
        assert rows.ids.tolist() == trained.squeeze(1).tolist()
        assert rows.nbytes == len(trained) * (8 + DIM * 8) + dense_bytes
        assert rows.nbytes + (space.rows + 7) // 8 < model_bytes / 10  # the mask sent: 1 bit a row


def test_once_training_ended_the_leader_takes_its_answer_once_for_every_member() -> None:
    """After the gather the leader changed every row any member did: each member gets the same
    answer (taken once, not once per member), and each still ends bit-identical. A merge into
    the leader, or a member with a row the leader never changed, gets a fresh answer."""
    cluster = Cluster(3, delta_dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(12)
    for round in range(1, 10):
        cluster.train(cluster.rng.choice(cluster.names), gen)
        run_round(cluster, round, cluster.rng.sample(cluster.names, 2), gen, train_between=True)
    for replica in cluster.replicas.values():
        replica.drop_cut()  # training ended
    leader, sent = end_job(cluster, cluster.names, 100)
    first, second = sent.values()
    assert first is second
    for replica in cluster.replicas.values():
        assert_bit_identical(cluster.replicas[leader], replica)

    served = cluster.replicas[leader]
    member = next(r for name, r in cluster.replicas.items() if name != leader)
    run_round(cluster, 101, cluster.names, gen, train_between=False)  # a merge, nothing new
    again = served.serve_rows(member.changed_rows())
    assert again is not first and again.ids.tolist() == first.ids.tolist()
    assert served.serve_rows(member.changed_rows()) is again
    unchanged = int((~served.changed_rows()).nonzero()[0])
    wider = member.changed_rows()
    wider[unchanged] = True
    extra = served.serve_rows(wider)
    assert extra is not again and unchanged in extra.ids.tolist()
    assert extra.ids.numel() == again.ids.numel() + 1
    assert served.serve_rows(member.changed_rows()) is again


def test_own_entries_the_leader_never_applied_are_dropped_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = Cluster(2)
    gen = torch.Generator().manual_seed(6)
    w0, w1 = (cluster.replicas[n] for n in cluster.names)
    for name in cluster.names:
        cluster.train(name, gen)
    run_round(cluster, 1, cluster.names, gen, train_between=False)
    cluster.train("w1", gen)
    w1.prepare(2)  # an entry that the leader w0 never pulls
    with caplog.at_level(logging.WARNING, logger="antdt.sync.embeddings"):
        w1.adopt_rows(w0.serve_rows(w1.changed_rows()))
    assert "w0 lacks our entries 2..2" in caplog.text
    assert_bit_identical(w0, w1)
    assert w1.log.last_seq == w0.log.applied_seq("w1") == 1
    run_round(cluster, 3, cluster.names, gen, train_between=False)  # nobody adds it on top
    assert_bit_identical(w0, w1)
    with pytest.raises(SyncError, match="its own rows"):
        w0.adopt_rows(w0.serve_rows(w0.changed_rows()))
    bad = w0.serve_rows(w1.changed_rows())
    with pytest.raises(SyncError, match=r"rows must be \(\d+, 3\)"):
        w1.adopt_rows(LeaderRows("w0", bad.ids, bad.rows[:, :2], bad.dense, bad.applied))
    with pytest.raises(SyncError, match="changed rows must be"):
        w0.serve_rows(torch.zeros(3, dtype=torch.bool))


def test_adopt_copies_in_place_and_keeps_own_published_entries() -> None:
    cluster = Cluster(2)
    gen = torch.Generator().manual_seed(4)
    w0, w1 = (cluster.replicas[n] for n in cluster.names)
    cluster.train("w0", gen)
    cluster.train("w1", gen)
    w1.prepare(1)  # w1 published an entry that w0 never pulled ...
    cluster.train("w1", gen)  # ... and made a change it did not publish yet
    storage = {t: table.data_ptr() for t, table in w1.tables.items()}
    w0.prepare(1)
    cluster.train("w0", gen)  # not in w0's snapshot: w1 pulls it later
    snapshot = w0.snapshot()
    assert snapshot.applied == {"w0": 1}
    w1.adopt(snapshot)
    assert {t: table.data_ptr() for t, table in w1.tables.items()} == storage  # in place
    assert w1.log.applied_seq("w0") == 1
    run_round(cluster, 2, cluster.names, gen, train_between=False)
    expected = cluster.expected_tables()  # every step of both: nothing lost, nothing twice
    for t in expected:
        torch.testing.assert_close(w1.tables[t], expected[t], rtol=0, atol=1e-10)
        torch.testing.assert_close(w0.tables[t], expected[t], rtol=0, atol=1e-10)
    with pytest.raises(SyncError, match="own snapshot"):
        w0.adopt(w0.snapshot())
    with pytest.raises(SyncError, match="does not match"):
        w0.adopt(ReplicaSnapshot("w1", [torch.zeros(1)], snapshot.tables, {},
                                 snapshot.changed))


def settle(cluster: Cluster, scheduler: SyncScheduler, names: list[str]) -> None:
    """Every member in ``names`` applies the current member list and acknowledges it."""
    for name in names:
        cluster.replicas[name].set_peers(scheduler.members())
        scheduler.acknowledge(name, scheduler.members_version)


def churn(cluster: Cluster, round: int, gen: torch.Generator) -> int:
    """Train every original member, then two full rounds: every entry so far is acknowledged
    by all three and dropped."""
    for name in ("w0", "w1", "w2"):
        cluster.train(name, gen)
    for r in (round, round + 1):
        run_round(cluster, r, ["w0", "w1", "w2"], gen, train_between=False)
    return round + 2


@pytest.mark.parametrize("wait_for_settle", [False, True])
def test_a_joiner_snapshots_only_once_every_source_knows_it(wait_for_settle: bool) -> None:
    """The hazard the settle step prevents: a snapshot taken while a source does not know the
    joiner yet lets that source drop entries after the snapshot's cursor; the joiner's pulls then
    fail for good. With the settle step every pull succeeds and the joiner converges."""
    cluster = Cluster(3)
    gen = torch.Generator().manual_seed(5)
    scheduler = SyncScheduler(group_size=4, max_wait_s=1.0)
    for name in cluster.names:
        scheduler.join(name)
    settle(cluster, scheduler, cluster.names)
    round = churn(cluster, 1, gen)
    assert len(cluster.replicas["w1"].log) == 0  # everything dropped: a joiner must bootstrap
    joiner = cluster.add("j")
    scheduler.join_running("j")
    assert scheduler.waiting_for("j") == ["w0", "w1", "w2"] and not scheduler.settled("j")
    joiner.set_peers(scheduler.members())
    if wait_for_settle:
        settle(cluster, scheduler, ["w0", "w1", "w2"])
        assert scheduler.settled("j")
    snapshot = cluster.replicas["w0"].snapshot()
    round = churn(cluster, round, gen)  # w1 drops entries after w0's cursor unless it knows j
    settle(cluster, scheduler, ["w0", "w1", "w2"])
    joiner.adopt(snapshot)
    fetch = cluster.fetch_for("j")
    if not wait_for_settle:
        with pytest.raises(SyncError, match="must bootstrap"):
            fetch("w1", round, joiner.log.applied_seq("w1"))
        return
    for _ in range(10):
        cluster.train("j", gen)
        members = cluster.rng.sample(cluster.names, 2)
        run_round(cluster, round, members, gen, train_between=True)
        round += 1
    report = joiner.exchange(round, cluster.names, fetch)
    assert report.failed == [] and len(report.merged) == 3
    run_round(cluster, round + 1, cluster.names, gen, train_between=False)
    assert_identical(cluster, cluster.names)
    # the joiner's changed rows came with its snapshot: the final round leaves all bit-identical
    leader, _ = end_job(cluster, cluster.names, round + 2)
    for name in cluster.names:
        assert_bit_identical(cluster.replicas[leader], cluster.replicas[name])


def test_payload_that_cannot_be_applied_is_skipped() -> None:
    cluster = Cluster(2)
    a = cluster.replicas["w0"]
    bad = PeerPayload("w1", [], [torch.zeros(1)], a.log.space.layout)
    report = a.merge(1, a.prepare(1), [bad])
    assert report.failed == ["w1"] and report.merged == []
    own = a.prepare(1)
    other_tables = PeerPayload("w1", [], [p.clone() for p in own], "a:40;b:21x3")
    report = a.merge(1, own, [other_tables])
    assert report.failed == ["w1"] and report.merged == []
    torch.testing.assert_close(a.dense[0], cluster.initial_dense[0])


def test_training_thread_and_background_exchanges_run_concurrently() -> None:
    cluster = Cluster(3)
    stop = threading.Event()
    errors: list[BaseException] = []
    steps = dict.fromkeys(cluster.names, 0)

    def trainer(name: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        try:
            while not stop.is_set():
                cluster.train(name, gen)
                steps[name] += 1
        except BaseException as exc:  # re-raised by the test below
            errors.append(exc)

    threads = [threading.Thread(target=trainer, args=(n, i)) for i, n in enumerate(cluster.names)]
    for thread in threads:
        thread.start()
    try:
        for round in range(1, 40):
            members = cluster.rng.sample(cluster.names, 2)
            for name in members:
                cluster.replicas[name].exchange(round, members, cluster.fetch_for(name))
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=30)
    assert not errors and min(steps.values()) > 0
    gen = torch.Generator()
    run_round(cluster, 1000, cluster.names, gen, train_between=False)
    assert_identical(cluster, cluster.names)


def test_defaults_come_from_dask_config() -> None:
    with dask.config.set({"antdt.sync.group-size": 3, "antdt.sync.max-wait": "250ms",
                          "antdt.sync.keep-rounds": 2}):
        s = SyncScheduler()
        replica = ReplicaSync("w", make_dense(), make_tables())
    assert (s.group_size, s.max_wait_s) == (3, 0.25)
    for round in (1, 2, 3):
        replica.prepare(round)
    snapshot = replica.prepare(3)
    assert replica.prepare(3) is snapshot and replica.prepare(1) is not snapshot  # 1 evicted
    with dask.config.set({"antdt.sync.group-size": "four"}), \
            pytest.raises(antdt.errors.ConfigError, match="antdt.sync.group-size"):
        SyncScheduler()
    assert replica.log.delta_dtype == torch.bfloat16  # the default: deltas rounded on the wire
    with dask.config.set({"antdt.sync.delta-dtype": "float32"}):
        assert ReplicaSync("w", make_dense(), make_tables()).log.delta_dtype == torch.float32
    with dask.config.set({"antdt.sync.delta-dtype": "int8"}), pytest.raises(
            antdt.errors.ConfigError, match="antdt.sync.delta-dtype: expected one of bfloat16, "
                                            "float16, float32, found 'int8'"):
        ReplicaSync("w", make_dense(), make_tables())


def test_the_replica_lock_lets_a_waiting_sync_call_in_before_the_next_step() -> None:
    lock = ReplicaLock()
    steps: list[int] = []
    in_first_step, first_step_may_end = threading.Event(), threading.Event()

    def train() -> None:
        for step in range(20):
            with lock.training():
                steps.append(step)
                if step == 0:
                    in_first_step.set()
                    first_step_may_end.wait(60.0)

    def merge() -> int:
        with lock:
            return len(steps)

    trainer = bounded.start(train)
    assert in_first_step.wait(60.0)
    merging = bounded.start(merge)
    bounded.until(lambda: lock.waiting == 1, "the sync call waits for the lock")
    first_step_may_end.set()
    assert merging.result() == 1  # in right after the first step, not after several
    trainer.result()
    assert steps == list(range(20)) and lock.waiting == 0


@pytest.mark.parametrize("delta_dtype", [torch.bfloat16, torch.float32])
def test_held_bytes_are_what_a_replica_allocates_beside_its_tables(
        delta_dtype: torch.dtype) -> None:
    storage = torch.randn(3000, 16)
    tables = {"a": storage[:1000], "b": storage[1000:]}
    dense = [torch.randn(100, 10), torch.randn(10)]
    # the profiler counts every tensor allocated and freed on the CPU while it records
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        replica = ReplicaSync("w", dense, tables, peers=["p"], keep_rounds=3,
                              delta_dtype=delta_dtype)
        for round in range(1, 6):
            replica.cut()
            replica.prepare(round)
        replica.cut()  # one that no round took yet
    allocated = sum(event.self_cpu_memory_usage for event in recorded.key_averages())
    expected = held_bytes(3000, tensor_bytes([storage]), tensor_bytes(dense), keep_rounds=3,
                          delta_dtype=delta_dtype)
    assert expected == 3000 * 16 * 4 + 3000 * (3 if delta_dtype != torch.float32 else 2) \
        + 4 * 1010 * 4
    # beyond it only the row space's bounds: a few int64
    assert expected <= allocated <= expected + 64, (allocated, expected)
