"""The synchronous mode's step machinery on a rank (:mod:`antdt.agent.modes.synchronous` runs
the loop): the header every rank all-reduces before a step (:class:`Header`), the split of a
global batch over the ranks' offers (:func:`step_rows`), a rank's rows between its leases
(:class:`StepRows`), its batches read while the step before runs (:class:`ReadAhead`) and the
measure of a rank's own time (:func:`own_seconds`)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch

from antdt import config
from antdt.agent.faults import PAUSE_POLL_S
from antdt.agent.modes.mode import AgentParts
from antdt.monitor import BATCHES, BUSY, CPU
from antdt.sharding import Claim, CommitReply, Finished, Lease, Revoked, Stop, Wait

RETRY_S = 0.05
"""A rank told to wait for rows asks again after this long (it trains empty steps meanwhile);
when no rank has rows, the request waits this long server side."""


_SCHEDSTAT = "/proc/thread-self/schedstat"


def step_rows(sizes: Sequence[int], offered: Sequence[int]) -> list[int]:
    """Each rank's rows of one step: its local batch ``sizes[r]`` where it offers that many;
    the rows of the ranks that offer fewer are spread over the ranks that offer more, in
    proportion to their local batches (the faster ranks take more), each at most what it
    offers. The step trains ``min(sum(sizes), sum(offered))`` rows: the global batch until
    the rows run out. Integer arithmetic on the header's figures only, so every rank finds
    the same.

    >>> step_rows([5, 1364, 1364, 1363], [40, 4, 7, 10904])  # two leases end
    [15, 4, 7, 4070]
    >>> step_rows([5, 1364, 1364, 1363], [40, 0, 0, 0])  # the job's last rows
    [40, 0, 0, 0]
    """
    rows = [min(size, max(offer, 0)) for size, offer in zip(sizes, offered)]
    short = sum(sizes) - sum(rows)
    while short > 0:
        room = [max(offer, 0) - r for offer, r in zip(offered, rows)]
        weights = [max(size, 1) if space > 0 else 0 for size, space in zip(sizes, room)]
        if not any(weights):
            break
        more = _spread(min(short, sum(room)), weights)
        added = [min(extra, space) for extra, space in zip(more, room)]
        rows = [r + extra for r, extra in zip(rows, added)]
        short -= sum(added)  # > 0: each round fills the shortfall or some rank's room
    return rows


def _spread(total: int, weights: Sequence[int]) -> list[int]:
    """``total`` split in proportion to ``weights`` (integers; a zero weight gets nothing),
    rounded by largest remainders, ties to the lower index."""
    whole = sum(weights)
    parts = [total * w // whole for w in weights]
    left = total - sum(parts)
    order = sorted(range(len(weights)), key=lambda i: (-(total * weights[i] % whole), i))
    for i in order[:left]:
        parts[i] += 1
    return parts


def own_seconds() -> float:
    """Seconds the calling thread has run on a CPU or waited in the run queue for one (Linux's
    ``/proc/thread-self/schedstat``: its first two fields, in nanoseconds); its CPU seconds
    where the kernel does not keep that (then time spent waiting for a CPU goes uncounted).
    Time the thread was blocked, in a collective waiting for its peers or asleep, is not counted.

    It measures the training thread only: with ``train.threads`` > 1 torch's other threads'
    work is missed. On a GPU the kernels' time is missed too (the thread waits for them)."""
    try:
        with open(_SCHEDSTAT, "rb") as f:
            ran, waited = f.read().split()[:2]
    except OSError:
        return time.thread_time()
    return (int(ran) + int(waited)) / 1e9


