"""TorchRec ranking models (DLRM, DCN-v2) built from a dataset schema, with fused sparse optimisers.

The model is TorchRec's own :class:`~torchrec.models.dlrm.DLRM` / ``DLRM_DCN`` (dense arch,
sparse arch, interaction arch, over arch). What differs here:

* the sparse arch holds a :class:`FusedEmbeddingBagCollection` instead of a plain
  ``EmbeddingBagCollection``: one FBGEMM table-batched kernel looks up all tables, and its
  optimiser (row-wise Adagrad by default) updates the touched rows *inside the backward pass*.
  No torch optimiser ever sees the tables; on CPU this is ~6x faster than a plain optimiser over an
  ``EmbeddingBagCollection``. ``DLRM`` accepts it as is (it only calls ``embedding_bag_configs()``
  and ``forward``);
* ``forward`` returns logits of shape ``(B,)`` instead of ``(B, 1)``.

Layout of one batch (schema with dense ``I1, I2`` and sparse ``C1`` (single), ``C2`` (multi))::

    dense_features  float32 (B, 2)              sparse_features  KJT, keys in schema order
      [[0.1, 3.0],                                 C1:  [4]     [7]          one id per row
       [0.0, 1.5]]                                 C2:  [1, 9]  [3]          bags, SUM-pooled
                                               -> logits float32 (B,)

Every table is ``(num_embeddings, embedding_dim)`` with ``num_embeddings`` from the schema; the
table of feature ``C1`` is named ``C1`` (so checkpoint keys name the feature).

The distributed sync needs to read and write parameters outside the training step; two helpers
give it exactly that: :func:`dense_parameters` (every trainable tensor except the tables) and
:func:`embedding_tables` (per-feature views of the FBGEMM storage, writable in place).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torchrec.models.dlrm import DLRM, DLRM_DCN
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.keyed import KeyedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig

logger = logging.getLogger(__name__)

# Which torch optimiser type TorchRec translates into which FBGEMM fused kernel.
_SPARSE_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "rowwise_adagrad": RowWiseAdagrad,
    "adagrad": torch.optim.Adagrad,
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
}
# FBGEMM's CPU kernels (fbgemm_gpu: "Optimizer ... is not supported in CPU mode").
_CPU_SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd")


class _LogitsPerRow:
    """Mixin: squeeze TorchRec's ``(B, 1)`` logits to ``(B,)``, the shape of ``Batch.labels``."""

    def forward(self, dense_features: torch.Tensor,
                sparse_features: KeyedJaggedTensor) -> torch.Tensor:
        """``dense_features`` float32 (B, n_dense), ``sparse_features`` KJT -> logits (B,)."""
        logits: torch.Tensor = super().forward(  # type: ignore[misc]
            dense_features=dense_features, sparse_features=sparse_features)
        return logits.squeeze(-1)


class RankingDLRM(_LogitsPerRow, DLRM):
    """DLRM (pairwise dot-product interaction) returning logits of shape (B,)."""


class RankingDCN(_LogitsPerRow, DLRM_DCN):
    """DLRM with a low-rank DCN-v2 cross network as interaction, returning logits (B,)."""


def fused_embedding_collection(schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig,
                               device: torch.device) -> FusedEmbeddingBagCollection:
    """One SUM-pooled table per sparse feature, all in one FBGEMM kernel with a fused optimiser."""
    if device.type == "cpu" and optim_cfg.sparse_optimizer not in _CPU_SPARSE_OPTIMIZERS:
        raise ConfigError(
            f"optim.sparse_optimizer: {optim_cfg.sparse_optimizer!r} has no FBGEMM CPU kernel; "
            f"expected one of {list(_CPU_SPARSE_OPTIMIZERS)} on device {device} "
            "(or train on a CUDA device)")
    bad = [name for name in schema.sparse_names if "." in name]
    if bad:
        raise ConfigError(f"{schema.source}: sparse column name(s) {bad} contain '.', which "
                          "cannot name an embedding table (torch module names); rename them")
    tables = [
        EmbeddingBagConfig(name=f.name, num_embeddings=f.num_embeddings,
                           embedding_dim=model_cfg.embedding_dim, feature_names=[f.name],
                           pooling=PoolingType.SUM)
        for f in schema.sparse
    ]
    kwargs: dict[str, Any] = {"lr": optim_cfg.sparse_lr}
    if optim_cfg.sparse_optimizer != "sgd":
        kwargs["eps"] = optim_cfg.eps
    return FusedEmbeddingBagCollection(
        tables=tables, optimizer_type=_SPARSE_OPTIMIZERS[optim_cfg.sparse_optimizer],
        optimizer_kwargs=kwargs, device=device)


