"""The plain sync classes: embedding delta logs, dense averaging, ReplicaSync, SyncScheduler."""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable

import dask.config
import pytest
import torch

import antdt.errors
from antdt.device import HUGE_PAGE, huge_pages
from antdt.sync import (
    EmbeddingDeltaLog,
    LeaderRows,
    LogEntry,
    MemberState,
    PeerPayload,
    ReplicaSnapshot,
    ReplicaSync,
    Staleness,
    SyncError,
    SyncGroup,
    SyncPeriod,
    SyncScheduler,
    average_dense,
)
from antdt.sync import kernels
from antdt.sync.replica import ReplicaLock, tensor_bytes
from pages import kernel_collapses, on_huge_pages
from waits import bounded

ROWS, DIM = 40, 3


def make_tables(seed: int = 0, rows: int = ROWS) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(rows, DIM, generator=gen, dtype=torch.float64),
            "b": torch.randn(rows // 2, DIM, generator=gen, dtype=torch.float64)}


def make_dense(seed: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 4, generator=gen, dtype=torch.float64),
            torch.randn(7, generator=gen, dtype=torch.float64)]


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


# ---- EmbeddingDeltaLog ---------------------------------------------------------------------


def test_publish_pull_apply_moves_a_row_without_dilution() -> None:
    a = EmbeddingDeltaLog({"t": torch.zeros(6, 2)}, peers=["b"])
    b = EmbeddingDeltaLog({"t": torch.zeros(6, 2)}, peers=["a"])
    a.tables["t"][2] += torch.tensor([1.0, 2.0])
    a.touch("t", torch.tensor([2, 2]))
    entry = a.publish(rows_offset=10)
    assert entry is not None and entry.seq == 1 and entry.rows_offset == 10
    assert entry.ids.tolist() == [2] and entry.deltas.tolist() == [[1.0, 2.0]]

    b.tables["t"][2] += torch.tensor([10.0, 0.0])
    b.touch("t", torch.tensor([2]))
    assert b.apply("a", a.pull("b", since_seq=0)) == 1
    assert b.tables["t"][2].tolist() == [11.0, 2.0]  # added, not averaged
    own = b.publish(rows_offset=5)
    assert own is not None and own.deltas.tolist() == [[10.0, 0.0]]  # a's delta not re-sent


def test_publish_without_change_is_none_and_offset_may_not_decrease() -> None:
    log = EmbeddingDeltaLog({"t": torch.zeros(3, 1)}, peers=["b"])
    assert log.publish(rows_offset=0) is None
    entry = log.publish(rows_offset=4)
    assert entry is not None and entry.ids.numel() == 0 and entry.deltas.shape == (0, 1)
    with pytest.raises(SyncError, match="must not decrease"):
        log.publish(rows_offset=3)
    with pytest.raises(SyncError, match="unknown embedding table"):
        log.touch("nope", torch.tensor([0]))
    with pytest.raises(SyncError, match="2-d"):
        EmbeddingDeltaLog({"t": torch.zeros(3)})


def test_a_lone_log_counts_a_row_synced_once_its_base_holds_it() -> None:
    """A log without peers still cuts its entries: a row counts synced only once its effect is
    in the base, which is what a joiner's snapshot and a checkpoint copy. The entry is dropped
    at once (nobody pulls it) and kept, provisional, until the ledger confirmed its rows."""
    log = EmbeddingDeltaLog({"t": torch.zeros(4, 2)}, delta_dtype=torch.bfloat16)
    assert not log.has_peers
    log.tables["t"][1] += 1.0
    log.touch("t", torch.tensor([1]))
    entry = log.publish(rows_offset=8)
    assert entry is not None and (len(log), log.synced_offset()) == (0, 8)
    state = log.state("me")
    assert state.tables["t"][1].tolist() == [1.0, 1.0]  # what a joiner copies holds the row
    assert [e.seq for e in state.kept["me"]] == [1] and state.confirmed["me"] == 0
    log.confirm(8)  # the ledger took the report: no longer provisional
    log.tables["t"][3] += 2.0
    log.touch("t", torch.tensor([3]))
    log.publish(rows_offset=16)
    state = log.state("me")
    assert [e.seq for e in state.kept["me"]] == [2] and state.confirmed["me"] == 8
    assert state.tables["t"][3].tolist() == [2.0, 2.0]


