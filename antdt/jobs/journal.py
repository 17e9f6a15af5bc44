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

and gets back one step of metrics for the tracking run. An event that is not one of these, or
whose fields are missing, of the wrong type or out of range, or that names a worker no agent of
the job runs on, is dropped and counted (the first few logged): a foreign or broken sender never
fails the job, and the job's accounting is the ledger's, never an event's.

A job's lease spans grow with its life (a long synchronous job has a million), but what the
master keeps of them does not: two :class:`SpanHistory` of the whole job, the page's
(:data:`PAGE_SPANS` bars, read at every view of the job's page) and the tracking run's timeline
(:data:`TIMELINE_SPANS`), each merging neighbouring leases of a worker with the same outcome as
it fills; the rows and the number of leases stay exact.

A plain class: the clock is handed in,
so tests drive it without a cluster; the agents' slots are the
:class:`~antdt.jobs.placement.Placement`'s, whose progress it updates.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from antdt.jobs.placement import Slot
from antdt.sharding import Clock
from antdt.watch.urls import redact

logger = logging.getLogger(__name__)

LAST_ACTIONS = 10
"""Controller actions a job's record shows."""

SERIES = "train."
"""Prefix of the metrics the master logs every tick (rows, samples/s, loss over time): a run's
final figures (``samples_per_s``, ``rows_trained``, ...) are the job's own, under their plain
names, and never shadowed by a tick's value."""

PAGE_SPANS = 2000
"""Bars a job page's timeline draws at most: the whole job, neighbouring leases merged."""

TIMELINE_SPANS = 20_000
"""Bars the tracking run's ``timeline.png`` draws at most (a PNG a few thousand pixels wide)."""

LOGGED_DROPS = 10
"""Dropped events logged in the job's log; the rest are only counted (``events_dropped``)."""

Span = tuple[str, int, float, float, int, str]
"""A lease span: ``(worker, lease_id, start, end, rows, outcome)``, the clock's times."""

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
        self._page = SpanHistory(PAGE_SPANS)
        self._timeline = SpanHistory(TIMELINE_SPANS)
        self._split: set[int] = set()
        """The leases the controller split (their spans end as ``split``)."""
        self.events_dropped = 0
        """Agents' events dropped as unknown or malformed."""
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
        """Add a record to the job's log (and the scheduler's), the password of any URL in
        ``message`` shown as ``***``."""
        message = redact(message)
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
            if record["action"] == "split" and record["lease_id"] is not None:
                self._split.add(record["lease_id"])
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
            problem = _problem(msg, by_worker, at)
            if problem is not None:
                self._dropped(msg, problem)
                continue
            kind, worker = msg["kind"], msg["worker"]
            if kind == "lease":
                self._lease(worker, msg)
            elif kind == "progress":
                fresh[worker] = float(msg["samples_per_s"])
                if msg.get("loss") is not None:
                    losses.append(float(msg["loss"]))
                slot = by_worker[worker]
                if slot.report is None:
                    slot.rows, slot.busy_s = int(msg["rows"]), float(msg["busy_s"])
                    slot.cpu_s = float(msg["cpu_s"])
                    slot.exchanges = int(msg.get("exchanges", slot.exchanges))
                    slot.exchanged_bytes = msg.get("exchanged_bytes", slot.exchanged_bytes)
                    slot.tables = _tables(msg.get("tables")) or slot.tables
            elif kind == "fault":
                self.log("warning", f"injected {str(msg.get('fault'))[:100]} after "
                                    f"{msg.get('rows')} rows", source=worker, at=at)
            else:
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
            self._span((*key, start, now, 0, "lost"))

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
                "last_row": self._last_row - self._t0 if self._last_row else None,
                "events_dropped": self.events_dropped}

    def report(self, slots: Sequence[Slot]) -> dict[str, Any]:
        """The journal's part of the report ``hooks.finish`` gets: counters, the seconds of
        training (until the last agent ended), agents, every controller action, the lease
        spans (at most about :data:`TIMELINE_SPANS`, neighbouring ones merged: see
        :class:`SpanHistory`; ``spans_total`` counts the leases) and the actions as marks of
        the timeline (seconds since training started)."""
        ended = [s.ended for s in slots if s.ended is not None]
        return {"rows": dict(self.rows), "train_s": max(ended, default=self.elapsed()),
                "agents": [s.as_dict() for s in slots], "actions": list(self.actions),
                "spans": self._spans(self._timeline, slots),
                "spans_total": self._timeline.leases,
                "marks": self.marks(slots, len(self.actions)),
                "first_lease": dict(self.first_lease)}

    def page_spans(self, slots: Sequence[Slot]) -> list[dict[str, Any]]:
        """The closed lease spans a job page draws: the whole job in at most about
        :data:`PAGE_SPANS` bars (seconds since training started); as many leases as
        :attr:`leases_total`. Bounded work, whatever the job's length."""
        return self._spans(self._page, slots)

    @property
    def leases_total(self) -> int:
        """Lease spans closed so far."""
        return self._page.leases

    def marks(self, slots: Sequence[Slot], last: int) -> list[dict[str, Any]]:
        """The ``last`` controller actions as marks of the timeline."""
        labels = {s.worker: s.label for s in slots}
        return [{"time": a["time"] - self._t0, "worker": labels.get(a["worker"], a["worker"]),
                 "action": a["action"], "rows": a["rows"], "reason": a["reason"]}
                for a in self.actions[-last:]] if last > 0 else []

    # ---- internals ----------------------------------------------------------------------------

    def _lease(self, worker: str, msg: Mapping[str, Any]) -> None:
        key = (worker, int(msg["lease_id"]))
        if msg["phase"] == "start":
            self._leasing[key] = float(msg["time"])
            self.first_lease.setdefault(worker, float(msg["time"]) - self._t0)
        elif self._leasing.pop(key, None) is not None:
            self._span((*key, float(msg["start"]), float(msg["time"]), int(msg["rows"]),
                        str(msg["outcome"])))
            if int(msg["rows"]):
                self._last_row = max(self._last_row, float(msg["time"]))

    def _span(self, span: Span) -> None:
        worker, lease, start, end, rows, outcome = span
        outcome = ("split" if outcome == "finished" and lease in self._split
                   else outcome if outcome in ("finished", "revoked") else "lost")
        span = (worker, lease, start, end, rows, outcome)
        self._page.add(span)
        self._timeline.add(span)

    def _spans(self, history: SpanHistory, slots: Sequence[Slot]) -> list[dict[str, Any]]:
        """``history``'s bars as dicts; while nothing is merged, a lease the controller split
        after its span closed (its action read later) shows as split too."""
        labels = {s.worker: s.label for s in slots}
        t0 = self._t0
        split = self._split if not history.width else ()
        return [{"worker": labels.get(w, w), "lease_id": lease, "start": start - t0,
                 "end": end - t0, "rows": rows,
                 "outcome": "split" if outcome == "finished" and lease in split else outcome}
                for w, lease, start, end, rows, outcome in history.spans]

    def _dropped(self, msg: object, problem: str) -> None:
        self.events_dropped += 1
        if self.events_dropped <= LOGGED_DROPS:
            shown = repr(msg)
            self.log("warning", f"dropped an agent's event ({problem}): "
                                f"{shown[:200]}{'...' if len(shown) > 200 else ''}"
                                + (" (further ones are only counted)"
                                   if self.events_dropped == LOGGED_DROPS else ""))


