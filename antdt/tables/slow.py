"""Which workers serve a job's buckets slowly (:class:`SlowHosts`): a shard host is a straggler
too, one that makes every trainer wait for its pulls. The trainers report how long their pulls
from each other host took (a worker's own buckets are read without the comm, so it never judges
itself); a host whose pulls take ``factor`` times the median of the other hosts', and at least
``floor_ms``, in ``reports`` reports in a row, is slow. The scheduler then hands its primaries
over to their backups (:func:`~antdt.tables.buckets.off_host`).

    >>> slow = SlowHosts(factor=3.0, reports=2, floor_ms=1.0)
    >>> slow.report("a", {"b": 2.0, "c": 30.0}), slow.report("b", {"a": 2.5, "c": 25.0})
    ([], ['c'])
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping


class SlowHosts:
    """The judge of the module docstring, fed one trainer's report at a time."""

    def __init__(self, factor: float, reports: int, floor_ms: float) -> None:
        self.factor = factor
        self.reports = reports
        self.floor_ms = floor_ms
        self.seen: dict[str, dict[str, float]] = {}
        """Per host, per trainer: the mean pull milliseconds of the trainer's latest report."""
        self._strikes: dict[str, int] = {}

    def latency(self, host: str) -> float:
        """``host``'s pull milliseconds: the median of the trainers' latest reports."""
        return statistics.median(self.seen[host].values())

    def report(self, trainer: str, pulls_ms: Mapping[str, float]) -> list[str]:
        """``trainer``'s mean pull milliseconds per host since its last report; the hosts
        judged slow by this report (each once, when its strikes reach ``reports``)."""
        for host, ms in pulls_ms.items():
            self.seen.setdefault(host, {})[trainer] = ms
        judged = []
        for host in pulls_ms:
            others = [self.latency(h) for h in self.seen if h != host]
            if not others:
                continue
            ms = self.latency(host)
            slow = ms >= self.floor_ms and ms > self.factor * statistics.median(others)
            self._strikes[host] = self._strikes.get(host, 0) + 1 if slow else 0
            if self._strikes[host] == self.reports:
                judged.append(host)
        return judged

    def forget(self, host: str) -> None:
        """``host`` left the job, or its primaries moved: judge it afresh."""
        self.seen.pop(host, None)
        self._strikes.pop(host, None)
