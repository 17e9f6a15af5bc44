"""What the ranks of the sharded-step tests run (``from sharded_ranks import ...``): module-level
functions for :class:`ranks.Ranks`, and the model and global batches they share with the test
process, which trains a plain :class:`TrainStep` on the same rows to compare; and how a rank's
own time is measured around a collective (the synchronous mode's step loop)."""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from antdt.agent.modes.sync_steps import own_seconds
from antdt.errors import ConfigError
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.sharded import ShardedTrainStep
from models.warm import WarmStart
from pipeline.training.recipes import ShardedRankingTrainer, ShardedTrainerRecipe, started
from ranks import Group
from small_model import CPU, SCHEMA, SMALL

WIDE = ModelConfig(embedding_dim=256, dense_arch=(256,), over_arch=(16, 1))
"""Tables wide enough for TorchRec to split column-wise (its column shards are >= 128 wide)."""
SGD = OptimConfig(sparse_optimizer="sgd", sparse_lr=0.5, dense_optimizer="sgd", dense_lr=0.5)
"""Plain gradient steps, large enough that a wrongly scaled gradient shows."""
ADAGRAD = OptimConfig(sparse_lr=0.1, dense_lr=0.01)
"""Row-wise Adagrad (the default) for the tables, Adam for the dense part."""


class Rows(NamedTuple):
    """A global batch, row by row: ``tags`` holds the bags of all rows end to end."""

    dense: torch.Tensor        # (B, 2)
    c1: torch.Tensor           # (B,)
    c2: torch.Tensor           # (B,)
    tag_lengths: torch.Tensor  # (B,)
    tags: torch.Tensor         # (sum of tag_lengths,)
    labels: torch.Tensor       # (B,)


def make_rows(seed: int, n: int) -> Rows:
    g = torch.Generator().manual_seed(seed)
    tag_lengths = torch.randint(1, 4, (n,), generator=g)
    return Rows(dense=torch.rand(n, 2, generator=g),
                c1=torch.randint(0, 50, (n,), generator=g),
                c2=torch.randint(0, 30, (n,), generator=g),
                tag_lengths=tag_lengths,
                tags=torch.randint(0, 20, (int(tag_lengths.sum()),), generator=g),
                labels=torch.randint(0, 2, (n,), generator=g).float())


def batch(rows: Rows, start: int = 0, stop: int | None = None) -> Batch:
    """Rows ``start .. stop-1`` of ``rows`` as a :class:`Batch` (possibly of no rows)."""
    stop = rows.labels.shape[0] if stop is None else stop
    tag_start = int(rows.tag_lengths[:start].sum())
    tag_stop = int(rows.tag_lengths[:stop].sum())
    lengths = rows.tag_lengths[start:stop]
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=SCHEMA.sparse_names,
        values=torch.cat([rows.c1[start:stop], rows.c2[start:stop],
                          rows.tags[tag_start:tag_stop]]),
        lengths=torch.cat([torch.ones(2 * (stop - start), dtype=torch.int64), lengths]))
    return Batch(dense_features=rows.dense[start:stop], sparse_features=kjt,
                 labels=rows.labels[start:stop])


def local_batch(group: Group, rows: Rows, split: tuple[int, ...]) -> Batch:
    """This rank's part of ``rows`` when rank ``r`` takes ``split[r]`` rows."""
    start = sum(split[:group.rank])
    return batch(rows, start, start + split[group.rank])


class Trained(NamedTuple):
    """One sharded run as rank 0 saw it (states are None on the other ranks)."""

    states: list[dict[str, Any] | None]  # full_state before the first step, then after each
    losses: list[float]                  # this rank's loss of each step
    plan: dict[str, str]


def train(group: Group, ranks: int, splits: list[tuple[int, ...]], model_cfg: ModelConfig,
          optim_cfg: OptimConfig, sharding_types: list[str] | None = None,
          state: dict[str, Any] | None = None) -> Trained | None:
    """On the first ``ranks`` ranks: build a sharded step (loading ``state`` if given), then
    train one step per split on the global batch ``make_rows(i, sum(split))``."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    step = ShardedTrainStep(SCHEMA, model_cfg, optim_cfg, device=CPU, seed=0,
                            process_group=process_group, sharding_types=sharding_types)
    if state is not None:
        step.load_full_state(state)
    states, losses = [step.full_state()], []
    for i, split in enumerate(splits):
        losses.append(step.step(local_batch(group, make_rows(i, sum(split)), split), sum(split)))
        states.append(step.full_state())
    return Trained(states, losses, step.plan_summary())


def refusal(group: Group, ranks: int, memory_bytes: int) -> str | None:
    """The :class:`ConfigError` a sharded step on the first ``ranks`` ranks raises with
    ``memory_bytes`` per rank (its message), or None where it was not refused."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    try:
        ShardedTrainStep(SCHEMA, SMALL, ADAGRAD, device=CPU, memory_bytes=memory_bytes,
                         process_group=process_group)
    except ConfigError as error:
        return str(error)
    return None


