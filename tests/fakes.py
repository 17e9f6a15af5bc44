"""A trivial model and reader for tests of the agent and of jobs: the "batch" is a row range,
and the model counts how often each row was trained. They run on workers in the test's own
process (``LocalCluster(processes=False)``): the gates are shared memory."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

Range = tuple[str, int, int, int]
"""A trivial batch: ``(path, row_group, start, stop)``."""

GROUPS = [("a.parquet", 0, 100), ("b.parquet", 0, 60)]
FIRST_ID = {("a.parquet", 0): 0, ("b.parquet", 0): 100}
TOTAL = 160
SHARD_ROWS, BATCH_ROWS = 20, 8

GATES: dict[str, threading.Event] = {}
"""Named gates a :class:`RangeReader` waits on before each read (workers share this process)."""


class RangeReader:
    """Reads nothing: the batch is the row range itself. With a gate, each read first waits for
    it (outside the replica lock, so the worker keeps serving its peers meanwhile)."""

    def __init__(self, gate: str | None) -> None:
        self.gate = GATES[gate] if gate is not None else None

    def read(self, path: str, row_group: int, start: int, stop: int) -> Range:
        if self.gate is not None:
            assert self.gate.wait(timeout=30), "the test never opened the gate"
        return (path, row_group, start, stop)


@dataclass(frozen=True)
class MakeReader:
    gate: str | None = None

    def __call__(self) -> RangeReader:
        return RangeReader(self.gate)


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
        # every table entry counts one trained row: the rest came from other replicas
        self.merged_while_training = max(self.merged_while_training,
                                         float(self.table.sum()) - self.own_rows)
        self.losses.append((start % 7) / 10)  # any loss that differs from batch to batch
        return self.losses[-1]

    def touched(self, batch: Range) -> dict[str, torch.Tensor]:
        path, group, start, stop = batch
        return {"t": torch.arange(start, stop) + FIRST_ID[(path, group)]}

    def dense(self) -> list[torch.Tensor]:
        return [self.bias]

    def tables(self) -> dict[str, torch.Tensor]:
        return {"t": self.table}

    def state(self) -> dict[str, Any]:
        return {"ranges": list(self.ranges), "table": self.table.clone(),
                "bias": self.bias.clone(), "losses": list(self.losses),
                "merged_while_training": self.merged_while_training}


@dataclass(frozen=True)
class MakeTrainer:
    step_s: float = 0.0

    def __call__(self, device: torch.device) -> CountingTrainer:
        return CountingTrainer(self.step_s)
