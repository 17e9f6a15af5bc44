"""What one job's master knows happened (:class:`Journal`): the agents' events and the
controller's actions come in, the job's log, the parts of its record clients see and of the
report ``hooks.finish`` gets go out.

Every tick the master hands it the ledger's counters (:meth:`Journal.read_ledger`), the
controller's new actions and the monitor's verdicts (:meth:`Journal.read_controller`) and the
agents' events received since the last tick (:meth:`Journal.read_events`)::

    lease start / end   ─► the lease spans of the timeline (a dead worker's open ones: lost),
                           each worker's first lease, the end of the last lease that trained
    progress            ─► each agent's rows, busy and CPU seconds, samples/s, exchanges and
                           their bytes, the mean loss
    fault, log          ─► the job's log, under the agent's worker and the event's time
    controller actions  ─► the job's log and record; their counts per kind

and gets back one step of metrics for the tracking run. A plain class: the clock is handed in,
so tests drive it without a cluster; the agents' slots are the
:class:`~antdt.jobs.placement.Placement`'s, whose progress it updates.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from antdt.jobs.placement import Slot
from antdt.sharding import Clock

logger = logging.getLogger(__name__)

LAST_ACTIONS = 10
"""Controller actions a job's record shows."""

SERIES = "train."
"""Prefix of the metrics the master logs every tick (rows, samples/s, loss over time): a run's
final figures (``samples_per_s``, ``rows_trained``, ...) are the job's own, under their plain
names, and never shadowed by a tick's value."""

ROWS = ("rows_expected", "rows_done", "rows_trained", "rows_todo", "rows_leased", "rows_lost",
        "rows_retrained", "rows_quarantined")
"""The ledger's counters a job's record shows (without their ``rows_`` prefix)."""


