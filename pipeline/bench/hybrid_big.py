"""`antdt bench hybrid --big`: a model the async mode refused before, trained with its tables
sharded over workers that could not hold a replica, against the sync mode on the same job.

The model: the synthetic job's 26 sparse features, each table rewritten to ``--tables-rows``
rows (1,450,000: 26 x 1.45M x 16 floats, about 2.4 GB of weights; the data's ids are hashed
into a table's rows as they are read, so the same data serves any table size). The cluster: a
LocalCluster of :data:`WORKERS` worker processes, each limited to ``--memory-limit`` (3 GiB) by
Dask, worker :data:`SLOW_WORKER` ``--slowdown`` (4) times slower (an injected fault), started
anew for each run. Two runs, each with a ``train.checkpoint_dir`` (a fresh folder under
``--checkpoint-root``, removed after the run: the model's parts take GBs):

* ``async``: ``model.tables: auto``, which must choose sharded tables by itself (the job's log
  says ``tables: sharded``), antdt sharding, each worker's batch a rank's share of the sync
  batch (as ``antdt bench stragglers --mode sync`` runs its ``async`` way);
* ``sync``: the sync mode with adaptive local batches (the default), the tables sharded over
  the ranks.

Each run must train to the end with exact accounting (rows trained = rows x epochs +
retrained, none lost) and leave Dask's memory limits untouched: the same worker addresses and
processes at the end as at the start, no worker ever ``paused`` (its status polled on the
scheduler, and no "Pausing worker" line in its log); each worker's peak RSS is reported beside
its limit. The workers run with :data:`WORKER_ENV`'s malloc settings (both runs alike). ``ratio`` is the async run's samples/s over the sync run's (training throughput as
the job summaries give it; target ``--ratio-target``, 1.5).

The dataset is sized by time (:mod:`pipeline.bench.sizing`): ``--target-s`` seconds of
fault-free synchronous training of the small-table job on :data:`WORKERS` workers, unless
``--rows`` names its size; the big tables and the slow worker make each run longer than that.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import click
import dask.config
import psutil
import yaml
from dask.utils import parse_bytes
from distributed import Client

from antdt.jobs import JobClient
from data.schema import Schema
from pipeline.bench.jobs import echo, run_async
from pipeline.bench.sizing import sized_job
from pipeline.bench.stragglers import RANK_BATCH, sync_way_job
from pipeline.job.config import FaultConfig, JobConfig

WORKERS = 4
SLOW_WORKER = 3
"""The index of the worker the fault slows down."""
TABLES_ROWS = 1_450_000
MEMORY_LIMIT = "3GiB"
RATIO_TARGET = 1.5
Way = Literal["async", "sync"]
WAYS: tuple[Way, ...] = ("async", "sync")
WORKER_ENV = {"MALLOC_MMAP_THRESHOLD_": 1 << 20, "MALLOC_ARENA_MAX": 2}
"""glibc malloc settings of the worker processes (``distributed.nanny.pre-spawn-environ``, beside
Dask's own): blocks of 1 MiB or more mapped apart and returned whole when freed, two arenas. With
glibc's defaults the freed buffers of the tables' pulls and pushes (MBs each, on several
threads) stayed in the process: 0.4 GiB more RSS a worker, 2.40 GiB of a 3 GiB limit, where Dask
pauses it (80%); with these, 2.0 GiB, at the same speed."""
PAUSING = "memory usage. Pausing worker"
"""What a worker's Dask memory monitor logs as it pauses the worker."""


def with_big_tables(job: JobConfig, rows: int, folder: Path) -> JobConfig:
    """``job`` with every sparse feature's table ``rows`` rows (its schema rewritten into
    ``folder``)."""
    schema = Schema.from_yaml(job.data.schema).to_dict()
    for feature in schema["sparse"]:
        feature["num_embeddings"] = rows
    path = folder / f"schema-{rows}.yaml"
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(schema))
    return dataclasses.replace(job, data=dataclasses.replace(job.data, schema=str(path)))


def way_job(job: JobConfig, way: Way, slowdown: float, checkpoint_dir: str) -> JobConfig:
    """``job`` as ``way`` runs it: worker :data:`SLOW_WORKER` slowed down, checkpoints in
    ``checkpoint_dir``, the async run's tables placed ``auto``."""
    faults = [FaultConfig(worker=SLOW_WORKER, slowdown=slowdown)]
    shaped = sync_way_job(job, "adaptive" if way == "sync" else "async", WORKERS, faults)
    shaped = dataclasses.replace(shaped, train=dataclasses.replace(
        shaped.train, checkpoint_dir=checkpoint_dir))
    if way == "async":
        shaped = dataclasses.replace(shaped, model=dataclasses.replace(shaped.model,
                                                                       tables="auto"))
    return shaped


