"""TrainStep: it learns, it is deterministic, and a checkpoint resumes exactly."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from models.config import ModelConfig, OptimConfig
from models.evaluate import evaluate
from models.ranking import dense_parameters, embedding_tables, sparse_optimizer
import models.train_step
from data.schema import Schema
from models.train_step import TrainStep, model_bytes, seeded_block
from small_model import CPU, SCHEMA, SMALL


class Task:
    """A learnable rule: the label is 1 when a fixed per-id effect of ``C1`` plus the summed effects
    of the ``tags`` bag plus a dense term is positive. ``C2`` is noise the model must ignore."""

    def __init__(self, seed: int) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.c1_effect = torch.randn(50, generator=self.g)
        self.tag_effect = torch.randn(20, generator=self.g)

    def batch(self, rows: int) -> Batch:
        g = self.g
        c1 = torch.randint(1, 50, (rows,), generator=g)
        c2 = torch.randint(1, 30, (rows,), generator=g)
        tag_lengths = torch.randint(1, 4, (rows,), generator=g)
        tags = torch.randint(1, 20, (int(tag_lengths.sum()),), generator=g)
        dense = torch.rand(rows, 2, generator=g)
        row_of_tag = torch.repeat_interleave(torch.arange(rows), tag_lengths)
        tag_sum = torch.zeros(rows).index_add_(0, row_of_tag, self.tag_effect[tags])
        score = self.c1_effect[c1] + tag_sum + 2.0 * (dense[:, 0] - 0.5)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=SCHEMA.sparse_names, values=torch.cat([c1, c2, tags]),
            lengths=torch.cat([torch.ones(2 * rows, dtype=torch.int64), tag_lengths]))
        return Batch(dense_features=dense, sparse_features=kjt, labels=(score > 0).float())


def weights(step: TrainStep) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in step.model.state_dict().items()}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("arch", ["dlrm", "dcn"])
def test_learns_a_synthetic_rule(arch: str) -> None:
    task = Task(seed=1)
    held_out = [task.batch(512) for _ in range(2)]
    train = [task.batch(256) for _ in range(60)]
    cfg = ModelConfig(**{**SMALL.to_dict(), "arch": arch})
    step = TrainStep(SCHEMA, cfg, OptimConfig(sparse_lr=0.1, dense_lr=3e-3), device=CPU)
    before = evaluate(step.predict, held_out)
    losses = [step.step(batch) for batch in train]
    after = evaluate(step.predict, held_out)
    assert after["rows"] == before["rows"] == 1024
    assert after["auc"] > before["auc"] + 0.2, (before, after)
    assert after["logloss"] < 0.6 * before["logloss"], (before, after)
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    assert step.rows_trained == 60 * 256


def test_same_seed_same_batches_same_weights() -> None:
    batches = [Task(seed=2).batch(64) for _ in range(5)]
    a, b = (TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU, seed=7) for _ in range(2))
    assert_same_weights(weights(a), weights(b))
    for batch in batches:
        assert a.step(batch) == b.step(batch)
    assert_same_weights(weights(a), weights(b))
    other = TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU, seed=8)
    assert not torch.equal(weights(other)["over_arch.model.1.weight"],
                           weights(a)["over_arch.model.1.weight"])


def test_any_block_of_a_table_is_drawn_alone_as_the_whole_table_has_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 7 rows of 8 floats: a block across chunks and columns equals the table's
    slice, tables keep their weights when another table changes size, and the values follow
    TorchRec's default (uniform within 1/sqrt(rows)); the dense part does not depend on the
    tables either."""
    monkeypatch.setattr(models.train_step, "INIT_CHUNK_ELEMENTS", 7 * 8)
    step = TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU, seed=4)
    tables = embedding_tables(step.model)
    block = torch.empty(20, 3)
    seeded_block(block, 4, "C1", (50, 8), (12, 5))
    assert torch.equal(block, tables["C1"][12:32, 5:8])
    assert tables["C1"].abs().max() <= 50 ** -0.5
    assert tables["C1"].std() > 0.5 * 50 ** -0.5 / 3 ** 0.5  # uniform: bound / sqrt(3)
    grown = Schema.from_dict({**SCHEMA.to_dict(), "sparse": [
        {"name": "C1", "num_embeddings": 50}, {"name": "C2", "num_embeddings": 3000},
        {"name": "tags", "num_embeddings": 20, "multi_valued": True}]})
    grown_step = TrainStep(grown, SMALL, OptimConfig(), device=CPU, seed=4)
    other = embedding_tables(grown_step.model)
    assert torch.equal(other["C1"], tables["C1"]) and torch.equal(other["tags"], tables["tags"])
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(dense_parameters(step.model),
                                                            dense_parameters(grown_step.model)))
    with pytest.raises(ValueError, match=r"a block of 20 x 3 at \(40, 5\) is not inside table "
                                         r"'C1' of shape \(50, 8\)"):
        seeded_block(block, 4, "C1", (50, 8), (40, 5))


