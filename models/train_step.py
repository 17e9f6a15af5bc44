"""The one training step every mode uses (local, async distributed, sync): model + optimisers.

A :class:`TrainStep` owns a ranking model (:func:`models.ranking.build_model`), whose embedding
tables are updated by the fused FBGEMM optimiser during backward, and a torch optimiser for the
dense parameters. One call of :meth:`TrainStep.step` is: forward, BCE-with-logits loss, backward
(embedding rows updated here), dense optimiser step. It syncs with the device once, to return the
loss as a float.

    >>> from data.schema import Schema
    >>> from torchrec.datasets.utils import Batch
    >>> from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    >>> schema = Schema.from_dict({"label": "y", "dense": ["x"],
    ...                            "sparse": [{"name": "c", "num_embeddings": 10}]})
    >>> ts = TrainStep(schema, ModelConfig(embedding_dim=4, dense_arch=(8, 4)), OptimConfig(),
    ...                device=torch.device("cpu"))
    >>> batch = Batch(dense_features=torch.zeros(2, 1),
    ...               sparse_features=KeyedJaggedTensor.from_lengths_sync(
    ...                   keys=["c"], values=torch.tensor([1, 2]), lengths=torch.tensor([1, 1])),
    ...               labels=torch.tensor([0.0, 1.0]))
    >>> loss = ts.step(batch)
    >>> ts.rows_trained, ts.predict(batch).shape
    (2, torch.Size([2]))
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from typing import Any, Mapping, NamedTuple

import torch
from torch import nn
from torchrec.datasets.utils import Batch

from antdt.device import huge_pages, pick_device
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import (build_model, dense_parameters, embedding_keys, embedding_tables,
                            fused_embedding_collection, fused_embeddings, sparse_optimizer)

logger = logging.getLogger(__name__)

_SPARSE_STATE = {"rowwise_adagrad": (1, 0), "adagrad": (0, 1), "sgd": (0, 0), "adam": (0, 2)}
"""Floats of the fused sparse optimiser's state, ``(per table row, per table element)``:
row-wise Adagrad keeps one sum of squares per row, Adagrad one per element, Adam two moments
per element, SGD nothing."""
_DENSE_STATE = {"adam": 2, "adagrad": 1, "sgd": 0}
"""Tensors the dense optimiser keeps per parameter (Adam: two moments; Adagrad: one sum; SGD
without momentum: none); the scalar step counters are left out."""


class ModelBytes(NamedTuple):
    """The bytes of the tensors one :class:`TrainStep` holds while it trains, by part:
    ``tables`` (the embedding weights), ``sparse_state`` (the fused optimiser's state),
    ``dense`` (every other parameter) and ``dense_state`` (their gradients and the dense
    optimiser's state)."""

    tables: int
    sparse_state: int
    dense: int
    dense_state: int

    @property
    def total(self) -> int:
        return self.tables + self.sparse_state + self.dense + self.dense_state


def model_bytes(schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig) -> ModelBytes:
    """What a :class:`TrainStep` of this model holds, computed without allocating its tables:
    a job can be sized (and refused) on a machine that could not hold them.

    The tables are ``rows x embedding_dim`` float32 and the sparse state follows from the
    optimiser. The dense part does not depend on the tables' rows, so it is counted on the same
    model built with one row per table.

    >>> schema = Schema.from_dict({"label": "y", "dense": ["x"],
    ...                            "sparse": [{"name": "c", "num_embeddings": 1_000_000}]})
    >>> size = model_bytes(schema, ModelConfig(embedding_dim=4, dense_arch=(8, 4)),
    ...                    OptimConfig(sparse_optimizer="adagrad"))
    >>> size.tables, size.sparse_state
    (16000000, 16000000)
    """
    rows = sum(f.num_embeddings for f in schema.sparse)
    per_row, per_element = _SPARSE_STATE[optim_cfg.sparse_optimizer]
    float_bytes = torch.float32.itemsize
    tiny = dataclasses.replace(schema, sparse=tuple(
        dataclasses.replace(f, num_embeddings=1) for f in schema.sparse))
    # the sparse optimiser leaves the dense part alone, and Adam's has no FBGEMM CPU kernel
    sgd = dataclasses.replace(optim_cfg, sparse_optimizer="sgd")
    with torch.random.fork_rng(devices=[]):
        model = build_model(tiny, model_cfg, sgd, torch.device("cpu"))
    dense = sum(p.numel() * p.element_size() for _, p in dense_parameters(model))
    return ModelBytes(
        tables=rows * model_cfg.embedding_dim * float_bytes,
        sparse_state=(per_row + per_element * model_cfg.embedding_dim) * rows * float_bytes,
        dense=dense, dense_state=dense * (1 + _DENSE_STATE[optim_cfg.dense_optimizer]))


def _dense_optimizer(params: list[nn.Parameter], cfg: OptimConfig,
                     device: torch.device) -> torch.optim.Optimizer:
    """The torch optimiser of the dense part; ``fused`` kernels (one pass over all parameters)
    keep its cost per step small next to forward/backward on CPU and GPU alike."""
    fused = device.type in ("cpu", "cuda")
    if cfg.dense_optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.dense_lr, eps=cfg.eps,
                                weight_decay=cfg.weight_decay, fused=fused)
    if cfg.dense_optimizer == "adagrad":
        return torch.optim.Adagrad(params, lr=cfg.dense_lr, eps=cfg.eps,
                                   weight_decay=cfg.weight_decay, fused=fused)
    return torch.optim.SGD(params, lr=cfg.dense_lr, weight_decay=cfg.weight_decay, fused=fused)


def _clone(obj: Any) -> Any:
    """Deep copy of a (nested) state dict that clones every tensor: a snapshot that training
    does not change afterwards (state dicts are otherwise views of the live tensors)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, Mapping):
        return {k: _clone(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(v) for v in obj)
    return obj


INIT_CHUNK_ELEMENTS = 1 << 20
"""Floats of one chunk of a table's initial weights: a table is drawn in chunks of
``max(1, INIT_CHUNK_ELEMENTS // embedding_dim)`` whole rows, each from its own generator."""


def _chunk_generator(seed: int, table: str, chunk: int) -> torch.Generator:
    """The generator of chunk ``chunk`` of ``table``'s initial weights: a stream of its own,
    named by ``(seed, table, chunk)`` (a table keeps its weights when other tables change)."""
    digest = hashlib.sha256(f"antdt-table-init/{seed}/{table}/{chunk}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def seeded_block(out: torch.Tensor, seed: int, table: str, shape: tuple[int, int],
                 offsets: tuple[int, int]) -> None:
    """Fill ``out`` ``(n, m)`` with rows ``offsets[0] .. +n`` and columns ``offsets[1] .. +m``
    of the initial weights of ``table`` (``shape``: its ``(num_embeddings, embedding_dim)``).

    TorchRec's default initialisation (uniform in ``±sqrt(1 / num_embeddings)``), drawn chunk by
    chunk of whole rows (:data:`INIT_CHUNK_ELEMENTS`), each chunk from its own generator: any
    block of any table is made with one chunk of extra memory, so a rank of the sync mode draws
    only its own shards, and every mode starts from the same tables for the same seed."""
    rows, dim = shape
    n, m = out.shape
    first, column = offsets
    if first < 0 or column < 0 or first + n > rows or column + m > dim:
        raise ValueError(f"a block of {n} x {m} at {offsets} is not inside table {table!r} of "
                         f"shape {shape}")
    bound = math.sqrt(1 / rows)
    per_chunk = max(1, INIT_CHUNK_ELEMENTS // dim)
    for chunk in range(first // per_chunk, -(-(first + n) // per_chunk) if n else 0):
        start = chunk * per_chunk
        values = torch.empty(min(per_chunk, rows - start), dim).uniform_(
            -bound, bound, generator=_chunk_generator(seed, table, chunk))
        low, high = max(first, start), min(first + n, start + values.shape[0])
        out[low - first:high - first].copy_(values[low - start:high - start, column:column + m])


def seeded_model(schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig,
                 device: torch.device, seed: int, *, tables: bool = True) -> nn.Module:
    """:func:`models.ranking.build_model` initialised from ``seed``, the same in every training
    mode. The dense parts are drawn from ``seed`` in a forked RNG (the caller's RNG stream is
    left alone) and do not depend on the tables; each table from its own streams
    (:func:`seeded_block`). ``tables=False``: the tables stay on the ``meta`` device (nothing
    allocated), for a sharded model that draws its own shards."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        # TorchRec draws the tables from the global RNG as it builds them; seeded_block
        # replaces them, and the seed below makes the dense draws independent of their sizes.
        embeddings = fused_embedding_collection(schema, model_cfg, optim_cfg,
                                                device if tables else torch.device("meta"))
        torch.manual_seed(seed)
        model = build_model(schema, model_cfg, optim_cfg, device, embeddings)
    if tables:
        for feature, table in embedding_tables(model).items():
            seeded_block(table, seed, feature, (table.shape[0], table.shape[1]), (0, 0))
    return model


class TrainStep:
    """Model + dense optimiser (+ the fused sparse optimiser inside the model) on one device.

    Deterministic: the same ``seed`` and the same batches give the same weights (the seed only
    drives initialisation, in a forked RNG, so the caller's RNG stream is left alone).
    ``rows_trained`` counts the rows of every batch passed to :meth:`step`.
    """

    def __init__(self, schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig, *,
                 device: torch.device | None = None, seed: int = 0) -> None:
        self.schema = schema
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        self.device = device if device is not None else pick_device()
        self.model = seeded_model(schema, model_cfg, optim_cfg, self.device, seed)
        for table in {t.untyped_storage().data_ptr(): t
                      for t in embedding_tables(self.model).values()}.values():
            # Rows are looked up, updated and synced at random. Marked only: moving them now
            # would hold up the start; the async mode's sync thread moves them between rounds.
            huge_pages(table)
        self.dense_optimizer = _dense_optimizer(
            [p for _, p in dense_parameters(self.model)], optim_cfg, self.device)
        self.rows_trained = 0
        self.model.train()
        logger.info("train step on %s (seed %d): %s sparse + %s dense optimiser",
                    self.device, seed, optim_cfg.sparse_optimizer, optim_cfg.dense_optimizer)

    def _on_device(self, batch: Batch) -> Batch:
        if batch.labels.device == self.device:
            return batch
        return batch.to(self.device, non_blocking=True)

    def step(self, batch: Batch) -> float:
        """Train on one batch; return its mean BCE loss (before the update)."""
        batch = self._on_device(batch)
        if not self.model.training:
            self.model.train()
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()  # the fused optimiser updates the touched embedding rows here
        self.dense_optimizer.step()
        self.rows_trained += batch.labels.shape[0]
        return loss.item()

    @torch.no_grad()
    def predict(self, batch: Batch) -> torch.Tensor:
        """Click probabilities ``(B,)`` float32 on this step's device (eval mode, no gradient,
        no update)."""
        batch = self._on_device(batch)
        if self.model.training:
            self.model.eval()
        return torch.sigmoid(self.model(batch.dense_features, batch.sparse_features))

    def state_dict(self, tables: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """A snapshot (cloned tensors) to resume from exactly: model weights, the dense optimiser's
        state, the fused sparse optimiser's state (e.g. row-wise Adagrad momentum per row) and
        ``rows_trained``. With ``tables`` (per feature, shaped as :func:`embedding_tables`'s),
        they are the snapshot's embedding weights instead of the live ones (taken as they are,
        not cloned: the caller's copies)."""
        weights = self.model.state_dict()
        keys = embedding_keys(self.model)
        if tables is not None:
            shapes = {feature: tuple(weights[key].shape) for feature, key in keys.items()}
            found = {feature: tuple(table.shape) for feature, table in tables.items()}
            if found != shapes:
                raise ValueError(f"tables must be {shapes} (feature: shape), found {found}")
            for key in keys.values():
                del weights[key]
        fused = fused_embeddings(self.model)
        state = _clone({
            "model": weights,
            "dense_optimizer": self.dense_optimizer.state_dict(),
            "sparse_optimizer": sparse_optimizer(self.model).state_dict(),
            # FBGEMM's step counter (Adam's bias correction); not part of the keyed state.
            "sparse_iter": [m._emb_module.iter for m in fused._emb_modules],
            "rows_trained": self.rows_trained,
        })
        if tables is not None:
            state["model"].update({keys[feature]: table for feature, table in tables.items()})
        return state

    def optimizer_state(self) -> dict[str, Any]:
        """Both optimisers' state as :meth:`state_dict` holds it, not copied (to be saved at
        once, beside the weights of a logged model: a warm start's optimisers)."""
        modules = fused_embeddings(self.model)._emb_modules
        return {"dense_optimizer": self.dense_optimizer.state_dict(),
                "sparse_optimizer": sparse_optimizer(self.model).state_dict(),
                "sparse_iter": [m._emb_module.iter for m in modules]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore a :meth:`state_dict` snapshot in place (the tables' storage does not move).
        ``state`` stays as it was: training on does not write into it."""
        self.model.load_state_dict(state["model"])
        # A torch optimiser adopts loaded state tensors that already have the parameters' dtype
        # and device instead of copying them, and then updates them in place.
        self.dense_optimizer.load_state_dict(_clone(state["dense_optimizer"]))
        sparse_optimizer(self.model).load_state_dict(state["sparse_optimizer"])
        for module, it in zip(fused_embeddings(self.model)._emb_modules, state["sparse_iter"]):
            module._emb_module.iter.copy_(it)
            module._emb_module.iter_cpu.zero_()  # re-read from `iter` on the next forward
        self.rows_trained = int(state["rows_trained"])

    def warm_start(self, state: Mapping[str, Any]) -> None:
        """Start from another model (:meth:`models.warm.WarmStart.read`): the weights
        ``state["model"]`` holds (all, or those a partial start took) and, where ``state`` has
        them, both optimisers' states (the sparse one for the tables taken); the rest keeps
        this step's initial values. ``rows_trained`` starts again."""
        missing, unexpected = self.model.load_state_dict(state["model"], strict=False)
        if unexpected:
            raise ValueError(f"the start's weights are not this model's: {unexpected}")
        if "dense_optimizer" in state:
            self.dense_optimizer.load_state_dict(_clone(state["dense_optimizer"]))
        if "sparse_optimizer" in state:
            taken = {f"{f}.weight" for f, key in embedding_keys(self.model).items()
                     if key not in missing}
            own = sparse_optimizer(self.model).state_dict()
            own["state"].update({k: v for k, v in state["sparse_optimizer"]["state"].items()
                                 if k in taken})
            sparse_optimizer(self.model).load_state_dict(own)
        for module, it in zip(fused_embeddings(self.model)._emb_modules,
                              state.get("sparse_iter", ())):
            module._emb_module.iter.copy_(it)
            module._emb_module.iter_cpu.zero_()
        self.rows_trained = 0
