"""Where one job's agents run: :class:`Placement` chooses the workers that get an agent when the
job starts, those that join it later and those a restart from a checkpoint trains on, and keeps
the job's agents as the master accounts for them (:class:`Slot`).

By default a job trains on every worker and on every worker that joins. A job whose plan asks
for fewer (``workers: N``, a sweep's trials), or is too small to keep that many replicas
learning together (:meth:`~antdt.jobs.spec.JobPlan.fitted_workers`), trains on the least busy:
the fewest other unfinished jobs placed there, then the fewest tasks running there. A worker
joins such a job only to replace an agent that died or was retired.

A plain class: the other jobs' placements, a worker's running tasks and the clock (seconds since
training started) are handed in, so tests drive it without a cluster.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from antdt.agent import AgentReport
from antdt.jobs.spec import JobPlan
from antdt.sharding import Clock

FENCE_AFTER_S = 10.0
"""An agent the controller stopped (cancelled) that has not returned after this long is stuck (a
read that never returns): the master fences it (:meth:`Placement.overdue`)."""


@dataclass
class Slot:
    """One agent of the job: its worker, number (faults refer to it), when it started and
    ended (seconds after training started; None: still running), its rows, busy seconds and
    the training thread's CPU seconds in them (from its report, or its latest progress event if
    it died), its latest samples/s, and its mode's model exchanges and the bytes they received
    as of its latest progress event (None: the mode does not count them), and what it saw of
    the async mode's sharded tables (``tables``: pull and push milliseconds, pushes in flight,
    waits; None: the job's tables are not sharded). ``generation``: the
    job's model it trained (one per restart from a checkpoint: a restart begins a new model,
    and the agents of an older one, finished or not, no longer hold the job's)."""

    worker: str
    index: int
    join: bool
    started: float
    generation: int = 0
    ended: float | None = None
    rows: int = 0
    busy_s: float = 0.0
    cpu_s: float = 0.0
    rate: float = 0.0
    exchanges: int = 0
    exchanged_bytes: int | None = None
    tables: dict[str, float] | None = None
    report: AgentReport | None = None
    dead: bool = False
    stopped: float | None = None
    fenced: bool = False

    @property
    def live(self) -> bool:
        return self.report is None and not self.dead

    @property
    def finished(self) -> bool:
        """The agent returned at the job's end (it holds the consensus model)."""
        return self.report is not None and self.report.outcome == "finished"

    @property
    def label(self) -> str:
        return f"worker{self.index}"

    def as_dict(self) -> dict[str, Any]:
        report = self.report
        return {"worker": self.worker, "index": self.index, "label": self.label,
                "join": self.join, "started": self.started, "ended": self.ended,
                "rows": self.rows, "busy_s": self.busy_s, "cpu_s": self.cpu_s,
                "samples_per_s": self.rate,
                "dead": self.dead, "outcome": report.outcome if report else
                ("dead" if self.dead else "running"),
                "batches": report.batches if report else None,
                "loss": report.loss if report and not math.isnan(report.loss) else None,
                "exchanges": report.exchanges if report else None,
                "joined_from": report.joined_from if report else None,
                "sync_wait_s": report.sync_wait_s if report else None}