class Header:
    """The step's header, one all-reduced int64 vector: per rank the rows it offers, the next
    local batches (filled by rank 0), checkpoint requests, then the ranks with no rows left and
    the ranks cancelled."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.values = torch.zeros(3 * world + 2, dtype=torch.int64)

    def set(self, rank: int, rows: int, sizes: Sequence[int] | None, checkpoint: bool,
            over: bool, cancelled: bool) -> None:
        w = self.world
        self.values.zero_()
        self.values[rank] = rows
        if sizes is not None:
            self.values[w:2 * w] = torch.tensor(list(sizes), dtype=torch.int64)
        self.values[2 * w + rank] = int(checkpoint)
        self.values[3 * w] = int(over)
        self.values[3 * w + 1] = int(cancelled)

    def rows(self) -> list[int]:
        return [int(v) for v in self.values[:self.world]]

    def sizes(self) -> list[int] | None:
        sizes = [int(v) for v in self.values[self.world:2 * self.world]]
        return sizes if any(sizes) else None

    def checkpoint_by(self) -> int | None:
        asked = self.values[2 * self.world:3 * self.world].nonzero()
        return int(asked[0]) if len(asked) else None

    def over(self) -> int:
        return int(self.values[3 * self.world])

    def cancelled(self) -> int:
        return int(self.values[3 * self.world + 1])


Span = tuple[Lease, int, int]
"""Rows ``[start, stop)`` of a lease."""


class StepRows:
    """This rank's rows: the lease it trains and where the next batch starts, and the lease
    that follows it once the rest of this one is less than two local batches; the lease
    requests never wait (a rank told to wait offers no rows and asks again).

    A lease holds at most ``antdt.sync-steps.lease-steps`` of the rank's local batches: leases
    of whole shards left a slow rank, whose local batch is small, hundreds of steps of rows
    when the others ran out, which it then trains alone, at its pace, at the job's end. A
    lease's end rarely falls on a step's (the local batches change, a shard's last lease is
    shorter), so a step may take a lease's rest and the front of the next: without it, ranks
    whose leases ended in the same step offered only their rests, and the slow rank, the one
    with rows to spare, took the rest of the global batch (9,872 of 16,384 rows in one step:
    twice a balanced step's time)."""

    def __init__(self, agent: AgentParts) -> None:
        self.agent = agent
        self.lease_steps = int(config.number("antdt.sync-steps.lease-steps", low=1,
                                             integer=True))
        self.lease: Lease | None = None
        self.offset = self.limit = 0
        self.ahead: Lease | None = None
        self.over = False
        self.retry_at = 0.0
        self._started = 0.0

    def offer(self, rows: int, idle: bool) -> int:
        """The rows this rank can train in the next step: what its lease's claim holds past
        the committed offset, and the next lease's claim once the claim reaches the lease's end;
        a lease is asked for (sized for ``rows``, the local batch) when the rank has none, and
        the next one a step before the lease's rest is less than ``rows``, when less than
        ``2 * rows`` are left (so the step before that one reads the next lease's front,
        :class:`ReadAhead`). 0 when it has none now. ``idle``: no rank had rows in the last
        step, so the request may wait for rows server side (every rank waits in the next
        header anyway)."""
        if self.over or rows <= 0:
            return 0
        lease = self.lease
        if lease is None:
            if self._paused(idle):
                return 0
            lease = self._ask(rows, RETRY_S if idle else 0.0, ahead=False)
            if lease is None:
                return 0
            self._begin(lease)
        elif self.ahead is None and lease.stop - self.offset < 2 * rows \
                and not self.agent.faults.pause_due(self.agent.rows):
            self.ahead = self._ask(rows, 0.0, ahead=True)
        offered = self.limit - self.offset
        if self.ahead is not None and self.limit == lease.stop:
            offered += self.ahead.claim_stop - self.ahead.start
        return offered

    def _paused(self, idle: bool) -> bool:
        """Whether the injected pause holds this rank between two leases
        (:meth:`~antdt.agent.faults.FaultInjector.held`, waiting for its event at most
        ``PAUSE_POLL_S`` after a step of no rows): it asks for no lease but takes part in every
        step, so its peers take its rows, and once every rank is paused the steps are empty,
        the job cannot end and a checkpoint is still taken (a test's gate). The rows it trained
        are reported first: the last lease's last commit rides on the next lease call."""
        if not self.agent.faults.pause_due(self.agent.rows):
            return False
        self.agent.shards.flush()
        return self.agent.faults.held(self.agent.rows, PAUSE_POLL_S if idle else 0.0)

    def _ask(self, rows: int, wait_s: float, ahead: bool) -> Lease | None:
        """A lease of at most ``lease_steps`` local batches, or None (asked again after
        ``RETRY_S`` when told to wait; :attr:`over` when the job is)."""
        if wait_s == 0 and time.perf_counter() < self.retry_at:
            return None
        reply = self.agent.shards.poll_lease(wait_s, max_rows=rows * self.lease_steps,
                                             ahead=ahead)
        if reply is None:
            self.over = True
            return None
        if isinstance(reply, Wait):
            self.retry_at = time.perf_counter() + RETRY_S
            return None
        return reply

    def _begin(self, lease: Lease) -> None:
        self.lease, self.offset, self.limit = lease, lease.start, lease.claim_stop
        self._started = time.time()
        self.agent.event({"kind": "lease", "phase": "start", "lease_id": lease.lease_id,
                          "time": self._started})

    def following(self, spans: Sequence[Span], rows: int) -> list[Span]:
        """The spans of ``rows`` rows from where ``spans`` end, as the leases held now go on:
        the next step's spans in the steady state (its header decides them), to read while
        this step runs; fewer where the leases held end sooner."""
        if not spans or rows <= 0:
            return []
        lease, _, end = spans[-1]
        following = [(lease, end, min(lease.stop, end + rows))] if end < lease.stop else []
        rows -= sum(stop - start for _, start, stop in following)
        ahead = self.ahead
        if rows > 0 and ahead is not None and lease is not ahead:
            following.append((ahead, ahead.start, min(ahead.stop, ahead.start + rows)))
        return following

    def take(self, rows: int) -> list[Span]:
        """The spans of this step's ``rows`` rows (at most what :meth:`offer` said): the
        lease's, then the next lease's front."""
        if rows <= 0:
            return []
        assert self.lease is not None
        first = min(rows, self.limit - self.offset)
        spans = [(self.lease, self.offset, self.offset + first)] if first else []
        if rows > first:
            assert self.ahead is not None and self.ahead.start + rows - first <= \
                self.ahead.claim_stop
            spans.append((self.ahead, self.ahead.start, self.ahead.start + rows - first))
        return spans

    def trained(self, spans: Sequence[Span], busy_s: float, next_rows: int,
                cpu_s: float) -> None:
        """The spans' rows were trained (their step completed); the claim is extended at once
        if it holds fewer than ``next_rows`` (the local batch) past them. The step's
        measurements (its own seconds, ``cpu_s`` of them on the CPU) ride with its last
        commit."""
        for i, (_, _, end) in enumerate(spans):
            last = i == len(spans) - 1
            reply = self.agent.shards.commit(
                end, stats={BUSY: busy_s, BATCHES: 1.0, CPU: cpu_s} if last else None,
                claim_ahead=next_rows if last else 0)
            self._committed(end, reply)
            if self.lease is None:  # its last span, or the job stopped under it
                return

    def _committed(self, end: int, reply: CommitReply) -> None:
        """What the commit of rows up to ``end`` said: the claim, or the lease's end (the
        lease asked ahead follows it)."""
        assert self.lease is not None
        self.offset = end
        if isinstance(reply, (Claim, Revoked)):
            self.limit = reply.stop
        if isinstance(reply, Revoked) and reply.stop > end:
            return
        if isinstance(reply, (Finished, Revoked, Stop)):
            self.agent.event({"kind": "lease", "phase": "end", "lease_id": self.lease.lease_id,
                              "start": self._started, "time": time.time(),
                              "rows": end - self.lease.start,
                              "outcome": "revoked" if isinstance(reply, Revoked) else "finished"})
            self.lease, ahead, self.ahead = None, self.ahead, None
            self.over = isinstance(reply, Stop)
            if ahead is not None and not self.over:
                self._begin(ahead)


class ReadAhead:
    """A rank's batches, read in a thread of their own (``read(spans)`` is the batch of the
    spans' rows): while a step runs, the next step's rows as its leases go on
    (:meth:`StepRows.following`) are read, so the step after it does not wait for the reader
    (the decoding of a row group a new lease starts, most of all). Every read runs in that one
    thread, in order: the reader is one thread's.

    The rows read ahead are a guess, used only when the next step takes exactly them; otherwise
    they are dropped (a read of rows no step took: its failure too, the rows taken are read
    again) and the step's own rows are read, after it. Reading moves off the training thread,
    so a rank's own time (:func:`own_seconds`) no longer holds it, but a read that competes
    with the training thread for a core makes it wait for one, which it does count.

    The thread runs at the lowest CPU priority (nice 19, :func:`_below_training`): on a core it
    shares with the training thread it takes the time that thread leaves, its waits in the
    step's collectives, instead of slowing the step. On 2 cores, 2 ranks of 4,096 rows a step
    (one run each): a step took 75 ms with the reads at the training thread's priority, 64 ms
    at nice 19, and 70 ms with the reads in the training thread."""

    def __init__(self, read: Callable[[Sequence[Span]], Any]) -> None:
        self._read = read
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="antdt-sync-read",
                                        initializer=_below_training)
        self._ahead: tuple[list[Span], Future[Any]] | None = None

    def batch(self, spans: Sequence[Span]) -> Any:
        """The batch of ``spans``: the one read ahead if it holds exactly these rows, else
        read now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            guessed, reading = ahead
            if guessed == list(spans):
                return reading.result()
            wait([reading])
        return self._pool.submit(self._read, spans).result()

    def read_ahead(self, spans: list[Span]) -> None:
        """Start reading ``spans`` (none: nothing to read) for the next :meth:`batch`."""
        if spans:
            self._ahead = (spans, self._pool.submit(self._read, spans))

    def close(self) -> None:
        """Drop the read ahead (waiting for a read under way) and end the thread."""
        self._ahead = None
        self._pool.shutdown(wait=True, cancel_futures=True)


def _below_training() -> None:
    """Give the calling thread alone the lowest CPU priority (on Linux a thread has its own)."""
    if sys.platform.startswith("linux"):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
