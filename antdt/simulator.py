"""Straggler simulator: the real :class:`~antdt.sharding.ShardLedger`, :class:`~antdt.monitor.Monitor`
and :class:`~antdt.controller.Controller` on a virtual clock, with thousands of simulated workers.

Worker-speed model (:class:`Mix`)
---------------------------------
Every worker trains at a nominal ``rate`` (rows/s, scaled by a small per-worker jitter) except:

* **transient** slowdowns: episodes arriving as a Poisson process per worker, each slowing it
  by a factor drawn from ``transient_factor`` for a time drawn from ``transient_s``;
* **persistent** stragglers: a fraction of the workers is ``persistent_factor`` times slower
  throughout;
* **hangs**: a fraction of the workers stops training at a uniform time in the nominal run for
  a time drawn from ``hang_s``, then carries on (the process is alive: no one removes it);
* **deaths**: a fraction of the workers dies at a uniform time; the scheduler removes it at once
  (its leases go back to the queue, as :meth:`ShardingService.remove_worker` does) and its nanny
  brings it back, empty-handed, ``restart_s`` later.

Each worker's speed is a step function of time (its *profile*), drawn once from the seed, so the
three strategies below face exactly the same cluster.

Strategies
----------
* ``static``: each worker gets a fixed 1/N of the shards up front (round-robin) and trains them
  at its own speed; the job ends when the last worker does. It is given the benefit of the doubt:
  a dead worker resumes its shards exactly where it stopped (no work lost, no ledger involved).
* ``pull``: dynamic leasing through the ledger, controller off.
* ``antdt``: dynamic leasing, monitor and controller on (policies from dask config).

In ``pull`` and ``antdt`` a worker behaves like :class:`~antdt.sharding.client.ShardClient`: it
leases with a claim of ``claim-intervals`` intervals of training at its measured rate, commits
at the first batch end after each ``commit-interval`` (or when its claim is used up), rides the
final commit of a lease on the next lease call, and obeys ``Revoked``. Rows are committed as
synced at once (local mode). A waiting worker (``Wait``) is woken when rows are queued again.
The simulation is event-driven: a queue of (time, worker) events, so its cost grows with the
number of commits, not with workers x time.

Efficiency
----------
``ideal_s`` is the makespan of a clairvoyant scheduler with no overhead that can divide rows
arbitrarily: the least ``T`` with ``sum over workers of the rows its profile can train in
[0, T] >= total rows``, i.e. total rows / the sum of the workers' mean rates over ``[0, T]``
(their effective rates, hangs, deaths and slowdowns included). A strategy's efficiency is
``ideal_s / makespan``, at most 1. Retiring a worker (``antdt``) gives up its later capacity,
which ``ideal_s`` still counts: retirement is charged, not free.

Accounting
----------
For ``pull`` and ``antdt`` every commit adds its rows to a per-shard tally kept by the simulator
(independently of the ledger). At the end every shard's tally must equal its rows, the ledger
must report every row done, none lost, ``rows_trained == rows_done + rows_retrained``, and
:meth:`ShardLedger.check_invariants` must pass; :class:`AccountingError` is raised otherwise.
"""

from __future__ import annotations

import gc
import heapq
import math
import multiprocessing
import time
from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any, Literal, TypeAlias

import numpy as np

from antdt import config
from antdt.controller import Controller, ControllerPolicy
from antdt.errors import AntdtError, ConfigError
from antdt.monitor import Monitor
from antdt.sharding import (Claim, CommitEvent, Finished, Lease, Revoked, RowGroup, ShardLedger,
                            Wait)


Strategy = Literal["static", "pull", "antdt"]
STRATEGIES: tuple[Strategy, ...] = ("static", "pull", "antdt")
"""Every strategy, cheapest to simulate first."""
SHARDS_PER_GROUP = 10
GROUPS_PER_FILE = 100


class AccountingError(AntdtError):
    """Rows were lost or trained twice beyond what the ledger reports."""