class MemoryWatch:
    """What Dask's memory limits did to one run's workers, watched from beside the run (a
    ``setting`` of :func:`~pipeline.bench.jobs.run_async`): their addresses and processes at
    the start and the end, every status the scheduler gave them (polled every ``poll_s``),
    their logs' pause lines, each worker process's peak RSS, and the job's log."""

    def __init__(self, poll_s: float = 0.1) -> None:
        self.poll_s = poll_s
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.statuses: dict[str, set[str]] = {}
        self.peaks: dict[str, int] = {}
        self.limits: dict[str, int] = {}
        self.pause_lines: list[str] = []
        self.job_log: list[str] = []

    @contextlib.contextmanager
    def __call__(self, client: Client) -> Iterator[None]:
        self.start = client.run(os.getpid)
        processes = {address: psutil.Process(pid) for address, pid in self.start.items()}
        self.peaks = dict.fromkeys(self.start, 0)
        stop = threading.Event()
        thread = threading.Thread(target=self._watch, args=(client, processes, stop),
                                  name="memory-watch", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=30)
            self.end = client.run(os.getpid)
            self.pause_lines = [f"{address}: {message}"
                                for address, lines in client.get_worker_logs().items()
                                for _, message in lines if PAUSING in message]
            with JobClient(client, register=False) as jobs:
                self.job_log = [r["message"] for record in jobs.status()
                                for r in jobs.logs(record["job_id"])]

    def _watch(self, client: Client, processes: dict[str, psutil.Process],
               stop: threading.Event) -> None:
        while not stop.wait(self.poll_s):
            for address, process in processes.items():
                with contextlib.suppress(psutil.NoSuchProcess):
                    self.peaks[address] = max(self.peaks[address], process.memory_info().rss)
            with contextlib.suppress(OSError, TimeoutError):  # the cluster closing
                info = client.sync(client.scheduler.identity, n_workers=-1)["workers"]
                for address, worker in info.items():
                    self.statuses.setdefault(address, set()).add(str(worker.get("status")))
                    self.limits[address] = int(worker.get("memory_limit") or 0)

    def as_dict(self) -> dict[str, Any]:
        """The figures of the run: ``unchanged`` (same addresses and processes at the end),
        ``paused`` (the workers ever paused), by worker address in sorted order the peak RSS
        and its share of the worker's limit."""
        order = sorted(self.start)
        paused = sorted({a for a, seen in self.statuses.items() if "paused" in seen}
                        | {line.partition(":")[0] for line in self.pause_lines})
        return {"unchanged": self.start == self.end, "paused": paused,
                "pause_lines": self.pause_lines[:4],
                "peak_rss_bytes": [self.peaks.get(a, 0) for a in order],
                "peak_of_limit": [round(self.peaks.get(a, 0) / self.limits[a], 3)
                                  if self.limits.get(a) else None for a in order]}


def placement(job_log: list[str]) -> str:
    """Where the job kept its tables, from its log: ``sharded`` (the async mode's master
    sharded them over the workers), ``ranks`` (the sync mode's ranks each built their shards)
    or ``replicated``."""
    if any(line.startswith("tables: sharded") for line in job_log):
        return "sharded"
    if any(" (gloo); tables: " in line for line in job_log):
        return "ranks"
    return "replicated"


def run_way(job: JobConfig, way: Way, slowdown: float, memory_limit: str,
            checkpoint_root: Path, expected: int) -> dict[str, Any]:
    """One run of ``way`` (the module docstring) on a new cluster; ``expected``: the rows of
    its epochs."""
    checkpoint_root.mkdir(parents=True, exist_ok=True)
    folder = tempfile.mkdtemp(prefix=f"hybrid-big-{way}-", dir=checkpoint_root)
    watch = MemoryWatch()
    try:
        outcome = run_async(way_job(job, way, slowdown, folder), WORKERS, setting=watch,
                            memory_limit=memory_limit)
        model_dir = outcome.summary.model_dir
        model_bytes = sum(f.stat().st_size for f in Path(model_dir).iterdir()) \
            if model_dir and Path(model_dir).is_dir() else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    summary = outcome.summary
    memory = watch.as_dict()
    exact = summary.rows_lost == 0 and \
        summary.rows_trained == expected + summary.rows_retrained
    return {"mode": way, "samples_per_s": round(summary.samples_per_s),
            "train_s": round(summary.train_s, 2), "wall_s": round(summary.wall_s, 2),
            "finished": outcome.stopped is None, "tables": placement(watch.job_log),
            "rows_trained": summary.rows_trained, "rows_lost": summary.rows_lost,
            "rows_retrained": summary.rows_retrained, "rows_expected": expected,
            "accounting_exact": exact, "model_in_parts": model_bytes is not None,
            "model_bytes": model_bytes, **memory,
            "passed": outcome.stopped is None and exact and memory["unchanged"]
            and not memory["paused"]}


