"""Controller policies: each looks at one :class:`Tick` and yields typed actions; the controller
(:mod:`antdt.controller.mechanism`) resolves conflicts and applies what it accepts. Adding a
policy touches this file only (or none: a user policy is named by dotted path in dask config,
see :func:`load_policies`)."""

from __future__ import annotations

import abc
import importlib
import math
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from antdt import config
from antdt.controller.actions import (Action, AdjustBatch, Evidence, Pace, Reassign, Retire,
                                      Revoke, Split)
from antdt.errors import ConfigError
from antdt.monitor import Health, Monitor, Sample, WorkerState
from antdt.sharding import LeaseStatus, ShardLedger, shares


class Tick:
    """The state one tick's policies see: ``ledger``, ``monitor`` (updated for this tick),
    ``flagged`` (verdicts other than ok, worst first), ``workers`` (the job's own workers, those
    that count toward ``min_workers``: other jobs' workers are not its capacity) and the live
    leases (read once per tick, lazily)."""

    def __init__(self, number: int, now: float, ledger: ShardLedger, monitor: Monitor,
                 workers: Collection[str], batch_sizes: dict[str, int]) -> None:
        self.number = number
        self.now = now
        self.ledger = ledger
        self.monitor = monitor
        self.workers = workers
        self.batch_sizes = batch_sizes
        self.flagged = monitor.flagged()
        self._leases: list[LeaseStatus] | None = None
        self._capacity: float | None = None
        self._leased_left: int | None = None

    @property
    def tail(self) -> bool:
        """Nothing is left to lease but rows are still leased: idle workers wait for the last
        leases to finish."""
        return self.ledger.rows_todo == 0 and self.ledger.rows_leased > 0

    def leases(self, worker: str | None = None) -> list[LeaseStatus]:
        """Live leases, of ``worker`` only if given."""
        if worker is not None:
            return self.ledger.leases(worker)
        if self._leases is None:
            self._leases = self.ledger.leases()
        return self._leases

    def rate(self, worker: str) -> float | None:
        """The worker's rows/s, the cluster median for a worker with no evidence yet."""
        rate = self.monitor.rate(worker)
        return rate if rate is not None else self.monitor.median_rate

    def capacity(self, without: str | None = None) -> float:
        """The workers' summed rows/s (:meth:`rate`), ``without`` one of them if given (the
        sum is taken once per tick)."""
        if self._capacity is None:
            self._capacity = sum(rate for w in self.workers if (rate := self.rate(w)) is not None)
        rate = self.rate(without) if without is not None and without in self.workers else None
        return self._capacity - rate if rate is not None else self._capacity

    def leased_left(self) -> int:
        """Rows of the live leases not trained yet (taken once per tick)."""
        if self._leased_left is None:
            self._leased_left = sum(lease.stop - lease.offset for lease in self.leases())
        return self._leased_left


class ControllerPolicy(abc.ABC):
    """A policy: :meth:`run` looks at a :class:`Tick` and yields actions. It must not change
    the ledger itself; the controller resolves conflicts and applies what it accepts."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    @abc.abstractmethod
    def run(self, tick: Tick) -> Iterator[Action]:
        """Yield the actions this policy wants now (possibly none)."""


class RevokeHung(ControllerPolicy):
    """Revoke every lease of a hung or partitioned worker: its unclaimed rows go to other
    workers now; its claim stays (exactly-once) until it commits or leaves."""

    def run(self, tick: Tick) -> Iterator[Action]:
        for health in tick.flagged:
            if health.state is WorkerState.HUNG:
                reason = (f"hung: no commit for {health.silent_s:.1f}s, timeout "
                          f"{health.timeout_s:.1f}s")
            elif health.state is WorkerState.PARTITIONED:
                reason = f"partitioned: {health.reason}"
            else:
                continue
            for lease in tick.leases(health.worker):
                if not lease.revoked and lease.unclaimed > 0:
                    yield Revoke(lease, Evidence.of(health, reason))



WAITING = 0.5
"""A straggler whose training thread is off the CPU for at least this share of its batch time
is said to wait (for its rows, on its link, or for a core), not to compute slowly."""


def waiting(health: Health) -> str:
    """What a straggler's reason says of its time off the CPU ("" when it mostly computes)."""
    if health.waiting is None or health.waiting < WAITING:
        return ""
    return (f" ({100 * health.waiting:.0f}% of its batch time off the CPU: waiting for its "
            "rows, on its link or for a core, not computing)")

