"""The synchronous training step (AntDT-DD): one ranking model sharded over a torch.distributed group.

Every rank of the group builds the same model as :class:`~models.train_step.TrainStep` (same seed,
same initial weights) and wraps it in TorchRec's :class:`DistributedModelParallel`: the embedding
tables are placed on the ranks by TorchRec's planner, the dense layers are replicated and kept equal
by DMP's DDP. One step is a collective of every rank on its own local batch::

    rank 0: rows 0..3      forward: ids to the tables' owners (all-to-all), pooled rows back
    rank 1: rows 4..7  ->  backward: row gradients to the owners, whose fused optimiser applies
                           them; dense gradients all-reduced (DDP), dense optimiser step

Placement. The planner chooses per table among the sharding types whose kernel is ``fused`` (the
FBGEMM kernel with the sparse optimiser inside backward): never ``data_parallel``, which crashes
the fused collection (it wraps the table in a DDP with ``device_ids=[cpu]``). On gloo the choice
is table-wise, column-wise or table-column-wise: TorchRec's CPU sharder offers no row-wise, and
row-wise with a different batch on each rank fails in backward on gloo (``allgather: invalid
tensor size``) unless TorchRec's process-wide ``set_use_sync_collectives(True)`` makes every
collective blocking. Column-wise already splits a table too large for one rank, so row-wise is
left to nccl, where the CUDA sharder offers it and uneven all-gathers work. The planner's topology
gets each rank's own memory (gathered from all ranks), so a plan that does not fit is refused
here, with the sizes, instead of failing later in an allocation.

Unequal local batches. Ranks may train different numbers of rows in a step (even none): TorchRec's
variable-batch path carries each rank's batch size with the ids. Rank ``r`` weights its loss as
``W * sum(BCE of its rows) / B_global`` (``W`` ranks): DDP divides dense gradients by ``W`` and
TorchRec divides sparse gradients by ``W`` in its all-to-all backward (``GRADIENT_DIVISION``), so
every gradient is the global batch's mean gradient, whatever the split.

Checkpoints. :meth:`ShardedTrainStep.full_state` gathers the whole model to one rank in exactly
:meth:`TrainStep.state_dict`'s format, and :meth:`ShardedTrainStep.load_full_state` loads such a
state on any number of ranks: a job may restart on a different world size, switch between the
async and the sync mode, and serve the final model as a plain :class:`TrainStep`
(:func:`to_train_step`). A row-wise optimiser state (row-wise Adagrad's one float per row) of a
table split column-wise is kept per column shard by FBGEMM (each shard's mean of squared
gradients over its own columns); the full state holds their column-weighted mean, which is the
unsharded state exactly, and loading gives every column shard the full state.

A model too large for one rank is not gathered: :meth:`ShardedTrainStep.gather_refusal` says
whether the whole fits on a rank (the gather holds about :data:`GATHER_COPIES` copies of it),
and otherwise every rank writes its own shards (:meth:`ShardedTrainStep.write_shards`, the
files of :mod:`models.shards`), which any number of ranks loads back
(:meth:`ShardedTrainStep.load_shards`) and a machine that holds the whole reads as one state
(:func:`models.shards.read_full_state`).

Memory: a rank allocates only its own shards. The unsharded model the planner sees has its
tables on the ``meta`` device, and each rank draws its shards' initial weights itself from the
tables' seeded streams (:func:`~models.train_step.seeded_block`), the same weights a
:class:`TrainStep` of the same seed starts from.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import DeviceMesh
from torchrec.datasets.utils import Batch
from torchrec.distributed import collective_utils, comm_ops
from torchrec.distributed.batched_embedding_kernel import BaseBatchedEmbeddingBag
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.fused_embeddingbag import FusedEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import (CustomTopologyData, KernelConfig,
                                                ParameterConstraints, PlannerError, Topology,
                                                TopologyFactory, TrainerConfig)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan, ShardingType

from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.ranking import dense_parameters, embedding_keys, fused_embeddings, sparse_optimizer
from models.shards import (Block, ShardFiles, Table, read_full_state, write_dense,
                           write_rank)
from models.train_step import (TrainStep, _clone, _dense_optimizer, model_bytes, seeded_block,
                               seeded_model)

logger = logging.getLogger(__name__)

_ROW_WISE = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)
"""Sharding types that split a table's rows: their backward all-gathers uneven batches, which
only nccl accepts (see the module docstring)."""

GATHER_COPIES = 3
"""Copies of the whole model a rank holds while the model is gathered on it: the gathered
buffers and the assembled state (:meth:`ShardedTrainStep.full_state`), then the single-process
model built from it, or a checkpoint's serialised bytes."""


