"""The sync protocol on real TorchRec replicas: two DLRMs with fused (FBGEMM row-wise Adagrad)
embedding tables train on different rows, exchange in process, and keep training in place."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch

from antdt.sync import PeerPayload, ReplicaSync
from data.reader import ShardReader
from data.synth import SynthResult, generate
from models.config import ModelConfig, OptimConfig
from models.ranking import dense_parameters, embedding_tables
from models.train_step import TrainStep

CPU = torch.device("cpu")
MODEL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1))
OPTIM = OptimConfig(sparse_lr=0.05, dense_lr=0.01)
ROW_GROUP, BATCH = 512, 128


class Worker:
    """One replica: a TrainStep and its ReplicaSync over the model's live tensors."""

    def __init__(self, name: str, data: SynthResult) -> None:
        self.step = TrainStep(data.schema, MODEL, OPTIM, device=CPU, seed=0)
        self.replica = ReplicaSync(name, [p for _, p in dense_parameters(self.step.model)],
                                   embedding_tables(self.step.model), peers=["a", "b"])
        self.reader = ShardReader(data.schema, threads=1)
        self.path = data.files[0]
        self.rows = 0

    def train(self, row_group: int) -> list[float]:
        """Train on every row of ``row_group`` as the agent does: step under the replica lock,
        then mark the batch's ids as touched."""
        losses = []
        for start in range(0, ROW_GROUP, BATCH):
            batch = self.reader.read(self.path, row_group, start, start + BATCH)
            with self.replica.lock:
                losses.append(self.step.step(batch))
            self.rows += BATCH
            self.replica.touch(touched(batch), self.rows)
        return losses

    def eval_loss(self, batch: Batch) -> float:
        logits = torch.logit(self.step.predict(batch).clamp(1e-6, 1 - 1e-6))
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.labels).item()


def touched(batch: Batch) -> dict[str, torch.Tensor]:
    kjt = batch.sparse_features
    return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))


def fetch_for(workers: dict[str, Worker],
              requester: str) -> Callable[[str, int, int], PeerPayload]:
    def fetch(peer: str, round: int, since_seq: int) -> PeerPayload:
        return workers[peer].replica.serve(requester, round, since_seq)
    return fetch


def exchange(workers: dict[str, Worker], round: int) -> None:
    for name, worker in workers.items():
        report = worker.replica.exchange(round, list(workers), fetch_for(workers, name))
        assert report.failed == [] and report.merged == [n for n in workers if n != name]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SynthResult:
    return generate(str(tmp_path_factory.mktemp("synth")), rows=8 * ROW_GROUP, num_dense=3,
                    num_sparse=3, row_group_rows=ROW_GROUP, files_per_day=1, seed=3)


def test_fused_replicas_sync_in_place_and_keep_training(data: SynthResult) -> None:
    workers = {"a": Worker("a", data), "b": Worker("b", data)}
    a, b = workers["a"], workers["b"]
    initial = {t: w.clone() for t, w in a.replica.tables.items()}
    for t, w in b.replica.tables.items():
        assert torch.equal(w, initial[t])  # same seed: the same initial model
    # FBGEMM keeps every table in one buffer: a publish or an apply is one kernel over all of them
    assert a.replica.log.space.flat is not None
    held_out = a.reader.read(a.path, 7, 0, ROW_GROUP)
    loss_initial = a.eval_loss(held_out)

    a.train(0)
    b.train(1)
    delta = {name: {t: w - initial[t] for t, w in worker.replica.tables.items()}
             for name, worker in workers.items()}
    trained_dense = {name: [p.detach().clone() for p in worker.replica.dense]
                     for name, worker in workers.items()}
    assert all(d.abs().sum() > 0 for worker_delta in delta.values() for d in worker_delta.values())
    exchange(workers, round=1)

    # tables: initial + the sum of both replicas' deltas, on both (nothing diluted), but for
    # what rounding the deltas to bfloat16 (the default) left out of the peer's: that stays in
    # its current - base, for its next delta
    expected = {t: initial[t] + delta["a"][t] + delta["b"][t] for t in initial}
    for name, worker in workers.items():
        peer = workers["b" if name == "a" else "a"].replica
        for t, base in peer.log.state(peer.worker).tables.items():
            torch.testing.assert_close(worker.replica.tables[t] + (peer.tables[t] - base),
                                       expected[t], rtol=0, atol=1e-6)
    # training ended: the next round sends what rounding left out, exactly
    for worker in workers.values():
        worker.replica.drop_cut()
    exchange(workers, round=2)
    for t in initial:
        for worker in workers.values():
            torch.testing.assert_close(worker.replica.tables[t], expected[t], rtol=0, atol=1e-6)
    # dense: the average of the two trained replicas
    for i, (pa, pb) in enumerate(zip(trained_dense["a"], trained_dense["b"])):
        for worker in workers.values():
            torch.testing.assert_close(worker.replica.dense[i].detach(), (pa + pb) / 2,
                                       rtol=0, atol=1e-6)
    # the fused lookup reads the synced rows: both models now compute the same function
    torch.testing.assert_close(a.step.predict(held_out), b.step.predict(held_out), rtol=0,
                               atol=1e-5)
    # the final round makes them bit-identical from the rows trained only, and the fused lookup
    # reads the rows written in place
    copied = b.replica.adopt_rows(a.replica.serve_rows(b.replica.changed_rows()))
    assert 0 < copied < b.replica.log.space.rows
    assert torch.equal(a.step.predict(held_out), b.step.predict(held_out))
    for t, w in a.replica.tables.items():
        assert torch.equal(w, b.replica.tables[t])
    loss_synced = a.eval_loss(held_out)
    assert loss_synced < loss_initial

    # the fused optimizer keeps updating the same storage: one step moves exactly its rows
    before = {t: w.clone() for t, w in a.replica.tables.items()}
    batch = a.reader.read(a.path, 2, 0, BATCH)
    with a.replica.lock:
        a.step.step(batch)
    for t, ids in touched(batch).items():
        moved = (a.replica.tables[t] != before[t]).any(dim=1).nonzero().squeeze(1)
        assert set(moved.tolist()) <= set(ids.tolist()) and moved.numel() > 0
        assert (a.replica.tables[t][moved] - before[t][moved]).abs().max() < 0.5
    a.rows += BATCH
    a.replica.touch(touched(batch), a.rows)

    # and training goes on learning after in-place syncs
    for round, (ga, gb) in enumerate([(2, 3), (4, 5), (2, 6), (3, 4)], start=2):
        a.train(ga)
        b.train(gb)
        exchange(workers, round)
    assert a.eval_loss(held_out) < loss_synced
    b.replica.adopt_rows(a.replica.serve_rows(b.replica.changed_rows()))
    assert torch.equal(a.step.predict(held_out), b.step.predict(held_out))
