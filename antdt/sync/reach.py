"""Which sync members cannot reach each other (:class:`Reach`): a worker whose pull of a peer went
unanswered (``antdt.sync.pull-timeout``) reports the peer with its next group ask, and the
:class:`~antdt.sync.SyncScheduler` groups neither pair for ``antdt.sync.unreachable-for``; then
they are grouped again, and a pull that still fails reports them again. A link cut between two
hosts is cut both ways, so a pair reported by either side is not grouped.

A worker that reaches no other member (its link to its peers is cut, its link to the scheduler is
not) is *isolated*: nothing it trains can ever be synced (a row is synced once every peer applied
it), so the scheduler answers its group asks with ``cut`` (its training waits at its staleness
bound), and the monitor calls it partitioned (the controller retires it; its unsynced rows are
trained again elsewhere). That takes a pair reported by both sides (each pulls the other in the
round that fails): one pull slow to answer on a busy machine only keeps the pair apart a while.
"""

from __future__ import annotations

from collections.abc import Iterable

from antdt.errors import SyncError


class Reach:
    """The pairs of workers reported unreachable, each report until its time runs out
    (``for_s`` seconds after it). Time comes in as ``now``.

    >>> reach = Reach(for_s=30.0)
    >>> reach.report("a", ["x"], now=0.0)
    ['x']
    >>> reach.cut("x", "a", now=10.0), reach.confirmed("a", now=10.0)
    (True, [])
    >>> reach.report("x", ["a"], now=10.0), reach.confirmed("a", now=10.0)
    ([], ['x'])
    >>> reach.cut("a", "x", now=31.0), reach.confirmed("a", now=31.0), reach.peers("a", 41.0)
    (True, [], [])
    """

    def __init__(self, for_s: float) -> None:
        if for_s <= 0:
            raise SyncError(f"unreachable_for_s must be > 0, found {for_s}")
        self.for_s = for_s
        self._said: dict[str, dict[str, float]] = {}  # reporter -> peer -> its report's end
        self._heard: dict[str, set[str]] = {}  # peer -> the workers that reported it

    def report(self, worker: str, peers: Iterable[str], now: float) -> list[str]:
        """``worker`` could not reach ``peers`` at ``now``: the pairs are not grouped for
        :attr:`for_s`; return the peers that were not cut already, sorted."""
        fresh = []
        said = self._said.setdefault(worker, {})
        for peer in set(peers) - {worker}:
            if not self.cut(worker, peer, now):
                fresh.append(peer)
            said[peer] = now + self.for_s
            self._heard.setdefault(peer, set()).add(worker)
        return sorted(fresh)

    def cut(self, a: str, b: str, now: float) -> bool:
        """Whether either of ``a`` and ``b`` reported the other at ``now`` (O(1))."""
        return self._said.get(a, {}).get(b, now) > now or self._said.get(b, {}).get(a, now) > now

    def peers(self, worker: str, now: float) -> list[str]:
        """The workers ``worker`` is cut from at ``now`` (either side reported), sorted;
        reports whose time ran out are dropped (O(the reports naming it or by it))."""
        self._expire(worker, now)
        return sorted(set(self._said.get(worker, ())) | self._heard.get(worker, set()))

    def confirmed(self, worker: str, now: float) -> list[str]:
        """The workers ``worker`` is cut from at ``now`` by both sides' reports, sorted."""
        self._expire(worker, now)
        return sorted(p for p in self._said.get(worker, ()) if worker in self._said.get(p, {}))

    def reported(self) -> list[str]:
        """Workers that reported a peer (some reports may have run out), sorted."""
        return sorted(worker for worker, said in self._said.items() if said)

    def forget(self, worker: str) -> None:
        """``worker`` left: drop the reports by it and of it."""
        for peer in self._said.pop(worker, {}):
            self._heard.get(peer, set()).discard(worker)
        for reporter in self._heard.pop(worker, set()):
            self._said.get(reporter, {}).pop(worker, None)

    def _expire(self, worker: str, now: float) -> None:
        """Drop the reports by or of ``worker`` whose time ran out."""
        said = self._said.get(worker, {})
        for peer in [p for p, end in said.items() if end <= now]:
            del said[peer]
            self._heard.get(peer, set()).discard(worker)
        for reporter in list(self._heard.get(worker, ())):
            if self._said.get(reporter, {}).get(worker, now) <= now:
                self._said.get(reporter, {}).pop(worker, None)
                self._heard[worker].discard(reporter)
