"""The host's sparse optimiser against FBGEMM's fused one: the same rows, the same change."""

from __future__ import annotations

import pytest
import torch
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.errors import ConfigError
from antdt.tables.optim import ROW_STATE, RowOptimizer
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import fused_embedding_collection

DIM = 4
SCHEMA = Schema.from_dict({"label": "y", "dense": ["x"],
                           "sparse": [{"name": "a", "num_embeddings": 10},
                                      {"name": "b", "num_embeddings": 7}]})
# three samples; row 1 of "a" twice in one bag and once more in another, row 2 of "b" in all
KEYS, VALUES, LENGTHS = ["a", "b"], [1, 1, 3, 1, 2, 2, 5, 2], [2, 1, 1, 2, 1, 1]
BAG_FEATURE = [0, 0, 0, 1, 1, 1]  # the feature of each bag, KJT order (feature-major)


def tables_and_state(ebc: FusedEmbeddingBagCollection,
                     width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both tables stacked ``(17, DIM)`` and their fused optimiser state ``(17, width)``
    (cloned)."""
    state = ebc.fused_optimizer().state_dict()["state"]
    weights = torch.cat([ebc.embedding_bags[k].weight.detach() for k in KEYS])
    if width == 0:
        return weights.clone(), torch.zeros(len(weights), 0)
    moments = torch.cat([state[f"{k}.weight"][f"{k}.weight.momentum_1"] for k in KEYS])
    return weights.clone(), moments.reshape(len(weights), width).clone()


def train_once(ebc: FusedEmbeddingBagCollection, upstream: torch.Tensor) -> torch.Tensor:
    """One forward/backward whose gradient w.r.t. the pooled ``(3, 2 * DIM)`` is ``upstream``;
    FBGEMM updates the rows. Returns the gradient per global row (``a`` then ``b``), summed
    over every occurrence of the row."""
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=torch.tensor(VALUES),
                                              lengths=torch.tensor(LENGTHS))
    (ebc(kjt).values() * upstream).sum().backward()
    per_bag = upstream.reshape(3, 2, DIM).transpose(0, 1).reshape(6, DIM)  # feature-major
    bags = torch.repeat_interleave(torch.arange(6), torch.tensor(LENGTHS))
    rows = torch.tensor(VALUES) + torch.tensor([0, 10])[torch.tensor(BAG_FEATURE)[bags]]
    return torch.zeros(17, DIM).index_add_(0, rows, per_bag[bags])


@pytest.mark.parametrize("kind", sorted(ROW_STATE))
def test_the_update_is_fbgemms_fused_update(kind: str) -> None:
    cfg = OptimConfig(sparse_optimizer=kind, sparse_lr=0.05, eps=1e-8)
    torch.manual_seed(0)
    ebc = fused_embedding_collection(SCHEMA, ModelConfig(embedding_dim=DIM, dense_arch=(DIM,)),
                                     cfg, torch.device("cpu"))
    opt = RowOptimizer(kind, lr=cfg.sparse_lr, eps=cfg.eps)
    width = opt.state_width(DIM)
    # a first step makes the state non-zero, so the second shows how the old state enters
    train_once(ebc, torch.randn(3, 2 * DIM))
    weights, state = tables_and_state(ebc, width)
    grads = train_once(ebc, torch.randn(3, 2 * DIM))
    after_w, after_s = tables_and_state(ebc, width)

    touched = grads.abs().sum(dim=1).nonzero().squeeze(1)
    assert touched.tolist() == [1, 3, 12, 15]  # a: 1, 3; b: 2, 5
    inputs = [t[touched].clone() for t in (weights, state, grads)]
    delta_w, delta_s = opt.update(*inputs)
    assert all(torch.equal(t, t0[touched]) for t, t0 in zip(inputs, (weights, state, grads)))
    expected_w, expected_s = weights.clone(), state.clone()
    expected_w[touched] += delta_w
    expected_s[touched] += delta_s
    torch.testing.assert_close(after_w, expected_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(after_s, expected_s, rtol=0, atol=1e-6)
    assert (after_w - weights)[touched].abs().min() > 1e-4  # every touched row moved


def test_state_width_per_kind() -> None:
    widths = {kind: RowOptimizer(kind, lr=0.1, eps=1e-8).state_width(8) for kind in ROW_STATE}
    assert widths == {"rowwise_adagrad": 1, "adagrad": 8, "sgd": 0}


def test_row_wise_adagrad_uses_the_mean_square_and_the_new_state() -> None:
    opt = RowOptimizer("rowwise_adagrad", lr=1.0, eps=1e-8)
    delta_w, delta_s = opt.update(torch.zeros(1, 2), torch.tensor([[11.5]]),
                                  torch.tensor([[1.0, 1.0]]))
    assert delta_s.tolist() == [[1.0]]  # mean of 1, 1; not their sum
    torch.testing.assert_close(delta_w, torch.full((1, 2), -1 / (12.5 ** 0.5)))


def test_an_unknown_kind_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"expected one of \['rowwise_adagrad', 'adagrad', "
                                          r"'sgd'\].*found 'adam'"):
        RowOptimizer("adam", lr=0.1, eps=1e-8)
    with pytest.raises(ConfigError, match="expected lr > 0"):
        RowOptimizer("sgd", lr=0.0, eps=1e-8)


def test_shapes_that_do_not_fit_are_refused() -> None:
    opt = RowOptimizer("adagrad", lr=0.1, eps=1e-8)
    with pytest.raises(ValueError, match=r"state \(n, 4\) for D=4.*state \(2, 1\)"):
        opt.update(torch.zeros(2, 4), torch.zeros(2, 1), torch.zeros(2, 4))
