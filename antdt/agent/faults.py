"""Injected faults (tests and benchmarks; off by default): what one agent is told to suffer
(:class:`Faults`) and the object that makes it happen in its loop (:class:`FaultInjector`).

A slowdown factor (after each batch, sleep ``(factor - 1)`` x the batch's measured time), a hang
(stop making progress after some rows, until cancelled), a pause (before leasing again after
some rows, wait for a named Dask ``Event``: a test's gate) and a crash (``os._exit`` of the
worker process after some rows, which looks like a real death to the scheduler and the nanny).
The lease loop waits in its pause (:meth:`FaultInjector.pause`); the synchronous mode's step
loop, whose peers wait for every rank in each step, asks for no lease while its pause holds and
goes on stepping (:meth:`FaultInjector.held`).
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from distributed import Event

from antdt.errors import ConfigError

logger = logging.getLogger(__name__)

CRASH_EXIT_CODE = 75
"""Exit status of a worker process killed by the crash fault."""

PAUSE_POLL_S = 0.2
"""A paused agent checks its cancellation flag (and hurries its mode) this often while it waits
for its event."""


@dataclass(frozen=True)
class Faults:
    """Injected faults of one agent (all off by default).

    ``slowdown``: after each batch sleep ``(slowdown - 1)`` x its measured time (a straggler);
    ``slow_for_rows``: only for the first this many rows (a transient straggler; None: always).
    ``hang_after_rows``: once this many rows are trained, make no more progress until cancelled.
    ``crash_after_rows``: once this many rows are trained, ``os._exit`` the worker process.
    ``pause_until``: the name of a Dask ``Event``; once ``pause_after_rows`` rows (default 0) are
    trained, the agent waits for it before its next lease, holding no lease meanwhile (a test
    gates a worker on an explicit event rather than on its speed).
    """

    slowdown: float = 1.0
    hang_after_rows: int | None = None
    crash_after_rows: int | None = None
    slow_for_rows: int | None = None
    pause_until: str | None = None
    pause_after_rows: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.slowdown, bool) or not isinstance(self.slowdown, (int, float)) \
                or not math.isfinite(self.slowdown) or self.slowdown < 1.0:
            raise ConfigError(f"fault slowdown must be a finite number >= 1, found "
                              f"{self.slowdown!r}")
        for name in ("hang_after_rows", "crash_after_rows", "slow_for_rows", "pause_after_rows"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ConfigError(f"fault {name} must be an int >= 0 or None, found {value!r}")
        if self.pause_until is not None and (not isinstance(self.pause_until, str)
                                             or not self.pause_until):
            raise ConfigError(f"fault pause_until must be the name of a Dask Event or None, "
                              f"found {self.pause_until!r}")

    @property
    def active(self) -> bool:
        return (self.slowdown > 1.0 or self.hang_after_rows is not None
                or self.crash_after_rows is not None or self.pause_until is not None)


class FaultInjector:
    """Makes one agent suffer its :class:`Faults`. ``where`` names the agent in log lines,
    ``cancelled`` is its cancellation flag (every injected wait ends when it is set) and
    ``event(msg)`` sends a ``fault`` event to the job's master. Every method takes the rows the
    agent has trained so far."""

    def __init__(self, faults: Faults, where: str, cancelled: threading.Event,
                 event: Callable[[dict[str, Any]], None]) -> None:
        self.faults = faults
        self.where = where
        self.cancelled = cancelled
        self.event = event
        self._paused = False
        self._gate: Event | None = None

    def slow_down(self, rows: int, batch_s: float) -> None:
        """After a batch that took ``batch_s``: sleep the slowdown's share of it."""
        faults = self.faults
        if faults.slow_for_rows is not None and rows >= faults.slow_for_rows:
            return
        extra = (faults.slowdown - 1.0) * batch_s
        if extra > 0:
            self.cancelled.wait(extra)

    def pause_due(self, rows: int) -> bool:
        """Whether the pause fires now (once: ``pause_after_rows`` are trained)."""
        faults = self.faults
        return faults.pause_until is not None and not self._paused \
            and rows >= faults.pause_after_rows

    def pause(self, rows: int, waiting: Callable[[], None]) -> bool:
        """Wait for the Dask Event ``pause_until``, calling ``waiting()`` between polls (the
        agent's mode goes on syncing meanwhile); True when the agent was cancelled meanwhile."""
        self._paused = True
        logger.warning("agent %s: injected pause after %d rows until event %r", self.where,
                       rows, self.faults.pause_until)
        self.event({"kind": "fault", "fault": "pause", "rows": rows})
        event = Event(self.faults.pause_until)
        while True:
            waiting()
            if event.wait(PAUSE_POLL_S):
                return False
            if self.cancelled.is_set():
                return True

    def held(self, rows: int, wait_s: float = 0.0) -> bool:
        """The pause of a loop that must not block in it (the synchronous mode's: its peers
        wait for it in every step): True from the moment it is due (``pause_after_rows``
        trained; announced then, as :meth:`pause` announces it) while the Dask Event
        ``pause_until`` is not set, waiting for it at most ``wait_s`` per call; False once the
        event is set, and from then on."""
        if not self.pause_due(rows):
            return False
        if self._gate is None:
            logger.warning("agent %s: injected pause after %d rows until event %r", self.where,
                           rows, self.faults.pause_until)
            self.event({"kind": "fault", "fault": "pause", "rows": rows})
            self._gate = Event(self.faults.pause_until)
        if self._gate.wait(wait_s) if wait_s > 0 else self._gate.is_set():
            self._paused = True
            return False
        return True

    def fire(self, rows: int) -> bool:
        """Crash or hang once their row counts are reached; True when a hang was cancelled."""
        faults = self.faults
        if faults.crash_after_rows is not None and rows >= faults.crash_after_rows:
            logger.warning("agent %s: injected crash after %d rows", self.where, rows)
            logging.shutdown()
            os._exit(CRASH_EXIT_CODE)
        if faults.hang_after_rows is not None and rows >= faults.hang_after_rows:
            logger.warning("agent %s: injected hang after %d rows", self.where, rows)
            self.event({"kind": "fault", "fault": "hang", "rows": rows})
            self.cancelled.wait()
            return True
        return False
