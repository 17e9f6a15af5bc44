"""EmbeddingDeltaLog: deltas added (not averaged) by every peer, once each, kept until every
peer acknowledged them, taken out when their source departs; one storage syncs like separate
tables."""

from __future__ import annotations

import pytest
import torch

from antdt.sync import EmbeddingDeltaLog, LogEntry, SyncError
from antdt.sync import kernels
from sync_replicas import DIM, ROWS, make_tables


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
