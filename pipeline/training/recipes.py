"""What travels from the driver to the workers: small picklable recipes that build the training
step and the reader on the worker (:mod:`antdt.agent`'s ``TrainerFactory`` and ``ReaderFactory``).

Kept apart from :mod:`pipeline.training.cluster` (which builds the job, and imports MLflow) so
that a worker unpickling a recipe imports only the training stack (torch, TorchRec, ``models``,
``data``), never MLflow or the plotting of :mod:`pipeline.tracking`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from distributed import get_worker
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from data.reader import ShardReader
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import dense_parameters, embedding_tables
from models.sharded import ShardedTrainStep, to_train_step
from models.train_step import TrainStep


class RankingTrainer:
    """:class:`antdt.agent.Trainer` over a :class:`TrainStep`: the tables the async mode syncs
    are the fused embedding tables (views of the FBGEMM storage), one per sparse feature, named
    like the features of a batch's ``KeyedJaggedTensor``."""

    def __init__(self, train_step: TrainStep) -> None:
        self.train_step = train_step
        self._dense = [p for _, p in dense_parameters(train_step.model)]
        self._tables = embedding_tables(train_step.model)

    def step(self, batch: Batch) -> float:
        return self.train_step.step(batch)

    def touched(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Per feature, the bucket ids ``(k,)`` int64 of the batch (duplicates included)."""
        kjt = batch.sparse_features
        return dict(zip(kjt.keys(), torch.split(kjt.values(), kjt.length_per_key())))

    def dense(self) -> list[torch.Tensor]:
        return list(self._dense)

    def tables(self) -> dict[str, torch.Tensor]:
        return dict(self._tables)

    def state(self) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU (no optimiser state: what serving needs)."""
        return {k: v.detach().cpu().clone() for k, v in self.train_step.model.state_dict().items()}

    def checkpoint_state(self, tables: Mapping[str, torch.Tensor] | None = None
                         ) -> dict[str, Any]:
        """Weights and both optimisers' state (:meth:`TrainStep.state_dict`, copied), with
        ``tables`` as the embedding weights when given."""
        return self.train_step.state_dict(tables)

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self.train_step.load_state_dict(state)


@dataclass(frozen=True)
class TrainerRecipe:
    """Builds a :class:`RankingTrainer` on a worker; the seed makes every replica start equal."""

    schema: Schema
    model: ModelConfig
    optim: OptimConfig
    seed: int

    def __call__(self, device: torch.device) -> RankingTrainer:
        return RankingTrainer(TrainStep(self.schema, self.model, self.optim, device=device,
                                        seed=self.seed))


class ShardedRankingTrainer:
    """:class:`antdt.agent.modes.synchronous.ShardedTrainer` over a
    :class:`~models.sharded.ShardedTrainStep`: one rank of the synchronous mode's model, its
    tables sharded across the ranks. Its full state is :class:`TrainStep`'s checkpoint form, so
    a checkpoint of either mode resumes in the other, and the final model is served as a plain
    :class:`RankingTrainer`."""

    def __init__(self, step: ShardedTrainStep, recipe: ShardedTrainerRecipe) -> None:
        self.sharded = step
        self.recipe = recipe
        self.schema = recipe.schema
        self.rank = step.rank
        self.world_size = step.world_size

    def step(self, batch: Batch, global_rows: int) -> float:
        return self.sharded.step(batch, global_rows)

    def empty_batch(self) -> Batch:
        """A batch of no rows (a rank with no rows still takes part in the step)."""
        names = self.schema.sparse_names
        return Batch(dense_features=torch.zeros(0, len(self.schema.dense)),
                     sparse_features=KeyedJaggedTensor.from_lengths_sync(
                         keys=names, values=torch.zeros(0, dtype=torch.int64),
                         lengths=torch.zeros(0, dtype=torch.int32)),
                     labels=torch.zeros(0))

    def full_state(self, dst: int) -> dict[str, Any] | None:
        return self.sharded.full_state(dst)

    def restore_state(self, state: Mapping[str, Any]) -> None:
        self.sharded.load_full_state(state)

    def final(self, state: Mapping[str, Any]) -> RankingTrainer:
        recipe = self.recipe
        return RankingTrainer(to_train_step(state, recipe.schema, recipe.model, recipe.optim))

    def plan_summary(self) -> Mapping[str, str]:
        return self.sharded.plan_summary()


@dataclass(frozen=True)
class ShardedTrainerRecipe:
    """Builds a :class:`ShardedRankingTrainer` on a worker that joined its job's process group;
    the planner is told the worker's memory limit (the Dask worker's, else the machine's share).
    The seed makes the model start as :class:`TrainerRecipe`'s does."""

    schema: Schema
    model: ModelConfig
    optim: OptimConfig
    seed: int

    def __call__(self, device: torch.device) -> ShardedRankingTrainer:
        limit = get_worker().memory_manager.memory_limit
        step = ShardedTrainStep(self.schema, self.model, self.optim, device=device,
                                seed=self.seed, memory_bytes=int(limit) if limit else None)
        return ShardedRankingTrainer(step, self)


@dataclass(frozen=True)
class ReaderRecipe:
    """Builds the worker's :class:`ShardReader` (converting with ``threads`` threads)."""

    schema: Schema
    threads: int

    def __call__(self) -> ShardReader:
        return ShardReader(self.schema, threads=self.threads)
