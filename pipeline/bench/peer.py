"""The torchrun peer: what a TorchRec user would run instead of antdt's sync mode, on the same job.

A plain script, one process per rank under ``torch.distributed.run``, no Dask, no ledger::

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone \\
        --nproc-per-node 2 -m pipeline.bench.peer JOB.yaml [--set key=value ...] [--json]

(``OMP_NUM_THREADS`` set, torchrun prints no banner about it; each rank trains with
``train.threads`` torch threads, as an antdt worker does.)

It reads the job file as ``antdt train`` does (:func:`~pipeline.job.config.load_job`, the same
``--set`` overrides), the same rows with the project's reader (:class:`~data.reader.ShardReader`
over the job's row groups and schema), and builds the same model as antdt's sync mode
(:class:`~models.sharded.ShardedTrainStep`: TorchRec's ``DistributedModelParallel`` with the
fused sparse optimiser, the same seed). What differs is the split, static as torchrun users
make it: the training rows, in row-group order, are cut into ``world`` contiguous shares of
equal rows (within one), and each rank trains its share ``train.epochs`` times in local batches
of its part of the global batch ``train.batch_size``; every rank takes as many steps (the most
any rank needs; a rank whose share ran out takes empty steps), so no rank waits at the end on a
collective the others never make. A step's global rows, the sum over the ranks, is known to
every rank from the static split alone.

Then the model is gathered to rank 0 (:meth:`~models.sharded.ShardedTrainStep.full_state`),
which evaluates it on the validation rows (:func:`models.evaluate.evaluate`) and prints a
summary: one JSON line with ``--json`` (``rows``, ``train_s``, ``samples_per_s``, ``auc``,
``logloss``, ``world`` and ``phases``: seconds of each phase, from the script's start inside
each rank, ``imports_s``, ``group_s`` (the process group and the model), ``train_s``,
``evaluate_s``; ``process_start_to_train_s``, from the process's creation to training's start),
else one ``key: value`` a line. Library warnings are silenced: the output is the summary alone.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # before the imports, which are a phase of their own

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from typing import Any, NamedTuple  # noqa: E402

if __name__ == "__main__":  # run as the script: torch's and TorchRec's warnings, some on import
    warnings.filterwarnings("ignore")

import psutil  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

from data.files import RowGroup, expand, row_groups  # noqa: E402
from data.reader import ShardReader, concat  # noqa: E402
from data.schema import Schema  # noqa: E402
from models.evaluate import evaluate  # noqa: E402
from models.sharded import ShardedTrainStep, to_train_step  # noqa: E402
from pipeline.job.config import JobConfig, load_job  # noqa: E402


class Span(NamedTuple):
    """Rows ``[start, stop)`` of one row group."""

    group: RowGroup
    start: int
    stop: int


def share(groups: Sequence[RowGroup], rank: int, world: int) -> list[Span]:
    """Rank ``rank``'s contiguous share of the rows of ``groups`` (in order): rows
    ``[total * rank // world, total * (rank + 1) // world)`` of their concatenation.

    >>> groups = [RowGroup("a", 0, 5), RowGroup("a", 1, 5)]
    >>> [(s.group.index, s.start, s.stop) for s in share(groups, 1, 3)]
    [(0, 3, 5), (1, 0, 1)]
    """
    total = sum(g.num_rows for g in groups)
    low, high = total * rank // world, total * (rank + 1) // world
    spans, first = [], 0
    for group in groups:
        start, stop = max(low - first, 0), min(high - first, group.num_rows)
        if start < stop:
            spans.append(Span(group, start, stop))
        first += group.num_rows
    return spans


def batches_of(spans: Sequence[Span], size: int) -> Iterator[list[Span]]:
    """The spans cut into consecutive local batches of ``size`` rows (the last may be shorter;
    a batch may end one row group and begin the next)."""
    batch: list[Span] = []
    rows = 0
    for span in spans:
        start = span.start
        while start < span.stop:
            stop = min(span.stop, start + size - rows)
            batch.append(Span(span.group, start, stop))
            rows += stop - start
            start = stop
            if rows == size:
                yield batch
                batch, rows = [], 0
    if batch:
        yield batch


def no_rows(schema: Schema) -> Batch:
    """A batch of no rows: a rank whose share ran out still takes part in every step."""
    empty = KeyedJaggedTensor.from_lengths_sync(keys=schema.sparse_names,
                                                values=torch.zeros(0, dtype=torch.int64),
                                                lengths=torch.zeros(0, dtype=torch.int32))
    return Batch(dense_features=torch.zeros(0, len(schema.dense)), sparse_features=empty,
                 labels=torch.zeros(0))


def read(reader: ShardReader, batch: Sequence[Span]) -> Batch:
    """The rows of ``batch`` as one ``Batch``."""
    return concat([reader.read(s.group.path, s.group.index, s.start, s.stop) for s in batch])


def train(job: JobConfig, schema: Schema, step: ShardedTrainStep, groups: Sequence[RowGroup],
          reader: ShardReader) -> int:
    """Train this rank's share ``train.epochs`` times in lock-step with the other ranks; the
    rows of every rank's steps (the same on every rank)."""
    rank, world = step.rank, step.world_size
    batch_size = job.train.batch_size
    local = [batch_size * (r + 1) // world - batch_size * r // world for r in range(world)]
    shares = [sum(s.stop - s.start for s in share(groups, r, world)) for r in range(world)]
    steps = max(-(-rows // size) for rows, size in zip(shares, local))
    rows = 0
    for _ in range(job.train.epochs):
        mine = batches_of(share(groups, rank, world), local[rank])
        for index in range(steps):
            global_rows = sum(min(size, max(total - index * size, 0))
                              for total, size in zip(shares, local))
            parts = next(mine, None)
            step.step(no_rows(schema) if parts is None else read(reader, parts), global_rows)
            rows += global_rows
    return rows


def run(job: JobConfig, imported: float) -> dict[str, Any] | None:
    """Run this rank of ``job`` (``imported``: when the imports ended); rank 0 returns the
    summary, the other ranks None."""
    torch.set_num_threads(job.train.threads)
    schema = Schema.from_yaml(job.data.schema)
    groups = row_groups(expand(list(job.data.train)))
    dist.init_process_group("gloo")
    step = ShardedTrainStep(schema, job.model, job.train.optim, device=torch.device("cpu"),
                            seed=job.train.seed)
    reader = ShardReader(schema, threads=job.train.threads)
    dist.barrier()  # every rank built its shards: training starts together
    built = time.perf_counter()
    to_train = time.time() - psutil.Process().create_time()
    rows = train(job, schema, step, groups, reader)
    trained = time.perf_counter()
    state = step.full_state(0)
    dist.destroy_process_group()
    if state is None:
        return None
    model = to_train_step(state, schema, job.model, job.train.optim)
    validation = row_groups(expand(list(job.data.validation)))
    metrics = evaluate(model.predict, (
        batch for g in validation
        for batch in reader.batches(g.path, g.index, 0, g.num_rows, job.train.batch_size)))
    done = time.perf_counter()
    train_s = trained - built
    return {"rows": rows, "train_s": round(train_s, 3),
            "samples_per_s": round(rows / train_s, 1), "auc": metrics["auc"],
            "logloss": metrics["logloss"], "world": step.world_size,
            "process_start_to_train_s": round(to_train, 3),
            "phases": {"imports_s": round(imported - STARTED, 3),
                       "group_s": round(built - imported, 3), "train_s": round(train_s, 3),
                       "evaluate_s": round(done - trained, 3)}}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pipeline.bench.peer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("job", help="the job file, as antdt train takes it")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a job setting (repeatable)")
    parser.add_argument("--json", dest="as_json", action="store_true",
                        help="print one JSON line")
    args = parser.parse_args(argv)
    imported = time.perf_counter()
    for name in ("torch", "torchrec", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
    summary = run(load_job(args.job, args.overrides), imported)
    if summary is None:
        return
    if args.as_json:
        print(json.dumps(summary, sort_keys=True), flush=True)
        return
    for key, value in summary.items():
        print(f"{key}: {value}", flush=True)


if __name__ == "__main__":
    main()
