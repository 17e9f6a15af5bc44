"""A trivial model and reader for tests of the agent and of jobs: the "batch" is a row range,
and the model counts how often each row was trained; test jobs' hooks record every call. They
run on workers in the test's own process (``LocalCluster(processes=False)``): the gates and the
recorded calls are shared memory."""

from __future__ import annotations

import gc
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import dask.config
import torch
from distributed import Client, LocalCluster, get_worker

from antdt.jobs import JobClient, JobCode, JobPlan, JobSpec

Range = tuple[str, int, int, int]
"""A trivial batch: ``(path, row_group, start, stop)``."""

GROUPS = [("a.parquet", 0, 100), ("b.parquet", 0, 60)]
FIRST_ID = {("a.parquet", 0): 0, ("b.parquet", 0): 100}
TOTAL = 160
SHARD_ROWS, BATCH_ROWS = 20, 8

QUICK = {"antdt.sharding.lease-wait": "100ms", "antdt.sharding.commit-interval": "100ms",
         "antdt.agent.report-interval": "50ms", "antdt.jobs.tick": "100ms",
         "antdt.jobs.metrics-interval": "100ms", "antdt.sync.max-wait": "50ms"}
"""Leases, commits, reports and the master's ticks quick enough for these tiny jobs."""


@contextmanager
def job_service() -> Iterator[JobClient]:
    """Two single-thread workers in this process (a LocalCluster with its dashboard, so its
    web server serves the job pages and ``/metrics``) and the job service, at :data:`QUICK`."""
    with dask.config.set(QUICK), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as client:
        cluster.wait_for_workers(2)
        with JobClient(client) as job_client:
            yield job_client


GATES: dict[str, threading.Event] = {}
"""Named gates a :class:`RangeReader` waits on before each read (workers share this process)."""

GATE_WAIT_S = 120.0
"""The longest a worker waits for a test to open its gate: only a hang takes it."""


def wait_for_gate(gate: str) -> bool:
    """A task that takes its worker's thread until the gate opens."""
    return GATES[gate].wait(timeout=GATE_WAIT_S)


class RangeReader:
    """Reads nothing: the batch is the row range itself. With a gate, each read first waits for
    it (outside the replica lock, so the worker keeps serving its peers meanwhile). With
    ``merged_after``, the read after that many waits until the trainer on its worker holds rows
    another replica trained (its background sync merged them): the next step surely trains on
    a peer's progress, however fast or slow the machine. With ``hold``, the read after
    ``hold_after`` reads waits for that gate too: the job cannot end before the test opens it."""

    def __init__(self, gate: str | None, merged_after: int | None, hold: str | None = None,
                 hold_after: int = 0) -> None:
        self.gate = GATES[gate] if gate is not None else None
        self.merged_after = merged_after
        self.hold = GATES[hold] if hold is not None else None
        self.hold_after = hold_after
        self.reads = 0
        self.worker = get_worker().address

    def read(self, path: str, row_group: int, start: int, stop: int) -> Range:
        if self.gate is not None:
            assert self.gate.wait(timeout=GATE_WAIT_S), "the test never opened the gate"
        if self.hold is not None and self.reads == self.hold_after:
            assert self.hold.wait(timeout=GATE_WAIT_S), "the test never let the job go on"
        if self.reads == self.merged_after:
            trainer = TRAINERS[self.worker]
            deadline = time.monotonic() + GATE_WAIT_S
            while trainer.merged_rows() <= 0:
                assert time.monotonic() < deadline, \
                    f"{self.worker}: no peer's rows merged within {GATE_WAIT_S:g}s"
                time.sleep(0.01)
        self.reads += 1
        return (path, row_group, start, stop)


@dataclass(frozen=True)
class MakeReader:
    gate: str | None = None
    merged_after: int | None = None
    hold: str | None = None
    hold_after: int = 0

    def __call__(self) -> RangeReader:
        return RangeReader(self.gate, self.merged_after, self.hold, self.hold_after)


