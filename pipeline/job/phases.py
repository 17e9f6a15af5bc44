"""Where the wall time of one ``antdt train`` goes, step by step, from the process's start to
the summary: what ``-v`` prints after the summary, what ``--json`` carries as ``phases``, and
what ``antdt bench overhead`` compares with the torchrun peer's.

A cluster job's steps happen in three places, timed on one clock (a LocalCluster's processes
share this machine's; a long-lived cluster's scheduler should keep its clock in sync):

====================  ==========================================================================
``start``             the interpreter and the command's imports, until the command runs
``prepare``           the job file read, every data file validated, the job's plan and code
``cluster``           waiting for the LocalCluster (started at once, beside ``prepare``)
``workers``           submitted until every worker imported the stack (the master's mark)
``plan``              the ledger registered, the MLflow run started: training starts
``first lease``       until the first agent had a lease (its model built, its reader open)
``training``          until every agent returned (the final sync round included)
``evaluate``          the final model on the validation rows (the hooks' own timing)
``metrics``           the run's final metrics, tags and small artifacts
``timeline``          the timeline image drawn and logged
``model``             the model logged (and registered)
``results``           the rest of finishing, until this process had the final record
``shutdown``          the LocalCluster closed
====================  ==========================================================================

The local mode has ``start``, ``prepare``, ``training``, ``evaluate``, ``metrics`` and ``model``.
``outside_s`` is the command's seconds outside training: what the user waits for besides it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import psutil

FINISH_STEPS = ("evaluate", "metrics", "timeline", "model")
"""The steps the tracking hooks time themselves, in order."""


class StepClock:
    """Seconds of consecutive steps in one process (:attr:`laps`, by step): each
    :meth:`lap` ends one, the next starts there."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.laps[step] = round(now - self._last, 3)
        self._last = now


def process_start() -> float:
    """When this process started, in the epoch's seconds, to the kernel's clock tick: its age
    on the boot clock taken from now (psutil's own figure counts from a boot time rounded to
    the second)."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
    except OSError:
        return psutil.Process().create_time()
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


class Phases:
    """Marks of one command's steps: each step's seconds run from the previous mark to its
    own. ``start`` is the first step, from the process's start to :meth:`mark`'s first call
    (a step marked again replaces its earlier mark)."""

    def __init__(self, started: float | None = None) -> None:
        self.started = process_start() if started is None else started
        self._marks: dict[str, float] = {}

    def mark(self, step: str, at: float | None = None) -> None:
        """``step`` ended at ``at`` (now by default)."""
        self._marks[step] = time.time() if at is None else at

    def steps(self, seconds: Mapping[str, float]) -> None:
        """Steps timed elsewhere as durations (the hooks' ``evaluate`` ... ``model``), each
        ending where the one before it ends plus its seconds."""
        end = max(self._marks.values(), default=self.started)
        for step, length in seconds.items():
            end += float(length)
            self.mark(step, end)

    def cluster_job(self, record: Mapping[str, Any], hooks: Mapping[str, float]) -> None:
        """A cluster job's steps from its final ``record`` (the master's marks, its first
        lease) and the hooks' timing of finishing, then ``results`` now."""
        marks = record.get("marks") or {}
        started = record.get("started_at")
        if "workers_ready" in marks:
            self.mark("workers", marks["workers_ready"])
        if started is not None:
            self.mark("plan", started)
            leases = record.get("first_lease") or {}
            if leases:
                self.mark("first lease", started + min(leases.values()))
        if "training_ended" in marks:
            self.mark("training", marks["training_ended"])
            self.steps({step: hooks[step] for step in FINISH_STEPS if step in hooks})
        self.mark("results")

    def seconds(self) -> dict[str, float]:
        """Each step's seconds, in the order they happened (a step that went back in time,
        another machine's clock, counts 0)."""
        out: dict[str, float] = {}
        last = self.started
        for step, at in sorted(self._marks.items(), key=lambda item: item[1]):
            out[step] = round(max(0.0, at - last), 3)
            last = max(last, at)
        return out

    def report(self, train_s: float) -> dict[str, float]:
        """:meth:`seconds`, with ``total_s`` (so far) and ``outside_s``, the total less the
        job's ``train_s`` (its seconds of training)."""
        steps = self.seconds()
        total = round(max(self._marks.values(), default=self.started) - self.started, 3)
        return {**steps, "total_s": total, "outside_s": round(total - train_s, 3)}


def lines(report: Mapping[str, float]) -> list[str]:
    """``report`` (:meth:`Phases.report`) for a person: one line of steps and one of totals."""
    steps = "  ".join(f"{step} {seconds:.1f}" for step, seconds in report.items()
                      if not step.endswith("_s"))
    return [f"phases   {steps}",
            f"         {report['total_s']:.1f} s until the summary, "
            f"{report['outside_s']:.1f} s of it outside training"]