class _Piece(NamedTuple):
    """A local shard of a table's weight (``state == -1``) or of its ``state``-th optimiser state,
    placed in that sharded tensor's global coordinates."""

    table: int
    state: int
    size: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


def _rank_memory(device: torch.device, memory_bytes: int | None,
                world_size: int) -> tuple[int, int]:
    """This rank's ``(ddr, hbm)`` capacity in bytes for the planner: host memory is
    ``memory_bytes`` (a Dask worker's memory limit) or, without one, the machine's memory shared
    by ``world_size`` ranks; device memory is the GPU's on ``cuda``, none on the CPU."""
    if memory_bytes is not None and memory_bytes < 1:
        raise ConfigError(f"memory_bytes: expected a positive number of bytes or None (the "
                          f"machine's memory / world size), found {memory_bytes!r}")
    ddr = memory_bytes if memory_bytes is not None else \
        os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // world_size
    hbm = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return ddr, hbm


def _topology(device: torch.device, capacities: list[tuple[int, int]]) -> Topology:
    """The planner's view of the group: one device per rank with that rank's own memory."""
    world_size = len(capacities)
    per_rank = {"ddr_cap": [ddr for ddr, _ in capacities]}
    if device.type == "cuda":
        per_rank["hbm_cap"] = [hbm for _, hbm in capacities]
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=world_size,
            additional_params={"custom_topology_data": CustomTopologyData(per_rank, world_size)}),
        kernel_config=KernelConfig(compute_device=device.type))


def _sharding_types(sharder: FusedEmbeddingBagCollectionSharder, device: torch.device,
                    backend: str) -> list[str]:
    """The sharding types the planner may choose (see the module docstring)."""
    return [kind for kind in sharder.sharding_types(device.type)
            if kind != ShardingType.DATA_PARALLEL.value
            and (backend == "nccl" or kind not in _ROW_WISE)]


def _plan(model: nn.Module, tables: list[Table], sharder: FusedEmbeddingBagCollectionSharder,
          kinds: list[str], device: torch.device, capacities: list[tuple[int, int]],
          group: dist.ProcessGroup) -> ShardingPlan:
    """Plan on the group's rank 0 and hand every rank the same plan, or the same
    :class:`ConfigError` when the tables do not fit (no rank is left waiting)."""
    if dist.get_rank(group) == 0:
        constraints = {t.name: ParameterConstraints(
            sharding_types=kinds, compute_kernels=[EmbeddingComputeKernel.FUSED.value])
            for t in tables}
        planner = EmbeddingShardingPlanner(topology=_topology(device, capacities),
                                           constraints=constraints, debug=False)
        try:
            outcome: list[Any] = [planner.plan(model, [sharder])]
        except PlannerError as error:
            weights = sum(math.prod(t.shape) for t in tables) * 4
            per_rank = sorted({ddr if device.type == "cpu" else hbm for ddr, hbm in capacities})
            outcome = [
                f"the embedding tables ({len(tables)} tables, {weights:,} bytes of float32 "
                f"weights, more with the optimiser state and buffers) do not fit on "
                f"{len(capacities)} rank(s) with {per_rank} bytes of "
                f"{'host' if device.type == 'cpu' else 'GPU'} memory per rank (memory_bytes, "
                f"or the machine's memory / world size); give the workers more memory or add "
                f"workers. The planner: "
                f"{str(error).splitlines()[0]}"]
    else:
        outcome = [None]
    dist.broadcast_object_list(outcome, group=group, group_src=0)
    if isinstance(outcome[0], str):
        raise ConfigError(outcome[0])
    plan: ShardingPlan = outcome[0]
    return plan


def _sharding_env(group: dist.ProcessGroup, device: torch.device) -> ShardingEnv:
    """TorchRec's sharding environment over ``group``.

    ``ShardingEnv.from_process_group`` builds its device mesh with ``new_group``, a collective of
    every process of the default group, which the processes outside a subgroup never join (the
    group's ranks then wait forever, or later ``new_group`` calls pair up wrongly). A mesh made
    from the group itself creates no group."""
    env = ShardingEnv(dist.get_world_size(group), dist.get_rank(group))
    env.process_group = group
    env.device_mesh = DeviceMesh.from_group(group, device.type)
    return env