@dataclass(frozen=True)
class Mix:
    """The worker-speed model (see the module docstring); times in virtual seconds."""

    transient_per_hour: float = 18.0
    transient_factor: tuple[float, float] = (2.0, 5.0)
    transient_s: tuple[float, float] = (5.0, 20.0)
    persistent_fraction: float = 0.02
    persistent_factor: float = 3.0
    hang_fraction: float = 0.005
    hang_s: tuple[float, float] = (60.0, 600.0)
    death_fraction: float = 0.002
    restart_s: float = 30.0
    jitter: float = 0.05

    def __post_init__(self) -> None:
        fractions = (self.persistent_fraction, self.hang_fraction, self.death_fraction)
        if not all(0 <= f <= 1 for f in fractions) or self.transient_per_hour < 0 \
                or min(self.transient_factor) < 1 or self.persistent_factor < 1 \
                or not 0 <= self.jitter < 1 or self.restart_s < 0 \
                or min(*self.transient_s, *self.hang_s) < 0:
            raise ConfigError(f"mix out of range (fractions in [0, 1], factors >= 1, "
                              f"durations >= 0, jitter in [0, 1)), found {self}")


MIXES: dict[str, Mix] = {
    "default": Mix(),
    "none": Mix(transient_per_hour=0.0, persistent_fraction=0.0, hang_fraction=0.0,
                death_fraction=0.0, jitter=0.0),
    "stragglers": Mix(persistent_fraction=0.1, hang_fraction=0.0, death_fraction=0.0),
}
"""Named mixes for ``--mix``."""


