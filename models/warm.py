"""A job's model started from another model (``train.init_from``): the check, where the job is
submitted, that the source fits the job (:func:`plan`), and what travels to the workers
(:class:`WarmStart`, small and picklable) and what each reads from it (:meth:`WarmStart.read`).

A source is in one of three layouts (:mod:`pipeline.tracking.init_from` finds which):

- ``state``: one file in :meth:`~models.train_step.TrainStep.state_dict`'s form (a checkpoint's
  ``model.pt``): the weights and both optimisers' state;
- ``logged``: a model antdt logged to MLflow: ``weights.pt`` (what serving needs) and
  ``train_state.pt`` (both optimisers' state; models logged before it existed have none and
  start fresh optimisers);
- ``parts``: a model a sync job's ranks or a sharded-tables job's hosts wrote in parts
  (:mod:`models.shards`); each rank or host reads only the rows it holds, as a resume does.

The source must have the job's shapes: the same tables (features, rows, dimension) and dense
layers; the first difference refuses the job before anything starts, in one line. With
``partial`` the weights whose shapes match are taken and the rest keep the job's initial values
(the seed's draw), named in :attr:`WarmStart.left`. The optimisers' state comes along when the
source trained with the same optimisers; a dense layer left behind leaves the dense optimiser
fresh too. A model in parts is taken whole or not at all: its rows are read where they are
held, with their optimiser state, as a resume reads them (:mod:`pipeline.training.recipes`).
"""

from __future__ import annotations

import io
import posixpath
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import embedding_keys
from models.shards import ShardFiles
from models.train_step import seeded_model

Layout = Literal["state", "logged", "parts"]
STATE_FILE = "model.pt"
WEIGHTS_FILE = "weights.pt"
TRAIN_STATE_FILE = "train_state.pt"
OPTIMIZER_KEYS = ("dense_optimizer", "sparse_optimizer", "sparse_iter")


_SETTINGS = {"dense_arch": "model.dense_arch", "over_arch": "model.over_arch",
             "inter_arch": "model.dcn_layers, model.dcn_low_rank"}
"""The settings that shape a dense layer, by the layer's first name."""


@dataclass(frozen=True)
class Shapes:
    """A model's weights by ``state_dict`` key, each ``(shape, table feature or None)``, and
    its optimisers' kinds (None where the source does not say)."""

    weights: dict[str, tuple[tuple[int, ...], str | None]]
    sparse_optimizer: str | None = None
    dense_optimizer: str | None = None


@dataclass(frozen=True)
class WarmStart:
    """Where a job's model starts (see the module docstring). ``source``: what the job names
    (``models:/ranking@champion``); ``folder`` and ``files``: the layout's files, readable from
    every worker; ``take``: the keys taken (None: all); ``optimizer``: whether both optimisers'
    state comes along; ``left``: what keeps its initial values, as a person reads it."""

    source: str
    layout: Layout
    folder: str
    files: Mapping[str, Any] = field(default_factory=dict)
    take: frozenset[str] | None = None
    optimizer: bool = True
    left: tuple[str, ...] = ()

    def read(self) -> dict[str, Any]:
        """What the trainers start from, of a source in one piece: a state in
        ``TrainStep.state_dict``'s form holding only what is taken (``warm_start`` of each
        trainer keeps its own values for the rest). A model in parts is read as a resume reads
        it, each rank or host its own rows."""
        if self.layout == "parts":
            raise ValueError(f"{self.source}: a model in parts is read where its rows are held")
        if self.layout == "state":
            state = dict(_load(posixpath.join(self.folder, STATE_FILE)))
        else:
            state = {"model": _load(posixpath.join(self.folder, WEIGHTS_FILE))}
            if self.optimizer:
                state.update(_load(posixpath.join(self.folder, TRAIN_STATE_FILE)))
        if not self.optimizer:
            for key in OPTIMIZER_KEYS:
                state.pop(key, None)
        if self.take is not None:
            state["model"] = {k: v for k, v in state["model"].items() if k in self.take}
        state["rows_trained"] = 0
        return state


def _load(path: str) -> Any:
    """A torch file at ``path`` (a local path or an fsspec URL), tensors only."""
    fs, local = fsspec.core.url_to_fs(path)
    if isinstance(fs, LocalFileSystem):  # mapped: a shape check reads no table
        return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
    with fs.open(local, "rb") as f:
        return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)


def job_shapes(schema: Schema, model: ModelConfig, optim: OptimConfig) -> Shapes:
    """The shapes a job's model has, its tables left unallocated (``meta``)."""
    built = seeded_model(schema, model, optim, torch.device("cpu"), 0, tables=False)
    features = {key: feature for feature, key in embedding_keys(built).items()}
    return Shapes({k: (tuple(v.shape), features.get(k)) for k, v in built.state_dict().items()},
                  optim.sparse_optimizer, optim.dense_optimizer)