def _block(full: torch.Tensor, piece: _Piece) -> torch.Tensor:
    """The part of an unsharded tensor (a table, or its optimiser state) that ``piece`` holds.

    A row-wise state of a table split column-wise is one copy of the rows per column shard, end
    to end (``size == (k * rows,)``): each copy is the whole unsharded state."""
    if tuple(full.shape) == piece.size:
        return full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))]
    rows = full.shape[0]
    assert full.dim() == 1 and len(piece.size) == 1 and piece.size[0] % rows == 0, (
        f"a sharded state of size {piece.size} does not fit an unsharded one of {full.shape}")
    start = piece.offsets[0] % rows
    return full[start:start + piece.sizes[0]]


def _unsharded_state(state: torch.Tensor, table: Table,
                     column_widths: list[int]) -> torch.Tensor:
    """An optimiser state gathered in its sharded tensor's coordinates, as the unsharded
    optimiser holds it: a row-wise state of a column-wise table (one block of rows per column
    shard, in column order) becomes the column-weighted mean of its blocks."""
    if tuple(state.shape) in (table.shape, table.shape[:1]):
        return state
    blocks = state.view(len(column_widths), table.shape[0])
    weights = torch.tensor(column_widths, dtype=state.dtype) / table.shape[1]
    return (weights[:, None] * blocks).sum(0)