def hybrid_big(job: JobConfig, expected: int, slowdown: float, memory_limit: str,
               ratio_target: float, checkpoint_root: Path, quiet: bool) -> dict[str, Any]:
    """The benchmark's result (the module docstring) on ``job`` with big tables."""
    runs = {}
    for way in WAYS:
        echo(f"{way}: {job.name} on {WORKERS} workers of {memory_limit}, worker {SLOW_WORKER} "
             f"{slowdown:g}x slower", quiet)
        runs[way] = run_way(job, way, slowdown, memory_limit, checkpoint_root, expected)
        echo(f"{way}: {runs[way]['samples_per_s']:,} samples/s, tables {runs[way]['tables']}",
             quiet)
    ratio = runs["async"]["samples_per_s"] / max(1, runs["sync"]["samples_per_s"])
    sharded = runs["async"]["tables"] == "sharded"
    return {"runs": runs, "ratio": round(ratio, 3), "ratio_target": ratio_target,
            "async_sharded": sharded,
            "passed": sharded and ratio >= ratio_target and all(r["passed"]
                                                                for r in runs.values())}


def big_command(tables_rows: int, memory_limit: str, slowdown: float, ratio_target: float,
                target_s: float, rows: int | None, data_dir: str | None,
                checkpoint_root: str, overrides: tuple[str, ...],
                quiet: bool) -> dict[str, Any]:
    """``antdt bench hybrid --big``: size the job, give it big tables, run both ways."""
    parse_bytes(memory_limit)  # a clear error before anything starts
    overrides = (f"train.batch_size={RANK_BATCH * WORKERS}", *overrides)
    # before the first cluster: its fork server, kept for the process, takes the environment
    with dask.config.set({f"distributed.nanny.pre-spawn-environ.{key}": value
                          for key, value in WORKER_ENV.items()}):
        job, sizing = sized_job(WORKERS, target_s, rows, data_dir, overrides, quiet,
                                mode="sync")
        big = with_big_tables(job, tables_rows, Path(checkpoint_root))
        expected = sizing.train_rows * job.train.epochs
        result = hybrid_big(big, expected, slowdown, memory_limit, ratio_target,
                            Path(checkpoint_root), quiet)
    schema = Schema.from_yaml(big.data.schema)
    weights = sum(f.num_embeddings for f in schema.sparse) * big.model.embedding_dim * 4
    return {"job": job.name, "scenario": "big", "workers": WORKERS, "worker_env": WORKER_ENV,
            "memory_limit": memory_limit, "slow_worker": SLOW_WORKER, "slowdown": slowdown,
            "tables": len(schema.sparse), "tables_rows": tables_rows,
            "embedding_dim": big.model.embedding_dim, "weights_bytes": weights,
            "rows": expected, "epochs": job.train.epochs, **result,
            "sizing": sizing.as_dict()}


def table(result: dict[str, Any]) -> None:
    """The short human summary of ``result``."""
    click.echo(f"job {result['job']}: {result['tables']} tables x {result['tables_rows']:,} "
               f"rows x dim {result['embedding_dim']} ({result['weights_bytes'] / 1e9:.2f} GB "
               f"of weights), {result['rows']:,} rows, {result['workers']} workers of "
               f"{result['memory_limit']}, worker {result['slow_worker']} "
               f"{result['slowdown']:g}x slower")
    for way, run in result["runs"].items():
        peak = max(run["peak_rss_bytes"], default=0) / 2**30
        click.echo(f"{way:>6}: {run['samples_per_s']:>8,} samples/s, tables {run['tables']}, "
                   f"rows {run['rows_trained']:,} (lost {run['rows_lost']}, retrained "
                   f"{run['rows_retrained']}), peak RSS {peak:.2f} GiB, paused "
                   f"{run['paused'] or 'none'}  {'pass' if run['passed'] else 'FAIL'}")
    click.echo(f"async / sync: {result['ratio']:.3f} (target >= {result['ratio_target']})")
    click.echo(f"passed: {result['passed']}")
