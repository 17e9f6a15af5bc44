"""A job's metrics on their way to its tracking run (:class:`MetricsShipper`): the master
buffers one step of metrics per tick and sends the buffer in one ``hooks.metrics`` task every
``antdt.jobs.metrics-interval``.

One task is on its way at a time, so the run gets its steps in order and a slow tracking store
gets fewer, larger batches instead of a queue of tasks. The tasks go to the worker that ran the
last hook and to no other while it lives (Dask would run them on, or steal them for, an idle
worker): a worker using the tracking store for the first time (about 0.45 s of CPU) takes it
from its agent's training, and its sync partners wait for it. Once that worker left, the steps
on their way go again, to any worker (those it logged before it died, twice).

A plain class: the clock, the task submission and the cluster's membership are handed in.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from distributed import Future

from antdt.jobs.keeper import Log
from antdt.sharding import Clock

Step = tuple[int, dict[str, float]]
"""``(step, {metric: value})``, as ``hooks.metrics`` logs them."""

Submit = Callable[[Mapping[str, Any], list[Step], str | None], Future]
"""``submit(run, steps, worker)``: the ``hooks.metrics`` task logging ``steps`` to ``run``, on
``worker`` only (None: any worker)."""


class MetricsShipper:
    """The steps of one job's metrics not yet in its tracking run (see the module docstring).
    ``step`` numbers the next one; ``hooks_on`` is the worker that ran the last hook (None:
    any); ``alive(worker)`` says whether a worker is still in the cluster; failed tasks are
    reported to ``log``; ``every_s`` is the interval between tasks."""

    def __init__(self, clock: Clock, every_s: float, submit: Submit,
                 alive: Callable[[str], bool], log: Log) -> None:
        self.step = 0
        self.hooks_on: str | None = None
        self._clock = clock
        self._every_s = every_s
        self._submit = submit
        self._alive = alive
        self._log = log
        self._steps: list[Step] = []
        self._pending: list[Future] = []
        self._in_flight: list[Step] = []
        """The steps of the pending task: sent again if its worker leaves first."""
        self._last = 0.0

    def add(self, metrics: dict[str, float]) -> None:
        """Buffer one step."""
        self._steps.append((self.step, metrics))
        self.step += 1

    def tick(self, run: Mapping[str, Any] | None) -> None:
        """Send the buffer to ``run`` when the interval passed; look at the task on its way."""
        if self._clock() - self._last >= self._every_s:
            self.send(run)
        self.check()

    def send(self, run: Mapping[str, Any] | None) -> None:
        """Send the buffered steps to ``run`` in one task, unless the previous one is still on
        its way (or the run is not open yet)."""
        self._last = self._clock()
        if not self._steps or run is None or self._pending:
            return
        steps, self._steps = self._steps, []
        self._in_flight = steps
        self._pending.append(self._submit(run, steps, self.hooks_on))

    def check(self) -> None:
        """Release the tasks that ended; log the ones that failed (metrics that do not reach
        the tracking run are a loss to report, not a reason to stop training). When the
        worker they were bound to left, the pending one is dropped and its steps go again."""
        for future in [f for f in self._pending if f.status != "pending"]:
            self._pending.remove(future)
            self._in_flight = []
            if future.status == "error":
                self._log("warning", "metrics did not reach the tracking run (see the worker's "
                                     f"log for task {future.key})")
            future.release()
        if self._worker_left():
            self.hooks_on = None
            for future in self._pending:
                future.release()
            self._pending.clear()
            self._steps, self._in_flight = self._in_flight + self._steps, []

    def settled(self) -> bool:
        """Nothing is on its way any more: the task ended, or its worker left."""
        return all(f.done() for f in self._pending) or self._worker_left()

    def _worker_left(self) -> bool:
        return self.hooks_on is not None and not self._alive(self.hooks_on)
