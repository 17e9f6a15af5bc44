"""Ranking models on real TorchRec/FBGEMM modules: shapes, fused updates, the sync helpers."""

from __future__ import annotations

import pytest
import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import (
    RankingDCN,
    RankingDLRM,
    build_model,
    dense_parameters,
    embedding_tables,
    sparse_optimizer,
)

CPU = torch.device("cpu")
SCHEMA = Schema.from_dict({
    "label": "label",
    "dense": ["I1", "I2", "I3"],
    "sparse": [{"name": "C1", "num_embeddings": 20},
               {"name": "C2", "num_embeddings": 7, "type": "string"},
               {"name": "tags", "num_embeddings": 11, "multi_valued": True}],
})
SMALL = ModelConfig(embedding_dim=4, dense_arch=(8, 4), over_arch=(8, 1), dcn_layers=2,
                    dcn_low_rank=3)


def make_batch(rows: int = 5, seed: int = 0) -> Batch:
    """``rows`` rows; ``tags`` bags hold 1..3 ids, the other features one id each."""
    g = torch.Generator().manual_seed(seed)
    lengths = [torch.ones(rows, dtype=torch.int64), torch.ones(rows, dtype=torch.int64),
               torch.randint(1, 4, (rows,), generator=g)]
    values = [torch.randint(1, f.num_embeddings, (int(n.sum()),), generator=g)
              for f, n in zip(SCHEMA.sparse, lengths)]
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=SCHEMA.sparse_names, values=torch.cat(values),
                                              lengths=torch.cat(lengths))
    return Batch(dense_features=torch.rand(rows, len(SCHEMA.dense), generator=g),
                 sparse_features=kjt, labels=torch.randint(0, 2, (rows,), generator=g).float())


@pytest.mark.parametrize("arch, cls", [("dlrm", RankingDLRM), ("dcn", RankingDCN)])
def test_output_is_one_logit_per_row(arch: str, cls: type) -> None:
    cfg = ModelConfig(**{**SMALL.to_dict(), "arch": arch})
    model = build_model(SCHEMA, cfg, OptimConfig(), CPU)
    assert isinstance(model, cls)
    batch = make_batch(rows=6)
    logits = model(batch.dense_features, batch.sparse_features)
    assert logits.shape == (6,) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_multi_valued_bag_is_the_sum_of_its_rows() -> None:
    model = build_model(SCHEMA, SMALL, OptimConfig(), CPU)
    tables = embedding_tables(model)
    #            row 0    row 1
    # C1         [1]      [2]
    # C2         [3]      [4]
    # tags       [5, 1]   [6]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=SCHEMA.sparse_names, values=torch.tensor([1, 2, 3, 4, 5, 1, 6]),
        lengths=torch.tensor([1, 1, 1, 1, 2, 1]))
    with torch.no_grad():
        pooled = model.sparse_arch(kjt)
    assert pooled.shape == (2, 3, 4)
    torch.testing.assert_close(pooled[0, 0], tables["C1"][1])
    torch.testing.assert_close(pooled[1, 1], tables["C2"][4])
    torch.testing.assert_close(pooled[0, 2], tables["tags"][5] + tables["tags"][1])
    torch.testing.assert_close(pooled[1, 2], tables["tags"][6])


def test_tables_follow_the_schema_and_dense_parameters_are_the_rest() -> None:
    model = build_model(SCHEMA, SMALL, OptimConfig(), CPU)
    tables = embedding_tables(model)
    assert list(tables) == ["C1", "C2", "tags"]
    assert [tuple(t.shape) for t in tables.values()] == [(20, 4), (7, 4), (11, 4)]
    dense = dense_parameters(model)
    names = [n for n, _ in dense]
    assert names and not any("embedding_bag" in n for n in names)
    total = sum(p.numel() for p in model.parameters())
    assert sum(p.numel() for _, p in dense) + sum(t.numel() for t in tables.values()) == total


def test_backward_updates_only_the_touched_rows_in_place() -> None:
    torch.manual_seed(0)  # a random init can leave a touched row with an all-zero gradient
    model = build_model(SCHEMA, SMALL, OptimConfig(sparse_lr=0.1), CPU)
    tables = embedding_tables(model)
    before = {k: t.clone() for k, t in tables.items()}
    batch = make_batch(rows=4)
    model(batch.dense_features, batch.sparse_features).sum().backward()
    touched = batch.sparse_features["C1"].values().unique()
    changed = (tables["C1"] != before["C1"]).any(dim=1).nonzero().flatten()
    assert torch.equal(changed, touched)
    momentum = sparse_optimizer(model).state_dict()["state"]["C1.weight"]["C1.weight.momentum_1"]
    assert torch.equal((momentum > 0).nonzero().flatten(), touched)


def test_in_place_table_write_is_seen_by_the_next_forward() -> None:
    model = build_model(SCHEMA, SMALL, OptimConfig(), CPU)
    batch = make_batch(rows=3)
    model.eval()
    with torch.no_grad():
        before = model(batch.dense_features, batch.sparse_features)
        row = batch.sparse_features["C2"].values()[:1]
        embedding_tables(model)["C2"].index_add_(0, row, torch.full((1, 4), 0.5))
        after = model(batch.dense_features, batch.sparse_features)
    assert not torch.allclose(before, after)
    # The write landed in the same memory the module's state_dict (the checkpoint) reads.
    state = model.state_dict()["sparse_arch.embedding_bag_collection.embedding_bags.C2.weight"]
    torch.testing.assert_close(state, embedding_tables(model)["C2"])


def test_adam_on_cpu_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"optim.sparse_optimizer: 'adam' has no FBGEMM CPU"):
        build_model(SCHEMA, SMALL, OptimConfig(sparse_optimizer="adam"), CPU)


def test_dotted_sparse_name_is_a_config_error() -> None:
    schema = Schema.from_dict({"label": "y", "dense": ["x"],
                               "sparse": [{"name": "user.id", "num_embeddings": 5}]})
    with pytest.raises(ConfigError, match=r"\['user.id'\] contain '\.'"):
        build_model(schema, SMALL, OptimConfig(), CPU)
