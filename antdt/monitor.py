"""The straggler monitor (AntDT's Monitor): per-worker batch processing time and throughput, fed
by the commits the workers send anyway (no extra RPC), and a verdict per worker.

A plain class with an injected clock and no Dask: :mod:`antdt.controller` runs it on the
scheduler (subscribed to :meth:`antdt.sharding.service.ShardingService.subscribe`) and in the simulator.

What a commit tells
-------------------
Each :class:`~antdt.sharding.CommitEvent` carries the rows trained since the worker's previous
commit and, optionally, the agent's own measurements in ``stats``: ``busy_s`` (seconds spent
training) and ``batches`` (batches trained). Without them the monitor derives both: ``busy_s`` is
the time since the worker's previous commit (or since it became a lease holder), ``batches`` is
``rows / batch_rows``. The batch processing time (BPT) of a window is ``busy_s / batches`` summed
over the window, its rate ``rows / busy_s``.

A worker's first ``warm-up-batches`` batches (the commits that reach that count) are its warm-up
and are not measured: they pay one-time costs beyond the first batch's (the first row groups
read, the first sync round joined, the allocator growing). While a lease holder is in its
warm-up (from its lease, imports and first batch included, until its warm-up ends or it is
hung), no other worker's commits are measured either: on a shared machine its cold start takes
their CPU. With windows of 150 ms on two cores, a healthy worker's first five batches took five
times its later BPT over two windows, and another's took twice its peer's while a third worker
started; each was retired as a persistent straggler. The warm-up is counted in batches, so it
is as long on a slow machine as on a fast one, and it leaves the rest of the window it falls in
to be judged; a join costs every worker a few batches of evidence, a worker stuck in its
warm-up only until its hang timeout.

Windows and verdicts
--------------------
Time is cut into windows of ``window`` seconds, closed by :meth:`Monitor.update` (the controller
calls it every tick). When a window closes:

* every worker that committed measured batches in it (past its warm-up) gets a sample
  ``(BPT, rows, busy_s)``; the last ``history`` samples are its sliding window (its rate is
  taken over them);
* the cluster median BPT is the median over those workers;
* a worker is **slow** in the window if its BPT is above ``slow-factor`` x the median BPT of the
  *other* workers: a worker is judged against its peers, not against a median it pulls up itself
  (with two workers, one at 2x the other's BPT is 1.33x the median of both, but 2x its peer's).
  A lease holder that is still training but committed nothing for the whole window is slow too
  (its evidence BPT is the time since its last commit, a lower bound); any other silent worker
  gives no evidence and keeps its verdict, and so does a holder before its warm-up ends (its
  first batch alone pays imports and the first use of its kernels: a healthy worker judged by
  that silence was retired within windows of 150 ms). A worker stuck in its warm-up is hung
  once its timeout passes. A worker with no measured peer gets no verdict;
* ``streak`` counts consecutive slow windows: 0 is :attr:`WorkerState.OK`, 1 to ``k - 1`` is
  :attr:`WorkerState.TRANSIENT`, ``k`` (``persistent-windows``) or more is
  :attr:`WorkerState.PERSISTENT`.

Independently of windows, at every update a lease holder still training whose last commit is
older than its hang timeout is :attr:`WorkerState.HUNG` until it commits again, unless the
scheduler hears none of the holders (Dask's heartbeats, each within its timeout): then the
scheduler's own link is cut, no worker is hung, and Dask's comm timeouts remove the workers if it
stays so (a short blip of the scheduler's link made every worker of a job look hung, and the
controller retired all but one). And a worker
the model sync finds reaching no peer (:meth:`Monitor.partitions`, from
:meth:`antdt.sync.service.SyncService.partitioned`: its link to its peers is cut, not its link
to the scheduler) is :attr:`WorkerState.PARTITIONED` until it reaches one again: nothing it trains can
be synced (a row is synced once every peer applied it), so the controller retires it. The timeout comes
from its own history: ``hang-factor`` x its usual gap between commits (an exponential average;
the cluster median gap for a worker with no history), never less than ``hang-floor``. Settings
live under ``antdt.monitor`` in dask config (see ``antdt/antdt.yaml``).

Cost: :meth:`Monitor.observe` is O(1); :meth:`Monitor.update` is O(lease holders), plus
O(workers) once per window.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from antdt import config
from antdt.errors import ConfigError
from antdt.sharding import Clock, CommitEvent

logger = logging.getLogger(__name__)

BUSY = "busy_s"
"""Commit stat: seconds the worker spent training since its previous commit."""
BATCHES = "batches"
"""Commit stat: batches the worker trained since its previous commit."""
CPU = "cpu_s"
"""Commit stat: CPU seconds its training thread used of those busy seconds (the rest it
waited: for its rows to arrive, on its link, or for a core)."""

GAP_WEIGHT = 0.2
"""Weight of the newest gap in a worker's exponential average of gaps between commits."""


