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
from torchrec.datasets.utils import Batch

from data.reader import ShardReader
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import dense_parameters, embedding_tables
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


@dataclass(frozen=True)
class ReaderRecipe:
    """Builds the worker's :class:`ShardReader` (converting with ``threads`` threads)."""

    schema: Schema
    threads: int

    def __call__(self) -> ShardReader:
        return ShardReader(self.schema, threads=self.threads)