class ShardedTrainStep:
    """Model + optimisers of one rank of a synchronous group (see the module docstring).

    Construct it on every rank after ``torch.distributed.init_process_group`` (the default
    group, or ``process_group``); :meth:`step`, :meth:`full_state` and the constructor are
    collectives that every rank of the group calls in the same order. ``rows_trained`` counts the
    rows of the global batches (every rank's), as the model has seen them.

    ``memory_bytes`` is this rank's host memory for the planner (a Dask worker's memory limit;
    None: the machine's memory / world size); ``sharding_types`` narrows the planner's choice
    (an operator's or a test's; each must be one this group allows, see the module docstring).
    """

    def __init__(self, schema: Schema, model_cfg: ModelConfig, optim_cfg: OptimConfig, *,
                 device: torch.device, seed: int = 0, memory_bytes: int | None = None,
                 process_group: dist.ProcessGroup | None = None,
                 sharding_types: Sequence[str] | None = None) -> None:
        if not comm_ops.get_gradient_division():
            raise ConfigError("torchrec.distributed.comm_ops.set_gradient_division(False) is in "
                              "effect; the sync step's loss weighting needs TorchRec to divide "
                              "sparse gradients by the world size (the default, True)")
        group = process_group if process_group is not None else dist.group.WORLD
        assert group is not None, "torch.distributed.init_process_group has not been called"
        self.group: dist.ProcessGroup = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device
        self.schema = schema
        self.model_cfg = model_cfg
        self.optim_cfg = optim_cfg
        sharder = FusedEmbeddingBagCollectionSharder()
        allowed = _sharding_types(sharder, device, dist.get_backend(group))
        if sharding_types is not None and (not sharding_types
                                           or set(sharding_types) - set(allowed)):
            raise ConfigError(f"sharding_types: expected some of {allowed} (on {device.type} "
                              f"with {dist.get_backend(group)}), found {list(sharding_types)}")
        kinds = allowed if sharding_types is None else list(sharding_types)

        model = seeded_model(schema, model_cfg, optim_cfg, device, seed, tables=False)
        keys = embedding_keys(model)
        rows = {f.name: f.num_embeddings for f in schema.sparse}
        template = sparse_optimizer(model).state_dict()["state"]
        self._tables = [
            Table(name=name, key=key, shape=(rows[name], model_cfg.embedding_dim),
                  states=list(template.get(f"{name}.weight", {})))
            for name, key in keys.items()]
        self._model_keys = list(model.state_dict())
        self._dense_names = [name for name, _ in dense_parameters(model)]
        self._sparse_modules = len(fused_embeddings(model)._emb_modules)
        self.whole_bytes = model_bytes(schema, model_cfg, optim_cfg).total
        """Bytes of the whole model as one :class:`TrainStep` holds it (tables, optimiser states,
        dense part)."""

        capacities: list[tuple[int, int]] = [(0, 0)] * self.world_size
        dist.all_gather_object(capacities, _rank_memory(device, memory_bytes, self.world_size),
                               group=group)
        self._capacities = [ddr if device.type == "cpu" else hbm for ddr, hbm in capacities]
        plan = _plan(model, self._tables, sharder, kinds, device, capacities, group)
        # DMP's first construction in a process broadcasts a setting from rank 0 and remembers
        # it process-wide: a group formed again from a survivor (which remembers) and a fresh
        # process (which broadcasts) would wait in different collectives for ever. Every rank
        # of every group takes part in the broadcast.
        collective_utils._INITIALIZED = False
        self.model = DistributedModelParallel(
            model, env=_sharding_env(group, device), device=device, plan=plan, sharders=[sharder])
        weights = self.model.state_dict()
        self._columns = [sorted({(m.shard_offsets[1], m.shard_sizes[1])
                                 for m in weights[t.key].metadata().shards_metadata})
                         for t in self._tables]
        """Per table, its column shards ``(first column, width)`` in column order: a row-wise
        state of a table split column-wise is one block of rows per column shard, in this
        order."""
        # The sharded tables start from the planner's own initialisation: draw this rank's
        # shards of the seeded tables, so a sync run starts from the same model as any other.
        held = 0
        for piece, shard in self._local_shards():
            held += shard.numel() * shard.element_size()
            if piece.state < 0:
                table = self._tables[piece.table]
                seeded_block(shard, seed, table.name, table.shape,
                             (piece.offsets[0], piece.offsets[1]))
        self._held: list[int] = [0] * self.world_size
        """Per rank, the bytes of its shards (weights and optimiser states)."""
        dist.all_gather_object(self._held, held, group=group)
        params = dict(self.model.named_parameters())
        self.dense_optimizer = _dense_optimizer([params[name] for name in self._dense_names],
                                                optim_cfg, device)
        self.rows_trained = 0
        logger.info("sync train step, rank %d of %d on %s (seed %d, memory %s bytes per rank, "
                    "shards %s bytes per rank): %s", self.rank, self.world_size, device, seed,
                    self._capacities, self._held, self.plan_summary())

    def _ebc_plan(self) -> dict[str, ParameterSharding]:
        plans = list(self.model.plan.plan.values())
        assert len(plans) == 1, f"expected one sharded embedding collection, found {len(plans)}"
        return dict(plans[0].items())  # type: ignore[union-attr]

    def plan_summary(self) -> dict[str, str]:
        """Per table, its sharding type and ranks, e.g. ``{"C1": "table_wise [0]"}``."""
        return {name: f"{sharding.sharding_type} {sharding.ranks}"
                for name, sharding in self._ebc_plan().items()}

    def _local_shards(self) -> list[tuple[_Piece, torch.Tensor]]:
        """This rank's shards of every table's weight and optimiser states: views of the FBGEMM
        storage that lookups and the fused optimiser use, so writes to them are training state."""
        weights = self.model.state_dict()
        states = self.model.fused_optimizer.state_dict()["state"]
        found: list[tuple[_Piece, torch.Tensor]] = []
        for index, table in enumerate(self._tables):
            sharded = [weights[table.key], *states.get(table.key, {}).values()]
            for state, tensor in enumerate(sharded, start=-1):
                assert isinstance(tensor, ShardedTensor), (
                    f"{table.key}: expected a ShardedTensor, found {type(tensor).__name__}")
                found.extend(
                    (_Piece(index, state, tuple(tensor.size()),
                            tuple(shard.metadata.shard_offsets),
                            tuple(shard.metadata.shard_sizes)), shard.tensor)
                    for shard in tensor.local_shards())
        return found

    def _step_counters(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``(iter, iter_cpu)`` of each of this rank's FBGEMM kernels: the sparse optimiser's
        step count (Adam's bias correction), as saved and as the next forward reads it. The
        sharded collection keeps its lookups in a plain list, out of ``modules()``."""
        collections = [m for m in self.model.modules()
                       if isinstance(m, ShardedEmbeddingBagCollection)]
        counters = []
        for kernel in (k for c in collections for lookup in c._lookups for k in lookup.modules()
                       if isinstance(k, BaseBatchedEmbeddingBag)):
            saved, read = kernel.emb_module.iter, kernel.emb_module.iter_cpu
            assert isinstance(saved, torch.Tensor) and isinstance(read, torch.Tensor)
            counters.append((saved, read))
        return counters

    def step(self, batch: Batch, global_rows: int) -> float:
        """Train one synchronous step on this rank's part of a global batch of ``global_rows``
        rows (the sum of every rank's local rows; this rank's may be none). Return the mean BCE
        loss of the local rows before the update (nan for no rows)."""
        if batch.labels.device != self.device:
            batch = batch.to(self.device, non_blocking=True)
        rows = int(batch.labels.shape[0])
        if global_rows < max(rows, 1):
            raise ValueError(f"global_rows must be the rows of every rank's batch this step, at "
                             f"least this rank's {rows} and at least 1; found {global_rows}")
        logits = self.model(batch.dense_features, batch.sparse_features)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels,
                                                              reduction="sum")
        self.dense_optimizer.zero_grad(set_to_none=True)
        (loss * (self.world_size / global_rows)).backward()  # owners' fused optimisers step here
        self.dense_optimizer.step()
        self.rows_trained += global_rows
        return loss.item() / rows if rows else math.nan

    def full_state(self, dst: int = 0) -> dict[str, Any] | None:
        """Collective: the whole model in :meth:`TrainStep.state_dict`'s format (full tables,
        both optimisers' states, the sparse step counter, ``rows_trained``) on the group's rank
        ``dst``, None on the others."""
        pieces = self._local_shards()
        layouts: list[list[_Piece]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(layouts, [piece for piece, _ in pieces], group=self.group)
        longest = max(sum(math.prod(p.sizes) for p in layout) for layout in layouts)
        local = torch.zeros(longest, dtype=torch.float32, device=self.device)
        if pieces:
            flat = torch.cat([shard.detach().reshape(-1).float() for _, shard in pieces])
            local[:flat.numel()] = flat
        received = [torch.empty_like(local) for _ in layouts] if self.rank == dst else None
        dist.gather(local, received, group=self.group, group_dst=dst)
        step_count = self._step_count()
        if received is None:
            return None

        gathered: dict[tuple[int, int], torch.Tensor] = {}
        columns: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(self._tables))}
        for layout, buffer in zip(layouts, received):
            start = 0
            for piece in layout:
                whole = gathered.setdefault((piece.table, piece.state),
                                            torch.empty(piece.size, device="cpu"))
                size = math.prod(piece.sizes)
                whole[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.sizes))] = \
                    buffer[start:start + size].view(piece.sizes).cpu()
                start += size
                if piece.state < 0:
                    columns[piece.table].append((piece.offsets[1], piece.sizes[1]))
        weights = self.model.state_dict()
        model: dict[str, torch.Tensor] = {}
        sparse: dict[str, dict[str, torch.Tensor]] = {}
        for index, table in enumerate(self._tables):
            widths = [width for _, width in sorted(columns[index])]
            model[table.key] = gathered[(index, -1)].to(self.device)
            if table.states:  # a stateless optimiser (SGD) has no entry, as unsharded
                sparse[f"{table.name}.weight"] = {
                    name: _unsharded_state(gathered[(index, state)], table, widths)
                    .to(self.device) for state, name in enumerate(table.states)}
        return {
            "model": {key: model[key] if key in model else weights[key].detach().clone()
                      for key in self._model_keys},
            "dense_optimizer": _clone(self.dense_optimizer.state_dict()),
            "sparse_optimizer": {"state": sparse},
            "sparse_iter": self._sparse_iter(step_count),
            "rows_trained": self.rows_trained,
        }

    def _step_count(self) -> torch.Tensor:
        """Collective: the sparse optimiser's step count, the largest of every rank's kernels."""
        counters = self._step_counters()
        step_count = torch.stack([saved.max() for saved, _ in counters]).max().to(self.device) \
            if counters else torch.zeros((), dtype=torch.int64, device=self.device)
        dist.all_reduce(step_count, dist.ReduceOp.MAX, group=self.group)
        return step_count

    def _sparse_iter(self, step_count: torch.Tensor) -> list[torch.Tensor]:
        """The step count as an unsharded model keeps it: once per FBGEMM kernel."""
        return [step_count.reshape(1).cpu().clone() for _ in range(self._sparse_modules)]

    def gather_refusal(self, dst: int) -> str | None:
        """None when the whole model fits on rank ``dst`` beside its own shards while it is
        gathered there (:data:`GATHER_COPIES` copies of it: :meth:`full_state`, then a model or
        a checkpoint's bytes made of it); otherwise why not, with the sizes. The same answer on
        every rank: each knows every rank's memory and shards."""
        need = GATHER_COPIES * self.whole_bytes + self._held[dst]
        if need <= self._capacities[dst]:
            return None
        return (f"the whole model ({_gib(self.whole_bytes)}) gathered on rank {dst} would need "
                f"about {_gib(need)} ({GATHER_COPIES} copies beside its own shards of "
                f"{_gib(self._held[dst])}), more than its {_gib(self._capacities[dst])}")

    def _blocks(self) -> list[tuple[Block, torch.Tensor]]:
        """This rank's shards (:meth:`_local_shards`) placed in their tables' coordinates."""
        blocks = []
        for piece, shard in self._local_shards():
            table = self._tables[piece.table]
            state = None if piece.state < 0 else table.states[piece.state]
            if len(piece.size) == 2:
                rows, cols = (piece.offsets[0], piece.sizes[0]), (piece.offsets[1], piece.sizes[1])
            elif piece.size[0] == table.shape[0]:  # a row-wise state over whole rows
                rows, cols = (piece.offsets[0], piece.sizes[0]), (0, table.shape[1])
            else:  # one block of rows per column shard, in column order
                rows = (piece.offsets[0] % table.shape[0], piece.sizes[0])
                cols = self._columns[piece.table][piece.offsets[0] // table.shape[0]]
            blocks.append((Block(table.key, state, rows, cols), shard))
        return blocks

    def write_shards(self, folder: str) -> dict[str, dict[str, Any]]:
        """Collective: every rank writes its own shards into ``folder`` (an fsspec path every
        rank reaches), rank 0 the rest of the model too (:mod:`models.shards`); nothing is
        gathered. Every rank gets each file's name with its size and sha256, or the same
        :class:`OSError` naming the ranks that could not write (training can go on)."""
        step_count = self._step_count()
        written: dict[str, dict[str, Any]] = {}
        failed = ""
        try:
            name, digest = write_rank(folder, self.rank, self.world_size, self._tables,
                                      self._blocks())
            written[name] = digest
            if self.rank == 0:
                weights = self.model.state_dict()
                keys = {t.key for t in self._tables}
                dense_name, dense_digest = write_dense(folder, {
                    "keys": self._model_keys,
                    "model": {key: weights[key].detach().cpu().clone()
                              for key in self._model_keys if key not in keys},
                    "dense_optimizer": _clone(self.dense_optimizer.state_dict()),
                    "sparse_iter": self._sparse_iter(step_count),
                    "rows_trained": self.rows_trained})
                written[dense_name] = dense_digest
        except OSError as error:
            failed = f"rank {self.rank}: {error}"
        every: list[tuple[dict[str, dict[str, Any]], str]] = [({}, "")] * self.world_size
        dist.all_gather_object(every, (written, failed), group=self.group)
        failures = [failure for _, failure in every if failure]
        if failures:
            raise OSError(f"the model could not be written into {folder}: {'; '.join(failures)}")
        return {file: found for part, _ in every for file, found in part.items()}

    def load_shards(self, folder: str, names: Iterable[str]) -> None:
        """Load a model :meth:`write_shards` wrote (``names``: its files, by any number of
        ranks): each rank reads only the blocks of its own shards, and the dense part."""
        files = ShardFiles(folder, names)
        if files.tables != self._tables:
            raise ValueError(f"{folder}: its tables {[(t.name, t.shape) for t in files.tables]} "
                             f"are not this model's {[(t.name, t.shape) for t in self._tables]}")
        for block, shard in self._blocks():
            files.fill(shard, self._tables[[t.key for t in self._tables].index(block.table)],
                       block.state, block.rows, block.cols)
        dense = files.dense()
        self._load_dense(dense["model"], dense["dense_optimizer"], dense["sparse_iter"],
                         dense["rows_trained"])

    def _load_dense(self, model: Mapping[str, torch.Tensor], dense_optimizer: Any,
                    sparse_iter: Sequence[torch.Tensor], rows_trained: int) -> None:
        """Load everything but the tables: the dense weights (the keys of ``model`` that are not
        tables), the dense optimiser's state, the sparse step count and ``rows_trained``."""
        tables = {t.key for t in self._tables}
        with torch.no_grad():
            weights = self.model.state_dict()
            for key in self._model_keys:
                if key not in tables:
                    weights[key].copy_(model[key])
        # cloned: the torch optimiser would adopt the state's tensors and update them in place
        self.dense_optimizer.load_state_dict(_clone(dense_optimizer))
        step_count = max(int(it.max()) for it in sparse_iter)
        for saved, read in self._step_counters():
            saved.fill_(step_count)
            read.zero_()  # re-read from `iter` on the next forward
        self.rows_trained = int(rows_trained)

    def load_full_state(self, state: Mapping[str, Any]) -> None:
        """Load a :meth:`TrainStep.state_dict`-format state (from an async or a sync job of any
        world size) on every rank: each rank copies its slices of the tables and their optimiser
        states into its shards, and the whole dense part and its optimiser state."""
        model = state["model"]
        shapes = {t.key: t.shape for t in self._tables}
        found = {key: tuple(model[key].shape) if key in model else None for key in shapes}
        if found != shapes:
            raise ValueError(f"state['model'] tables must be {shapes} (key: shape), "
                             f"found {found}")
        sparse = state["sparse_optimizer"]["state"]
        with torch.no_grad():
            for piece, shard in self._local_shards():
                table = self._tables[piece.table]
                full = model[table.key] if piece.state < 0 else \
                    sparse[f"{table.name}.weight"][table.states[piece.state]]
                shard.copy_(_block(full, piece))
        self._load_dense(model, state["dense_optimizer"], state["sparse_iter"],
                         state["rows_trained"])

    def warm_start(self, state: Mapping[str, Any]) -> None:
        """Start from another model (:meth:`models.warm.WarmStart.read`, one piece): each rank
        copies its slices of the tables ``state["model"]`` holds and, where ``state`` has
        them, of their optimiser states, and the dense weights it holds; the dense optimiser
        and the step count where given. The rest keeps this rank's initial values;
        ``rows_trained`` starts again."""
        model = state["model"]
        sparse = state.get("sparse_optimizer", {"state": {}})["state"]
        with torch.no_grad():
            for piece, shard in self._local_shards():
                table = self._tables[piece.table]
                if table.key not in model:
                    continue
                if piece.state < 0:
                    shard.copy_(_block(model[table.key], piece))
                elif f"{table.name}.weight" in sparse:
                    shard.copy_(_block(sparse[f"{table.name}.weight"][table.states[piece.state]],
                                       piece))
            weights = self.model.state_dict()
            tables = {t.key for t in self._tables}
            for key in self._model_keys:
                if key not in tables and key in model:
                    weights[key].copy_(model[key])
        if "dense_optimizer" in state:
            self.dense_optimizer.load_state_dict(_clone(state["dense_optimizer"]))
        if state.get("sparse_iter"):
            step_count = max(int(it.max()) for it in state["sparse_iter"])
            for saved, read in self._step_counters():
                saved.fill_(step_count)
                read.zero_()
        self.rows_trained = 0


def _gib(size: int) -> str:
    """``size`` bytes as a person reads them (``1.50 GiB``, ``12.3 MiB``)."""
    if size >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    return f"{size / 2**20:.1f} MiB"


def read_train_step(folder: str, names: Iterable[str], schema: Schema, model_cfg: ModelConfig,
                    optim_cfg: OptimConfig, *, device: torch.device | None = None) -> TrainStep:
    """A plain :class:`TrainStep` holding the model :meth:`ShardedTrainStep.write_shards` wrote
    into ``folder`` (``names``: its files), on a machine that holds the whole model."""
    return to_train_step(read_full_state(folder, names), schema, model_cfg, optim_cfg,
                         device=device)


def to_train_step(state: Mapping[str, Any], schema: Schema, model_cfg: ModelConfig,
                  optim_cfg: OptimConfig, *, device: torch.device | None = None) -> TrainStep:
    """A plain single-process :class:`TrainStep` holding ``state`` (a
    :meth:`ShardedTrainStep.full_state`): the model a sync job keeps, evaluates and serves."""
    train_step = TrainStep(schema, model_cfg, optim_cfg, device=device)
    train_step.load_state_dict(state)
    return train_step