@dataclass(repr=False)
class RetireHung(ControllerPolicy):
    """Retire a worker hung for ``after_s`` seconds, or hung as the job's end nears: only its
    leaving frees its claimed rows and the rows it trained but did not sync (trained again by
    the others). Near the end means that the others would finish every other row within
    ``lead_s`` seconds plus the time those held rows take them; waiting for the tail instead
    would leave every other worker idle while it is retired and its rows trained last.

    A partitioned worker (it reaches no sync peer, see :meth:`~antdt.monitor.Monitor.partitioned`)
    is retired at once: none of its rows can be synced while it stays, and its training waits at
    its staleness bound."""

    after_s: float = 30.0
    lead_s: float = 2.0

    def run(self, tick: Tick) -> Iterator[Action]:
        for health in tick.flagged:
            if health.state is WorkerState.PARTITIONED:
                yield Retire(health.worker, Evidence.of(health, f"partitioned: {health.reason}"))
                continue
            if health.state is not WorkerState.HUNG:
                continue
            if health.silent_s >= self.after_s:
                when = f"for more than {self.after_s:g}s"
            elif tick.tail:
                when = "in the tail"
            else:
                ending = self._ending(tick, health.worker)
                if ending is None:
                    continue
                when = ending
            yield Retire(health.worker, Evidence.of(health, (
                f"hung {when}: no commit for {health.silent_s:.1f}s")))

    def _ending(self, tick: Tick, worker: str) -> str | None:
        """Why ``worker``'s held rows are needed soon (None: they are not yet)."""
        capacity = tick.capacity(without=worker)
        if capacity <= 0:
            return None
        held = sum(lease.claim_stop - lease.synced for lease in tick.leases(worker))
        rest = tick.ledger.rows_todo + tick.leased_left() - sum(
            lease.stop - lease.offset for lease in tick.leases(worker))
        left_s, held_s = rest / capacity, held / capacity
        if left_s > held_s + self.lead_s:
            return None
        return (f"near the end (the others finish the rest in {left_s:.1f}s, its {held} held "
                f"rows in {held_s:.1f}s)")


@dataclass(repr=False)
class ReassignStragglers(ControllerPolicy):
    """Reassign the unclaimed rows of a transient or persistent straggler's leases (at least
    ``min_batches`` batches) to the queue front: a faster worker pulls them at once, the
    straggler finishes its claim and leases again."""

    min_batches: int = 1

    def run(self, tick: Tick) -> Iterator[Action]:
        least = self.min_batches * tick.ledger.batch_rows
        for health in tick.flagged:
            if health.state not in (WorkerState.TRANSIENT, WorkerState.PERSISTENT):
                continue
            for lease in tick.leases(health.worker):
                if not lease.revoked and lease.unclaimed >= least:
                    yield Reassign(lease, Evidence.of(health, (
                        f"{health.state.value} straggler: BPT {health.bpt:.3g}s vs median "
                        f"{health.median:.3g}s{waiting(health)}")))


