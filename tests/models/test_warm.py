"""A warm start (``train.init_from``) checked and read as a job's workers read it: the model it
starts equals its source before the first step (every table, layer and both optimisers'
states), in a plain TrainStep and in the sharded tables' trainer; a source of other shapes is
refused naming the first difference; a partial start takes what fits and says what it left."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import embedding_tables, sparse_optimizer
from models.remote_tables import RemoteTableStep, TableLayout, initial_rows
from models.train_step import TrainStep
from models.warm import (STATE_FILE, TRAIN_STATE_FILE, WEIGHTS_FILE, WarmStart, job_shapes, plan,
                         source_shapes)
from pipeline.training.recipes import TrainerRecipe
from small_model import CPU, SCHEMA, SMALL, batches

OPTIM = OptimConfig(sparse_lr=0.1, dense_lr=0.01)
LAYOUT = TableLayout.from_schema(SCHEMA, SMALL)


def trained(model: ModelConfig = SMALL, optim: OptimConfig = OPTIM,
            schema: Schema = SCHEMA) -> TrainStep:
    """A step trained three batches from seed 3 (its optimisers hold state)."""
    step = TrainStep(schema, model, optim, device=CPU, seed=3)
    for batch in batches(3, seed=5):
        step.step(batch)
    return step


def logged(step: TrainStep, folder: Path, *, train_state: bool = True) -> Path:
    """``step`` saved as antdt logs a model (:func:`pipeline.serving.log_ranking_model`'s
    files)."""
    folder.mkdir(parents=True)
    torch.save({k: v.detach() for k, v in step.model.state_dict().items()}, folder / WEIGHTS_FILE)
    if train_state:
        torch.save(step.optimizer_state(), folder / TRAIN_STATE_FILE)
    return folder


def warm(folder: Path, layout: str = "logged", *, model: ModelConfig = SMALL,
         optim: OptimConfig = OPTIM, schema: Schema = SCHEMA, partial: bool = False,
         train_state: bool = True, found_optim: OptimConfig = OPTIM) -> WarmStart:
    found = source_shapes(layout, str(folder), {},  # type: ignore[arg-type]
                          (found_optim.sparse_optimizer, found_optim.dense_optimizer))
    return plan("models:/ranking/1", layout, str(folder), {}, found,  # type: ignore[arg-type]
                job_shapes(schema, model, optim), partial=partial, with_train_state=train_state)


def assert_same(a: dict[str, Any], b: dict[str, Any], *, optimizers: bool = True) -> None:
    """Two TrainStep states hold the same weights (and optimisers' states)."""
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    if optimizers:
        torch.testing.assert_close(a["sparse_optimizer"], b["sparse_optimizer"], rtol=0, atol=0)
        torch.testing.assert_close(a["dense_optimizer"]["state"], b["dense_optimizer"]["state"],
                                   rtol=0, atol=0)


def test_a_warm_start_equals_its_source_and_trains_on_as_it_would(tmp_path: Path) -> None:
    source = trained()
    init = warm(logged(source, tmp_path / "model"))
    assert init.optimizer and init.take is None and init.left == ()
    step = TrainerRecipe(SCHEMA, SMALL, OPTIM, seed=0, init=init)(CPU).train_step
    assert_same(step.state_dict(), source.state_dict())
    assert step.rows_trained == 0
    probe = batches(1, seed=9)[0]
    assert step.step(probe) == pytest.approx(source.step(probe), abs=1e-6)
    assert_same(step.state_dict(), source.state_dict())  # the same update: the same state

    checkpoint = tmp_path / "checkpoint"  # a checkpoint's model.pt starts it alike
    checkpoint.mkdir()
    torch.save(source.state_dict(), checkpoint / STATE_FILE)
    again = TrainStep(SCHEMA, SMALL, OPTIM, device=CPU, seed=0)
    again.warm_start(warm(checkpoint, "state").read())  # type: ignore[arg-type]
    assert_same(again.state_dict(), source.state_dict())


def test_a_model_logged_without_optimiser_state_starts_fresh_optimisers(tmp_path: Path) -> None:
    source = trained()
    init = warm(logged(source, tmp_path / "model", train_state=False), train_state=False)
    assert not init.optimizer and "logged without it" in init.left[0]
    step = TrainerRecipe(SCHEMA, SMALL, OPTIM, seed=0, init=init)(CPU).train_step
    fresh = TrainStep(SCHEMA, SMALL, OPTIM, device=CPU, seed=0).state_dict()
    assert_same(step.state_dict(), {**fresh, "model": source.state_dict()["model"]})


@pytest.mark.parametrize("change, expected", [
    ({"schema": SCHEMA.to_dict() | {"sparse": [{"name": "C1", "num_embeddings": 60},
                                               *SCHEMA.to_dict()["sparse"][1:]]}},
     "table C1 has 50 rows there, 60 here (the schema's num_embeddings)"),
    ({"model": dataclasses.replace(SMALL, embedding_dim=4, dense_arch=(16, 4))},
     "has dimension 8 there, 4 here (model.embedding_dim)"),
    ({"model": dataclasses.replace(SMALL, arch="dcn")}, "(another schema or architecture)"),
    ({"model": dataclasses.replace(SMALL, over_arch=(32, 1))}, "over_arch.model.0._mlp.0._linear.weight is [16, 14] there, [32, 14] here "
     "(model.over_arch)"),
])
def test_a_source_of_other_shapes_is_refused_naming_the_first_difference(
        tmp_path: Path, change: dict[str, Any], expected: str) -> None:
    folder = logged(trained(), tmp_path / "model")
    schema = Schema.from_dict(change["schema"]) if "schema" in change else SCHEMA
    with pytest.raises(ConfigError) as refused:
        warm(folder, schema=schema, model=change.get("model", SMALL))
    message = str(refused.value)
    assert message.startswith("train.init_from models:/ranking/1: does not fit this job: ")
    assert expected in message and "\n" not in message
    assert "train.init_from_partial" in message


def test_a_partial_start_takes_what_fits_and_leaves_the_rest_initial(tmp_path: Path) -> None:
    source = trained()
    wider = Schema.from_dict(SCHEMA.to_dict() | {"sparse": [
        {"name": "C1", "num_embeddings": 60}, *SCHEMA.to_dict()["sparse"][1:]]})
    init = warm(logged(source, tmp_path / "model"), schema=wider, partial=True)
    assert init.left == ("table C1",) and init.optimizer
    step = TrainerRecipe(wider, SMALL, OPTIM, seed=0, init=init)(CPU).train_step
    fresh = TrainStep(wider, SMALL, OPTIM, device=CPU, seed=0)
    tables, fresh_tables = embedding_tables(step.model), embedding_tables(fresh.model)
    assert torch.equal(tables["C1"], fresh_tables["C1"])  # left: the seed's draw
    for feature in ("C2", "tags"):
        assert torch.equal(tables[feature], embedding_tables(source.model)[feature])
    momentum = sparse_optimizer(step.model).state_dict()["state"]
    source_momentum = sparse_optimizer(source.model).state_dict()["state"]
    assert torch.equal(momentum["C2.weight"]["C2.weight.momentum_1"],
                       source_momentum["C2.weight"]["C2.weight.momentum_1"])
    assert not momentum["C1.weight"]["C1.weight.momentum_1"].any()  # fresh with its table

    other = OptimConfig(sparse_optimizer="adagrad", sparse_lr=0.1, dense_lr=0.01)
    fresh_state = warm(tmp_path / "model", optim=other, found_optim=OPTIM)
    assert not fresh_state.optimizer and "rowwise_adagrad/adam, this job uses adagrad/adam" in \
        fresh_state.left[0]


def test_the_sharded_tables_start_from_the_source_on_their_hosts(tmp_path: Path) -> None:
    """Each host draws its rows from the source (a partial start: a left table from the seed),
    and the dense part starts as the source's."""
    source = trained()
    init = warm(logged(source, tmp_path / "model"))
    remote = TrainerRecipe(SCHEMA, SMALL, OPTIM, seed=0, init=init).remote_tables(CPU)
    whole = torch.cat([embedding_tables(source.model)[f] for f in LAYOUT.features])
    weights, state = remote.initial_rows(10, 90)  # across all three tables
    assert torch.equal(weights, whole[10:90])
    momentum = sparse_optimizer(source.model).state_dict()["state"]
    expected = torch.cat([momentum[f"{f}.weight"][f"{f}.weight.momentum_1"]
                          for f in LAYOUT.features])
    assert state is not None and torch.equal(state[:, 0], expected[10:90])
    dense = {k: v for k, v in source.state_dict()["model"].items() if "embedding_bags" not in k}
    for key, value in remote.remote.model.state_dict().items():
        if key in dense:
            assert torch.equal(value, dense[key]), key
    assert remote.remote.rows_trained == 0

    wider = Schema.from_dict(SCHEMA.to_dict() | {"sparse": [
        *SCHEMA.to_dict()["sparse"][:2], {"name": "tags", "num_embeddings": 25,
                                          "multi_valued": True}]})
    partial = warm(tmp_path / "model", schema=wider, partial=True)
    remote = TrainerRecipe(wider, SMALL, OPTIM, seed=0, init=partial).remote_tables(CPU)
    weights, _ = remote.initial_rows(0, 105)
    assert torch.equal(weights[:80], whole[:80])
    layout = RemoteTableStep(wider, SMALL, OPTIM, device=CPU, seed=0).layout
    assert torch.equal(weights[80:], initial_rows(layout, 0, 80, 105))
