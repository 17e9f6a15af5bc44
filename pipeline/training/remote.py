"""The trainer of the async mode with sharded tables (:class:`TableRankingTrainer`, the
application's side of :class:`antdt.agent.modes.hybrid.TableTrainer`): the dense part of the
ranking model trains here, over the rows the hosts serve (:class:`models.remote_tables.
RemoteTableStep`). Its checkpoints are :class:`~models.train_step.TrainStep`'s form, so a
checkpoint of any mode resumes in any other, and its final model is a plain
:class:`~models.train_step.TrainStep`, built from the gathered tables on the worker that
evaluates it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from antdt.agent import SavedModel
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.remote_tables import RemoteTableStep, initial_rows
from models.sharded import to_train_step
from models.shards import read_full_state
from models.train_step import TrainStep

Tables = tuple[torch.Tensor, torch.Tensor]


class TableRankingTrainer:
    """One worker's dense part of the model; the tables are the hosts' (see the module
    docstring)."""

    def __init__(self, step: RemoteTableStep, schema: Schema, model: ModelConfig,
                 optim: OptimConfig, seed: int) -> None:
        self.remote = step
        self.schema, self.model, self.optim, self.seed = schema, model, optim, seed
        self.layout = step.layout
        self._restored: Mapping[str, Any] | None = None

    def rows_of(self, batch: Batch) -> torch.Tensor:
        return self.remote.rows_of(batch)

    def step(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor
             ) -> tuple[float, torch.Tensor]:
        return self.remote.step(batch, ids, rows)

    def dense(self) -> list[torch.Tensor]:
        return list(self.remote.dense())

    def initial_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The seed's rows (no optimiser state), or the restored checkpoint's with theirs."""
        if self._restored is None:
            return initial_rows(self.layout, self.seed, start, stop), None
        return self._slice(self._restored, start, stop)

    def checkpoint_state(self, tables: Tables) -> dict[str, Any]:
        """:meth:`RemoteTableStep.state_dict` of the gathered ``tables`` (weights and state end
        to end, cut back into one table a feature)."""
        weights, state = tables
        offsets = self.layout.offsets
        per_feature = {f: (weights[offsets[i]:offsets[i + 1]], state[offsets[i]:offsets[i + 1]])
                       for i, f in enumerate(self.layout.features)}
        return self.remote.state_dict({f: w for f, (w, _) in per_feature.items()},
                                      {f: s for f, (_, s) in per_feature.items()})

    def restore_state(self, state: Mapping[str, Any] | SavedModel) -> None:
        """Resume: the dense part here; the tables are drawn by each host from the same state
        (:meth:`initial_rows`)."""
        if isinstance(state, SavedModel):
            state = read_full_state(state.folder, state.files)
        self.remote.load_dense(state)
        self._restored = state

    def _slice(self, state: Mapping[str, Any], start: int, stop: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``[start, stop)`` end to end of a TrainStep state's tables and sparse state."""
        keys = self.remote._table_keys
        sparse = state["sparse_optimizer"]["state"]
        weights, states = [], []
        offsets = self.layout.offsets
        for i, feature in enumerate(self.layout.features):
            low, high = max(start, offsets[i]), min(stop, offsets[i + 1])
            if low >= high:
                continue
            rows = slice(low - offsets[i], high - offsets[i])
            weights.append(state["model"][keys[feature]][rows])
            kept = sparse.get(f"{feature}.weight", {})
            if kept:
                (value,) = kept.values()
                states.append(value.reshape(offsets[i + 1] - offsets[i], -1)[rows])
        if not states:
            return torch.cat(weights).clone(), None
        return torch.cat(weights).clone(), torch.cat(states).float().clone()

    def final(self, gather: Callable[[], Tables]) -> GatheredTrainer:
        return GatheredTrainer(self, gather)


class GatheredTrainer:
    """The final model of a job with sharded tables: a
    :class:`~models.train_step.TrainStep` built from the hosts' tables when it is first
    used (on the worker that evaluates and logs it)."""

    def __init__(self, trainer: TableRankingTrainer, gather: Callable[[], Tables]) -> None:
        self._trainer = trainer
        self._gather = gather

    @functools.cached_property
    def train_step(self) -> TrainStep:
        t = self._trainer
        return to_train_step(t.checkpoint_state(self._gather()), t.schema, t.model, t.optim)

    def state(self) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU (as :meth:`RankingTrainer.state`)."""
        return {k: v.detach().cpu().clone() for k, v in self.train_step.model.state_dict().items()}
