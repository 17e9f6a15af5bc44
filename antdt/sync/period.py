"""How often a worker's background sync starts a round (``train.sync_period``,
``antdt.sync.period``): seconds of wall time or batches of training; and how far training may
run ahead of the rounds (:class:`Staleness`, ``antdt.sync.max-staleness``)."""

from __future__ import annotations

import math
import re
import threading
import time
from dataclasses import dataclass

import dask.utils

from antdt.errors import ConfigError

_BATCHES = re.compile(r"\s*(\d+)\s*batch(?:es)?\s*")


@dataclass(frozen=True)
class SyncPeriod:
    """How often a worker's background sync starts a round: every ``seconds`` of wall time, or
    whenever its training thread finished ``batches`` batches since the last round began.
    Exactly one of the two is set.

    A period in batches sets how often rounds start whatever the speed of the machine; a period
    in seconds bounds the share of the CPU the exchanges take. A round that takes longer than
    the period is followed by the next one at once; how far training may run ahead of the
    rounds is :class:`Staleness`'s bound.

    >>> SyncPeriod.parse(0.5), SyncPeriod.parse("250ms"), SyncPeriod.parse("4 batches")
    (SyncPeriod(seconds=0.5, batches=None), SyncPeriod(seconds=0.25, batches=None), \
SyncPeriod(seconds=None, batches=4))
    >>> str(SyncPeriod(seconds=0.5)), str(SyncPeriod(batches=1))
    ('0.5s', '1 batch')
    """

    seconds: float | None = None
    batches: int | None = None

    def __post_init__(self) -> None:
        if (self.seconds is None) == (self.batches is None):
            raise ConfigError(f"sync period: expected seconds or batches (one of them), found "
                              f"seconds={self.seconds!r}, batches={self.batches!r}")
        if self.seconds is not None and (isinstance(self.seconds, bool)
                                         or not isinstance(self.seconds, (int, float))
                                         or not math.isfinite(self.seconds)
                                         or self.seconds <= 0):
            raise ConfigError(f"sync period: seconds must be a finite number > 0, found "
                              f"{self.seconds!r}")
        if self.batches is not None and (isinstance(self.batches, bool)
                                         or not isinstance(self.batches, int)
                                         or self.batches < 1):
            raise ConfigError(f"sync period: batches must be an int >= 1, found {self.batches!r}")

    @classmethod
    def parse(cls, value: object, where: str = "sync_period") -> SyncPeriod:
        """A number of seconds (``0.5``), a duration (``"500ms"``, ``"2s"``) or a number of
        batches (``"4 batches"``, ``"1 batch"``); a :class:`ConfigError` naming ``where``
        otherwise."""
        try:
            if isinstance(value, str):
                match = _BATCHES.fullmatch(value)
                if match:
                    return cls(batches=int(match.group(1)))
                return cls(seconds=dask.utils.parse_timedelta(value, default="seconds"))
            return cls(seconds=value)  # type: ignore[arg-type]  # checked on construction
        except (ConfigError, TypeError, ValueError, KeyError):
            raise ConfigError(f"{where}: expected seconds > 0 (0.5, '500ms') or batches "
                              f"('4 batches'), found {value!r}") from None

    def __str__(self) -> str:
        if self.batches is not None:
            return f"{self.batches} batch{'es' if self.batches != 1 else ''}"
        return f"{self.seconds:g}s"


class Staleness:
    """The bound on how far one replica trains ahead of its sync rounds (the stale synchronous
    parallel bound of Ho et al., NeurIPS 2013, counted in batches).

    The background sync runs beside training and never holds it up, but on a busy machine its
    rounds can fall behind: with 4 workers on 2 cores a round took about 3 batches, and the
    replicas, each training 3 batches on what the others did 3 batches ago, ended 0.02-0.05 AUC
    below the single-process model (a round every batch: within 0.006). So before each step the
    training thread checks its lag, the batches it trained since the start of its newest
    finished round, and waits while the lag exceeds ``bound`` (None: never waits). The wait
    ends when a round finishes, or after ``timeout_s`` (a round held up by a peer slows the
    training down, never stops it).

    >>> gate = Staleness(bound=1)
    >>> gate.trained(); gate.trained(); gate.lag, gate.wait(timeout_s=0.01) > 0
    (2, True)
    >>> covered = gate.round_started(); gate.round_ended(covered); gate.lag, gate.wait(1.0)
    (0, 0.0)
    """

    def __init__(self, bound: object) -> None:
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)
                                  or bound < 0):
            raise ConfigError(f"max staleness: expected batches >= 0 or None, found {bound!r}")
        self.bound: int | None = bound
        self._turn = threading.Condition()
        self._trained = 0
        self._covered = 0
        self._released = False

    @property
    def lag(self) -> int:
        """Batches trained since the start of the newest finished round."""
        with self._turn:
            return self._trained - self._covered

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

    def wait(self, timeout_s: float) -> float:
        """Before a step: wait while the lag exceeds the bound, at most ``timeout_s``; return
        the seconds waited."""
        bound = self.bound
        if bound is None:
            return 0.0
        started = time.perf_counter()
        with self._turn:
            if self._trained - self._covered <= bound or self._released:
                return 0.0
            self._turn.wait_for(lambda: self._trained - self._covered <= bound
                                or self._released, timeout=timeout_s)
        return time.perf_counter() - started

    def release(self) -> None:
        """No more rounds come (the sync stopped): never wait again."""
        with self._turn:
            self._released = True
            self._turn.notify_all()