@dataclass(repr=False)
class PaceStragglers(ControllerPolicy):
    """As the job's rows run out, size a straggler's leases to its pace: at most what it trains
    in ``fraction`` of the time the whole cluster needs for the rows left, in whole batches
    rounded down to a power of two (so a pace changes a few times a job, not every tick), and no
    lease at all once that is less than a batch. The others take the rest; the straggler's last
    claim ends before theirs instead of holding the job's end.

    The time left is ``(rows to do + rows leased) / the workers' summed rates``. A pace is set only
    while a worker that is not a straggler takes the rows, and lifted when the worker recovers
    (or when nobody else is left)."""

    fraction: float = 0.5

    def run(self, tick: Tick) -> Iterator[Action]:
        ledger = tick.ledger
        wanted: dict[str, tuple[int, Evidence]] = {}
        slow = {h.worker: h for h in tick.flagged
                if h.state in (WorkerState.TRANSIENT, WorkerState.PERSISTENT)}
        rates = {w: rate for w in tick.workers if (rate := tick.rate(w)) is not None}
        capacity = sum(rates.values())
        if slow and capacity > 0 and any(w not in slow for w in rates):
            left_s = (ledger.rows_todo + ledger.rows_leased) / capacity
            largest = max(ledger.shard_rows, ledger.max_claim_rows)
            for worker, health in slow.items():
                rate = rates.get(worker)
                if rate is None:
                    continue
                batches = int(self.fraction * rate * left_s) // ledger.batch_rows
                rows = ledger.batch_rows * (1 << (batches.bit_length() - 1)) if batches else 0
                if rows < largest:
                    wanted[worker] = rows, Evidence.of(health, (
                        f"{health.state.value} straggler at {rate:.4g} rows/s{waiting(health)}, "
                        f"the job's rows last {left_s:.1f}s: leases of at most {rows} rows"))
        paces = ledger.paces
        for worker, (rows, evidence) in wanted.items():
            if paces.get(worker) != rows:
                yield Pace(worker, rows, evidence)
        for worker in paces.keys() - wanted.keys():
            verdict = tick.monitor.health(worker)
            state = "gone" if verdict is None else verdict.state.value
            yield Pace(worker, None, Evidence.of(verdict, f"pace lifted: the worker is {state}"))


@dataclass(repr=False)
class SplitTail(ControllerPolicy):
    """In the tail of the job, split every lease that would finish late so the last leases end
    together.

    The cluster would finish the leased rows in ``target = max(min_piece_s, rows left / sum of
    the workers' rates)`` seconds if they could be shared perfectly; a lease whose holder needs
    ``t > slack x target`` for its rows left is split into ``ceil(t / target)`` parts (at most
    ``max_parts``; the ledger keeps the holder's claim and whole batches)."""

    max_parts: int = 8
    min_piece_s: float = 2.0
    slack: float = 1.5

    def run(self, tick: Tick) -> Iterator[Action]:
        if not tick.tail or tick.monitor.median_rate is None:
            return
        leases = tick.leases()
        capacity = tick.capacity()
        left = sum(lease.stop - lease.offset for lease in leases)
        if capacity <= 0 or left <= 0:
            return
        target = max(self.min_piece_s, left / capacity)
        least = 2 * tick.ledger.batch_rows
        for lease in leases:
            if lease.revoked or lease.unclaimed < least:
                continue
            rate = tick.rate(lease.worker)
            assert rate is not None  # the median exists
            needs = (lease.stop - lease.offset) / rate
            if needs > self.slack * target:
                parts = min(self.max_parts, math.ceil(needs / target))
                yield Split(lease, parts, Evidence.of(tick.monitor.health(lease.worker), (
                    f"tail: {needs:.1f}s left at {rate:.4g} rows/s, target {target:.1f}s")))


@dataclass(repr=False)
class RetirePersistent(ControllerPolicy):
    """Retire persistent stragglers, slowest first, at most ``max_fraction`` of the workers per
    tick; the cluster manager (or an adaptive deployment) brings fresh workers."""

    max_fraction: float = 0.05

    def run(self, tick: Tick) -> Iterator[Action]:
        budget = max(1, int(self.max_fraction * len(tick.workers)))
        for health in tick.flagged:
            if budget == 0:
                return
            if health.state is WorkerState.PERSISTENT:
                budget -= 1
                yield Retire(health.worker, Evidence.of(health, (
                    f"persistent straggler: slow for {health.streak} windows, BPT "
                    f"{health.bpt:.3g}s vs median {health.median:.3g}s{waiting(health)}")))