def test_seed_leaves_the_callers_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU, seed=0)
    assert torch.equal(torch.rand(3), expected)


@pytest.mark.parametrize("optim", [
    OptimConfig(),
    OptimConfig(sparse_optimizer="adagrad", dense_optimizer="adagrad", dense_lr=0.01),
    OptimConfig(sparse_optimizer="sgd", sparse_lr=0.5, dense_optimizer="sgd", dense_lr=0.05,
                weight_decay=1e-4),
])
def test_state_dict_resumes_exactly(optim: OptimConfig) -> None:
    task = Task(seed=3)
    first, then = [task.batch(64) for _ in range(3)], [task.batch(64) for _ in range(3)]
    original = TrainStep(SCHEMA, SMALL, optim, device=CPU, seed=0)
    for batch in first:
        original.step(batch)
    checkpoint = original.state_dict()
    losses = [original.step(batch) for batch in then]

    # A fresh step with another seed, so nothing matches unless the checkpoint carries it.
    resumed = TrainStep(SCHEMA, SMALL, optim, device=CPU, seed=99)
    resumed.load_state_dict(checkpoint)
    assert resumed.rows_trained == 3 * 64
    assert [resumed.step(batch) for batch in then] == losses
    assert_same_weights(weights(resumed), weights(original))
    assert resumed.rows_trained == original.rows_trained == 6 * 64
    # training the resumed step left the checkpoint as it was: a second resume trains alike
    again = TrainStep(SCHEMA, SMALL, optim, device=CPU, seed=99)
    again.load_state_dict(checkpoint)
    assert [again.step(batch) for batch in then] == losses


def test_state_dict_is_a_snapshot_including_sparse_momentum() -> None:
    step = TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU)
    task = Task(seed=4)
    step.step(task.batch(32))
    state = step.state_dict()
    momentum = state["sparse_optimizer"]["state"]["C1.weight"]["C1.weight.momentum_1"]
    assert momentum.shape == (50,) and (momentum > 0).any()
    saved_table = state["model"]["sparse_arch.embedding_bag_collection.embedding_bags.C1.weight"]
    frozen = saved_table.clone()
    step.step(task.batch(32))
    assert torch.equal(saved_table, frozen)
    assert not torch.equal(embedding_tables(step.model)["C1"], frozen)


def test_predict_is_probabilities_and_changes_nothing() -> None:
    step = TrainStep(SCHEMA, SMALL, OptimConfig(), device=CPU)
    batch = Task(seed=5).batch(16)
    before = weights(step)
    probs = step.predict(batch)
    assert probs.shape == (16,) and not probs.requires_grad
    assert ((probs > 0) & (probs < 1)).all()
    assert torch.equal(step.predict(batch), probs)
    assert_same_weights(before, weights(step))
    assert step.rows_trained == 0
    step.step(batch)
    assert step.model.training



def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("arch, optim", [
    ("dlrm", OptimConfig()),
    ("dcn", OptimConfig(sparse_optimizer="adagrad", dense_optimizer="adagrad")),
    ("dlrm", OptimConfig(sparse_optimizer="sgd", dense_optimizer="sgd")),
])
def test_model_bytes_are_the_trained_steps_tensors(arch: str, optim: OptimConfig) -> None:
    cfg = ModelConfig(**{**SMALL.to_dict(), "arch": arch})
    step = TrainStep(SCHEMA, cfg, optim, device=CPU)
    step.step(Task(seed=6).batch(32))  # gradients and the dense optimiser's state now exist
    sparse_state = [t for state in sparse_optimizer(step.model).state_dict()["state"].values()
                    for t in state.values()]
    dense = [p for _, p in dense_parameters(step.model)]
    dense_state = [p.grad for p in dense if p.grad is not None] + [
        t for state in step.dense_optimizer.state.values() for t in state.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0]  # not the scalar step counters

    size = model_bytes(SCHEMA, cfg, optim)
    assert size.tables == nbytes(embedding_tables(step.model).values()) == 100 * 8 * 4
    assert size.sparse_state == nbytes(sparse_state)
    assert size.dense == nbytes(dense) > 0
    assert size.dense_state == nbytes(dense_state)
    assert size.total == size.tables + size.sparse_state + size.dense + size.dense_state
