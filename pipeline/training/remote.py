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
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torchrec.datasets.utils import Batch

from antdt.agent import SavedModel
from antdt.tables.optim import RowOptimizer
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.remote_tables import RemoteTableStep, initial_rows
from models.sharded import to_train_step
from models.ranking import embedding_keys, sparse_optimizer
from models.shards import Block, ShardFiles, Table, write_dense, write_rank
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
        self._restored: Mapping[str, Any] | ShardFiles | None = None
        template = sparse_optimizer(step.model).state_dict()["state"]
        keys = embedding_keys(step.model)
        self.tables = [Table(name=f, key=keys[f], shape=(rows, self.layout.dim),
                             states=list(template.get(f"{f}.weight", {})))
                       for f, rows in zip(self.layout.features, self.layout.rows)]
        """The tables as :mod:`models.shards` names them (a part's header)."""
        self.width = RowOptimizer(optim.sparse_optimizer, optim.sparse_lr,
                                  optim.eps).state_width(self.layout.dim)

    def rows_of(self, batch: Batch) -> torch.Tensor:
        return self.remote.rows_of(batch)

    def step(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor
             ) -> tuple[float, torch.Tensor]:
        return self.remote.step(batch, ids, rows)

    def dense(self) -> list[torch.Tensor]:
        return list(self.remote.dense())

    def initial_rows(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The seed's rows (no optimiser state), or the restored checkpoint's with theirs (of
        a model in parts, only these rows are read)."""
        if self._restored is None:
            return initial_rows(self.layout, self.seed, start, stop), None
        if isinstance(self._restored, ShardFiles):
            return self._read(self._restored, start, stop)
        return self._slice(self._restored, start, stop)

    def _pieces(self, start: int, stop: int) -> list[tuple[Table, int, int]]:
        """The tables' pieces of global rows ``[start, stop)``: ``(table, first row in it,
        rows)``."""
        offsets = self.layout.offsets
        return [(table, max(start, offsets[i]) - offsets[i],
                 min(stop, offsets[i + 1]) - max(start, offsets[i]))
                for i, table in enumerate(self.tables)
                if max(start, offsets[i]) < min(stop, offsets[i + 1])]

    def _read(self, files: ShardFiles, start: int, stop: int
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        dim = self.layout.dim
        weights = torch.empty(stop - start, dim)
        width = self.width
        state = torch.zeros(stop - start, width)
        at = 0
        for table, first, rows in self._pieces(start, stop):
            files.fill(weights[at:at + rows], table, None, (first, rows), (0, dim))
            for name in table.states:
                out = state[at:at + rows, 0] if width == 1 else state[at:at + rows]
                files.fill(out, table, name, (first, rows), (0, dim))
            at += rows
        return weights, state

    def write_part(self, folder: str, index: int, count: int,
                   parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]]
                   ) -> tuple[str, dict[str, Any]]:
        """Write buckets ``(first global row, weights, state)`` as part ``index`` of ``count``
        of a model in parts (:func:`models.shards.write_rank`: blocks in each table's
        coordinates, so any mode and any number of workers reads it back)."""
        blocks = []
        dim = self.layout.dim
        for start, weights, state in parts:
            at = 0
            for table, first, rows in self._pieces(start, start + weights.shape[0]):
                blocks.append((Block(table.key, None, (first, rows), (0, dim)),
                               weights[at:at + rows]))
                for name in table.states:
                    part = state[at:at + rows]
                    blocks.append((Block(table.key, name, (first, rows), (0, dim)),
                                   part[:, 0] if part.shape[1] == 1 else part))
                at += rows
        return write_rank(folder, index, count, self.tables, blocks)

    def write_dense(self, folder: str) -> tuple[str, dict[str, Any]]:
        """Write everything but the tables (:func:`models.shards.write_dense`)."""
        return write_dense(folder, self.remote.dense_state())

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
            files = ShardFiles(state.folder, state.files)
            dense = files.dense()
            self.remote.load_dense(dense)
            self._restored = files
            return
        self.remote.load_dense(state)
        self._restored = state

    def warm_start(self, state: Mapping[str, Any]) -> None:
        """Start from another model (:meth:`models.warm.WarmStart.read`): the dense part here
        (:meth:`RemoteTableStep.warm_dense`); each host draws its rows from ``state`` where it
        holds them and from the seed where a partial start left a table (:meth:`initial_rows`)."""
        self.remote.warm_dense(state)
        self._restored = state

    def _slice(self, state: Mapping[str, Any], start: int, stop: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows ``[start, stop)`` end to end of a TrainStep state's tables and sparse state; a
        table the state does not hold (a partial warm start) from the seed, and state it does
        not hold as a fresh optimiser's (None where it holds none at all)."""
        sparse = state.get("sparse_optimizer", {"state": {}})["state"]
        weights = torch.empty(stop - start, self.layout.dim)
        states = torch.zeros(stop - start, self.width) if self.width else None
        given = False
        at = 0
        for table, first, rows in self._pieces(start, stop):
            source = state["model"].get(table.key)
            if source is None:
                low = self.layout.offsets[self.tables.index(table)] + first
                weights[at:at + rows] = initial_rows(self.layout, self.seed, low, low + rows)
            else:
                weights[at:at + rows] = source[first:first + rows]
                kept = sparse.get(f"{table.name}.weight", {})
                if kept and states is not None:
                    (value,) = kept.values()
                    states[at:at + rows] = value.reshape(table.shape[0], -1)[first:first + rows]
                    given = True
            at += rows
        return weights, states if given else None

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