class StepTime(NamedTuple):
    """A worker's step time as a function of its local batch: ``fixed + per_row x rows``
    seconds of its own time."""

    fixed: float
    per_row: float

    def rows(self, seconds: float) -> float:
        """The local batch whose step takes ``seconds`` (0 when even an empty step takes
        longer)."""
        return max(0.0, (seconds - self.fixed) / self.per_row)


def balanced_sizes(steps: Sequence[StepTime], total: int) -> list[int]:
    """Local batches summing to ``total`` (each at least 1 row) whose steps take as long, as
    far as a worker's fixed part allows: a worker whose empty step already takes longer than
    the others' steps gets 1 row. Bisection on the common step time.

    >>> balanced_sizes([StepTime(0.0, 1.0), StepTime(0.0, 3.0)], 400)  # rates alone
    [300, 100]
    >>> balanced_sizes([StepTime(0.01, 1e-4), StepTime(0.06, 4e-4)], 600)
    [579, 21]
    """
    low, high = 0.0, max(step.fixed + step.per_row * total for step in steps)
    for _ in range(100):
        middle = (low + high) / 2
        if sum(step.rows(middle) for step in steps) < total:
            low = middle
        else:
            high = middle
    return shares([step.rows(high) for step in steps], total)


@dataclass(repr=False)
class BalanceBatch(ControllerPolicy):
    """Synchronous mode (AntDT-DD): per-worker local batches, summing to ``global_batch``
    exactly, whose steps take each worker as long (:func:`balanced_sizes`); a size changes only
    when it moves by more than ``tolerance`` (relative). Waits until every worker of the job
    has a sample of trained rows (:meth:`~antdt.monitor.Monitor.last_sample`).

    A worker's step time is not proportional to its local batch: its share of the global
    batch's embedding lookups, the step's collectives and the optimiser's dense update take as
    long whatever its batch. Sizes in proportion to the workers' rates (rows per second)
    therefore settle only slowly where that fixed part is large: a slow worker's rate falls
    with its batch, so each adjustment cut it by a fifth or so again (a benchmark job's slow
    rank went from 1,230 rows to 218 over 30 of its 45 steps). So each worker's step time is
    fitted, ``fixed + per_row x rows``, to its last ``points`` samples once their batches
    differ by a factor of ``spread`` (least squares), the last line kept while its batch stays
    put; a worker with no line yet, or whose line makes no sense (no positive slope or a
    negative fixed part), is taken as proportional to its batch, at its last sample's rate.

    The line is scaled to the last sample (so a change of speed counts at once): both parts by
    the ratio of the sample's step time to the line's at its batch. A rank's speed changes when
    its core is shared or freed (a busy process next to it, a noisy neighbour), and that slows
    or speeds everything the rank runs, the rows of its batch as much as its fixed part. Moving
    the level alone (the slope kept) priced the rows of a rank whose core became shared at its
    old speed: the balance moved too many rows off it (a rank twice as slow got 245 rows of
    600 instead of 300, its peer's step 11% longer), and back once its line was fitted again.

    What a contended rank costs its peers in the collectives (gloo's threads on its core run
    at its speed) is in no rank's own time, and the balance leaves it out: on 2 cores, one
    rank's shared with a busy loop (issue 57, a 2 x 4,096-row global batch), of the contended
    rank's local batches tried the one that equals the ranks' own times gave the shortest
    steps (2,366 rows: 103 ms a step; 1,500, 1,800, 2,900 and 3,500 rows: 114, 118, 109 and
    118 ms; equal batches 137 ms)."""

    global_batch: int
    tolerance: float = 0.1
    points: int = 4
    spread: float = 1.25
    _seen: dict[str, deque[Sample]] = field(default_factory=dict, init=False)
    _lines: dict[str, StepTime] = field(default_factory=dict, init=False)

    def run(self, tick: Tick) -> Iterator[Action]:
        workers = sorted(set(tick.workers) & set(tick.monitor.workers()))
        samples = [tick.monitor.last_sample(w) for w in workers]
        if not workers or self.global_batch < len(workers):
            return
        for gone in set(self._seen) - set(workers):  # left the job: a later worker of its
            del self._seen[gone]                     # address starts afresh
            self._lines.pop(gone, None)
        steps = []
        for worker, sample in zip(workers, samples):
            seen = self._seen.setdefault(worker, deque(maxlen=self.points))
            if sample is not None and sample.batch_rows > 0 and \
                    (not seen or seen[-1].window != sample.window):
                seen.append(sample)
            if not seen:
                return
            steps.append(self._step_time(worker, seen))
        even = self.global_batch / len(workers)
        sizes = balanced_sizes(steps, self.global_batch)
        for worker, step, size in zip(workers, steps, sizes):
            current = tick.batch_sizes.get(worker, even)
            if abs(size - current) > self.tolerance * current:
                health = tick.monitor.health(worker)
                yield AdjustBatch(worker, size, Evidence.of(health, (
                    f"step {step.fixed:.3g}s + {step.per_row * 1e3:.3g}s per 1000 rows"
                    f"{'' if health is None or size > current else waiting(health)}")))

    def _step_time(self, worker: str, seen: deque[Sample]) -> StepTime:
        """The worker's step time from its samples (the class docstring)."""
        rows = [sample.batch_rows for sample in seen]
        if max(rows) >= self.spread * min(rows):
            mean_rows = sum(rows) / len(rows)
            mean_bpt = sum(sample.bpt for sample in seen) / len(seen)
            slope = sum((r - mean_rows) * (sample.bpt - mean_bpt)
                        for r, sample in zip(rows, seen)) / \
                sum((r - mean_rows) ** 2 for r in rows)
            self._lines[worker] = StepTime(mean_bpt - slope * mean_rows, slope)
        last = seen[-1]
        line = self._lines.get(worker)
        if line is None or line.per_row <= 0 or line.fixed < 0:
            return StepTime(0.0, last.bpt / last.batch_rows)
        speed = last.bpt / (line.fixed + line.per_row * last.batch_rows)
        return StepTime(line.fixed * speed, line.per_row * speed)


def load_policies(specs: object = None) -> list[ControllerPolicy]:
    """Policies from ``[{class: dotted.path, **kwargs}, ...]`` (default: the dask config
    ``antdt.controller.policies``)."""
    if specs is None:
        specs = config.get("antdt.controller.policies")
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"antdt.controller.policies must be a list of {{class: dotted.path, "
                          f"...}}, found {specs!r}")
    policies = []
    for i, spec in enumerate(specs):
        if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
            raise ConfigError(f"antdt.controller.policies[{i}] must be a mapping with a 'class' "
                              f"dotted path, found {spec!r}")
        kwargs = dict(spec)
        path = kwargs.pop("class")
        module, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError, ValueError) as e:
            raise ConfigError(f"antdt.controller.policies[{i}]: cannot import {path!r}: {e}") \
                from e
        if not (isinstance(cls, type) and issubclass(cls, ControllerPolicy)):
            raise ConfigError(f"antdt.controller.policies[{i}]: {path!r} is not a "
                              f"ControllerPolicy subclass, found {cls!r}")
        try:
            policies.append(cls(**kwargs))
        except TypeError as e:
            raise ConfigError(f"antdt.controller.policies[{i}]: {path}({kwargs}) failed: {e}") \
                from e
    return policies
