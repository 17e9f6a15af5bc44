"""The training step of the async mode with sharded tables: the embedding tables live outside it.

A :class:`~models.train_step.TrainStep` holds its tables and FBGEMM updates them in backward.
Here the tables are spread over hosts as one run of *global rows* (:class:`TableLayout`), and a
trainer's step is:

1. :meth:`RemoteTableStep.rows_of` the batch: the sorted unique global rows it reads;
2. pull their current values from the hosts (the first time: :func:`initial_rows`);
3. :meth:`RemoteTableStep.step` on them: forward, loss, backward, dense optimiser step; it
   returns the gradient of each pulled row (summed over its occurrences);
4. push the gradients; a host applies the sparse optimiser to its rows.

For the same seed and the same batches, pulling exactly the rows the previous pushes made, this is
TrainStep's training: the same model, the same initial tables and dense weights, the same
updates. :meth:`RemoteTableStep.state_dict` writes a snapshot in TrainStep's format, so a model
trained this way is loaded, evaluated and resumed like any other.

Global rows, for features ``C1`` (3 rows) and ``C2`` (2 rows)::

    feature      C1          C2          offsets (0, 3, 5): row i of feature f is global row
    table row    0   1   2   0   1       offsets[f] + i; total_rows 5
    global row   0   1   2   3   4

    batch of 2   C1: [2]  [1]            rows_of -> [1, 2, 3]: C1's 1 and 2, C2's 0
                 C2: [0]  [0, 0]         rows (3, D) pulled for them; the pooled (2, 2, D) is
                                         [[r(2), r(3)], [r(1), 2 r(3)]]
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import math
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.device import pick_device
from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import (_CPU_SPARSE_OPTIMIZERS, dense_parameters, embedding_keys,
                            fused_embeddings, sparse_optimizer)
from models.train_step import _clone, _dense_optimizer, seeded_block, seeded_model

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """The tables of a model as one run of global rows: feature ``features[f]``'s table has
    ``rows[f]`` rows of ``dim`` floats, and its row ``i`` is global row ``offsets[f] + i``.
    Features in schema order (the order of the model's sparse arch)."""

    features: tuple[str, ...]
    rows: tuple[int, ...]
    dim: int

    def __post_init__(self) -> None:
        if len(self.features) != len(self.rows):
            raise ValueError(f"a layout needs one row count per feature, found "
                             f"{len(self.features)} features and {len(self.rows)} counts")

    @property
    def offsets(self) -> tuple[int, ...]:
        """``F + 1`` cumulative row counts: the first global row of each table, then the end."""
        return tuple(itertools.accumulate(self.rows, initial=0))

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @classmethod
    def from_schema(cls, schema: Schema, model_cfg: ModelConfig) -> TableLayout:
        return cls(features=tuple(schema.sparse_names),
                   rows=tuple(f.num_embeddings for f in schema.sparse),
                   dim=model_cfg.embedding_dim)


def initial_rows(layout: TableLayout, seed: int, start: int, stop: int) -> torch.Tensor:
    """The initial weights ``(stop - start, dim)`` float32 of global rows ``[start, stop)``: bit
    for bit the tables of ``seeded_model(..., seed)`` (:func:`~models.train_step.seeded_block`
    per table piece), made with memory for the range only (and one chunk of the draw)."""
    if not 0 <= start <= stop <= layout.total_rows:
        raise ValueError(f"rows [{start}, {stop}) are not inside the {layout.total_rows} global "
                         "rows of the tables")
    out = torch.empty(stop - start, layout.dim)
    for feature, rows, first in zip(layout.features, layout.rows, layout.offsets):
        low, high = max(start, first), min(stop, first + rows)
        if low < high:
            seeded_block(out[low - start:high - start], seed, feature, (rows, layout.dim),
                         (low - first, 0))
    return out


class _SumBags(torch.autograd.Function):
    """SUM-pooled bags of ``rows[index]`` cut at ``offsets`` (``embedding_bag`` with
    ``include_last_offset``), whose backward adds each bag's gradient to its rows in one
    ``index_add_``: half the time of ``embedding_bag``'s own backward on the CPU."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, index: torch.Tensor,
                offsets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index, offsets)
        ctx.rows = rows.shape[0]
        return nn.functional.embedding_bag(index, rows, offsets, mode="sum",
                                           include_last_offset=True)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        index, offsets = ctx.saved_tensors
        bag_of = torch.repeat_interleave(
            torch.arange(len(offsets) - 1, device=grad.device), offsets.diff(),
            output_size=len(index))
        out = torch.zeros(ctx.rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
        return out.index_add_(0, index, grad.index_select(0, bag_of)), None, None


class _PulledRows(nn.Module):
    """Stands in for the model's sparse arch: returns the pooled embeddings ``(B, F, D)`` the
    step prepared from the pulled rows (:meth:`prepared`), in place of a lookup.

    It keeps the model's :class:`FusedEmbeddingBagCollection` (on the ``meta`` device, never
    called) under the sparse arch's name for it, so the model's parameter names, state-dict keys
    and :func:`~models.ranking.dense_parameters` stay those of a TrainStep's model."""

    def __init__(self, embeddings: FusedEmbeddingBagCollection) -> None:
        super().__init__()
        self.embedding_bag_collection = embeddings
        self._pooled: torch.Tensor | None = None

    @contextlib.contextmanager
    def prepared(self, pooled: torch.Tensor) -> Iterator[None]:
        """The pooled embeddings of the one forward inside the ``with`` block."""
        self._pooled = pooled
        try:
            yield
        finally:
            self._pooled = None

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        assert self._pooled is not None, "a forward outside RemoteTableStep's prepared rows"
        return self._pooled


