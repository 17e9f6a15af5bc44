"""How often a worker's background sync starts a round (``train.sync_period``,
``antdt.sync.period``): seconds of wall time or batches of training."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import dask.utils

from antdt.errors import ConfigError

_BATCHES = re.compile(r"\s*(\d+)\s*batch(?:es)?\s*")


@dataclass(frozen=True)
class SyncPeriod:
    """How often a worker's background sync starts a round: every ``seconds`` of wall time, or
    whenever its training thread finished ``batches`` batches since the last round began.
    Exactly one of the two is set.

    A period in batches bounds the staleness (the steps a replica takes between exchanges)
    whatever the speed of the machine; a period in seconds bounds the share of the CPU the
    exchanges take. Either way training never waits: a round that takes longer than the period
    is followed by the next one at once.

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