def test_a_departed_source_leaves_exactly_its_rows_past_the_ledger_s() -> None:
    """A peer keeps a source's entries past the source's confirmed offset; when the source
    departs with the rows the ledger counts synced, the peer takes out exactly the entries past
    them (current and base), and refuses the source's entries from then on."""
    src = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["dst"])
    dst = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["src"])
    for offset, row in ((8, 0), (16, 1), (24, 2)):
        src.tables["t"][row] += 1.0
        src.touch("t", torch.tensor([row]))
        src.publish(rows_offset=offset)
    entries = src.pull("dst", since_seq=0)
    assert dst.apply("src", entries[:1]) == 1
    assert dst.apply("src", entries, confirmed=8) == 2  # the ledger holds src's rows up to 8
    assert dst.tables["t"][:, 0].tolist() == [1.0, 1.0, 1.0, 0.0]
    undone = dst.depart("src", synced=16)  # src died: the ledger trains its rows past 16 again
    assert [e.seq for e in undone] == [3]
    assert dst.tables["t"][:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert dst.state("dst").tables["t"][:, 0].tolist() == [1.0, 1.0, 0.0, 0.0]  # the base too
    assert dst.depart("src", synced=16) == [] and dst.departed() == {"src": 16}
    with pytest.raises(SyncError, match="it left the job"):
        dst.apply("src", entries)
    told_more = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["src"])
    told_more.apply("src", entries, confirmed=24)
    with pytest.raises(SyncError, match="cannot be taken back"):
        told_more.depart("src", synced=16)


def test_a_checkpoint_s_tables_hold_exactly_the_rows_the_ledger_counts_done() -> None:
    """The committed tables are the base less own entries past the ledger's synced rows of this
    worker and kept entries past each source's: no unpublished change, no provisional entry
    the ledger would train again. A ledger older than what the log was told is refused."""
    a = EmbeddingDeltaLog({"t": torch.zeros(5, 1)}, peers=["b"])
    b = EmbeddingDeltaLog({"t": torch.zeros(5, 1)}, peers=["a"])
    for log, rows in ((a, (0, 1)), (b, (2, 3))):
        for offset, row in zip((8, 16), rows):
            log.tables["t"][row] += 1.0
            log.touch("t", torch.tensor([row]))
            log.publish(rows_offset=offset)
    b.apply("a", a.pull("b", since_seq=0), confirmed=0)
    b.confirm(8)
    b.tables["t"][4] += 1.0  # trained, not published
    b.touch("t", torch.tensor([4]))
    assert b.tables["t"][:, 0].tolist() == [1.0] * 5
    committed = b.committed(own_synced=8, synced={"a": 8})
    assert committed["t"][:, 0].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert b.committed(own_synced=16, synced={"a": 16})["t"][:, 0].tolist() == [1.0] * 4 + [0.0]
    b.publish(rows_offset=24)  # prunes own entries the ledger confirmed
    with pytest.raises(SyncError, match="older than the replica"):
        b.committed(own_synced=0, synced={"a": 16})
    b.apply("a", [], confirmed=8)
    with pytest.raises(SyncError, match="older than the replica"):
        b.committed(own_synced=24, synced={"a": 0})


def test_apply_is_idempotent_and_rejects_gaps() -> None:
    src = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["dst"])
    dst = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["src"])
    for offset in (1, 2, 3):
        src.tables["t"][0] += 1.0
        src.touch("t", torch.tensor([0]))
        src.publish(rows_offset=offset)
    entries = src.pull("dst", since_seq=0)
    assert dst.apply("src", entries[:2]) == 2
    assert dst.apply("src", entries) == 1  # the first two are skipped
    assert dst.apply("src", entries) == 0
    assert dst.tables["t"][0].item() == 3.0 and dst.applied_seq("src") == 3
    other = EmbeddingDeltaLog({"t": torch.zeros(4, 1)})
    with pytest.raises(SyncError, match="without gaps"):
        other.apply("src", entries[1:])
    assert other.tables["t"].abs().sum().item() == 0.0


def test_entries_dropped_once_every_peer_acknowledged() -> None:
    log = EmbeddingDeltaLog({"t": torch.zeros(4, 1)}, peers=["p", "q"])
    for offset in (10, 20):
        log.tables["t"][1] += 1.0
        log.touch("t", torch.tensor([1]))
        log.publish(rows_offset=offset)
    assert len(log) == 2 and log.synced_offset() == 0
    assert [e.seq for e in log.pull("p", since_seq=0)] == [1, 2]
    assert log.synced_offset() == 0  # receiving is not acknowledging
    log.pull("p", since_seq=2)
    log.pull("q", since_seq=1)
    assert len(log) == 1 and log.synced_offset() == 10
    log.set_peers(["p"])  # q left: forgotten
    assert len(log) == 0 and log.synced_offset() == 20
    with pytest.raises(SyncError, match="must bootstrap"):
        log.pull("late", since_seq=0)
    with pytest.raises(SyncError, match="since_seq must be"):
        log.pull("p", since_seq=3)