def build_model(schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig,
                device: torch.device,
                embeddings: FusedEmbeddingBagCollection | None = None) -> nn.Module:
    """Build the ranking model ``(dense (B, n_dense), KJT) -> logits (B,)`` on ``device``, over
    ``embeddings`` (the caller's :func:`fused_embedding_collection`, e.g. on the ``meta`` device
    for a model whose tables are sharded later; default: one built here on ``device``).

    Weights are initialised from torch's global RNG: seed it (or fork it) around this call for a
    reproducible model, as :func:`models.train_step.seeded_model` does.
    """
    ebc = embeddings if embeddings is not None else \
        fused_embedding_collection(schema, model_cfg, optim_cfg, device)
    common: dict[str, Any] = {
        "embedding_bag_collection": ebc,
        "dense_in_features": len(schema.dense),
        "dense_arch_layer_sizes": list(model_cfg.dense_arch),
        "over_arch_layer_sizes": list(model_cfg.over_arch),
        "dense_device": device,
    }
    model: DLRM
    if model_cfg.arch == "dlrm":
        model = RankingDLRM(**common)
    else:
        model = RankingDCN(**common, dcn_num_layers=model_cfg.dcn_layers,
                           dcn_low_rank_dim=model_cfg.dcn_low_rank)
    # DLRM_DCN builds its cross net without a device: move the dense parts only. The tables
    # already live on `device`, in FBGEMM storage that the table parameters must keep viewing.
    for part in (model.dense_arch, model.inter_arch, model.over_arch):
        part.to(device)
    logger.info("built %s: %d tables (dim %d, %d rows in all), %d dense parameters, "
                "sparse optimiser %s (lr %g)", model_cfg.arch, len(schema.sparse),
                model_cfg.embedding_dim, sum(f.num_embeddings for f in schema.sparse),
                sum(p.numel() for _, p in dense_parameters(model)),
                optim_cfg.sparse_optimizer, optim_cfg.sparse_lr)
    return model


def fused_embeddings(model: nn.Module) -> FusedEmbeddingBagCollection:
    """The model's one :class:`FusedEmbeddingBagCollection` (raises if there is not exactly one)."""
    found = [m for m in model.modules() if isinstance(m, FusedEmbeddingBagCollection)]
    if len(found) != 1:
        raise ValueError(f"expected a model with one FusedEmbeddingBagCollection, "
                         f"found {len(found)} in {type(model).__name__}")
    return found[0]


def sparse_optimizer(model: nn.Module) -> KeyedOptimizer:
    """The fused sparse optimiser: its ``state_dict()`` holds e.g. row-wise Adagrad's momentum
    (one float per table row, key ``"<feature>.weight.momentum_1"``)."""
    return fused_embeddings(model).fused_optimizer()


def dense_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Every parameter except the embedding tables, as ``(name, parameter)`` in a fixed order.

    These are what the dense optimiser steps and what the sync averages across workers. The
    parameters themselves are returned (not copies): write them under ``torch.no_grad()``.
    """
    table_ids = {id(p) for p in fused_embeddings(model).parameters()}
    return [(name, p) for name, p in model.named_parameters() if id(p) not in table_ids]


def embedding_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per sparse feature, its table ``(num_embeddings, embedding_dim)``: a detached *view* of the
    FBGEMM storage the lookup kernel and the fused optimiser read and write.

    An in-place write (``table.index_add_(0, rows, deltas)``) is seen by the next forward, and the
    fused optimiser keeps updating the same memory; no copy back is needed. Detached, so such a
    write needs no ``torch.no_grad()``.
    """
    ebc = fused_embeddings(model)
    return {cfg.feature_names[0]: ebc.embedding_bags[cfg.name].weight.detach()
            for cfg in ebc.embedding_bag_configs()}


def embedding_keys(model: nn.Module) -> dict[str, str]:
    """Per sparse feature, the ``model.state_dict()`` key of its table (the tables of
    :func:`embedding_tables`, named alike)."""
    ebc = fused_embeddings(model)
    prefix = next(name for name, module in model.named_modules() if module is ebc)
    return {cfg.feature_names[0]: f"{prefix}.embedding_bags.{cfg.name}.weight"
            for cfg in ebc.embedding_bag_configs()}