class WorkerState(enum.Enum):
    """A worker's verdict; ``hung`` overrides the window verdicts while it lasts, and
    ``partitioned`` every other verdict."""

    OK = "ok"
    TRANSIENT = "transient"
    PERSISTENT = "persistent"
    HUNG = "hung"
    PARTITIONED = "partitioned"


class Health(NamedTuple):
    """A worker's verdict with its evidence.

    ``bpt`` and ``median`` are the worker's BPT and the median BPT of the other workers in
    ``window``, the last window that gave evidence about it (None before any); ``streak`` its consecutive slow
    windows; ``rate`` its rows/s over its sliding window; ``silent_s`` the seconds since its last
    commit (as of the last update) and ``timeout_s`` its hang timeout; ``reason`` why it is
    partitioned (None when it is not); ``waiting`` the share of its batch time its training
    thread spent off the CPU (waiting for its rows, on its link, or for a core; None: unknown).
    """

    worker: str
    state: WorkerState
    bpt: float | None
    median: float | None
    window: int | None
    streak: int
    rate: float | None
    silent_s: float
    timeout_s: float
    reason: str | None = None
    waiting: float | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain (msgpack-able) form, the state as its value."""
        return {**self._asdict(), "state": self.state.value}


class Sample(NamedTuple):
    """A worker's evidence in one closed window: the window, its average batch (rows per
    batch) and its BPT (busy seconds per batch)."""

    window: int
    batch_rows: float
    bpt: float


@dataclass(frozen=True, slots=True)
class MonitorSettings:
    """Thresholds and windows; :meth:`from_config` reads ``antdt.monitor``."""

    window_s: float = 10.0
    history: int = 6
    slow_factor: float = 1.5
    persistent_windows: int = 3
    hang_factor: float = 5.0
    hang_floor_s: float = 5.0
    warm_up_batches: int = 8

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.history >= 1 and self.slow_factor > 1
                and self.persistent_windows >= 1 and self.hang_factor > 1
                and self.hang_floor_s > 0 and self.warm_up_batches >= 0):
            raise ConfigError(f"monitor settings out of range (window_s > 0, history >= 1, "
                              f"slow_factor > 1, persistent_windows >= 1, hang_factor > 1, "
                              f"hang_floor_s > 0, warm_up_batches >= 0), found {self}")

    @classmethod
    def from_config(cls) -> MonitorSettings:
        return cls(window_s=config.seconds("antdt.monitor.window"),
                   history=int(config.number("antdt.monitor.history", low=1, integer=True)),
                   slow_factor=config.number("antdt.monitor.slow-factor", low=1.0),
                   persistent_windows=int(config.number("antdt.monitor.persistent-windows",
                                                        low=1, integer=True)),
                   hang_factor=config.number("antdt.monitor.hang-factor", low=1.0),
                   hang_floor_s=config.seconds("antdt.monitor.hang-floor"),
                   warm_up_batches=int(config.number("antdt.monitor.warm-up-batches",
                                                     integer=True)))

    @classmethod
    def synchronous(cls) -> MonitorSettings:
        """:meth:`from_config` for a synchronous job, whose batches are steps: its warm-up is
        ``antdt.sync-steps.warm-up-steps`` steps. A step's one-time costs (the first lease and
        row group, the kernels' first use) are paid in its first step, as every rank built its
        shards before the first one: with the async mode's eight batches, a benchmark job with
        a 4x slow rank trained 12 of its 46 steps at equal local batches, at the slow rank's
        pace."""
        return dataclasses.replace(
            cls.from_config(),
            warm_up_batches=int(config.number("antdt.sync-steps.warm-up-steps", integer=True)))


@dataclass(slots=True)
class _Track:
    """What the monitor knows of one worker."""

    since: float
    """When it was last seen becoming a lease holder."""
    history: int
    warm_up: float
    """Batches of its warm-up still to come (<= 0: over)."""
    rows: int = 0
    busy: float = 0.0
    batches: float = 0.0
    last_commit: float | None = None
    seen_update: int = -1
    gap: float | None = None
    samples: deque[tuple[float, int, float]] = field(default_factory=deque)
    sampled: int = -1
    """The window of its last sample."""
    bpt: float | None = None
    median: float | None = None
    window: int | None = None
    streak: int = 0
    verdict: WorkerState = WorkerState.OK
    hung: bool = False
    partitioned: str | None = None
    """Why the model sync finds it reaching no peer (None: it reaches one)."""
    silent: float = 0.0
    timeout: float = 0.0
    waiting: float | None = None
    """The share of its batch time off the CPU (an average over its commits; None: no CPU
    stat)."""

    def __post_init__(self) -> None:
        self.samples = deque(maxlen=self.history)


def _always(worker: str) -> bool:
    return True


def _heard(worker: str) -> float:
    return 0.0


class _OthersMedian:
    """Medians of a list of values with one of them left out, each in O(log n).

    >>> others = _OthersMedian([1.0, 2.0, 4.0])
    >>> others.without(4.0), others.without(1.0), others.without(None)
    (1.5, 3.0, 2.0)
    """

    def __init__(self, values: list[float]) -> None:
        self._sorted = np.sort(np.asarray(values, dtype=np.float64))

    def without(self, value: float | None) -> float | None:
        """The median of the values with one occurrence of ``value`` left out (all of them for
        None); None when nothing is left."""
        values = self._sorted
        if value is None:
            return float(np.median(values)) if len(values) else None
        n = len(values) - 1
        if n < 1:
            return None
        gone = int(np.searchsorted(values, value))

        def at(i: int) -> float:  # the i-th of the values left
            return float(values[i if i < gone else i + 1])

        return at(n // 2) if n % 2 else (at(n // 2 - 1) + at(n // 2)) / 2


class Monitor:
    """Per-worker BPT windows and verdicts of one job (see the module docstring).

    ``clock`` must be the clock of the ledger whose commits are observed (event times and
    ``clock()`` are compared). ``batch_rows`` converts rows to batches when a commit carries no
    ``batches`` stat.

    >>> now = [0.0]
    >>> monitor = Monitor(lambda: now[0], batch_rows=10,
    ...                   settings=MonitorSettings(window_s=10, persistent_windows=2))
    >>> for t in range(1, 11):
    ...     now[0] = float(t)
    ...     for worker, rows in (("a", 100), ("b", 100), ("c", 30)):  # c: 1/3 of the speed
    ...         monitor.observe(CommitEvent(worker, 0, 0, rows, {}, now[0]))
    >>> monitor.update(["a", "b", "c"])
    >>> monitor.health("c").state, monitor.health("a").state
    (<WorkerState.TRANSIENT: 'transient'>, <WorkerState.OK: 'ok'>)
    >>> monitor.health("c").rate  # of the commits after its warm-up (its first 9 batches)
    30.0
    """

    def __init__(self, clock: Clock, *, batch_rows: int,
                 settings: MonitorSettings | None = None) -> None:
        if batch_rows < 1:
            raise ConfigError(f"batch_rows must be >= 1, found {batch_rows}")
        self.settings = settings if settings is not None else MonitorSettings.from_config()
        self.batch_rows = batch_rows
        self._clock = clock
        self._tracks: dict[str, _Track] = {}
        self._flagged: set[str] = set()
        self._partitioned: set[str] = set()
        self._warming: set[str] = set()
        """Holders in their warm-up and not hung: while there are any, no commit is measured."""
        self._window_end = clock() + self.settings.window_s
        self._updates = 0
        self.windows = 0
        """Windows closed so far; the last closed one is ``windows - 1``."""
        self.median_bpt: float | None = None
        """Cluster median BPT of the last window with commits."""
        self.median_rate: float | None = None
        """Cluster median rows/s of the last window with commits."""
        self.median_gap: float | None = None
        """Cluster median of the workers' usual gaps between commits, as of the last window."""

    # ---- input --------------------------------------------------------------------------------

    def observe(self, event: CommitEvent) -> None:
        """Account one commit (a ledger listener: O(1), never raises for a well-formed event)."""
        worker, rows, stats, now = event.worker, event.rows, event.stats, event.time
        track = self._tracks.get(worker)
        if track is None:
            track = self._new_track(worker, now)
        last = track.last_commit
        if rows > 0:
            since = track.since
            elapsed = max(0.0, now - (since if last is None or since > last else last))
            if last is not None:
                gap = track.gap
                track.gap = elapsed if gap is None else \
                    GAP_WEIGHT * elapsed + (1 - GAP_WEIGHT) * gap
            if stats:
                busy = _measured(stats, BUSY, elapsed, elapsed + 3600.0)
                batches = _measured(stats, BATCHES, rows / self.batch_rows, rows)
                if CPU in stats and busy > 0:
                    off = max(0.0, 1.0 - stats[CPU] / busy)
                    waiting = track.waiting
                    track.waiting = off if waiting is None else \
                        GAP_WEIGHT * off + (1 - GAP_WEIGHT) * waiting
            else:  # the common case, without a lookup per stat
                busy, batches = elapsed, rows / self.batch_rows
            if track.warm_up > 0:
                track.warm_up -= batches
                if track.warm_up <= 0:
                    self._warming.discard(worker)
            elif not self._warming:
                track.rows += rows
                track.busy += busy
                track.batches += batches
        track.last_commit = now

    def update(self, holders: Iterable[str], training: Callable[[str], bool] = _always,
               unheard: Callable[[str], float] = _heard) -> None:
        """Close the windows that ended by now and re-check hangs.

        ``holders``: the workers holding live leases now; ``training(worker)``: whether one of
        its leases still has rows to train (a holder whose leases only wait for their synced
        offset is not hung); ``unheard(worker)``: seconds since the scheduler last heard from
        its process (no holder heard within its timeout: the scheduler is cut off, nobody is
        hung). ``training`` is asked only about silent holders.
        """
        now = self._clock()
        holding = list(holders)
        while now >= self._window_end:
            self._close_window(self._window_end, set(holding), training)
            self._window_end += self.settings.window_s
        self._updates += 1
        updates, tracks, settings = self._updates, self._tracks, self.settings
        floor, factor, median_gap = settings.hang_floor_s, settings.hang_factor, self.median_gap
        warming = self._warming
        for worker in holding:  # every holder at every tick: hot, hence the locals
            track = tracks.get(worker)
            if track is None:
                track = self._new_track(worker, now)
            elif track.seen_update != updates - 1:
                track.since = now  # it (re)became a holder since the last update
            track.seen_update = updates
            since, last = track.since, track.last_commit
            track.silent = now - (since if last is None or since > last else last)
            gap = track.gap
            if gap is None:
                gap = median_gap
            track.timeout = floor if gap is None else max(floor, factor * gap)
        # a silent holder the scheduler does not hear either is cut off: hung (retired) when
        # the scheduler hears another holder, not when it hears none (its own link is cut)
        heard = [w for w in holding if unheard(w) <= tracks[w].timeout]
        for worker in holding:
            track = tracks[worker]
            hung = track.silent > track.timeout and training(worker) and bool(heard)
            if hung != track.hung:
                track.hung = hung
                if hung:
                    logger.info("worker %s hung: no commit for %.1fs (timeout %.1fs)", worker,
                                track.silent, track.timeout)
                self._flag(worker, track)
            if track.warm_up > 0:
                if hung:
                    warming.discard(worker)
                else:
                    warming.add(worker)
        for worker in [w for w in self._flagged if tracks[w].seen_update != updates]:
            track = tracks[worker]  # no longer a holder: cannot be hung
            if track.hung:
                track.hung = False
                self._flag(worker, track)
        warming.difference_update([w for w in warming if tracks[w].seen_update != updates])

    def partitions(self, found: Mapping[str, str]) -> None:
        """The workers the model sync finds reaching no peer now, each with why: their verdict
        is partitioned until a later call leaves them out (O(found + partitioned before))."""
        for worker in [w for w in self._partitioned if w not in found]:
            self._partitioned.discard(worker)
            track = self._tracks.get(worker)
            if track is not None:
                logger.info("worker %s reaches its sync peers again", worker)
                track.partitioned = None
                self._flag(worker, track)
        for worker, reason in found.items():
            track = self._tracks.get(worker)
            if track is None:
                track = self._new_track(worker, self._clock())
            if track.partitioned is None:
                logger.info("worker %s partitioned: %s", worker, reason)
            track.partitioned = reason
            self._partitioned.add(worker)
            self._flag(worker, track)

    def forget(self, worker: str) -> None:
        """The worker left the cluster."""
        self._tracks.pop(worker, None)
        self._flagged.discard(worker)
        self._partitioned.discard(worker)
        self._warming.discard(worker)

    # ---- output -------------------------------------------------------------------------------

    def health(self, worker: str) -> Health | None:
        track = self._tracks.get(worker)
        return None if track is None else self._health(worker, track)

    def flagged(self) -> list[Health]:
        """Workers not ``ok``: partitioned first, then hung, persistent, transient, slowest
        first."""
        order = {WorkerState.PARTITIONED: 0, WorkerState.HUNG: 1, WorkerState.PERSISTENT: 2,
                 WorkerState.TRANSIENT: 3}
        found = [self._health(w, self._tracks[w]) for w in self._flagged]
        return sorted(found, key=lambda h: (order[h.state], -(h.bpt or 0.0), h.worker))

    def workers(self) -> list[str]:
        return list(self._tracks)

    def rate(self, worker: str) -> float | None:
        """Rows/s of ``worker`` over its sliding window and the current window (None: no
        evidence yet)."""
        track = self._tracks.get(worker)
        if track is None:
            return None
        rows, busy = track.rows, track.busy
        for _, sample_rows, sample_busy in track.samples:
            rows += sample_rows
            busy += sample_busy
        return rows / busy if busy > 0 and rows > 0 else None

    def last_sample(self, worker: str) -> Sample | None:
        """``worker``'s evidence in the last window it committed measured batches in (None
        before any)."""
        track = self._tracks.get(worker)
        if track is None or not track.samples:
            return None
        bpt, rows, busy = track.samples[-1]
        return Sample(track.sampled, rows * bpt / busy, bpt)

    def summary(self) -> dict[str, Any]:
        """Medians and every worker's health, plain (msgpack-able)."""
        return {"windows": self.windows, "median_bpt": self.median_bpt,
                "median_rate": self.median_rate, "median_gap": self.median_gap,
                "workers": {w: self._health(w, t).as_dict() for w, t in self._tracks.items()}}

    # ---- internals ----------------------------------------------------------------------------

    def _new_track(self, worker: str, now: float) -> _Track:
        track = self._tracks[worker] = _Track(now, self.settings.history,
                                              float(self.settings.warm_up_batches))
        return track

    def _health(self, worker: str, track: _Track) -> Health:
        state = WorkerState.PARTITIONED if track.partitioned is not None else \
            WorkerState.HUNG if track.hung else track.verdict
        return Health(worker, state, track.bpt, track.median, track.window, track.streak,
                      self.rate(worker), track.silent, track.timeout, track.partitioned,
                      track.waiting)

    def _flag(self, worker: str, track: _Track) -> None:
        if track.hung or track.partitioned is not None or track.verdict is not WorkerState.OK:
            self._flagged.add(worker)
        else:
            self._flagged.discard(worker)

    def _close_window(self, end: float, holders: set[str],
                      training: Callable[[str], bool]) -> None:
        """Sample every worker that committed, take the medians, give the verdicts."""
        window = self.windows
        self.windows += 1
        bpts: list[float] = []
        rates: list[float] = []
        measured: list[tuple[str, _Track, float, bool]] = []  # ..., BPT, whether in bpts
        for worker, track in self._tracks.items():
            if track.batches > 0 and track.busy > 0:
                bpt = track.busy / track.batches
                track.samples.append((bpt, track.rows, track.busy))
                track.sampled = window
                bpts.append(bpt)
                rates.append(track.rows / track.busy)
                measured.append((worker, track, bpt, True))
            elif worker in holders and track.last_commit is not None and track.warm_up <= 0:
                last = max(track.last_commit, track.since)
                if end - last >= self.settings.window_s and training(worker):
                    measured.append((worker, track, end - last, False))
            track.rows, track.busy, track.batches = 0, 0.0, 0.0
        if bpts:
            self.median_bpt = float(np.median(bpts))
            self.median_rate = float(np.median(rates))
        gaps = [t.gap for t in self._tracks.values() if t.gap is not None]
        if gaps:
            self.median_gap = float(np.median(gaps))
        if bpts:
            others = _OthersMedian(bpts)
        elif self.median_bpt is not None:  # only silent holders: judged by the last median
            others = _OthersMedian([self.median_bpt])
        else:
            return
        slow_factor, k = self.settings.slow_factor, self.settings.persistent_windows
        for worker, track, bpt, sampled in measured:
            median = others.without(bpt if sampled else None)
            if median is None:
                continue
            track.bpt, track.median, track.window = bpt, median, window
            track.streak = track.streak + 1 if bpt > slow_factor * median else 0
            verdict = WorkerState.OK if track.streak == 0 else \
                WorkerState.PERSISTENT if track.streak >= k else WorkerState.TRANSIENT
            if verdict is not track.verdict:
                logger.debug("worker %s: %s -> %s (BPT %.4g, median %.4g, window %d)", worker,
                             track.verdict.value, verdict.value, bpt, median, window)
                track.verdict = verdict
                self._flag(worker, track)


def _measured(stats: Mapping[str, float], key: str, derived: float, most: float) -> float:
    """A commit's own measurement ``key``, or ``derived`` when it has none or an impossible
    one (negative, not finite: a negative ``batches`` would keep the worker in warm-up for
    ever); at most ``most`` (a batch has a row, a commit's busy time fits its wall time)."""
    value = stats.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        return derived
    return min(float(value), most)
