"""What the chaos runs of every mode share (``antdt bench chaos``, :mod:`pipeline.bench.chaos`
and :mod:`pipeline.bench.chaos_sync`): the data, whose rows are their ids; the reader of those
ids; the single-process model that counts them (and :class:`CountingTables`, the same count
with its table sharded over the workers); the hooks that save the final model's counts;
the audit of those counts against the ledger; and a run's clusters, kills and waits.

Data. ``rows`` rows whose one column is the row's id (``0 .. rows-1``), in Parquet files of
``ROW_GROUP_ROWS``-row row groups (:func:`write_data`). A counting model's table row ``i`` is
how many times data row ``i`` was trained, so the final model says, row by row, what the job did.

A model written in parts (a sync job's, when its trainer refuses to gather it): one file per
rank, each a contiguous range ``[start, stop)`` of the table's rows, its name saying the range
and the world size (``counts-000000000-000004000-of-3.pt``), each holding the rows the model
trained (the same in every part). Any number of processes reads them back (:func:`read_parts`).
"""

from __future__ import annotations

import io
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml
from distributed import Event

from antdt.agent import SavedModel, event_topic
from antdt.jobs import JobClient, checkpoints
from antdt.jobs.client import FINAL
from pipeline.bench.processes import DaskProcesses, wait_for_workers, wait_until

ROW_ID = "row_id"
STEP_S = 0.004
"""A counting step's stand-in for a real step's compute: 64 rows in 4 ms (16,000 rows/s)."""
EPOCHS = 2
ROW_GROUP_ROWS = 4_096
WAIT_S = 180.0
"""The longest any one wait of a run may take (a worker's start, a kill's moment)."""
JOB_WAIT_S = 600.0
"""The longest a run's job may take to end once the harm is done."""


# ---- the model, its data and its hooks (run on the workers) -----------------------------------


class CountingModel:
    """:class:`antdt.agent.Trainer` of a model that counts: table row ``i`` (one table, ``(rows,
    1)`` float32, every count exact) is how many times row ``i`` of the data reached it. A step
    sleeps ``step_s`` (a real step's compute), adds 1 to the rows of its batch and 0.01 to the
    dense bias (averaged by the model sync: not counted)."""

    def __init__(self, rows: int, step_s: float) -> None:
        self.step_s = step_s
        self.table = torch.zeros(rows, 1)
        self.bias = torch.zeros(1)

    def step(self, ids: torch.Tensor) -> float:
        time.sleep(self.step_s)
        self.table.index_add_(0, ids, torch.ones(len(ids), 1))
        self.bias += 0.01
        return 0.5

    def touched(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"t": ids}

    def dense(self) -> list[torch.Tensor]:
        return [self.bias]

    def tables(self) -> dict[str, torch.Tensor]:
        return {"t": self.table}

    def state(self) -> np.ndarray:
        return self.table[:, 0].numpy().copy()

    def checkpoint_state(self, tables: Mapping[str, torch.Tensor] | None = None
                         ) -> dict[str, torch.Tensor]:
        table = self.table.clone() if tables is None else tables["t"]
        return {"table": table, "bias": self.bias.clone()}

    def restore_state(self, state: Mapping[str, torch.Tensor]) -> None:
        self.table.copy_(state["table"])
        self.bias.copy_(state["bias"])


