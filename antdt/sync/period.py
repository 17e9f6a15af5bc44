"""How often a worker's background sync starts a round (``train.sync_period``,
``antdt.sync.period``): seconds of wall time, batches of its own training, or batches of its
peers' training; and how far training may run ahead of the rounds (:class:`Staleness`,
``antdt.sync.max-staleness``)."""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass

import dask.utils

from antdt.errors import ConfigError

_BATCHES = re.compile(r"\s*(\d+)\s*(peer\s+)?batch(?:es)?\s*")


@dataclass(frozen=True)
class SyncPeriod:
    """How often a worker's background sync starts a round: every ``seconds`` of wall time;
    whenever its training thread finished ``batches`` batches since the last round began; or
    whenever its peers together trained about ``peer_batches`` batches since then, that is every
    ``peer_batches // (members - 1)`` of its own batches (at least one; a lone member: every
    ``peer_batches``). Exactly one of the three is set.

    A period in seconds bounds the share of the CPU the exchanges take; one in batches sets how
    often rounds start whatever the speed of the machine. One in peer batches bounds what decides
    the model's quality, the batches of the others a replica trains on without having applied
    them: about ``members - 1`` times its own period. On the default job 2 workers at a round
    every 4 batches (4 unseen) and 4 at every 2 (6 unseen) end within 0.0025 AUC of the
    single-process model, 2 at every 8 (8 unseen) 0.010 below it and 4 at every 4 (12 unseen)
    0.015 below. A round that takes longer than the period is followed by the next one at once;
    how far training may run ahead of the rounds is :class:`Staleness`'s bound.

    >>> SyncPeriod.parse(0.5), SyncPeriod.parse("250ms"), SyncPeriod.parse("4 batches")
    (SyncPeriod(seconds=0.5, batches=None, peer_batches=None), \
SyncPeriod(seconds=0.25, batches=None, peer_batches=None), \
SyncPeriod(seconds=None, batches=4, peer_batches=None))
    >>> period = SyncPeriod.parse("4 peer batches")
    >>> str(period), [period.batches_for(members) for members in (1, 2, 3, 4, 8)]
    ('4 peer batches', [4, 4, 2, 1, 1])
    >>> str(SyncPeriod(seconds=0.5)), str(SyncPeriod(batches=1))
    ('0.5s', '1 batch')
    >>> SyncPeriod(batches=3).batches_for(9), SyncPeriod(seconds=0.5).batches_for(9) is None
    (3, True)
    """

    seconds: float | None = None
    batches: int | None = None
    peer_batches: int | None = None

    def __post_init__(self) -> None:
        if sum(value is not None for value in (self.seconds, self.batches,
                                               self.peer_batches)) != 1:
            raise ConfigError(f"sync period: expected seconds, batches or peer batches (one of "
                              f"them), found seconds={self.seconds!r}, batches={self.batches!r}, "
                              f"peer_batches={self.peer_batches!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool)
                                         or not isinstance(self.seconds, (int, float))
                                         or not math.isfinite(self.seconds)
                                         or self.seconds <= 0):
            raise ConfigError(f"sync period: seconds must be a finite number > 0, found "
                              f"{self.seconds!r}")
        for name, value in (("batches", self.batches), ("peer batches", self.peer_batches)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ConfigError(f"sync period: {name} must be an int >= 1, found {value!r}")

    @classmethod
    def parse(cls, value: object, where: str = "sync_period") -> SyncPeriod:
        """A number of seconds (``0.5``), a duration (``"500ms"``, ``"2s"``), a number of
        batches (``"4 batches"``, ``"1 batch"``) or of peer batches (``"4 peer batches"``); a
        :class:`ConfigError` naming ``where`` otherwise."""
        try:
            if isinstance(value, str):
                match = _BATCHES.fullmatch(value)
                if match and match.group(2):
                    return cls(peer_batches=int(match.group(1)))
                if match:
                    return cls(batches=int(match.group(1)))
                return cls(seconds=dask.utils.parse_timedelta(value, default="seconds"))
            return cls(seconds=value)  # type: ignore[arg-type]  # checked on construction
        except (ConfigError, TypeError, ValueError, KeyError):
            raise ConfigError(f"{where}: expected seconds > 0 (0.5, '500ms'), batches "
                              f"('4 batches') or peer batches ('4 peer batches'), found "
                              f"{value!r}") from None

    def batches_for(self, members: int) -> int | None:
        """A round every this many of a worker's own batches while the job's sync has
        ``members`` members (None: a period in seconds)."""
        if self.peer_batches is not None:
            return max(1, self.peer_batches // max(1, members - 1))
        return self.batches

    def __str__(self) -> str:
        if self.seconds is not None:
            return f"{self.seconds:g}s"
        count = self.batches if self.batches is not None else self.peer_batches
        return (f"{count} {'peer ' if self.peer_batches is not None else ''}"
                f"batch{'es' if count != 1 else ''}")


DEFAULT_PERIOD = SyncPeriod(peer_batches=4)
"""A job's sync period unless it names one: the peers' batches a replica has not applied stay
about 4 (2 workers: a round every 4 batches; 3: every 2; 4 or more: every batch)."""


class Staleness:
    """The bound on how far one replica trains ahead of its sync rounds (the stale synchronous
    parallel bound of Ho et al., NeurIPS 2013, counted in batches).

    The background sync runs beside training and never holds it up, but on a busy machine its
    rounds can fall behind: with 4 workers on 2 cores a round took about 3 batches, and the
    replicas, each training 3 batches on what the others did 3 batches ago, ended 0.02-0.05 AUC
    below the single-process model (a round every batch: within 0.006). So before each step the
    training thread checks its lag, the batches it trained since the start of its newest
    finished round, and waits while the lag exceeds its :attr:`limit`: the bound's batches past
    the sync period's, when the period is in batches (a round every 4 batches lets the lag reach
    4 before the next round starts; None: never waits). In other words a round may take the
    bound's batches to finish before training waits for it. The wait ends when a round
    finishes, or after ``timeout_s`` (a round held up by a peer slows the training down, never
    stops it).

    The bound is a number of the replica's own batches (``1``), or of its peers' batches
    (``"2 peer batches"``): ``N // (members - 1)`` of its own, at least 1 (a lone member: N),
    recomputed as members come and go (:meth:`follow`). Like a period in peer batches, it keeps
    what decides quality, the peers' batches a replica trains without having applied, the same
    for any number of workers: with the default period (4 peer batches), 2 peer batches let a
    round take 2 batches with 2 workers and 1 with 3 or more, at most 6 unseen batches with 2 to
    4 workers.
    A round's partners end their steps up to a batch apart, so with 2 workers a bound of 1 held
    training up for 1-2% of the job (measured on machine G).

    >>> gate = Staleness(bound=1)
    >>> gate.trained(); gate.trained(); gate.lag, gate.limit, gate.wait(timeout_s=0.01) > 0
    (2, 1, True)
    >>> gate.follow(period_batches=2); gate.limit, gate.wait(timeout_s=60.0)
    (2, 0.0)
    >>> covered = gate.round_started(); gate.round_ended(covered); gate.lag, gate.wait(1.0)
    (0, 0.0)
    >>> peers = Staleness("2 peer batches")
    >>> peers.follow(period_batches=4, members=2); peers.batches, peers.limit
    (2, 5)
    >>> peers.follow(period_batches=2, members=3); peers.batches, peers.limit
    (1, 2)
    """

    def __init__(self, bound: object) -> None:
        self.bound, self.peer_bound = _parse_bound(bound)
        self._members = 1
        self._period_batches = 1
        self._turn = threading.Condition()
        self._trained = 0
        self._covered = 0
        self._released = False
        self._held = False

    @property
    def batches(self) -> int | None:
        """The bound in the replica's own batches with the current members (None: never
        waits)."""
        if self.peer_bound is not None:
            return max(1, self.peer_bound // max(1, self._members - 1))
        return self.bound

    @property
    def lag(self) -> int:
        """Batches trained since the start of the newest finished round."""
        with self._turn:
            return self._trained - self._covered

    @property
    def limit(self) -> int | None:
        """The lag above which training waits (None: never)."""
        batches = self.batches
        return None if batches is None else batches + self._period_batches - 1

    def follow(self, period_batches: int | None, members: int = 1) -> None:
        """The sync period is now a round every ``period_batches`` batches (None: a period in
        seconds, which adds nothing to the bound) among ``members`` members (a bound in peer
        batches follows their number)."""
        with self._turn:
            self._period_batches = period_batches or 1
            self._members = members
            self._turn.notify_all()

    def trained(self) -> None:
        """The training thread finished a batch."""
        with self._turn:
            self._trained += 1

    def round_started(self) -> int:
        """A round starts: the batches it covers (hand them to :meth:`round_ended`)."""
        with self._turn:
            return self._trained

    def round_ended(self, covered: int) -> None:
        """A round that started when ``covered`` batches were trained ended (merged, alone or
        failed: the training thread never waits for more than one round at a time)."""
        with self._turn:
            self._covered = max(self._covered, covered)
            self._turn.notify_all()

    def hold(self, held: bool) -> None:
        """While ``held`` (the replica reaches no peer: nothing it trains can be synced),
        :meth:`wait` waits past its timeout, until a round ends, the hold is lifted or
        :meth:`release` is called."""
        with self._turn:
            self._held = held
            self._turn.notify_all()

    def wait(self, timeout_s: float) -> float:
        """Before a step: wait while the lag exceeds the bound, at most ``timeout_s`` (unless
        :meth:`hold` holds it); return the seconds waited."""
        if self.bound is None and self.peer_bound is None:
            return 0.0

        def free() -> bool:
            limit = self.limit
            return limit is None or self._trained - self._covered <= limit or self._released

        started = time.perf_counter()
        with self._turn:
            if free():
                return 0.0
            while not free():
                left = started + timeout_s - time.perf_counter()
                if not self._held and left <= 0:
                    break
                self._turn.wait(None if self._held else left)
        return time.perf_counter() - started

    def release(self) -> None:
        """No more rounds come (the sync stopped): never wait again."""
        with self._turn:
            self._released = True
            self._turn.notify_all()


def _parse_bound(bound: object) -> tuple[int | None, int | None]:
    """A staleness bound as (batches, peer batches), one of them set (both None: no bound);
    a :class:`ConfigError` for anything but None, an int >= 0, ``"N batches"`` or ``"N peer
    batches"`` (N >= 1)."""
    if bound is None:
        return None, None
    if isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0:
        return bound, None
    match = _BATCHES.fullmatch(bound) if isinstance(bound, str) else None
    if match is not None and int(match.group(1)) >= 1:
        count = int(match.group(1))
        return (None, count) if match.group(2) else (count, None)
    raise ConfigError(f"max staleness: expected batches >= 0 (1), 'N batches' or 'N peer "
                      f"batches' (N >= 1), or None, found {bound!r}")