class Journal:
    """The events, actions and log of job ``job_id`` (see the module docstring). ``clock()`` is
    the scheduler's time; ``changed()`` is called whenever clients should look again (a log
    record was added); the log keeps the newest ``log_length`` records.

    ``rows`` are the ledger's counters as last read, ``leases`` its lease counters (granted,
    revoked, split), ``actions`` the controller's applied actions (every one) and
    ``action_counts`` their counts per kind, ``health`` the monitor's verdict per worker as
    ``status`` names it and ``verdicts`` the monitor's own (:meth:`~antdt.monitor.Health.as_dict`:
    its state, BPT, rate), ``first_lease`` when each worker's first lease started (seconds after
    training started)."""

    def __init__(self, job_id: str, clock: Clock, changed: Callable[[], None],
                 log_length: int) -> None:
        self.job_id = job_id
        self.rows: dict[str, Any] = {}
        self.leases: dict[str, int] = {}
        self.actions: list[dict[str, Any]] = []
        self.action_counts: dict[str, int] = {}
        self.health: dict[str, str] = {}
        self.verdicts: dict[str, Mapping[str, Any]] = {}
        self.batch_rows: dict[str, int] = {}
        """The local batch the controller set each worker (the synchronous mode's shares)."""
        self.first_lease: dict[str, float] = {}
        self.logs: deque[dict[str, Any]] = deque(maxlen=log_length)
        self._clock = clock
        self._changed = changed
        self._inbox: deque[tuple[float, dict[str, Any]]] = deque()
        self._seq = 0
        self._t0 = 0.0
        self._leasing: dict[tuple[str, int], float] = {}
        self._spans: list[tuple[str, int, float, float, int, str]] = []
        self._last_row = 0.0
        """When the last lease that trained rows ended (the clock's time)."""

    # ---- in ---------------------------------------------------------------------------------

    def began(self, at: float) -> None:
        """Training started at ``at``: the times of the record and report count from it."""
        self._t0 = at

    def elapsed(self) -> float:
        """Seconds since training started (0 before)."""
        return self._clock() - self._t0 if self._t0 else 0.0

    def received(self, msg: dict[str, Any]) -> None:
        """An agent's event, read at the next :meth:`read_events`."""
        self._inbox.append((self._clock(), msg))

    def log(self, level: str, message: str, source: str = "job", at: float | None = None) -> None:
        """Add a record to the job's log (and the scheduler's)."""
        self._seq += 1
        self.logs.append({"seq": self._seq, "time": self._clock() if at is None else at,
                          "level": level, "source": source, "message": message})
        getattr(logger, "warning" if level == "warning" else "error" if level == "error"
                else "info")("job %s: %s", self.job_id, message)
        self._changed()

    def read_ledger(self, summary: Mapping[str, Any]) -> None:
        """The ledger's counters (:meth:`~antdt.sharding.ShardLedger.summary`)."""
        self.rows = {key.removeprefix("rows_"): summary[key] for key in ROWS}
        self.rows.update(epoch=summary["epoch"], epochs=summary["epochs"],
                         done_by_epoch=summary["rows_done_by_epoch"])
        self.leases = {kind: int(summary[f"leases_{kind}"])
                       for kind in ("granted", "revoked", "split")}

    def read_controller(self, actions: Callable[[int], Mapping[str, Any]],
                        workers: Mapping[str, Mapping[str, Any]]) -> dict[str, int]:
        """The controller's actions not read yet (``actions(since)``, as
        :meth:`~antdt.controller.Controller.actions`), logged, and the monitor's health of
        ``workers`` (its summary's); the applied actions' counts per kind."""
        new = actions(len(self.actions))
        for record in new["records"]:
            self.actions.append(record)
            lease = "" if record["lease_id"] is None else f" lease {record['lease_id']}"
            self.log("info", f"controller: {record['action']} {record['worker']}{lease} "
                             f"({record['reason']})")
        self.health = {w: _health(h["state"]) for w, h in workers.items()}
        self.verdicts = dict(workers)
        self.batch_rows = dict(new.get("batch_sizes") or {})
        self.action_counts = dict(new["counts"])
        return dict(self.action_counts)

    def read_events(self, slots: Sequence[Slot], counts: Mapping[str, int]) -> dict[str, float]:
        """Read the agents' events received since the last call (updating the progress of
        their ``slots``); the tick's metrics for the tracking run (``counts``: the
        controller's actions per kind)."""
        by_worker = {s.worker: s for s in slots}
        fresh: dict[str, float] = {}
        losses: list[float] = []
        while self._inbox:
            at, msg = self._inbox.popleft()
            kind, worker = msg.get("kind"), str(msg.get("worker"))
            if kind == "lease":
                self._lease(worker, msg)
            elif kind == "progress":
                fresh[worker] = float(msg["samples_per_s"])
                if msg.get("loss") is not None:
                    losses.append(float(msg["loss"]))
                slot = by_worker.get(worker)
                if slot is not None and slot.report is None:
                    slot.rows, slot.busy_s = int(msg["rows"]), float(msg["busy_s"])
                    slot.cpu_s = float(msg["cpu_s"])
                    slot.exchanges = int(msg.get("exchanges", slot.exchanges))
                    slot.exchanged_bytes = msg.get("exchanged_bytes", slot.exchanged_bytes)
                    slot.tables = _tables(msg.get("tables")) or slot.tables
            elif kind == "fault":
                self.log("warning", f"injected {msg.get('fault')} after {msg.get('rows')} rows",
                         source=worker, at=at)
            elif kind == "log":
                self.log(str(msg.get("level", "warning")), str(msg.get("message")),
                         source=worker, at=at)
        for worker, rate in fresh.items():
            by_worker[worker].rate = rate
        live = [s for s in slots if s.live]
        rows = self.rows
        metrics: dict[str, float] = {
            f"{SERIES}rows_done": rows["done"], f"{SERIES}rows_trained": rows["trained"],
            f"{SERIES}rows_retrained": rows["retrained"],
            f"{SERIES}samples_per_s": sum(s.rate for s in live),
            f"{SERIES}workers": len(live)}
        metrics.update({f"{SERIES}samples_per_s.{by_worker[w].label}": r
                        for w, r in fresh.items()})
        metrics.update({f"{SERIES}batch_rows.{by_worker[w].label}": float(n)
                        for w, n in self.batch_rows.items() if w in by_worker})
        metrics.update({f"{SERIES}{name}.{s.label}": s.tables[name]
                        for s in live if s.tables for name in ("pull_ms", "push_ms")})
        if losses:
            metrics[f"{SERIES}loss"] = sum(losses) / len(losses)
        metrics["controller.actions"] = len(self.actions)
        metrics.update({f"controller.{kind}": n for kind, n in counts.items()})
        return metrics

    def lost(self, worker: str) -> None:
        """``worker`` died: its open leases end now, as lost."""
        now = self._clock()
        for key in [key for key in self._leasing if key[0] == worker]:
            start = self._leasing.pop(key)
            self._spans.append((*key, start, now, 0, "lost"))

    # ---- out --------------------------------------------------------------------------------

    def log_records(self, since: int) -> list[dict[str, Any]]:
        """The job's log records with ``seq >= since``, oldest first."""
        return [record for record in self.logs if record["seq"] >= since]

    def record(self, slots: Sequence[Slot]) -> dict[str, Any]:
        """The journal's part of the job's record (plain, msgpack-able): counters, workers
        with their health, the last actions, the agents."""
        live = {s.worker for s in slots if s.live}
        workers = [{"worker": s.worker, "label": s.label, "rows": s.rows,
                    "samples_per_s": round(s.rate, 1) if s.worker in live else 0.0,
                    "state": s.as_dict()["outcome"],
                    "health": self.health.get(s.worker, "normal") if s.worker in live else "-",
                    "batch_rows": self.batch_rows.get(s.worker), "tables": s.tables}
                   for s in slots]
        return {"rows": dict(self.rows), "workers": workers,
                "actions": self.actions[-LAST_ACTIONS:], "actions_total": len(self.actions),
                "agents": [s.as_dict() for s in slots], "first_lease": dict(self.first_lease),
                "last_row": self._last_row - self._t0 if self._last_row else None}

    def report(self, slots: Sequence[Slot]) -> dict[str, Any]:
        """The journal's part of the report ``hooks.finish`` gets: counters, the seconds of
        training (until the last agent ended), agents, every controller action, the lease
        spans and the actions as marks of the timeline (seconds since training started)."""
        ended = [s.ended for s in slots if s.ended is not None]
        t0 = self._t0
        labels = {s.worker: s.label for s in slots}
        split = {a["lease_id"] for a in self.actions if a["action"] == "split"}
        spans = [{"worker": labels.get(w, w), "lease_id": lease, "start": start - t0,
                  "end": end - t0, "rows": rows,
                  "outcome": "split" if outcome == "finished" and lease in split
                  else outcome if outcome in ("finished", "revoked") else "lost"}
                 for w, lease, start, end, rows, outcome in self._spans]
        marks = [{"time": a["time"] - t0, "worker": labels.get(a["worker"], a["worker"]),
                  "action": a["action"], "rows": a["rows"], "reason": a["reason"]}
                 for a in self.actions]
        return {"rows": dict(self.rows), "train_s": max(ended, default=self.elapsed()),
                "agents": [s.as_dict() for s in slots], "actions": list(self.actions),
                "spans": spans, "marks": marks, "first_lease": dict(self.first_lease)}

    # ---- internals ----------------------------------------------------------------------------

    def _lease(self, worker: str, msg: Mapping[str, Any]) -> None:
        key = (worker, int(msg["lease_id"]))
        if msg["phase"] == "start":
            self._leasing[key] = float(msg["time"])
            self.first_lease.setdefault(worker, float(msg["time"]) - self._t0)
        elif self._leasing.pop(key, None) is not None:
            self._spans.append((*key, float(msg["start"]), float(msg["time"]),
                                int(msg["rows"]), str(msg["outcome"])))
            if int(msg["rows"]):
                self._last_row = max(self._last_row, float(msg["time"]))


def _tables(value: object) -> dict[str, float] | None:
    """An agent's ``tables`` stats as numbers (None: absent or not a mapping of numbers)."""
    if not isinstance(value, dict):
        return None
    found = {str(k): float(v) for k, v in value.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return found or None


def _health(state: str) -> str:
    """A monitor verdict as ``status`` names it."""
    return {"ok": "normal", "hung": "hung"}.get(state, "straggler")