class RemoteTableStep:
    """TrainStep's model and dense optimiser without the tables: each call is handed the rows
    its batch reads (see the module docstring).

    The dense parameters start as a TrainStep's of the same ``seed`` (bit for bit) and are
    stepped by the same optimiser; ``rows_trained`` counts the rows of every batch passed to
    :meth:`step`. The sparse optimiser must be one a table host applies (FBGEMM's CPU kinds:
    ``rowwise_adagrad``, ``adagrad``, ``sgd``); anything else raises ``ConfigError``.
    """

    def __init__(self, schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig, *,
                 device: torch.device | None = None, seed: int = 0) -> None:
        if optim_cfg.sparse_optimizer not in _CPU_SPARSE_OPTIMIZERS:
            raise ConfigError(
                f"optim.sparse_optimizer: sharded tables are updated on their hosts with one of "
                f"{list(_CPU_SPARSE_OPTIMIZERS)}, found {optim_cfg.sparse_optimizer!r}")
        self.device = device if device is not None else pick_device()
        self.layout = TableLayout.from_schema(schema, model_cfg)
        self.model = seeded_model(schema, model_cfg, optim_cfg, self.device, seed, tables=False)
        self._table_keys = embedding_keys(self.model)
        self._sparse = _PulledRows(fused_embeddings(self.model))
        self.model.sparse_arch = self._sparse
        self.dense_optimizer = _dense_optimizer(self.dense(), optim_cfg, self.device)
        self.rows_trained = 0
        self._last: tuple[KeyedJaggedTensor, torch.Tensor, torch.Tensor] | None = None
        """The features :meth:`rows_of` read last, their ids and each value's index in them."""
        self.model.train()
        logger.info("remote-table step on %s (seed %d): %d global rows of dim %d outside, "
                    "%s dense optimiser", self.device, seed, self.layout.total_rows,
                    self.layout.dim, optim_cfg.dense_optimizer)

    def dense(self) -> list[nn.Parameter]:
        """The dense parameters (live), in :func:`~models.ranking.dense_parameters`' order of a
        TrainStep's model."""
        return [p for _, p in dense_parameters(self.model)]

    def rows_of(self, batch: Batch) -> torch.Tensor:
        """The sorted unique global rows ``(U,)`` int64 that ``batch`` reads, over all features
        (on the batch's device). Raises ``ValueError`` for a batch whose features are not the
        schema's, in its order, or whose id is outside its table."""
        features = batch.sparse_features
        ids, index = torch.unique(self._global_rows(features), return_inverse=True)
        self._last = (features, ids, index)  # the step on this batch needs no search
        return ids

    def _global_rows(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """The global row of every value of ``features`` ``(N,)`` int64, in the KJT's order."""
        if features.keys() != list(self.layout.features):
            raise ValueError(f"expected a batch of the features {list(self.layout.features)} "
                             f"in this order, found {features.keys()}")
        values = features.values().long()
        feature = torch.repeat_interleave(
            torch.arange(len(self.layout.features), device=values.device),
            torch.tensor(features.length_per_key(), device=values.device),
            output_size=len(values))
        rows = torch.tensor(self.layout.rows, device=values.device)[feature]
        bad = ((values < 0) | (values >= rows)).nonzero()
        if len(bad):
            at = int(bad[0])
            raise ValueError(f"feature {self.layout.features[int(feature[at])]!r}: id "
                             f"{int(values[at])} is outside its table of {int(rows[at])} rows")
        return values + torch.tensor(self.layout.offsets[:-1], device=values.device)[feature]

    def _pooled(self, features: KeyedJaggedTensor, ids: torch.Tensor,
                rows: torch.Tensor) -> torch.Tensor:
        """The SUM-pooled embeddings ``(B, F, D)`` of ``features`` over the pulled ``rows``
        ``(U, D)`` of ``ids`` ``(U,)``: the layout TorchRec's sparse arch returns."""
        last = self._last
        if last is not None and last[0] is features and last[1] is ids:
            index = last[2].to(rows.device)
        else:
            wanted = self._global_rows(features)
            index = torch.searchsorted(ids, wanted).clamp_(max=max(len(ids) - 1, 0))
            if len(wanted) and not torch.equal(ids[index], wanted):
                raise ValueError("the pulled ids do not hold every row the batch reads; pass "
                                 "the ids rows_of(batch) returned")
        bags = _SumBags.apply(rows, index, features.offsets().long())
        return bags.view(len(self.layout.features), features.stride(), -1).transpose(0, 1)

    def _logits(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if rows.shape != (len(ids), self.layout.dim):
            raise ValueError(f"expected rows ({len(ids)}, {self.layout.dim}) for {len(ids)} ids, "
                             f"found {tuple(rows.shape)}")
        with self._sparse.prepared(self._pooled(batch.sparse_features, ids, rows)):
            logits: torch.Tensor = self.model(batch.dense_features, batch.sparse_features)
        return logits

    def _on_device(self, batch: Batch, ids: torch.Tensor) -> tuple[Batch, torch.Tensor]:
        if batch.labels.device != self.device:
            batch = batch.to(self.device, non_blocking=True)
        return batch, ids.to(self.device)

    def step(self, batch: Batch, ids: torch.Tensor,
             rows: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Train on one batch over ``rows`` ``(U, D)`` float32, the current values of ``ids``
        ``(U,)`` (as :meth:`rows_of` returned them). Returns the mean BCE loss (before the
        update) and the gradient of the loss w.r.t. ``rows`` ``(U, D)``, each row's summed over
        its occurrences in the batch (what FBGEMM's fused optimiser would apply), on ``rows``'
        device. Syncs with the device once (the loss)."""
        batch, ids = self._on_device(batch, ids)
        pulled = rows.to(self.device).detach().requires_grad_()
        if not self.model.training:
            self.model.train()
        logits = self._logits(batch, ids, pulled)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.dense_optimizer.step()
        self.rows_trained += batch.labels.shape[0]
        assert pulled.grad is not None
        return loss.item(), pulled.grad.to(rows.device)

    @torch.no_grad()
    def predict(self, batch: Batch, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Click probabilities ``(B,)`` float32 on this step's device over ``rows`` of ``ids``
        (eval mode, no gradient, no update)."""
        batch, ids = self._on_device(batch, ids)
        if self.model.training:
            self.model.eval()
        return torch.sigmoid(self._logits(batch, ids, rows.to(self.device)))

    def state_dict(self, tables: Mapping[str, torch.Tensor],
                   sparse_state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """A snapshot in :meth:`TrainStep.state_dict`'s format, which ``TrainStep.load_state_dict``
        loads: this step's dense weights and optimiser state and ``rows_trained`` (cloned), with
        the hosts' ``tables`` (per feature ``(num_embeddings, dim)``) and ``sparse_state`` (per
        feature, that table's optimiser state ``(num_embeddings, W)``, W floats per row; SGD:
        none, or empty tensors), taken as they are (not copied).

        The fused optimiser's state keeps its keyed names (``"<feature>.weight.momentum_1"``).
        ``sparse_iter``, FBGEMM's step counter, is 0: no FBGEMM module counted here, and none of
        the three kinds reads it in its update."""
        tables_of = {key: feature for feature, key in self._table_keys.items()}
        shapes = {feature: (rows, self.layout.dim)
                  for feature, rows in zip(self.layout.features, self.layout.rows)}
        found = {feature: tuple(table.shape) for feature, table in tables.items()}
        if found != shapes:
            raise ValueError(f"tables must be {shapes} (feature: shape), found {found}")
        weights = {key: tables[tables_of[key]] if key in tables_of else _clone(value)
                   for key, value in self.model.state_dict().items()}
        fused = fused_embeddings(self.model)
        return {
            "model": weights,
            "dense_optimizer": _clone(self.dense_optimizer.state_dict()),
            "sparse_optimizer": self._sparse_optimizer_state(sparse_state),
            "sparse_iter": [torch.zeros(m._emb_module.iter.shape, dtype=torch.int64)
                            for m in fused._emb_modules],
            "rows_trained": self.rows_trained,
        }

    def dense_state(self) -> dict[str, Any]:
        """What :meth:`state_dict` holds but the tables and their optimiser's state (cloned),
        with ``keys``, the model's state keys in order: the dense part of a model in parts
        (:func:`models.shards.write_dense`)."""
        tables = set(self._table_keys.values())
        weights = self.model.state_dict()
        fused = fused_embeddings(self.model)
        return {"keys": list(weights),
                "model": {k: _clone(v) for k, v in weights.items() if k not in tables},
                "dense_optimizer": _clone(self.dense_optimizer.state_dict()),
                "sparse_iter": [torch.zeros(m._emb_module.iter.shape, dtype=torch.int64)
                                for m in fused._emb_modules],
                "rows_trained": self.rows_trained}

    def _sparse_optimizer_state(self, sparse_state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """``sparse_state`` keyed and shaped as the fused optimiser's ``state_dict()`` (whose
        names and shapes the ``meta`` tables' optimiser gives: table ``f``'s key is
        ``"f.weight"``, tables being named after their features)."""
        expected: dict[str, tuple[str, tuple[int, ...]]] = {}  # one state tensor per table
        for param, entries in sparse_optimizer(self.model).state_dict()["state"].items():
            (name, meta), = entries.items()
            expected[param.removesuffix(".weight")] = (name, tuple(meta.shape))
        given = {feature: state for feature, state in sparse_state.items() if state.numel()}
        if given.keys() != expected.keys() or any(
                given[f].shape[0] != shape[0] or given[f].numel() != math.prod(shape)
                for f, (_, shape) in expected.items()):
            raise ValueError(
                f"sparse_state must hold {expected} (feature: state name and shape), found "
                f"{ {f: tuple(s.shape) for f, s in sparse_state.items()} }")
        return {"state": {f"{f}.weight": {name: given[f].reshape(shape)}
                          for f, (name, shape) in expected.items()}}

    def load_dense(self, state: Mapping[str, Any]) -> None:
        """Take the dense weights, the dense optimiser's state and ``rows_trained`` of a
        :meth:`state_dict` snapshot (or a TrainStep's), to resume; its tables and sparse state
        are the hosts'. ``state`` stays as it was."""
        table_keys = set(self._table_keys.values())
        dense = {k: v for k, v in state["model"].items() if k not in table_keys}
        missing, unexpected = self.model.load_state_dict(dense, strict=False)
        if unexpected or set(missing) != table_keys:
            raise ValueError(f"the snapshot's model is not this one: keys missing "
                             f"{sorted(set(missing) - table_keys)}, unexpected {unexpected}")
        self.dense_optimizer.load_state_dict(_clone(state["dense_optimizer"]))
        self.rows_trained = int(state["rows_trained"])

    def warm_dense(self, state: Mapping[str, Any]) -> None:
        """:meth:`load_dense` of a warm start (:meth:`models.warm.WarmStart.read`): the dense
        weights ``state`` holds, the dense optimiser's state where given; the rest keeps its
        initial values and ``rows_trained`` starts again."""
        table_keys = set(self._table_keys.values())
        dense = {k: v for k, v in state["model"].items() if k not in table_keys}
        _, unexpected = self.model.load_state_dict(dense, strict=False)
        if unexpected:
            raise ValueError(f"the start's weights are not this model's: {unexpected}")
        if "dense_optimizer" in state:
            self.dense_optimizer.load_state_dict(_clone(state["dense_optimizer"]))
        self.rows_trained = 0