class CountingTables:
    """:class:`antdt.agent.modes.hybrid.TableTrainer` of the same count, its table (``(rows, 1)``
    float32) held by the job's workers in buckets: global row ``i`` is data row ``i``, from 0;
    a step sleeps ``step_s``, adds 0.01 to the dense bias and returns the gradient -1 per
    occurrence of a row in its batch, which the hosts' SGD (lr 1) adds to the row. Its
    checkpoints are written in parts (:meth:`write_part` by every host, :meth:`write_dense`)
    or given whole (:meth:`checkpoint_state`); either resumes (:meth:`restore_state`)."""

    def __init__(self, rows: int, step_s: float) -> None:
        self.rows = rows
        self.step_s = step_s
        self.bias = torch.zeros(1)
        self._restored: torch.Tensor | None = None

    def rows_of(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.unique(batch)

    def step(self, batch: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor
             ) -> tuple[float, torch.Tensor]:
        time.sleep(self.step_s)
        _, counts = torch.unique(batch, return_counts=True)
        self.bias += 0.01
        return 0.5, -counts.to(rows.dtype).reshape(-1, 1)

    def dense(self) -> list[torch.Tensor]:
        return [self.bias]

    def initial_rows(self, start: int, stop: int) -> tuple[torch.Tensor, None]:
        if self._restored is None:
            return torch.zeros(stop - start, 1), None
        return self._restored[start:stop].reshape(-1, 1).clone(), None

    def checkpoint_state(self, tables: tuple[torch.Tensor, torch.Tensor]
                         ) -> dict[str, torch.Tensor]:
        return {"table": tables[0].reshape(-1, 1).clone(), "bias": self.bias.clone()}

    def write_part(self, folder: str, index: int, count: int,
                   parts: Sequence[tuple[int, torch.Tensor, torch.Tensor]]
                   ) -> tuple[str, dict[str, Any]]:
        """Buckets ``(first row, weights (n, 1), state)`` as part ``index`` of ``count``."""
        blocks = [(first, weights.reshape(-1).clone()) for first, weights, _ in parts]
        return _save(folder, f"table-{index:04d}-of-{count}.pt", blocks)

    def write_dense(self, folder: str) -> tuple[str, dict[str, Any]]:
        return _save(folder, DENSE_FILE, {"bias": self.bias.clone()})

    def restore_state(self, state: Mapping[str, torch.Tensor] | SavedModel) -> None:
        if isinstance(state, SavedModel):
            table = torch.zeros(self.rows)
            for name in state.files:
                if name != DENSE_FILE:
                    for first, weights in _load(state.folder, name):
                        table[first:first + weights.shape[0]] = weights
            state = {"table": table, "bias": _load(state.folder, DENSE_FILE)["bias"]}
        self._restored = state["table"].reshape(-1).clone()
        self.bias.copy_(state["bias"])

    def final(self, gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> GatheredCounts:
        return GatheredCounts(gather)


DENSE_FILE = "dense.pt"
"""The dense part's file of a :class:`CountingTables` checkpoint in parts."""


def _save(folder: str, name: str, value: Any) -> tuple[str, dict[str, Any]]:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return name, checkpoints.write(checkpoints.join(folder, name), buffer.getvalue())


def _load(folder: str, name: str) -> Any:
    return torch.load(os.path.join(folder, name), weights_only=True)


class GatheredCounts:
    """The final model of a job with sharded counting tables: the counts gathered from their
    hosts when :meth:`state` is read (by the worker that finishes the job)."""

    def __init__(self, gather: Callable[[], tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._gather = gather

    def state(self) -> np.ndarray:
        return self._gather()[0][:, 0].numpy().copy()


class IdReader:
    """Reads a row range of a row group: its row ids (``(k,)`` int64), from the Parquet file."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, int], np.ndarray] = {}

    def read(self, path: str, row_group: int, start: int, stop: int) -> torch.Tensor:
        ids = self._ids.get((path, row_group))
        if ids is None:
            table = pq.ParquetFile(path).read_row_group(row_group, columns=[ROW_ID])
            ids = self._ids[(path, row_group)] = table.column(ROW_ID).to_numpy()
        return torch.from_numpy(ids[start:stop])


@dataclass(frozen=True)
class IdReaderRecipe:
    def __call__(self) -> IdReader:
        return IdReader()


def part_name(start: int, stop: int, world_size: int) -> str:
    """The file of rows ``[start, stop)`` of a model written in parts by ``world_size`` ranks."""
    return f"counts-{start:09d}-{stop:09d}-of-{world_size}.pt"


def write_part(folder: str, start: int, stop: int, world_size: int, table: torch.Tensor,
               rows: int, size: int) -> tuple[str, dict[str, Any]]:
    """Write rows ``[start, stop)`` (``table``, ``(stop - start,)`` float32) of a ``size``-row
    model that trained ``rows`` rows into ``folder`` (atomically); the file's name, and its
    size and sha256."""
    os.makedirs(folder, exist_ok=True)
    name = part_name(start, stop, world_size)
    buffer = io.BytesIO()
    torch.save({"start": start, "stop": stop, "size": size, "rows": rows, "table": table.clone()},
               buffer)
    return name, checkpoints.write(checkpoints.join(folder, name), buffer.getvalue())


def read_parts(folder: str, files: Mapping[str, Any]) -> tuple[torch.Tensor, int]:
    """The whole table (``(size,)`` float32) and the rows the model trained, from the parts
    ``files`` (names) in ``folder``, written by any number of ranks; :class:`ValueError` when
    the parts do not cover the table exactly once or disagree."""
    parts = sorted((torch.load(os.path.join(folder, name), weights_only=True) for name in files),
                   key=lambda part: int(part["start"]))
    if not parts:
        raise ValueError(f"{folder}: no parts listed")
    sizes = {int(part["size"]) for part in parts}
    rows = {int(part["rows"]) for part in parts}
    bounds = [(int(part["start"]), int(part["stop"])) for part in parts]
    edges = [0] + [stop for _, stop in bounds]
    if len(sizes) != 1 or len(rows) != 1 or [start for start, _ in bounds] != edges[:-1] \
            or edges[-1] != next(iter(sizes)):
        raise ValueError(f"{folder}: parts {sorted(files)} do not make one model (ranges "
                         f"{bounds}, sizes {sorted(sizes)}, rows {sorted(rows)})")
    return torch.cat([part["table"] for part in parts]), next(iter(rows))


@dataclass(frozen=True)
class AuditHooks:
    """Hooks that keep no tracking run: the final model's counts go to ``<folder>/<job
    id>.npy`` (written by the worker that finishes the job: from the model it holds, or read
    from the parts a sync job's ranks wrote it in), the summary is the master's counters."""

    folder: str

    def start(self, job_id: str, workers: int, resume: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
        return dict(resume["run"]) if resume is not None else {"run_id": job_id}

    def metrics(self, run: Mapping[str, Any], steps: Sequence[tuple[int, dict[str, float]]]
                ) -> None:
        return None

    def finish(self, run: Mapping[str, Any], trainer: CountingModel | None,
               report: Mapping[str, Any]) -> dict[str, Any]:
        path = os.path.join(self.folder, f"{run['run_id']}.npy")
        saved = report.get("saved_model")
        if trainer is not None:
            np.save(path, trainer.state())
        elif saved is not None:
            np.save(path, read_parts(saved["folder"], saved["files"])[0].numpy())
        return {"rows": dict(report["rows"]), "rows_replayed": report["rows_replayed"],
                "with_model": trainer is not None,
                "saved_in_parts": trainer is None and saved is not None}

    def abort(self, run: Mapping[str, Any], status: str, reason: str) -> None:
        return None


# ---- the check --------------------------------------------------------------------------------


def write_data(folder: Path, rows: int, files: int = 4) -> list[tuple[str, int, int]]:
    """``rows`` rows of ids ``0..rows-1`` in ``files`` Parquet files of ``ROW_GROUP_ROWS``-row
    row groups; their row groups ``(path, row_group, num_rows)``."""
    folder.mkdir(parents=True, exist_ok=True)
    groups = []
    bounds = np.linspace(0, rows, files + 1).astype(np.int64)
    for index, (start, stop) in enumerate(zip(bounds, bounds[1:])):
        path = str(folder / f"part-{index}.parquet")
        pq.write_table(pa.table({ROW_ID: np.arange(start, stop, dtype=np.int64)}), path,
                       row_group_size=ROW_GROUP_ROWS)
        metadata = pq.ParquetFile(path).metadata
        groups += [(path, group, metadata.row_group(group).num_rows)
                   for group in range(metadata.num_row_groups)]
    return groups


def audit(counts: np.ndarray, epochs: int, rows: Mapping[str, int]) -> dict[str, int]:
    """``counts`` (per row id, the final model's count) held against the ledger's ``rows``
    counters of a finished job: every row is done once per epoch (no row lost, none
    quarantined), so every count must be ``epochs``. ``missing``: rows the model holds fewer
    times, ``extra``: more times, ``discrepancies``: both; ``counters``: 1 when the counters
    disagree with each other (trained != done + retrained, or rows lost)."""
    missing = int((counts < epochs).sum())
    extra = int((counts > epochs).sum())
    expected = len(counts) * epochs
    counters = int(rows["done"] != expected or rows["lost"] != 0
                   or rows["trained"] != rows["done"] + rows["retrained"])
    return {"rows_checked": expected, "missing": missing, "extra": extra,
            "discrepancies": missing + extra + counters, "counters": counters}


NOTHING_CHECKED = {"rows_checked": 0, "missing": 0, "extra": 0, "discrepancies": 0,
                   "counters": 0}
""":func:`audit`'s figures for a job that did not finish: nothing was checked."""


def ignore(message: str) -> None:
    """A torn or corrupt checkpoint's warning: expected after a kill, not reported."""


# ---- one run ----------------------------------------------------------------------------------


class Watch:
    """The events a job's agents send (subscribed before the job is submitted, so none is
    missed): the workers that paused at their gate (and the rows each had trained then), hung,
    or trained a batch."""

    def __init__(self, jobs: JobClient, job_id: str) -> None:
        self._lock = threading.Lock()
        self._paused: dict[str, int] = {}
        self._hung: set[str] = set()
        self._trained: set[str] = set()
        jobs.client.subscribe_topic(event_topic(job_id), self._on_event)

    def _on_event(self, event: tuple[float, dict[str, Any]]) -> None:
        msg = event[1]
        worker = str(msg.get("worker"))
        with self._lock:
            if msg.get("kind") == "fault" and msg.get("fault") == "pause":
                self._paused[worker] = int(msg.get("rows", 0))
            elif msg.get("kind") == "fault" and msg.get("fault") == "hang":
                self._hung.add(worker)
            elif msg.get("kind") == "progress" and msg.get("batches"):
                self._trained.add(worker)

    def paused(self) -> set[str]:
        """The workers that paused at their gate so far."""
        with self._lock:
            return set(self._paused)

    def paused_rows(self) -> int:
        """The rows the workers that paused so far had trained when they paused."""
        with self._lock:
            return sum(self._paused.values())

    def hung(self) -> set[str]:
        """The workers that hung so far."""
        with self._lock:
            return set(self._hung)

    def trained(self) -> set[str]:
        """The workers that trained a batch so far."""
        with self._lock:
            return set(self._trained)


class Run:
    """One scenario's run: its own folder, its cluster(s) (every process with the Dask
    ``config``), its job, and the harm it did. A mode's runs add the job's data and spec."""

    def __init__(self, scenario: str, seed: int, folder: Path,
                 config: Mapping[str, Any]) -> None:
        self.scenario = scenario
        self.seed = seed
        self.folder = folder.resolve()  # the workers read its data from their own folders
        self.rng = random.Random(seed)
        self.kills = 0
        self.hangs = 0
        dask_config = self.folder / "dask"
        dask_config.mkdir(parents=True, exist_ok=True)
        (dask_config / "antdt.yaml").write_text(yaml.safe_dump(dict(config)))
        self.env = {"DASK_CONFIG": str(dask_config)}
        self.job_id = f"chaos-{self.scenario}-{uuid.uuid4().hex[:8]}"
        self.released = f"{self.job_id}-released"
        """The Dask Event the gated workers wait for once the harm is done."""
        self.clusters = 0

    def release(self, jobs: JobClient) -> None:
        """Set :attr:`released`: the gated workers go on."""
        Event(self.released, client=jobs.client).set()

    def cluster(self, workers: int) -> tuple[DaskProcesses, list[Any]]:
        """A new cluster of ``workers`` worker commands (one nanny and worker each)."""
        folder = self.folder / f"cluster-{self.clusters}"
        self.clusters += 1
        folder.mkdir()
        processes = DaskProcesses(folder, env=self.env)
        commands = [processes.add_workers(1) for _ in range(workers)]
        wait_for_workers(processes.address, workers, timeout_s=WAIT_S)
        return processes, commands

    def until(self, jobs: JobClient, condition: Callable[[], Any], what: str,
              poll_s: float = 0.2) -> bool:
        """Whether ``condition()`` came true before the job ended (a gate holds its end, so it
        ended first only if it failed)."""
        wait_until(lambda: condition() or jobs.status(self.job_id)["state"] in FINAL,
                   f"{self.job_id}: {what}", WAIT_S, poll_s=poll_s)
        return bool(condition())

    def end(self, jobs: JobClient, job_id: str | None = None) -> dict[str, Any]:
        """The final record of the run's job (or of ``job_id``)."""
        job_id = job_id or self.job_id
        record = jobs.status(job_id)
        deadline = time.monotonic() + JOB_WAIT_S
        while record["state"] not in FINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} did not end within {JOB_WAIT_S:g}s")
            record = jobs.wait(job_id, record["version"])
        return record

    def command_of(self, jobs: JobClient, processes: DaskProcesses, commands: list[Any],
                   worker: str) -> Any:
        """The worker command whose worker process is ``worker`` (an address)."""
        pid = jobs.client.run(os.getpid, workers=[worker])[worker]
        return next(command for command in commands
                    if pid in [p.pid for p in processes.worker_processes(command)])

    def kill_process(self, processes: DaskProcesses, command: Any) -> None:
        """SIGKILL the worker process of ``command`` (its nanny starts a new one, unless it is
        stopped)."""
        for process in processes.worker_processes(command):
            process.kill()
            self.kills += 1
            return

    def kill_command(self, processes: DaskProcesses, commands: list[Any], command: Any) -> None:
        """SIGKILL a nanny with its worker."""
        processes.kill_group(command)
        commands.remove(command)
        self.kills += 1