def test_without_peers_entries_are_synced_at_once() -> None:
    log = EmbeddingDeltaLog({"t": torch.zeros(2, 1)})
    log.tables["t"][0] += 1.0
    log.touch("t", torch.tensor([0]))
    log.publish(rows_offset=7)
    assert len(log) == 0 and log.synced_offset() == 7


@pytest.mark.parametrize(("dtype", "delta_dtype"), [
    (torch.float64, torch.float64),  # torch's index kernels on one view and per table
    (torch.float32, torch.float32),  # antdt.sync.kernels against torch's per table
    (torch.float32, torch.bfloat16),
])
def test_tables_end_to_end_in_one_storage_sync_like_separate_tables(
        dtype: torch.dtype, delta_dtype: torch.dtype) -> None:
    """The one-view path (tables are views of one buffer, as FBGEMM keeps them: one torch
    kernel, or one pass of :mod:`antdt.sync.kernels` for float32 tables) and the per-table path
    publish the same entries, bit for bit, and end with the same tables and bases, rounded
    deltas and the final exact publish included."""
    separate = {name: table.to(dtype) for name, table in make_tables().items()}
    storage = torch.cat(list(separate.values()))
    views = dict(zip(separate, storage.split([t.shape[0] for t in separate.values()])))
    logs = {"views": EmbeddingDeltaLog(views, peers=["peer"], delta_dtype=delta_dtype),
            "separate": EmbeddingDeltaLog(separate, peers=["peer"], delta_dtype=delta_dtype)}
    assert logs["views"].space.flat is not None and logs["separate"].space.flat is None
    kernel = kernels.host_rows(logs["views"].space.flat, delta_dtype) is not None
    assert kernel == (dtype == torch.float32)
    peer = EmbeddingDeltaLog({t: w.clone() for t, w in separate.items()}, peers=["me"],
                             delta_dtype=delta_dtype)
    gen = torch.Generator().manual_seed(5)
    for offset in (1, 2, 3, 4):
        exact = offset == 4  # training ended: rows owing a rounding error go out exactly
        for name in separate:
            ids = torch.randint(0, separate[name].shape[0], (6,), generator=gen)
            peer.tables[name][ids] += torch.randn(len(ids), DIM, generator=gen, dtype=dtype)
            peer.touch(name, ids)
        peer.publish(rows_offset=offset, exact=exact)
        change = {name: torch.randperm(t.shape[0], generator=gen)[:4] for name, t in
                  separate.items()}
        steps = {name: torch.randn(len(ids), DIM, generator=gen, dtype=dtype)
                 for name, ids in change.items()}
        published = []
        for log in logs.values():
            for name, ids in change.items():
                log.tables[name][ids] -= steps[name]
                log.touch(name, ids)
            published.append(log.publish(rows_offset=offset, exact=exact))
            assert log.apply("peer", peer.pull("me", since_seq=offset - 1)) > 0
        assert torch.equal(published[0].ids, published[1].ids)
        assert published[0].deltas.dtype == (dtype if exact else delta_dtype)
        assert bits_equal(published[0].deltas, published[1].deltas)
    bases = [log.state("me").tables for log in logs.values()]
    assert bases[0].keys() == separate.keys()
    for name in separate:
        assert bits_equal(views[name], separate[name]), name
        assert bits_equal(bases[0][name], bases[1][name]), name
        assert not torch.equal(views[name], make_tables()[name].to(dtype)), name


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` hold the same bits (``torch.equal`` says -0.0 == 0.0)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return a.dtype == b.dtype and torch.equal(a.view(ints), b.view(ints))


@pytest.mark.parametrize(("ids", "deltas", "match"), [
    (torch.tensor([3, 1]), torch.ones(2, DIM), "increase strictly"),
    (torch.tensor([1, 1]), torch.ones(2, DIM), "increase strictly"),
    (torch.tensor([-1, 2]), torch.ones(2, DIM), "increase strictly"),
    (torch.tensor([2, ROWS + ROWS // 2]), torch.ones(2, DIM), "increase strictly"),
    (torch.tensor([1, 2]), torch.ones(2, DIM + 1), r"deltas must be \(2, 3\)"),
    (torch.tensor([1.0, 2.0]), torch.ones(2, DIM), "int64"),
])
def test_apply_refuses_ids_outside_the_row_space(ids: torch.Tensor, deltas: torch.Tensor,
                                                  match: str) -> None:
    log = EmbeddingDeltaLog(make_tables())
    before = {name: t.clone() for name, t in log.tables.items()}
    good = LogEntry(1, torch.tensor([0]), torch.ones(1, DIM, dtype=torch.float64), 1)
    with pytest.raises(SyncError, match=match):
        log.apply("peer", [good, LogEntry(2, ids, deltas, 2)])
    for name, table in log.tables.items():
        assert torch.equal(table, before[name]), name  # nothing of the batch was applied
    assert log.applied_seq("peer") == 0


def test_tables_of_one_row_space_share_dim_and_dtype() -> None:
    with pytest.raises(SyncError, match="'b' is \\(2, torch.float64, cpu\\)"):
        EmbeddingDeltaLog({"a": torch.zeros(3, 4, dtype=torch.float64),
                           "b": torch.zeros(3, 2, dtype=torch.float64)})
    with pytest.raises(SyncError, match="'b' is \\(4, torch.float32, cpu\\)"):
        EmbeddingDeltaLog({"a": torch.zeros(3, 4, dtype=torch.float64),
                           "b": torch.zeros(3, 4)})


@pytest.mark.skipif(not kernel_collapses(), reason="the kernel moves no memory to huge pages")
def test_a_replica_s_page_steps_move_its_tables_and_its_base() -> None:
    storage = torch.randn(3 * (3 << 20) // 4)  # 9 MB of float32, as FBGEMM keeps its tables
    tables = {"a": storage[:(6 << 20) // 4].view(-1, 4), "b": storage[(6 << 20) // 4:].view(-1, 4)}
    replica = ReplicaSync("w", make_dense(), tables)
    moved = sum(replica.page_steps())
    # the tables' storage once (what it holds of whole huge pages), then the base (9 MB: 3+)
    assert moved >= huge_pages(storage, collapse=False) + 3 * HUGE_PAGE
    assert all(on_huge_pages(table) for table in replica.tables.values())


# ---- dense averaging -----------------------------------------------------------------------


def test_average_keeps_local_progress_made_during_the_exchange() -> None:
    x = [torch.tensor([1.0, 1.0])]
    own = [t.clone() for t in x]
    x[0] += torch.tensor([0.5, 0.0])  # a training step during the exchange
    average_dense(x, own, [[torch.tensor([3.0, 5.0])]])
    assert x[0].tolist() == [2.5, 3.0]
    with pytest.raises(SyncError, match="does not match"):
        average_dense(x, own, [[torch.zeros(3)]])


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


def test_pairwise_random_groups_reach_consensus_and_keep_the_mean() -> None:
    rng = random.Random(3)
    replicas = [[torch.randn(4, 3, dtype=torch.float64)] for _ in range(6)]
    mean = torch.stack([r[0] for r in replicas]).mean(0)
    for _ in range(300):
        i, j = rng.sample(range(len(replicas)), 2)
        snaps = {k: [replicas[k][0].clone()] for k in (i, j)}
        average_dense(replicas[i], snaps[i], [snaps[j]])
        average_dense(replicas[j], snaps[j], [snaps[i]])
    spread = max((r[0] - mean).abs().max().item() for r in replicas)
    assert spread < 1e-6
    torch.testing.assert_close(torch.stack([r[0] for r in replicas]).mean(0), mean,
                               rtol=0, atol=1e-12)


# ---- ReplicaSync: the protocol end to end -------------------------------------------------


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


# ---- SyncScheduler ---------------------------------------------------------------------------


def joined(names: list[str], group_size: int, max_wait_s: float,
           max_progress_gap: int | None = None, away_spans: float = 0) -> SyncScheduler:
    scheduler = SyncScheduler(group_size, max_wait_s, max_progress_gap, away_spans)
    for name in names:
        scheduler.join(name)
    return scheduler


def test_groups_have_similar_progress_and_partners_learn_on_next_call() -> None:
    s = joined(["a", "b", "c", "d"], group_size=2, max_wait_s=10.0, max_progress_gap=100)
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.ready("c", 1000, now=0.0).kind == "wait"
    answer = s.ready("d", 1010, now=0.0)
    assert answer.group is not None and answer.group.members == ("c", "d")
    assert s.state("c") is MemberState.ASSIGNED and s.state("d") is MemberState.IDLE
    assert s.ready("c", 1005, now=0.1) == answer  # handed over, whatever progress says
    answer = s.ready("b", 10, now=0.2)
    assert answer.group is not None and answer.group.members == ("a", "b")
    assert answer.group.round > 0 and not answer.group.final
    assert s.ready("a", 0, now=1.0) == answer  # a picks up its group
    assert s.ready("a", 0, now=1.0).kind == "wait"
    assert s.ready("c", 1000, now=1.0).kind == "wait"  # too far from a ...
    answer = s.ready("a", 0, now=11.0)  # ... until a waited max_wait_s
    assert answer.group is not None and answer.group.members == ("a", "c")


def test_max_wait_gives_a_partial_group_or_alone() -> None:
    s = joined(["a", "b", "c", "d"], group_size=4, max_wait_s=1.0)
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.ready("b", 5, now=0.5).kind == "wait"
    assert s.wait_left("a", now=0.5) == pytest.approx(0.5)
    answer = s.ready("a", 0, now=1.0)  # waited long enough: take whoever is ready
    assert answer.group is not None and answer.group.members == ("a", "b")
    assert s.ready("c", 0, now=2.0).kind == "wait"
    assert s.ready("c", 0, now=3.0).kind == "alone"
    assert s.state("c") is MemberState.IDLE


def test_a_worker_waiting_too_long_joins_the_next_group() -> None:
    s = joined(["lead", "a", "b"], group_size=2, max_wait_s=1.0, max_progress_gap=100)
    assert s.ready("lead", 500, now=0.0).kind == "wait"
    assert s.ready("a", 0, now=0.6).kind == "wait"
    answer = s.ready("b", 0, now=1.5)  # a is nearer, but lead has waited max_wait_s
    assert answer.group is not None and answer.group.members == ("b", "lead")
    assert s.ready("a", 0, now=1.55).kind == "wait"


def test_groups_do_not_wait_for_a_member_that_is_away() -> None:
    """Members train 1 s between asks; after 3 spans without asking, a member is away: the
    others' groups form without it, and it is grouped again when it asks."""
    s = joined(["a", "b", "c"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    now = 0.0
    for _ in range(3):  # everyone trains 1 s a span and syncs with everyone
        s.ready("a", 0, now)
        s.ready("b", 0, now)
        assert s.ready("c", 0, now).group is not None
        s.ready("a", 0, now)
        s.ready("b", 0, now)  # both pick up their group: training again from `now`
        now += 1.0
    # c hangs: it stopped asking at 2.0
    assert s.ready("a", 0, now).kind == "wait"  # c trained 1 s: not away yet
    assert s.ready("b", 0, now).kind == "wait"
    assert s.wait_left("a", now) == pytest.approx(2.0)  # c goes away at 2.0 + 3 spans
    answer = s.ready("b", 0, now=5.0)  # asked again when its wait ran out
    assert answer.group is not None and answer.group.members == ("a", "b")
    s.ready("a", 0, now=5.0)
    assert s.ready("c", 0, now=7.5).kind == "wait"  # back, and waits for a, b (2.5 s of 1 s
    s.ready("a", 0, now=7.5)                       # spans: expected, not away)
    answer = s.ready("b", 0, now=7.5)
    assert answer.group is not None and answer.group.members == ("a", "b", "c")


def test_a_member_twice_as_slow_is_late_for_the_fast_one_and_waits_for_it() -> None:
    """fast asks every second, slow every two (each at its progress, 100 rows a second): fast
    goes on alone when slow is mid-span and groups with it when slow is due; slow waits for
    fast, which is due within its span."""
    s = joined(["fast", "slow"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    s.ready("fast", 0, now=0.0)
    assert s.ready("slow", 0, now=0.0).kind == "group"
    s.ready("fast", 0, now=0.0)
    assert s.ready("fast", 100, now=1.0).kind == "wait"  # no pace measured yet: waited for
    assert s.ready("slow", 100, now=2.0).kind == "group"
    s.ready("fast", 100, now=2.0)  # both trained from 2.0: fast at 1 s a span, slow at 2 s
    assert s.ready("fast", 300, now=3.0).kind == "alone"  # slow is due at 4.0: late
    assert s.ready("fast", 400, now=4.0).kind == "wait"  # slow is due now
    answer = s.ready("slow", 200, now=4.0)
    assert answer.group is not None and answer.group.members == ("fast", "slow")
    s.ready("fast", 400, now=4.0)
    assert s.ready("fast", 500, now=5.0).kind == "alone"
    assert s.ready("slow", 300, now=6.0).kind == "wait"  # fast is due within half slow's span
    answer = s.ready("fast", 600, now=6.1)
    assert answer.group is not None and answer.group.members == ("fast", "slow")


def test_an_idle_member_waits_for_a_late_one() -> None:
    """A member that trained nothing since its previous ask (no lease left, its rows waiting
    for sync) waits for the others even when they are late: it loses no training, and its rows
    are synced only once they applied them."""
    s = joined(["fast", "slow"], group_size=4, max_wait_s=100.0, away_spans=3.0)
    s.ready("fast", 0, now=0.0)
    assert s.ready("slow", 0, now=0.0).kind == "group"
    s.ready("fast", 0, now=0.0)
    s.ready("fast", 100, now=1.0)
    assert s.ready("slow", 100, now=2.0).kind == "group"
    s.ready("fast", 100, now=2.0)  # both trained from 2.0: fast at 1 s a span, slow at 2 s
    assert s.ready("fast", 300, now=3.0).kind == "alone"  # training: slow is late
    assert s.ready("fast", 300, now=3.1).kind == "wait"  # idle: it waits for slow after all
    assert s.wait_left("fast", now=3.1) > 0
    answer = s.ready("slow", 200, now=4.0)
    assert answer.group is not None and answer.group.members == ("fast", "slow")


def test_nobody_is_away_before_a_span_is_measured_or_with_away_spans_0() -> None:
    for away_spans in (3.0, 0.0):
        s = joined(["a", "b"], group_size=2, max_wait_s=100.0, away_spans=away_spans)
        assert s.ready("a", 0, now=50.0).kind == "wait"
        assert s.wait_left("a", now=50.0) == pytest.approx(100.0)


def test_group_size_is_capped_by_active_members() -> None:
    s = joined(["a", "b", "c"], group_size=8, max_wait_s=100.0)
    s.ready("a", 0, now=0.0)
    s.ready("b", 0, now=0.0)
    answer = s.ready("c", 0, now=0.0)
    assert answer.group is not None and answer.group.members == ("a", "b", "c")
    solo = joined(["a"], group_size=2, max_wait_s=100.0)
    assert solo.ready("a", 0, now=0.0).kind == "alone"


def test_final_round_forms_when_every_live_member_finished() -> None:
    s = joined(["a", "b", "c"], group_size=2, max_wait_s=100.0)
    s.ready("a", 0, now=0.0)
    pending = s.ready("b", 0, now=0.0)  # a is ASSIGNED to this group
    assert s.ready("b", 0, now=0.0, final=True).kind == "wait"
    assert s.ready("a", 0, now=0.0, final=True) == pending  # the pending group comes first
    assert s.ready("a", 0, now=0.0, final=True).kind == "wait"
    s.ready("c", 0, now=0.0)
    with pytest.raises(SyncError, match="received the final"):
        s.final_step("c")
    with pytest.raises(SyncError, match="expected final=True"):
        s.ready("a", 0, now=0.0)
    final = s.leave("c")  # the last one still training dies
    assert final is not None and final.final and final.members == ("a", "b")
    for name in ("a", "b"):
        answer = s.ready(name, 0, now=1.0, final=True)
        assert answer.group == final and s.state(name) is MemberState.DONE
    assert s.ready("a", 0, now=2.0).group == final  # asked again: same answer
    assert s.final_leader() == "a"  # the smallest address
    assert s.departed() == {"c": 0}
    assert (s.final_step("a"), s.final_step("b")) == ("gather", "wait")
    with pytest.raises(SyncError, match="final round"):
        s.join("late")


def test_join_running_waits_for_every_member_to_acknowledge() -> None:
    s = joined(["a", "b"], group_size=2, max_wait_s=100.0)
    listed = s.members_version
    assert s.acknowledge("a", listed) is False
    s.join_running("j")
    assert s.joined_running("j") and not s.joined_running("a")
    assert s.waiting_for("j") == ["a", "b"] and not s.settled("j")
    assert s.acknowledge("a", listed) is False and s.waiting_for("j") == ["a", "b"]  # stale list
    assert s.acknowledge("a", s.members_version) is False and s.waiting_for("j") == ["b"]
    s.join_running("k")  # j has not acknowledged k's join either
    assert s.waiting_for("k") == ["a", "b", "j"]
    s.join_running("j")  # idempotent
    assert s.waiting_for("k") == ["a", "b", "j"]
    assert s.acknowledge("b", s.members_version) is True  # settles j (and acknowledges k)
    assert s.settled("j") and s.waiting_for("k") == ["a", "j"]
    s.leave("j")
    assert s.acknowledge("a", s.members_version) is True and s.settled("k")
    assert s.state("k") is MemberState.IDLE  # not grouped until it asks
    with pytest.raises(SyncError, match="members_version must be"):
        s.acknowledge("a", s.members_version + 1)
    s.started("k", now=0.0)  # it took its snapshot: the final round waits for it
    for name in s.members():
        s.ready(name, 0, now=0.0, final=True)
    with pytest.raises(SyncError, match="final round"):
        s.join_running("late")


def test_a_joiner_holds_no_group_and_no_final_round_until_it_started() -> None:
    s = joined(["a", "b", "c"], group_size=4, max_wait_s=100.0)
    s.join_running("j")
    for name in ("a", "b", "c"):
        s.acknowledge(name, s.members_version)
    assert s.settled("j")  # taking its snapshot now: the others' rounds do not wait for it
    assert [s.ready(n, 0, now=0.0).kind for n in ("a", "b", "c")] == ["wait", "wait", "group"]
    assert [s.ready(n, 0, now=1.0).kind for n in ("a", "b")] == ["group"] * 2  # handed over
    s.started("j", now=1.0)  # it trains: a full group is all four again
    assert [s.ready(n, 0, now=2.0).kind for n in ("a", "b", "c")] == ["wait"] * 3
    assert s.ready("j", 0, now=2.0).group == SyncGroup(2, ("a", "b", "c", "j"), final=False)

    s = joined(["a", "b"], group_size=4, max_wait_s=100.0)
    s.join_running("j")
    s.join_running("k")
    s.started("k", now=0.0)
    for name in ("a", "b", "k"):
        assert s.ready(name, 0, now=0.0, final=True).kind in ("wait", "group")
    assert s.final is not None and s.final.members == ("a", "b", "k")  # not waiting for j
    assert s.members() == ["a", "b", "k"]
    for call in (lambda: s.started("j", now=0.0), lambda: s.settled("j"),
                 lambda: s.ready("j", 0, now=0.0, final=True)):
        with pytest.raises(SyncError, match=r"final round \d+ formed while it was joining"):
            call()


def test_the_final_leader_gathers_and_the_others_adopt_its_rows() -> None:
    s = joined(["a", "b", "c", "d"], group_size=4, max_wait_s=100.0)
    s.leave("d", synced_rows=96)  # d died with 96 rows counted synced
    assert s.departed() == {"d": 96} and s.final_leader() is None
    for _ in range(2):  # the last one forms the final group, the others pick it up
        for name in ("c", "b", "a"):
            s.ready(name, 0, now=0.0, final=True)
    assert s.final_leader() == "a"
    assert [s.final_step(n) for n in ("a", "b", "c")] == ["gather", "wait", "wait"]
    with pytest.raises(SyncError, match="expected the final leader 'a'"):
        s.gathered("c")
    s.gathered("a")
    assert [s.final_step(n) for n in ("a", "b", "c")] == ["wait", "adopt", "adopt"]
    s.adopted("c", "a")
    assert s.final_step("c") == "wait" and s.adopted_from("c") == "a" and not s.final_done()
    s.adopted("b", "a")
    assert s.final_done() and [s.final_step(n) for n in ("a", "b", "c")] == ["done"] * 3
    s.leave("a")  # the leader dies: b leads and gathers again
    assert s.final_leader() == "b" and not s.final_done()
    assert [s.final_step(n) for n in ("b", "c")] == ["gather", "wait"]
    s.gathered("b")
    assert s.final_step("c") == "adopt"
    s.adopted("c", "b")
    assert s.final_done() and s.final_step("b") == "done"


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


def test_leave_and_unknown_workers() -> None:
    s = joined(["a", "b"], group_size=2, max_wait_s=100.0)
    version = s.members_version
    assert s.ready("a", 0, now=0.0).kind == "wait"
    assert s.leave("a") is None and s.leave("a") is None
    assert s.members() == ["b"] and s.members_version == version + 1
    assert s.ready("b", 0, now=0.0).kind == "alone"  # the waiting pool no longer holds a
    with pytest.raises(SyncError, match="not a sync member"):
        s.ready("a", 0, now=0.0)
    with pytest.raises(SyncError, match="group_size"):
        SyncScheduler(group_size=1)


def test_the_groups_of_ten_thousand_workers_are_disjoint() -> None:
    """Nobody is in two groups at once, and every group has 2 to 4 members (what an ask costs
    at this scale is `antdt bench sharding`'s figure)."""
    rng = random.Random(0)
    names = [f"w{i}" for i in range(10_000)]
    s = joined(names, group_size=4, max_wait_s=0.5)
    progress = dict.fromkeys(names, 0)
    pending: dict[str, int] = {}  # partner -> round of the group it has not picked up yet
    seen: set[int] = set()
    sizes: list[int] = []
    now = 0.0
    for _ in range(50_000):
        now += 0.001
        name = rng.choice(names)
        progress[name] += rng.randint(0, 100)
        answer = s.ready(name, progress[name], now)
        group = answer.group
        if group is None:
            assert name not in pending
        elif group.round in seen:
            assert pending.pop(name) == group.round
        else:
            seen.add(group.round)
            assert name not in pending
            for member in group.members:
                if member != name:
                    assert member not in pending  # nobody is in two groups at once
                    pending[member] = group.round
            sizes.append(len(group.members))
    assert sizes and min(sizes) >= 2 and max(sizes) == 4


# ---- SyncPeriod ----------------------------------------------------------------------------


@pytest.mark.parametrize("period", [SyncPeriod(seconds=0.25), SyncPeriod(seconds=3.0),
                                    SyncPeriod(batches=1), SyncPeriod(batches=16),
                                    SyncPeriod(peer_batches=1), SyncPeriod(peer_batches=4)],
                         ids=str)
def test_a_sync_period_reads_back_what_it_writes(period: SyncPeriod) -> None:
    assert SyncPeriod.parse(str(period)) == period


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "expected seconds, batches or peer batches (one of them)"),
    ({"seconds": 1.0, "batches": 2}, "expected seconds, batches or peer batches (one of them)"),
    ({"batches": 1, "peer_batches": 2}, "expected seconds, batches or peer batches"),
    ({"seconds": float("inf")}, "seconds must be a finite number > 0, found inf"),
    ({"batches": 0}, "batches must be an int >= 1, found 0"),
    ({"batches": 1.5}, "batches must be an int >= 1, found 1.5"),
    ({"peer_batches": 0}, "peer batches must be an int >= 1, found 0"),
])
def test_a_sync_period_refuses_what_it_cannot_mean(kwargs: dict[str, float],
                                                   message: str) -> None:
    with pytest.raises(antdt.errors.ConfigError) as info:
        SyncPeriod(**kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_a_period_in_peer_batches_keeps_what_a_replica_has_not_seen_of_its_peers() -> None:
    period = SyncPeriod.parse("6 peer batches")
    assert period == SyncPeriod(peer_batches=6)
    # members - 1 peers, each training about the period's own batches between two rounds
    assert {members: period.batches_for(members) for members in range(1, 9)} == \
        {1: 6, 2: 6, 3: 3, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1}
    assert all((members - 1) * (period.batches_for(members) or 0) <= 6
               for members in range(2, 8))


# ---- Staleness and the replica lock ----------------------------------------------------------


def test_staleness_holds_the_step_until_a_round_covers_the_batches() -> None:
    gate = Staleness(bound=1)
    for _ in range(3):
        gate.trained()
    covered = gate.round_started()  # a round covering 3 batches starts ...
    waiting = bounded.start(gate.wait, 60.0)
    gate.round_ended(covered)  # ... and ends: the step may go
    assert waiting.result() < 60.0 and gate.lag == 0
    gate.trained()
    gate.trained()
    assert gate.wait(timeout_s=0.05) >= 0.05  # no round: the wait runs out, training goes on
    gate.release()
    assert gate.wait(timeout_s=60.0) == 0.0  # the sync stopped: never wait again
    assert Staleness(bound=None).wait(timeout_s=60.0) == 0.0


def test_staleness_bounds_the_lag_past_the_sync_period() -> None:
    gate = Staleness(bound=1)
    gate.follow(period_batches=4)  # a round every 4 batches: the lag reaches 4 before it starts
    assert gate.limit == 4
    for _ in range(5):
        gate.trained()
    assert gate.wait(timeout_s=0.05) >= 0.05  # 5 > 4: the step waits
    waiting = bounded.start(gate.wait, 60.0)
    gate.follow(period_batches=8)  # a member left: the wider period releases the wait
    assert waiting.result() < 60.0 and gate.limit == 8
    gate.follow(None)  # a period in seconds: the bound alone
    assert gate.limit == 1 and Staleness(bound=None).limit is None


def test_a_staleness_bound_in_peer_batches_follows_the_members() -> None:
    gate = Staleness("2 peer batches")
    gate.follow(period_batches=4, members=2)  # one peer: its 2 batches are 2 of ours
    assert (gate.batches, gate.limit) == (2, 5)
    for _ in range(5):
        gate.trained()
    assert gate.wait(timeout_s=60.0) == 0.0  # a round may take 2 batches before training waits
    gate.follow(period_batches=4, members=3)  # a member joined: 2 peer batches are 1 of ours
    assert gate.limit == 4 and gate.wait(timeout_s=0.05) >= 0.05
    gate.follow(period_batches=4, members=1)  # alone: the whole bound
    assert gate.batches == 2 and gate.wait(timeout_s=60.0) == 0.0
    assert Staleness("3 batches").batches == 3  # own batches, whatever the members


def test_a_bad_staleness_bound_is_refused() -> None:
    for bad in (-1, 1.5, True, "1", "0 peer batches", "2 peers"):
        with pytest.raises(antdt.errors.ConfigError, match="max staleness"):
            Staleness(bad)


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
