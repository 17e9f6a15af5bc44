"""What travels from the driver to the workers: small picklable recipes that build the training
step and the reader on the worker (:mod:`antdt.agent`'s ``TrainerFactory`` and ``ReaderFactory``).

Kept apart from :mod:`pipeline.training.cluster` (which builds the job, and imports MLflow) so
that a worker unpickling a recipe imports only the training stack (torch, TorchRec, ``models``,
``data``), never MLflow or the plotting of :mod:`pipeline.tracking`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import dask.config
import torch
from dask.utils import format_bytes
from distributed import Worker, get_worker
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.agent import SavedModel
from antdt.errors import ConfigError
from data.reader import ShardReader, concat
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import dense_parameters, embedding_tables
from models.sharded import ShardedTrainStep, to_train_step
from models.shards import read_full_state
from models.remote_tables import RemoteTableStep
from models.train_step import TrainStep
from models.warm import WarmStart
from pipeline.training.remote import TableRankingTrainer


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

    def restore_state(self, state: Mapping[str, Any] | SavedModel) -> None:
        """Load a checkpoint's state: :meth:`checkpoint_state`'s, or the parts a sync job's
        ranks wrote (read whole: this worker holds the whole model)."""
        if isinstance(state, SavedModel):
            state = read_full_state(state.folder, state.files)
        self.train_step.load_state_dict(state)

    def warm_start(self, state: Mapping[str, Any]) -> None:
        self.train_step.warm_start(state)


class _Startable(Protocol):
    def restore_state(self, state: Any) -> None: ...

    def warm_start(self, state: Mapping[str, Any]) -> None: ...


Started = TypeVar("Started", bound=_Startable)


def started(trainer: Started, init: WarmStart | None) -> Started:
    """``trainer`` from the model ``init`` names (as built without one): a model in parts as a
    resume reads it (each rank or host its own rows), one piece by ``warm_start``."""
    if init is not None and init.layout == "parts":
        trainer.restore_state(SavedModel(init.folder, dict(init.files)))
    elif init is not None:
        trainer.warm_start(init.read())
    return trainer


@dataclass(frozen=True)
class TrainerRecipe:
    """Builds a :class:`RankingTrainer` on a worker; the seed makes every replica start equal,
    and ``init`` (:mod:`models.warm`) starts them all from another model."""

    schema: Schema
    model: ModelConfig
    optim: OptimConfig
    seed: int
    init: WarmStart | None = None

    def __call__(self, device: torch.device) -> RankingTrainer:
        return started(RankingTrainer(TrainStep(self.schema, self.model, self.optim,
                                                device=device, seed=self.seed)), self.init)

    def remote_tables(self, device: torch.device) -> TableRankingTrainer:
        """The trainer of the async mode with sharded tables: the dense part only."""
        return started(TableRankingTrainer(
            RemoteTableStep(self.schema, self.model, self.optim, device=device, seed=self.seed),
            self.schema, self.model, self.optim, self.seed), self.init)


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

    def batch(self, parts: Sequence[Batch]) -> Batch:
        """The rows of ``parts`` as one batch (:func:`data.reader.concat`); a batch of no rows
        for none (a rank with no rows still takes part in the step)."""
        if parts:
            return concat(parts)
        names = self.schema.sparse_names
        return Batch(dense_features=torch.zeros(0, len(self.schema.dense)),
                     sparse_features=KeyedJaggedTensor.from_lengths_sync(
                         keys=names, values=torch.zeros(0, dtype=torch.int64),
                         lengths=torch.zeros(0, dtype=torch.int32)),
                     labels=torch.zeros(0))

    def gather_refusal(self, dst: int) -> str | None:
        return self.sharded.gather_refusal(dst)

    def state_bytes(self) -> int:
        return self.sharded.whole_bytes

    def full_state(self, dst: int) -> dict[str, Any] | None:
        return self.sharded.full_state(dst)

    def write_shards(self, folder: str) -> dict[str, dict[str, Any]]:
        return self.sharded.write_shards(folder)

    def restore_state(self, state: Mapping[str, Any] | SavedModel) -> None:
        """Load a checkpoint's state on every rank: a gathered one, or each rank its own shards
        of the parts the ranks wrote."""
        if isinstance(state, SavedModel):
            self.sharded.load_shards(state.folder, state.files)
        else:
            self.sharded.load_full_state(state)

    def warm_start(self, state: Mapping[str, Any]) -> None:
        self.sharded.warm_start(state)

    def final(self, state: Mapping[str, Any]) -> RankingTrainer:
        recipe = self.recipe
        return RankingTrainer(to_train_step(state, recipe.schema, recipe.model, recipe.optim))

    def plan_summary(self) -> Mapping[str, str]:
        return self.sharded.plan_summary()


def rank_memory(worker: Worker) -> int | None:
    """The bytes a rank's shards may take on ``worker`` (None: it has no memory limit, the
    planner shares the machine's memory): its Dask memory limit up to where the worker pauses
    (it then starts no task, not even a checkpoint's; else up to where its nanny restarts it),
    less what the worker process holds already (what the nanny counts: its resident memory).
    That baseline is the Python and torch runtime with the job's modules imported (the training
    stack, MLflow's store) and the process group formed: 0.62-0.65 GiB on a LocalCluster worker
    as its first group forms, about 0.09 GiB more when a group forms again in the same process
    (measured with psutil, torch 2.13 + TorchRec 1.8, 2026-11-28). The planner keeps 15% of
    what it is given for the step's own buffers (TorchRec's default reservation), which covered
    a rank's growth while it trained (0.03-0.06 GiB)."""
    manager = worker.memory_manager
    limit = manager.memory_limit
    if not limit:
        return None
    fraction = manager.memory_pause_fraction or \
        dask.config.get("distributed.worker.memory.terminate") or 1.0
    held = worker.monitor.get_process_memory()
    budget = int(limit * fraction) - held
    if budget <= 0:
        raise ConfigError(f"worker {worker.address}: its memory limit {format_bytes(limit)} "
                          f"(up to {fraction:.0%} of it usable) leaves nothing for the model's "
                          f"shards beside the {format_bytes(held)} its process holds already; "
                          "give the workers more memory")
    return budget


@dataclass(frozen=True)
class ShardedTrainerRecipe:
    """Builds a :class:`ShardedRankingTrainer` on a worker that joined its job's process group;
    the planner is told what the worker's memory leaves for the rank's shards
    (:func:`rank_memory`; without a limit, the machine's share). The seed makes the model start
    as :class:`TrainerRecipe`'s does, and so does ``init``."""

    schema: Schema
    model: ModelConfig
    optim: OptimConfig
    seed: int
    init: WarmStart | None = None

    def __call__(self, device: torch.device) -> ShardedRankingTrainer:
        step = ShardedTrainStep(self.schema, self.model, self.optim, device=device,
                                seed=self.seed, memory_bytes=rank_memory(get_worker()))
        return started(ShardedRankingTrainer(step, self), self.init)


@dataclass(frozen=True)
class ReaderRecipe:
    """Builds the worker's :class:`ShardReader` (converting with ``threads`` threads)."""

    schema: Schema
    threads: int

    def __call__(self) -> ShardReader:
        return ShardReader(self.schema, threads=self.threads)