def wait_in_a_collective(group: Group, work_s: float) -> tuple[float, float]:
    """Rank 0 waits in an all-reduce while the last rank computes: rank 0 sends the last rank a
    message as it goes into the all-reduce, and only once it has it does the last rank spin
    for ``work_s`` seconds of its own CPU time, then join the all-reduce. So rank 0 waits for
    the whole computation however late either rank runs on a loaded machine (a rank that came
    late after a barrier could find the all-reduce ready and not wait at all). This rank's own
    seconds (:func:`own_seconds`) and CPU seconds, from the message to the all-reduce's end."""
    last = group.world_size - 1
    own_began, cpu_began = own_seconds(), time.thread_time()
    if group.rank == 0:
        dist.send(torch.ones(1), dst=last)
    elif group.rank == last:
        dist.recv(torch.ones(1), src=0)
        own_began, cpu_began = own_seconds(), time.thread_time()
        while time.thread_time() - cpu_began < work_s:
            pass
    dist.all_reduce(torch.ones(1))
    cpu = time.thread_time() - cpu_began  # read before the own seconds: own >= cpu
    return own_seconds() - own_began, cpu


def assert_states_close(found: Any, expected: Any, *, rtol: float = 1e-5,
                        where: str = "") -> None:
    """Two (nested) states have the same structure and keys, equal plain values, and tensors
    that differ by at most ``rtol`` times the expected tensor's largest magnitude (a row-wise
    Adagrad state is ~1e-7 where weights are ~0.1: one absolute bound would not see it)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(found, torch.Tensor), f"{where}: {type(found).__name__}"
        assert found.shape == expected.shape and found.dtype == expected.dtype, \
            f"{where}: {found.shape} {found.dtype} != {expected.shape} {expected.dtype}"
        if expected.numel():
            diff = (found - expected).abs().max().item()
            scale = expected.abs().max().item()
            assert diff <= rtol * scale, f"{where}: max diff {diff} (largest value {scale})"
    elif isinstance(expected, dict):
        assert isinstance(found, dict) and list(found) == list(expected), \
            f"{where}: keys {list(found)} != {list(expected)}"
        for key in expected:
            assert_states_close(found[key], expected[key], rtol=rtol, where=f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert isinstance(found, (list, tuple)) and len(found) == len(expected), where
        for i, (a, b) in enumerate(zip(found, expected)):
            assert_states_close(a, b, rtol=rtol, where=f"{where}[{i}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(found, float) and math.isnan(found), f"{where}: {found}"
    else:
        assert found == expected, f"{where}: {found!r} != {expected!r}"


def written(group: Group, ranks: int, folder: str, splits: list[tuple[int, ...]],
            model_cfg: ModelConfig, optim_cfg: OptimConfig,
            sharding_types: list[str] | None = None
            ) -> tuple[dict[str, dict[str, Any]], dict[str, Any] | None] | None:
    """On the first ``ranks`` ranks: train one step per split, then write the shards into
    ``folder``; every file as this rank was told of them, and the gathered state (rank 0)."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    step = ShardedTrainStep(SCHEMA, model_cfg, optim_cfg, device=CPU, seed=0,
                            process_group=process_group, sharding_types=sharding_types)
    for i, split in enumerate(splits):
        step.step(local_batch(group, make_rows(i, sum(split)), split), sum(split))
    return step.write_shards(folder), step.full_state()


def loaded(group: Group, ranks: int, folder: str, names: list[str], model_cfg: ModelConfig,
           optim_cfg: OptimConfig, sharding_types: list[str] | None = None
           ) -> tuple[dict[str, Any] | None, dict[str, str]] | None:
    """On the first ``ranks`` ranks: a sharded step loading the shards in ``folder``; its
    gathered state (rank 0) and its plan."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    step = ShardedTrainStep(SCHEMA, model_cfg, optim_cfg, device=CPU, seed=1,
                            process_group=process_group, sharding_types=sharding_types)
    step.load_shards(folder, names)
    return step.full_state(), step.plan_summary()


def gather_refusals(group: Group, ranks: int, memory_bytes: int, schema: Schema
                    ) -> list[str | None] | None:
    """On the first ``ranks`` ranks with ``memory_bytes`` each: the gather refusal of every
    rank as this rank sees it."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    step = ShardedTrainStep(schema, SMALL, ADAGRAD, device=CPU, memory_bytes=memory_bytes,
                            process_group=process_group)
    return [step.gather_refusal(rank) for rank in range(ranks)]


def write_failure(group: Group, ranks: int, folder: str) -> str | None:
    """On the first ``ranks`` ranks: the :class:`OSError` writing the shards into ``folder``
    raised (its message), or None where it wrote them."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    step = ShardedTrainStep(SCHEMA, SMALL, ADAGRAD, device=CPU, process_group=process_group)
    try:
        step.write_shards(folder)
    except OSError as error:
        return str(error)
    return None


def warmed(group: Group, ranks: int, init: WarmStart, model_cfg: ModelConfig,
           optim_cfg: OptimConfig, schema: Schema = SCHEMA) -> dict[str, Any] | None:
    """On the first ``ranks`` ranks: a sync job's trainer (seed 1) started from ``init`` as a
    job's workers start it (:func:`pipeline.training.recipes.started`); its gathered state
    (rank 0)."""
    process_group = group.first(ranks)
    if process_group is None:
        return None
    recipe = ShardedTrainerRecipe(schema, model_cfg, optim_cfg, 1)
    step = ShardedTrainStep(schema, model_cfg, optim_cfg, device=CPU, seed=1,
                            process_group=process_group)
    return started(ShardedRankingTrainer(step, recipe), init).sharded.full_state()
