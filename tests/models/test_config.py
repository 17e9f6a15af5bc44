"""ModelConfig / OptimConfig: defaults, round trip, errors naming key, value and expectation."""

from __future__ import annotations

import dataclasses

import pytest

from antdt.errors import ConfigError
from models.config import ModelConfig, OptimConfig


def test_defaults_and_round_trip() -> None:
    model = ModelConfig.from_dict(None)
    assert model == ModelConfig()
    assert model.dense_arch[-1] == model.embedding_dim
    assert ModelConfig.from_dict(model.to_dict()) == model
    assert model.to_dict()["dense_arch"] == [64, 16]
    optim = OptimConfig.from_dict({"sparse_lr": 0.1, "dense_optimizer": "sgd"})
    assert (optim.sparse_lr, optim.dense_optimizer, optim.sparse_optimizer) == \
        (0.1, "sgd", "rowwise_adagrad")
    assert OptimConfig.from_dict(optim.to_dict()) == optim


def test_list_and_tuple_layers_are_equal_and_frozen() -> None:
    a = ModelConfig.from_dict({"arch": "dcn", "embedding_dim": 8, "dense_arch": [32, 8]})
    b = ModelConfig(arch="dcn", embedding_dim=8, dense_arch=(32, 8))
    assert a == b
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.embedding_dim = 4  # type: ignore[misc]


def test_unknown_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"job\.model: unknown key\(s\) \['embeding_dim'\]"):
        ModelConfig.from_dict({"embeding_dim": 8}, where="job.model")
    with pytest.raises(ConfigError, match=r"optim: unknown key\(s\) \['lr'\]"):
        OptimConfig.from_dict({"lr": 0.1})


def test_dense_arch_must_end_in_embedding_dim() -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict({"embedding_dim": 8, "dense_arch": [64, 16]})
    message = str(err.value)
    assert "model.dense_arch" in message and "(8)" in message and "[64, 16]" in message


@pytest.mark.parametrize("raw, fragment", [
    ({"over_arch": [64, 2]}, "model.over_arch: expected at least two layers ending in 1"),
    ({"over_arch": [1]}, "found [1]"),
    ({"arch": "wide_deep"}, "model.arch: expected one of ['dlrm', 'dcn'], found 'wide_deep'"),
    ({"embedding_dim": 0}, "model.embedding_dim: expected a positive integer, found 0"),
    ({"dcn_layers": True}, "model.dcn_layers: expected a positive integer, found True"),
    ({"dense_arch": "64,16"}, "model.dense_arch: expected a non-empty list of positive integers"),
    ({"dense_arch": []}, "found []"),
    ([1, 2], "model: expected a mapping"),
])
def test_bad_model_values(raw: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        ModelConfig.from_dict(raw)
    assert fragment in str(err.value)


@pytest.mark.parametrize("raw, fragment", [
    ({"sparse_optimizer": "ftrl"}, "optim.sparse_optimizer: expected one of"),
    ({"dense_optimizer": "lamb"}, "found 'lamb'"),
    ({"sparse_lr": 0}, "optim.sparse_lr: expected a number > 0, found 0"),
    ({"dense_lr": "fast"}, "optim.dense_lr: expected a number > 0, found 'fast'"),
    ({"weight_decay": -0.1}, "optim.weight_decay: expected a number >= 0, found -0.1"),
    ({"eps": float("nan")}, "optim.eps"),
])
def test_bad_optim_values(raw: object, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        OptimConfig.from_dict(raw)
    assert fragment in str(err.value)