class Placement:
    """The workers of one job's agents (see the module docstring). ``slots`` are its agents in
    the order they started (a slot's index is its position); ``cap`` the most workers it
    trains on (None: every worker), ``adapted`` why it trains on fewer than it asked for.

    ``others()`` yields the workers each other unfinished job placed agents on, ``tasks_on(w)``
    the tasks running on worker ``w``; ``clock()`` is seconds since training started."""

    def __init__(self, plan: JobPlan, clock: Clock,
                 others: Callable[[], Iterable[Collection[str]]],
                 tasks_on: Callable[[str], int]) -> None:
        self.slots: list[Slot] = []
        self.cap = plan.workers
        self.adapted: str | None = None
        self._plan = plan
        self._clock = clock
        self._others = others
        self._tasks_on = tasks_on
        self._chosen: set[str] = set()
        """The workers chosen for the job's agents (placed before they start)."""
        self.generation = 0
        """The job's current model: one more at each restart."""

    @property
    def placed(self) -> set[str]:
        """The workers this job has chosen or runs agents on."""
        return self._chosen | {s.worker for s in self.slots}

    @property
    def live(self) -> list[Slot]:
        return [s for s in self.slots if s.live]

    @property
    def current(self) -> list[Slot]:
        """The agents of the job's current model (see :attr:`Slot.generation`)."""
        return [s for s in self.slots if s.generation == self.generation]

    def training(self) -> set[str]:
        """The workers this job trains on now: its live agents' (less those stopped), and those
        chosen for agents not started yet."""
        started = {s.worker for s in self.slots}
        return {s.worker for s in self.slots if s.live and s.stopped is None} \
            | (self._chosen - started)

    def initial(self, workers: Collection[str]) -> list[str]:
        """The workers the job starts on, sorted: every one of ``workers``, or the least busy
        when the plan asks for fewer or the job is too small for them all (then ``cap`` is
        lowered and ``adapted`` says why)."""
        fitted, self.adapted = self._plan.fitted_workers(len(workers))
        if self.adapted is not None:
            self.cap = fitted
        return self._choose(workers, self.cap)

    def restart(self, workers: Collection[str]) -> list[str]:
        """The workers a restart from a checkpoint trains on (every agent was lost): chosen
        like the first ones, the workers of the lost agents among the candidates. The agents
        started from now on train a new model (:attr:`generation`)."""
        self.generation += 1
        return self._choose(workers, self.cap)

    def joiners(self, workers: Collection[str]) -> list[str]:
        """Workers without an agent of this job that get one now: every new worker, or while
        the job has fewer agents training or finished than its ``cap`` (one died or was
        retired), the least busy."""
        free = set(workers) - {s.worker for s in self.slots}
        if self.cap is None:
            return sorted(free)
        wanted = self.cap - sum(s.live or s.finished for s in self.slots)
        return self._choose(free, wanted) if wanted > 0 and free else []

    def stop(self, worker: str) -> list[Slot]:
        """The live agents on ``worker`` that the controller stops now (it retires the worker
        for this job while another job trains there); they no longer count as the job's
        workers (:meth:`training`), and no agent of the job starts there again."""
        slots = [s for s in self.live if s.worker == worker and s.stopped is None]
        for slot in slots:
            slot.stopped = self._clock()
        return slots

    def overdue(self) -> list[Slot]:
        """The stopped agents still running :data:`FENCE_AFTER_S` after their stop and not
        fenced yet; marked fenced."""
        now = self._clock()
        slots = [s for s in self.live if s.stopped is not None and not s.fenced
                 and now - s.stopped >= FENCE_AFTER_S]
        for slot in slots:
            slot.fenced = True
        return slots

    def add(self, worker: str, join: bool = False) -> Slot:
        """The slot of an agent starting on ``worker`` now (numbered after the others)."""
        slot = Slot(worker, len(self.slots), join, started=self._clock(),
                    generation=self.generation)
        self.slots.append(slot)
        return slot

    def returned(self, slot: Slot, report: AgentReport) -> None:
        """``slot``'s agent returned ``report``: its own counts replace its progress events'."""
        slot.report = report
        slot.ended = self._clock()
        slot.rows, slot.busy_s, slot.cpu_s = report.rows, report.busy_s, report.cpu_s
        slot.tables = report.tables or slot.tables

    def write_off(self, slot: Slot) -> None:
        """``slot``'s agent died with its worker."""
        slot.dead = True
        slot.ended = self._clock()

    def final_model(self, alive: Collection[str]) -> Slot | None:
        """The agent of the job's current model that holds its final model on a worker still
        ``alive``, or wrote it in parts; None while it has not formed, or was lost with its
        worker."""
        for slot in self.current:
            report = slot.report
            if slot.finished and report is not None and (
                    report.saved_model is not None
                    or report.holds_model and slot.worker in alive):
                return slot
        return None

    def every_lost(self) -> bool:
        """The job had agents and every one died before its end (none finished)."""
        return bool(self.slots) and not any(s.live or s.finished for s in self.slots)

    def _choose(self, workers: Collection[str], wanted: int | None) -> list[str]:
        """The workers to train on, sorted: all of ``workers``, or the ``wanted`` least busy of
        them (fewest other unfinished jobs placed on a worker, then fewest tasks running
        there: a sweep's trials side by side). Recorded at once, before anything awaits, so two
        jobs starting together choose apart."""
        if wanted is None:
            chosen = sorted(workers)
        else:
            jobs: dict[str, int] = {}
            for placed in self._others():
                for worker in placed:
                    jobs[worker] = jobs.get(worker, 0) + 1
            by_load = sorted(workers, key=lambda w: (jobs.get(w, 0), self._tasks_on(w), w))
            chosen = sorted(by_load[:wanted])
        self._chosen.update(chosen)
        return chosen