class SpanHistory:
    """The lease spans of a whole job in at most about ``bound`` bars. Spans are kept as they
    come until ``bound``; then the spans of one worker with the same outcome that end in the
    same window of ``width`` seconds (windows aligned on multiples of ``width``) become one bar
    from the first start to the last end, with the rows of all of them and the first lease's id,
    and ``width`` doubles until at most half of ``bound`` bars are left. So a bar never hides a
    row or another outcome, the picture spans the whole job at a resolution of ``width`` (the
    job's length over about a thousand), and each span costs amortised constant time. A job
    with more than ``bound / 12`` workers keeps two bars per worker and outcome at least."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.spans: list[Span] = []
        self.width = 0.0
        """Seconds of the windows merged into one bar (0: nothing merged yet)."""
        self.leases = 0
        """Spans added (each a lease)."""

    def add(self, span: Span) -> None:
        self.spans.append(span)
        self.leases += 1
        if len(self.spans) >= self.bound:
            self._compact()

    def _compact(self) -> None:
        first = min(s[2] for s in self.spans)
        last = max(s[3] for s in self.spans)
        lanes = len({(s[0], s[5]) for s in self.spans})
        width = max(self.width * 2, (last - first) * lanes / (self.bound / 4), 1e-6)
        merged = _merge(self.spans, width)
        while len(merged) > self.bound // 2 and width < 2 * (last - first):
            width *= 2
            merged = _merge(merged, width)
        self.spans, self.width = merged, width
        self.bound = max(self.bound, 2 * len(merged))  # too many workers to merge further


def _merge(spans: Sequence[Span], width: float) -> list[Span]:
    """``spans`` with those of a worker and outcome ending in one window of ``width`` seconds
    merged (first seen first)."""
    bars: dict[tuple[str, str, int], list[Any]] = {}
    for worker, lease, start, end, rows, outcome in spans:
        key = (worker, outcome, math.floor(end / width))
        bar = bars.get(key)
        if bar is None:
            bars[key] = [worker, lease, start, end, rows, outcome]
        else:
            bar[1], bar[2] = min(bar[1], lease), min(bar[2], start)
            bar[3], bar[4] = max(bar[3], end), bar[4] + rows
    return [(w, lease, start, end, rows, outcome)
            for w, lease, start, end, rows, outcome in bars.values()]


MAX_COUNT = 2**53
"""The largest row, byte or lease count an event may carry (a float holds it exactly)."""


MAX_SKEW_S = 86_400.0
"""How far a lease event's time may be from the master's clock when it arrives."""


def _problem(msg: object, slots: Mapping[str, Slot], now: float) -> str | None:
    """What is wrong with agent event ``msg``, received at ``now`` (None: nothing): not a
    mapping, a kind the journal does not read, a worker no agent of the job runs on
    (``slots``), a field missing, of the wrong type or out of range."""
    if not isinstance(msg, Mapping):
        return f"not a mapping but {type(msg).__name__}"
    kind, worker = msg.get("kind"), msg.get("worker")
    if kind not in ("lease", "progress", "fault", "log"):
        return f"unknown kind {kind!r}"[:120]
    if not isinstance(worker, str) or worker not in slots:
        return f"no agent of the job on worker {worker!r}"[:120]
    if kind == "lease":
        phase = msg.get("phase")
        if phase not in ("start", "end"):
            return f"lease phase {phase!r}"[:120]
        wrong = _wrong(msg, {"lease_id": _count, "time": _seconds} if phase == "start" else
                       {"lease_id": _count, "time": _seconds, "start": _seconds,
                        "rows": _count, "outcome": _word})
        if wrong is None and phase == "end" and float(msg["start"]) > float(msg["time"]):
            wrong = "a lease that ends before it starts"
        if wrong is None and abs(float(msg["time"]) - now) > MAX_SKEW_S:
            wrong = f"time {msg['time']!r}, {now:.0f} here"
        return wrong
    if kind == "progress":
        return _wrong(msg, {"samples_per_s": _seconds, "rows": _count, "busy_s": _seconds,
                            "cpu_s": _seconds}) or _wrong(
            msg, {"loss": _number, "exchanged_bytes": _count}, optional=True) or (
            None if _count(msg.get("exchanges", 0)) else f"exchanges {msg['exchanges']!r}"[:120])
    return None


def _wrong(msg: Mapping[str, Any], checks: Mapping[str, Callable[[object], bool]],
           optional: bool = False) -> str | None:
    """The first field of ``msg`` that fails its check (missing: only when not ``optional``;
    None where optional is allowed)."""
    for name, check in checks.items():
        if name not in msg:
            if optional:
                continue
            return f"no {name}"
        value = msg[name]
        if not (optional and value is None) and not check(value):
            return f"{name} {value!r}"[:120]
    return None


def _number(value: object) -> bool:
    """A finite float, or an int of at most :data:`MAX_COUNT` either way (not a bool)."""
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return abs(value) <= MAX_COUNT
    return isinstance(value, float) and math.isfinite(value)


def _seconds(value: object) -> bool:
    """A finite number, not negative (a time, a duration, a rate)."""
    return _number(value) and float(value) >= 0  # type: ignore[arg-type]


def _count(value: object) -> bool:
    """An int from 0 to :data:`MAX_COUNT`."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_COUNT


def _word(value: object) -> bool:
    """A short string."""
    return isinstance(value, str) and 0 < len(value) <= 64


def _tables(value: object) -> dict[str, float] | None:
    """An agent's ``tables`` stats as numbers (None: absent or not a mapping of numbers)."""
    if not isinstance(value, dict):
        return None
    found = {str(k): float(v) for k, v in value.items()
             if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return found or None


def _health(state: str) -> str:
    """A monitor verdict as ``status`` names it."""
    return {"ok": "normal", "hung": "hung", "partitioned": "partitioned"}.get(state, "straggler")