def source_shapes(layout: Layout, folder: str, files: Mapping[str, Any],
                  optimizers: tuple[str | None, str | None] = (None, None)) -> Shapes:
    """The shapes of the model in ``folder`` (tables named by their ``state_dict`` keys; which
    key is a table the job's own shapes say). ``optimizers``: its sparse and dense optimisers'
    kinds where the caller knows them."""
    weights: dict[str, tuple[tuple[int, ...], str | None]]
    if layout == "parts":
        parts = ShardFiles(folder, files)
        dense = parts.dense()
        weights = {k: (tuple(v.shape), None) for k, v in dense["model"].items()}
        weights.update({t.key: (tuple(t.shape), t.name) for t in parts.tables})
    else:
        state = _load(posixpath.join(folder, STATE_FILE if layout == "state" else WEIGHTS_FILE))
        model = state["model"] if layout == "state" else state
        weights = {k: (tuple(v.shape), None) for k, v in model.items()}
    return Shapes(weights, *optimizers)


def has_train_state(folder: str) -> bool:
    """Whether a logged model in ``folder`` carries its optimisers' state."""
    fs, local = fsspec.core.url_to_fs(posixpath.join(folder, TRAIN_STATE_FILE))
    return bool(fs.exists(local))


def first_difference(source: Shapes, job: Shapes) -> str | None:
    """The first way ``source``'s weights differ from ``job``'s, as a person reads it (None:
    the same): a table's rows or dimension, a dense layer's shape, a weight only one has."""
    for key, (shape, feature) in job.weights.items():
        found = source.weights.get(key)
        what = f"table {feature}" if feature else f"layer {key}"
        if found is None:
            return f"{what} is not in it (another schema or architecture)"
        if found[0] != shape:
            if feature and len(shape) == 2 and len(found[0]) == 2:
                if found[0][1] != shape[1]:
                    return (f"table {feature} has dimension {found[0][1]} there, "
                            f"{shape[1]} here (model.embedding_dim)")
                return (f"table {feature} has {found[0][0]:,} rows there, {shape[0]:,} here "
                        "(the schema's num_embeddings)")
            setting = _SETTINGS.get(key.partition(".")[0], "model.arch")
            return f"{what} is {list(found[0])} there, {list(shape)} here ({setting})"
    extra = [key for key in source.weights if key not in job.weights]
    if extra:
        return f"it has {extra[0]}, which this job's model does not (another architecture)"
    return None


def plan(source: str, layout: Layout, folder: str, files: Mapping[str, Any], found: Shapes,
         job: Shapes, *, partial: bool, with_train_state: bool = True) -> WarmStart:
    """The :class:`WarmStart` of a job whose model has ``job``'s shapes from the model ``found``
    in ``folder``; :class:`ConfigError` naming the first difference unless ``partial`` (then the
    weights that match are taken and the rest named)."""
    difference = first_difference(found, job)
    same_optimizers = found.sparse_optimizer in (None, job.sparse_optimizer) and \
        found.dense_optimizer in (None, job.dense_optimizer)
    if layout == "parts" and not same_optimizers:
        raise ConfigError(f"train.init_from {source}: a model in parts starts only a job of "
                          f"its own optimisers: {_optimizers(found, job)}")
    if difference is None:
        return WarmStart(source, layout, folder, files,
                         optimizer=same_optimizers and with_train_state,
                         left=() if same_optimizers and with_train_state
                         else (_fresh_optimizers(found, job, with_train_state),))
    if not partial:
        raise ConfigError(f"train.init_from {source}: does not fit this job: {difference}; "
                          "set train.init_from_partial: true to take what fits")
    if layout == "parts":
        raise ConfigError(f"train.init_from {source}: a model in parts starts only a job of "
                          f"its own shapes, and {difference}")
    take = frozenset(k for k, (shape, _) in job.weights.items()
                     if k in found.weights and found.weights[k][0] == shape)
    left = [f"table {feature}" if feature else k for k, (_, feature) in job.weights.items()
            if k not in take]
    dense_left = any(feature is None for k, (_, feature) in job.weights.items() if k not in take)
    optimizer = same_optimizers and with_train_state and not dense_left
    if not optimizer:
        left.append(_fresh_optimizers(found, job, with_train_state, dense_left))
    return WarmStart(source, layout, folder, files, take=take, optimizer=optimizer,
                     left=tuple(left))


def _fresh_optimizers(found: Shapes, job: Shapes, with_train_state: bool,
                      dense_left: bool = False) -> str:
    """Why the optimisers start fresh, as a person reads it."""
    if not with_train_state:
        return "optimisers' state (the model was logged without it)"
    if dense_left:
        return "optimisers' state (a dense layer did not fit)"
    return f"optimisers' state ({_optimizers(found, job)})"


def _optimizers(found: Shapes, job: Shapes) -> str:
    return (f"trained with {found.sparse_optimizer}/{found.dense_optimizer}, this job uses "
            f"{job.sparse_optimizer}/{job.dense_optimizer}")