@dataclass(frozen=True)
class Scenario:
    """A simulated job: ``shards`` shards of ``shard_rows`` rows on ``workers`` workers training
    ``rate`` rows/s nominally. ``commit_s``, ``claim_intervals``, ``tick_s`` and ``guided_end``
    default to the dask config (``antdt.sharding.commit-interval``, ``claim-intervals``,
    ``antdt.controller.interval``, ``antdt.sharding.guided-end``)."""

    workers: int
    shards: int
    shard_rows: int = 1000
    batch_rows: int = 50
    rate: float = 1000.0
    mix: Mix = field(default_factory=Mix)
    seed: int = 0
    commit_s: float | None = None
    claim_intervals: float | None = None
    tick_s: float | None = None
    guided_end: bool | None = None

    def __post_init__(self) -> None:
        if self.workers < 1 or self.shards < 1 or self.shard_rows < 1 or self.batch_rows < 1 \
                or self.rate <= 0:
            raise ConfigError(f"scenario needs workers, shards, shard_rows, batch_rows >= 1 and "
                              f"rate > 0, found {self}")

    def resolved(self) -> Scenario:
        """This scenario with the config-driven intervals filled in."""
        return replace(
            self,
            commit_s=config.seconds("antdt.sharding.commit-interval")
            if self.commit_s is None else self.commit_s,
            claim_intervals=config.number("antdt.sharding.claim-intervals", low=0.0)
            if self.claim_intervals is None else self.claim_intervals,
            tick_s=config.seconds("antdt.controller.interval")
            if self.tick_s is None else self.tick_s,
            guided_end=config.flag("antdt.sharding.guided-end")
            if self.guided_end is None else self.guided_end)

    @property
    def total_rows(self) -> int:
        return self.shards * self.shard_rows

    def row_groups(self) -> list[RowGroup]:
        """``SHARDS_PER_GROUP`` shards per row group, ``GROUPS_PER_FILE`` groups per file."""
        groups = -(-self.shards // SHARDS_PER_GROUP)
        last = self.shards - (groups - 1) * SHARDS_PER_GROUP
        return [(f"sim/part-{g // GROUPS_PER_FILE:05d}.parquet", g % GROUPS_PER_FILE,
                 (SHARDS_PER_GROUP if g < groups - 1 else last) * self.shard_rows)
                for g in range(groups)]


class Profile:
    """A worker's speed as a step function: ``rates[i]`` rows/s from ``times[i]`` on;
    ``cum[i]`` is the work (rows) done by ``times[i]``. The last step lasts for ever."""

    __slots__ = ("times", "rates", "cum", "deaths")

    def __init__(self, times: list[float], rates: list[float], deaths: list[float]) -> None:
        self.times = times
        self.rates = rates
        self.deaths = deaths
        cum = [0.0]
        for i in range(1, len(times)):
            cum.append(cum[-1] + rates[i - 1] * (times[i] - times[i - 1]))
        self.cum = cum

    def work(self, t: float) -> float:
        """Rows the worker can train in ``[0, t]``."""
        i = bisect_right(self.times, t) - 1
        return self.cum[i] + self.rates[i] * (t - self.times[i])

    def time_at(self, work: float) -> float:
        """The first time by which the worker has trained ``work`` rows (inf: never)."""
        i = bisect_right(self.cum, work) - 1
        if self.rates[i] == 0:
            return math.inf
        return self.times[i] + (work - self.cum[i]) / self.rates[i]


def profiles(scenario: Scenario) -> list[Profile]:
    """Every worker's speed profile, drawn from ``scenario.seed`` (see :class:`Mix`)."""
    mix = scenario.mix
    rng = np.random.default_rng(scenario.seed)
    n = scenario.workers
    nominal_s = scenario.total_rows / (n * scenario.rate)
    horizon = 3 * nominal_s + max(mix.hang_s) + mix.restart_s
    base = scenario.rate * rng.uniform(1 - mix.jitter, 1 + mix.jitter, n)
    base[rng.random(n) < mix.persistent_fraction] /= mix.persistent_factor
    hung = rng.random(n) < mix.hang_fraction
    dead = rng.random(n) < mix.death_fraction
    episodes = rng.poisson(mix.transient_per_hour * horizon / 3600, n)
    result = []
    for w in range(n):
        spans: list[tuple[float, float, float]] = []  # (start, stop, speed factor: 0 = stopped)
        for _ in range(int(episodes[w])):
            start = float(rng.uniform(0, horizon))
            spans.append((start, start + float(rng.uniform(*mix.transient_s)),
                          1 / float(rng.uniform(*mix.transient_factor))))
        if hung[w]:
            start = float(rng.uniform(0, nominal_s))
            spans.append((start, start + float(rng.uniform(*mix.hang_s)), 0.0))
        deaths = []
        if dead[w]:
            start = float(rng.uniform(0, nominal_s))
            deaths.append(start)
            spans.append((start, start + mix.restart_s, 0.0))
        cuts = sorted({0.0, *(s for s, _, _ in spans), *(e for _, e, _ in spans)})
        rates = [float(base[w]) * min([f for s, e, f in spans if s <= t < e], default=1.0)
                 for t in cuts]
        result.append(Profile(cuts, rates, deaths))
    return result


def ideal_seconds(total_rows: int, workers: Sequence[Profile]) -> float:
    """The least ``T`` at which all workers together could have trained ``total_rows``."""
    changes: dict[float, float] = {}
    for profile in workers:
        previous = 0.0
        for t, rate in zip(profile.times, profile.rates):
            changes[t] = changes.get(t, 0.0) + rate - previous
            previous = rate
    now, rate, done = 0.0, 0.0, 0.0
    for t in sorted(changes):
        if rate > 0 and done + rate * (t - now) >= total_rows:
            break
        done += rate * (t - now)
        now, rate = t, rate + changes[t]
    return now + (total_rows - done) / rate


def static_makespan(scenario: Scenario, workers: Sequence[Profile]) -> float:
    """Shard ``s`` goes to worker ``s mod N``; each trains its share at its own speed."""
    n = scenario.workers
    return max(profile.time_at(((scenario.shards - w + n - 1) // n) * scenario.shard_rows)
               for w, profile in enumerate(workers))


# ---- dynamic leasing --------------------------------------------------------------------------


class _Worker:
    """A simulated worker: its speed profile and what its ShardClient knows. A worker that
    leaves the cluster is ``gone`` (its pending events are void); its restart is a new
    ``_Worker`` of the next ``generation``.

    It keeps the step of its profile in force at its latest RPC (``_since`` to ``_until``, at
    ``_speed``, ``_done`` to ``_done_until`` rows of work): steps last many RPCs, so most
    look-ups need no search. They return exactly what the :class:`Profile` methods return."""

    __slots__ = ("index", "generation", "name", "profile", "lease", "shard", "offset", "claim",
                 "base", "last_rpc", "rate", "gone", "_since", "_until", "_speed", "_done",
                 "_done_until")

    def __init__(self, index: int, generation: int, profile: Profile, now: float) -> None:
        self.index = index
        self.generation = generation
        self.name = f"w{index}.{generation}" if generation else f"w{index}"
        self.profile = profile
        self.lease: Lease | None = None
        self.shard = 0
        """The lease's shard (its index in the simulator's tally)."""
        self.offset = 0
        """The lease's committed offset."""
        self.claim = 0
        """The end of the lease's claim."""
        self.base = 0.0
        """The profile's work (rows) accounted for by commits and leases so far."""
        self.last_rpc = now
        self.rate = 0.0
        """Rows/s measured between RPCs, as the ShardClient does (0: none yet)."""
        self.gone = False
        self._step(now)

    def _step(self, t: float) -> None:
        """Keep the step in force at ``t``."""
        profile = self.profile
        i = bisect_right(profile.times, t) - 1
        last = i + 1 == len(profile.times)
        self._since, self._speed, self._done = profile.times[i], profile.rates[i], profile.cum[i]
        self._until = math.inf if last else profile.times[i + 1]
        self._done_until = math.inf if last else profile.cum[i + 1]

    def move(self, t: float) -> float:
        """Move to ``t`` (no earlier than the last move); returns ``profile.work(t)``."""
        if not t < self._until:
            self._step(t)
        return self._done + self._speed * (t - self._since)

    def work(self, t: float) -> float:
        """``profile.work(t)``."""
        if self._since <= t < self._until:
            return self._done + self._speed * (t - self._since)
        return self.profile.work(t)

    def time_at(self, work: float) -> float:
        """``profile.time_at(work)``."""
        if self._done <= work < self._done_until and self._speed > 0:
            return self._since + (work - self._done) / self._speed
        return self.profile.time_at(work)


_Event: TypeAlias = _Worker | Callable[[], None]
"""A worker (its next RPC is due) or a cluster event (death, restart, controller tick)."""


class _Events:
    """The event queue: events by virtual time, those due at the same time in the order they
    were put. A heap of the distinct due times plus a list of events per time: a heap step
    compares two floats rather than two tuples, and an event costs no tuple."""

    def __init__(self) -> None:
        self._times: list[float] = []
        self._due: dict[float, list[_Event]] = {}

    def __bool__(self) -> bool:
        return bool(self._times)

    def put(self, t: float, event: _Event) -> None:
        due = self._due.get(t)
        if due is None:
            self._due[t] = [event]
            heapq.heappush(self._times, t)
        else:
            due.append(event)

    def pop(self) -> tuple[float, list[_Event]]:
        """The earliest due time and its events; events put for that time from now on come
        out of a later call."""
        t = heapq.heappop(self._times)
        return t, self._due.pop(t)


class _Dynamic:
    """One ``pull`` or ``antdt`` run (see the module docstring); :meth:`run` returns its
    figures."""

    def __init__(self, scenario: Scenario, workers: Sequence[Profile], controlled: bool,
                 policies: Sequence[ControllerPolicy] | None) -> None:
        self.s = scenario
        self.now = 0.0
        row_groups = scenario.row_groups()
        self.ledger = ShardLedger(row_groups, shard_rows=scenario.shard_rows,
                                  batch_rows=scenario.batch_rows, clock=self.clock,
                                  max_claim_rows=scenario.shard_rows, job="sim",
                                  seed=scenario.seed, guided_end=bool(scenario.guided_end))
        self.first_group = {path: g for g, (path, number, _) in enumerate(row_groups)
                            if number == 0}
        self.workers = [_Worker(i, 0, profile, 0.0) for i, profile in enumerate(workers)]
        """The workers as they start."""
        self.by_name = {worker.name: worker for worker in self.workers}
        self.alive = set(self.by_name)
        self.waiting: list[_Worker] = []
        self.events = _Events()
        self.tally = array("q", [0]) * scenario.shards
        self.total_rows = scenario.total_rows
        self.shard_rows = scenario.shard_rows
        self.batch = scenario.batch_rows
        assert scenario.commit_s is not None and scenario.claim_intervals is not None
        self.commit_s = scenario.commit_s
        self.claim_s = scenario.commit_s * scenario.claim_intervals
        self.tick_s = scenario.tick_s or 1.0
        self.ops = 0
        self.rpcs = 0
        self.finished_at: float | None = None
        self.control_s = 0.0
        self.controller: Controller | None = None
        self.monitor: Monitor | None = None
        if controlled:
            self.monitor = Monitor(self.clock, batch_rows=scenario.batch_rows)
            self.ledger.subscribe(self._observe)
            self.controller = Controller(self.ledger, self.monitor, clock=self.clock,
                                         retire=self._retire, workers=lambda: self.alive,
                                         policies=policies)

    def clock(self) -> float:
        return self.now

    def run(self) -> dict[str, Any]:
        for worker in self.workers:
            self.events.put(0.0, worker)
            for t in worker.profile.deaths:
                self.events.put(t, partial(self._die, worker))
        if self.controller is not None:
            self.events.put(self.tick_s, self._tick)
        collecting = gc.isenabled()
        # The loop leaves no cyclic garbage, but it keeps a few live objects per worker (its
        # lease, the ledger's state of it, its next event) that every collection would traverse
        # again and again: with 10,000 workers collections took ~9% of an antdt run.
        gc.disable()
        try:
            self._loop()
        finally:
            if collecting:
                gc.enable()
        if self.finished_at is None:
            raise AccountingError(f"the simulated job never finished: {self.ledger.summary()}")
        self._check()
        actions = dict(self.controller.counts) if self.controller is not None else {}
        return {"makespan_s": self.finished_at, "ops": self.ops, "rpcs": self.rpcs,
                "control_s": self.control_s, "actions": actions,
                **{k: v for k, v in self.ledger.summary().items() if k.startswith("rows_")}}

    def _loop(self) -> None:
        """Carry out the events in time order until the job is done or nothing is left."""
        events = self.events
        work = self._work
        while events:
            t, due = events.pop()
            self.now = t
            for event in due:
                if isinstance(event, _Worker):
                    if not event.gone:
                        work(event, t)
                else:
                    event()
                if self.finished_at is not None:
                    return

    # ---- worker behaviour ---------------------------------------------------------------------

    def _work(self, worker: _Worker, t: float) -> None:
        """The worker's RPC at ``t``: a commit of what it trained since the last one (the final
        commit of a lease rides on the next lease call), or a lease call. Like the ShardClient
        it asks for a claim at the rate measured before this RPC, then measures the rate over
        the rows this RPC commits."""
        rate = worker.rate
        claim_rows = max(1, int(rate * self.claim_s)) if rate > 0 else None
        self.rpcs += 1
        elapsed = t - worker.last_rpc
        worker.last_rpc = t
        done = worker.move(t)
        lease = worker.lease
        if lease is None:
            self._lease(worker, t, claim_rows, done)
            return
        batch = self.batch
        offset = worker.offset
        base = worker.base
        rows = min(int((done - base + 1e-6) // batch) * batch, worker.claim - offset)
        end = offset + rows
        self.ops += 1
        ledger = self.ledger
        reply = ledger.commit(lease.lease_id, lease.token, end, end, None, claim_rows)
        if elapsed > 0 and rows:
            measured = rows / elapsed
            worker.rate = measured if rate <= 0 else 0.5 * (rate + measured)
        base += rows
        worker.base = base
        worker.offset = end
        self.tally[worker.shard] += rows
        if ledger.rows_done == self.total_rows:
            self.finished_at = t
            return
        if isinstance(reply, Claim):
            worker.claim = reply.stop
        elif isinstance(reply, Revoked) and end < reply.stop:
            worker.claim = reply.stop
        elif isinstance(reply, (Finished, Revoked)):
            worker.lease = None
            self._lease(worker, t, claim_rows, done)
            return
        else:
            self.alive.discard(worker.name)
            return
        self._schedule(worker, t, base)

    def _lease(self, worker: _Worker, t: float, claim_rows: int | None, done: float) -> None:
        """Lease at ``t``, when the worker's profile has done ``done`` rows of work."""
        self.ops += 1
        reply = self.ledger.lease(worker.name, claim_rows)
        if isinstance(reply, Lease):
            worker.lease = reply
            worker.offset = reply.start
            worker.claim = reply.claim_stop
            worker.shard = (self.first_group[reply.path] + reply.row_group) * SHARDS_PER_GROUP \
                + reply.start // self.shard_rows
            worker.base = done
            self._schedule(worker, t, done)
        elif isinstance(reply, Wait):
            self.waiting.append(worker)
        else:
            self.alive.discard(worker.name)

    def _schedule(self, worker: _Worker, t: float, base: float) -> None:
        """Its next commit after the RPC at ``t``, ``base`` rows of work accounted for: when
        the claim is used up, or at the first batch end after the commit interval."""
        batch = self.batch
        due = worker.work(t + self.commit_s) - base
        at = worker.time_at(base + min(max(1, math.ceil(due / batch - 1e-9)) * batch,
                                       worker.claim - worker.offset))
        if at < math.inf:
            self.events.put(max(at, t), worker)

    def _wake(self) -> None:
        """Rows were queued again: every waiting worker asks for a lease (as the service wakes
        its waiting lease calls)."""
        waiting, self.waiting = self.waiting, []
        for worker in waiting:
            if not worker.gone:
                self.events.put(self.now, worker)

    # ---- cluster events -----------------------------------------------------------------------

    def _leave(self, worker: _Worker) -> None:
        worker.gone = True
        self.alive.discard(worker.name)
        if self.monitor is not None:
            self.monitor.forget(worker.name)
        if self.ledger.remove_worker(worker.name):
            self._wake()

    def _die(self, worker: _Worker) -> None:
        if worker.name not in self.alive:
            return
        self._leave(worker)
        self.events.put(self.now + self.s.mix.restart_s, partial(self._restart, worker))

    def _restart(self, dead: _Worker) -> None:
        worker = _Worker(dead.index, dead.generation + 1, dead.profile, self.now)
        self.by_name[worker.name] = worker
        self.alive.add(worker.name)
        self.events.put(self.now, worker)

    def _retire(self, worker: str, stimulus_id: str) -> None:
        self._leave(self.by_name[worker])

    def _observe(self, event: CommitEvent) -> None:
        assert self.monitor is not None
        start = time.perf_counter()
        self.monitor.observe(event)
        self.control_s += time.perf_counter() - start

    def _tick(self) -> None:
        assert self.controller is not None
        start = time.perf_counter()
        applied = self.controller.tick()
        self.control_s += time.perf_counter() - start
        if any(record["rows"] for record in applied):
            self._wake()
        self.events.put(self.now + self.tick_s, self._tick)

    def _check(self) -> None:
        ledger = self.ledger
        ledger.check_invariants()
        tally = np.asarray(self.tally, dtype=np.int64)
        wrong = np.flatnonzero(tally != self.s.shard_rows)
        if len(wrong) or ledger.rows_done != self.s.total_rows or ledger.rows_lost \
                or ledger.rows_trained != ledger.rows_done + ledger.rows_retrained:
            raise AccountingError(
                f"rows lost or trained twice: {len(wrong)} shards off (first {wrong[:5]} "
                f"tallied {tally[wrong[:5]]}), ledger {ledger.summary()}")


def run_strategy(scenario: Scenario, strategy: Strategy,
                 policies: Sequence[ControllerPolicy] | None = None) -> dict[str, Any]:
    """One strategy on ``scenario`` (intervals resolved); ``makespan_s`` plus, for ``pull``
    and ``antdt``, the ledger's counters, ``ops`` (ledger calls), ``rpcs``, ``control_s``
    (seconds spent in the monitor and the controller) and ``actions`` (applied, per kind)."""
    workers = profiles(scenario)
    if strategy == "static":
        return {"makespan_s": static_makespan(scenario, workers)}
    return _Dynamic(scenario, workers, strategy == "antdt", policies).run()


def simulate(scenario: Scenario, strategies: Sequence[Strategy] = STRATEGIES,
             policies: Sequence[ControllerPolicy] | None = None,
             processes: int = 1) -> dict[str, Any]:
    """Run ``scenario`` with each strategy (in up to ``processes`` forked processes: the runs
    are independent); returns ``efficiency`` per strategy, ``control_us_per_op`` (monitor and
    controller time per ledger call, antdt run), ``rpc_per_worker_per_s`` (antdt run),
    ``sim_wall_s`` and the details."""
    started = time.perf_counter()
    scenario = scenario.resolved()
    ideal = ideal_seconds(scenario.total_rows, profiles(scenario))
    if processes > 1 and len(strategies) > 1:
        context = multiprocessing.get_context("fork")
        # costliest first (STRATEGIES is in increasing cost): no long run waits for a short one
        order = sorted(strategies, key=STRATEGIES.index, reverse=True)
        with ProcessPoolExecutor(min(processes, len(strategies)), mp_context=context) as pool:
            futures = {strategy: pool.submit(run_strategy, scenario, strategy, policies)
                       for strategy in order}
            runs = {strategy: futures[strategy].result() for strategy in strategies}
    else:
        runs = {strategy: run_strategy(scenario, strategy, policies) for strategy in strategies}
    makespan = {strategy: run.pop("makespan_s") for strategy, run in runs.items()}
    result: dict[str, Any] = {
        "workers": scenario.workers, "shards": scenario.shards, "seed": scenario.seed,
        "ideal_s": ideal, "makespan_s": makespan,
        "efficiency": {k: ideal / v for k, v in makespan.items()},
    }
    controlled = runs.get("antdt")
    if controlled is not None:
        result["control_us_per_op"] = 1e6 * controlled["control_s"] / controlled["ops"]
        result["rpc_per_worker_per_s"] = controlled["rpcs"] / (scenario.workers
                                                               * makespan["antdt"])
    result["runs"] = {k: v for k, v in runs.items() if v}
    result["scenario"] = {k: v for k, v in asdict(scenario).items() if k != "mix"}
    result["mix"] = asdict(scenario.mix)
    result["sim_wall_s"] = time.perf_counter() - started
    return result