class CountingTrainer:
    """A model whose table row ``i`` counts how often global row ``i`` was trained (so after a
    job every replica's table must equal the number of epochs) and whose dense bias grows by
    0.01 a step; it records every batch it trained, the loss it returned for it, and the most
    rows of other replicas it had merged when it stepped (background sync during training)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.table = torch.zeros(TOTAL, 1)
        self.bias = torch.zeros(1)
        self.ranges: list[Range] = []
        self.losses: list[float] = []
        self.own_rows = 0
        self.merged_while_training = 0.0

    def step(self, batch: Range) -> float:
        if self.step_s:
            time.sleep(self.step_s)  # stands for the compute of a real step
        _, _, start, stop = batch
        self.table[self.touched(batch)["t"]] += 1.0
        self.bias += 0.01
        self.ranges.append(batch)
        self.own_rows += stop - start
        self.merged_while_training = max(self.merged_while_training, self.merged_rows())
        self.losses.append((start % 7) / 10)  # any loss that differs from batch to batch
        return self.losses[-1]

    def merged_rows(self) -> float:
        """Rows of other replicas this one holds: every table entry counts one trained row."""
        return float(self.table.sum()) - self.own_rows

    def touched(self, batch: Range) -> dict[str, torch.Tensor]:
        path, group, start, stop = batch
        return {"t": torch.arange(start, stop) + FIRST_ID[(path, group)]}

    def dense(self) -> list[torch.Tensor]:
        return [self.bias]

    def tables(self) -> dict[str, torch.Tensor]:
        return {"t": self.table}

    def checkpoint_state(self, tables: Mapping[str, torch.Tensor] | None = None
                         ) -> dict[str, Any]:
        table = self.table.clone() if tables is None else tables["t"]
        return {"table": table, "bias": self.bias.clone()}

    def restore_state(self, state: dict[str, Any]) -> None:
        self.table.copy_(state["table"])
        self.bias.copy_(state["bias"])

    def state(self) -> dict[str, Any]:
        return {"ranges": list(self.ranges), "table": self.table.clone(),
                "bias": self.bias.clone(), "losses": list(self.losses),
                "merged_while_training": self.merged_while_training}


FROZEN_AT_BUILD: list[int] = []
"""The objects the garbage collector left out (:func:`gc.get_freeze_count`) each time a
:class:`MakeTrainer` built a model (the workers share this process)."""


FROZEN_AT_FINISH: list[int] = []
""":func:`gc.get_freeze_count` each time :class:`RecordingHooks` finished a job: its agents have
ended by then, the job's master has not."""


TRAINERS: dict[str, CountingTrainer] = {}
"""The trainer each worker built last (its address: the workers share this process)."""


@dataclass(frozen=True)
class MakeTrainer:
    step_s: float = 0.0

    def __call__(self, device: torch.device) -> CountingTrainer:
        FROZEN_AT_BUILD.append(gc.get_freeze_count())
        trainer = TRAINERS[get_worker().address] = CountingTrainer(self.step_s)
        return trainer


# ---- hooks of test jobs ------------------------------------------------------------------

CALLS: dict[str, list[tuple[Any, ...]]] = {}
"""Every hook call, per tracking run (the workers share this process)."""

RAN_ON: dict[str, dict[str, set[str]]] = {}
"""Per tracking run, the workers each hook method ran on."""


@dataclass(frozen=True)
class RecordingHooks:
    """Test-only hooks: a "run" is a fresh id; every call is recorded in CALLS. ``fail``
    names a method that raises instead; with ``hold``, the first ``finish`` waits for that gate
    (and records the worker it runs on) before it goes on."""

    fail: str | None = None
    hold: str | None = None

    def start(self, job_id: str, workers: int, resume: Mapping[str, Any] | None = None
              ) -> dict[str, Any]:
        self._maybe_fail("start")
        if resume is not None:  # the same run goes on
            run = resume["run"]["run_id"]
            CALLS[run].append(("resume", job_id, workers, dict(resume)))
            return {"run_id": run}
        run = uuid.uuid4().hex
        CALLS[run] = [("start", job_id, workers)]
        _ran("start", run)
        return {"run_id": run}

    def metrics(self, run: Mapping[str, Any], steps: Sequence[tuple[int, dict[str, float]]]
                ) -> None:
        CALLS[run["run_id"]].append(("metrics", list(steps)))
        _ran("metrics", run["run_id"])

    def finish(self, run: Mapping[str, Any], trainer: Any, report: Mapping[str, Any]
               ) -> dict[str, Any]:
        self._maybe_fail("finish")
        if self.hold is not None and not any(c[0] == "held" for c in CALLS[run["run_id"]]):
            CALLS[run["run_id"]].append(("held", get_worker().address))
            assert GATES[self.hold].wait(timeout=GATE_WAIT_S), "the test never opened the gate"
            raise RuntimeError("the test closed this worker: a dead worker returns nothing")
        FROZEN_AT_FINISH.append(gc.get_freeze_count())
        table = None if trainer is None else trainer.table.clone()
        CALLS[run["run_id"]].append(("finish", table, dict(report)))
        return {"rows_trained": report["rows"]["trained"], "with_model": trainer is not None}

    def abort(self, run: Mapping[str, Any], status: str, reason: str) -> None:
        CALLS[run["run_id"]].append(("abort", status, reason))

    def _maybe_fail(self, method: str) -> None:
        if self.fail == method:
            raise RuntimeError(f"the test's hooks fail in {method}")


def _ran(method: str, run: str) -> None:
    RAN_ON.setdefault(run, {}).setdefault(method, set()).add(get_worker().address)


def spec(epochs: int = 1, gate: str | None = None, hooks: RecordingHooks = RecordingHooks(),
         **plan: Any) -> JobSpec:
    return JobSpec(JobPlan(name="fake", row_groups=list(GROUPS), batch_rows=BATCH_ROWS,
                           shard_rows=SHARD_ROWS, epochs=epochs, sync_period="0.02s", **plan),
                   JobCode.of(MakeTrainer(), MakeReader(gate), hooks))


def calls(record: Mapping[str, Any]) -> list[tuple[Any, ...]]:
    return CALLS[record["run"]["run_id"]]


def ran_on(record: Mapping[str, Any]) -> dict[str, set[str]]:
    return RAN_ON[record["run"]["run_id"]]
