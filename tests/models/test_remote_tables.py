"""RemoteTableStep with a plain in-test host trains as TrainStep does, and its snapshots are
TrainStep's."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import models.train_step
from antdt.errors import ConfigError
from antdt.tables.optim import RowOptimizer
from models.config import OptimConfig
from models.ranking import dense_parameters, embedding_tables, sparse_optimizer
from models.remote_tables import RemoteTableStep, TableLayout, initial_rows
from models.train_step import TrainStep
from small_model import CPU, SCHEMA, SMALL, batches

LAYOUT = TableLayout.from_schema(SCHEMA, SMALL)  # C1 50, C2 30, tags 20 rows: 100 global rows


class Host:
    """Every table row in one tensor, updated as a table host updates its rows."""

    def __init__(self, optim: OptimConfig, seed: int) -> None:
        self.optimizer = RowOptimizer(optim.sparse_optimizer, lr=optim.sparse_lr, eps=optim.eps)
        self.weights = initial_rows(LAYOUT, seed, 0, LAYOUT.total_rows)
        self.state = torch.zeros(LAYOUT.total_rows, self.optimizer.state_width(LAYOUT.dim))

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        delta_w, delta_s = self.optimizer.update(self.weights[ids], self.state[ids], grads)
        self.weights.index_add_(0, ids, delta_w)
        self.state.index_add_(0, ids, delta_s)

    def tables(self) -> dict[str, torch.Tensor]:
        return {f: self.weights[a:b] for f, a, b in zip(LAYOUT.features, LAYOUT.offsets,
                                                        LAYOUT.offsets[1:])}

    def sparse_state(self) -> dict[str, torch.Tensor]:
        return {f: self.state[a:b] for f, a, b in zip(LAYOUT.features, LAYOUT.offsets,
                                                      LAYOUT.offsets[1:])}


def stacked_tables(step: TrainStep) -> torch.Tensor:
    return torch.cat([embedding_tables(step.model)[f] for f in LAYOUT.features])


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_the_layout_numbers_rows_table_after_table() -> None:
    assert LAYOUT.features == ("C1", "C2", "tags") and LAYOUT.rows == (50, 30, 20)
    assert LAYOUT.offsets == (0, 50, 80, 100) and LAYOUT.total_rows == 100 and LAYOUT.dim == 8


def test_initial_rows_are_the_train_steps_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.train_step, "INIT_CHUNK_ELEMENTS", 24)  # chunks of 3 rows
    tables = stacked_tables(TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU, seed=5))
    for start, stop in [(0, 100), (7, 53), (49, 51), (50, 80), (79, 97), (33, 33), (99, 100)]:
        assert torch.equal(initial_rows(LAYOUT, 5, start, stop), tables[start:stop]), (start, stop)
    assert not torch.equal(initial_rows(LAYOUT, 6, 7, 53), tables[7:53])
    with pytest.raises(ValueError, match=r"rows \[90, 101\) are not inside the 100 global rows"):
        initial_rows(LAYOUT, 5, 90, 101)


@pytest.mark.parametrize("arch,kind", [("dlrm", "rowwise_adagrad"), ("dcn", "rowwise_adagrad"),
                                       ("dlrm", "adagrad"), ("dlrm", "sgd")])
def test_three_steps_match_the_train_step(arch: str, kind: str) -> None:
    model = SMALL.__class__(**{**SMALL.to_dict(), "arch": arch})
    optim = OptimConfig(sparse_optimizer=kind, sparse_lr=0.1, dense_lr=0.01)
    local = TrainStep(SCHEMA, model, optim, device=CPU, seed=2)
    remote = RemoteTableStep(SCHEMA, model, optim, device=CPU, seed=2)
    host = Host(optim, seed=2)
    dense = [p for _, p in dense_parameters(local.model)]
    assert len(dense) == len(remote.dense()) and all(
        torch.equal(a, b) for a, b in zip(dense, remote.dense()))

    for batch in batches(3):
        ids = remote.rows_of(batch)
        assert torch.equal(ids, torch.unique(ids)) and ids.dtype == torch.int64
        loss, grads = remote.step(batch, ids, host.weights[ids])
        assert grads.shape == (len(ids), LAYOUT.dim)
        host.push(ids, grads)
        assert abs(loss - local.step(batch)) < 1e-5
    for a, b in zip(dense, remote.dense()):
        close(b, a)
    close(host.weights, stacked_tables(local))
    assert not torch.equal(host.weights, initial_rows(LAYOUT, 2, 0, 100))
    assert remote.rows_trained == local.rows_trained == 48

    snapshot, expected = remote.state_dict(host.tables(), host.sparse_state()), local.state_dict()
    assert snapshot.keys() == expected.keys() and snapshot["rows_trained"] == 48
    assert snapshot["model"].keys() == expected["model"].keys()
    for key, value in expected["model"].items():
        close(snapshot["model"][key], value)
    fused = expected["sparse_optimizer"]["state"]
    assert snapshot["sparse_optimizer"]["state"].keys() == fused.keys()
    for param, entries in fused.items():
        assert snapshot["sparse_optimizer"]["state"][param].keys() == entries.keys()
        for name, value in entries.items():
            close(snapshot["sparse_optimizer"]["state"][param][name], value)


def test_a_snapshot_loads_into_a_train_step_and_resumes() -> None:
    optim = OptimConfig(sparse_lr=0.1, dense_lr=0.01)
    remote = RemoteTableStep(SCHEMA, SMALL, optim, device=CPU, seed=1)
    host = Host(optim, seed=1)
    first, second, probe = batches(3, seed=4)
    for batch in (first, second):
        ids = remote.rows_of(batch)
        host.push(ids, remote.step(batch, ids, host.weights[ids])[1])
    snapshot = remote.state_dict(host.tables(), host.sparse_state())
    assert "C1.weight.momentum_1" in snapshot["sparse_optimizer"]["state"]["C1.weight"]

    local = TrainStep(SCHEMA, SMALL, optim, device=CPU, seed=7)
    local.load_state_dict(snapshot)
    ids = remote.rows_of(probe)
    close(local.predict(probe), remote.predict(probe, ids, host.weights[ids]))
    assert local.rows_trained == 32

    resumed = RemoteTableStep(SCHEMA, SMALL, optim, device=CPU, seed=7)
    resumed.load_dense(snapshot)
    assert all(torch.equal(a, b) for a, b in zip(resumed.dense(), remote.dense()))
    assert resumed.rows_trained == 32
    loss, grads = resumed.step(probe, ids, host.weights[ids])
    assert loss == pytest.approx(local.step(probe), abs=1e-5)
    host.push(ids, grads)
    close(host.weights, stacked_tables(local))
    momentum = sparse_optimizer(local.model).state_dict()["state"]["tags.weight"]
    close(host.sparse_state()["tags"].squeeze(1), momentum["tags.weight.momentum_1"])


def test_bad_input_is_refused() -> None:
    remote = RemoteTableStep(SCHEMA, SMALL, OptimConfig(), device=CPU)
    batch = batches(1)[0]
    ids = remote.rows_of(batch)
    rows = initial_rows(LAYOUT, 0, 0, 100)[ids]
    with pytest.raises(ValueError, match="do not hold every row"):
        remote.step(batch, ids[1:], rows[1:])
    with pytest.raises(ValueError, match=r"expected rows \(\d+, 8\)"):
        remote.step(batch, ids, rows[:, :4])
    kjt = batch.sparse_features
    wrong = KeyedJaggedTensor.from_lengths_sync(keys=kjt.keys(), lengths=kjt.lengths(),
                                                values=kjt.values().clone().fill_(35))
    with pytest.raises(ValueError, match="feature 'C2': id 35 is outside its table of 30 rows"):
        remote.rows_of(Batch(batch.dense_features, wrong, batch.labels))
    host = Host(OptimConfig(), seed=0)
    with pytest.raises(ValueError, match="tables must be"):
        remote.state_dict({"C1": host.weights[:50]}, host.sparse_state())
    with pytest.raises(ValueError, match="sparse_state must hold"):
        remote.state_dict(host.tables(), {**host.sparse_state(), "tags": torch.zeros(20, 8)})
    with pytest.raises(ConfigError, match="found 'adam'"):
        RemoteTableStep(SCHEMA, SMALL, OptimConfig(sparse_optimizer="adam"), device=CPU)
