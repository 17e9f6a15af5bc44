"""Which sync members cannot reach each other (:class:`Reach`): a worker whose pull of a peer went
unanswered (``antdt.sync.pull-timeout``) reports the peer with its next group ask, and the
:class:`~antdt.sync.SyncScheduler` groups neither pair for ``antdt.sync.unreachable-for``; then
they are grouped again, and a pull that still fails reports them again. A link cut between two
hosts is cut both ways, so a pair reported by either side is cut for both.

A worker that reaches no other member (its link to its peers is cut, its link to the scheduler is
not) is *isolated*: nothing it trains can ever be synced (a row is synced once every peer applied
it), so the scheduler answers its group asks with ``cut`` (its training waits at its staleness
bound), and the monitor calls it partitioned (the controller retires it; its unsynced rows are
trained again elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterable

from antdt.errors import SyncError


class Reach:
    """The pairs of workers reported unreachable, each until its time runs out (``for_s``
    seconds after the newest report). Time comes in as ``now``.

    >>> reach = Reach(for_s=30.0)
    >>> reach.report("a", ["x"], now=0.0)
    ['x']
    >>> reach.cut("x", "a", now=10.0), reach.peers("a", now=10.0), reach.cut("a", "x", now=31.0)
    (True, ['x'], False)
    """

    def __init__(self, for_s: float) -> None:
        if for_s <= 0:
            raise SyncError(f"unreachable_for_s must be > 0, found {for_s}")
        self.for_s = for_s
        self._until: dict[str, dict[str, float]] = {}  # worker -> peer -> cut until

    def report(self, worker: str, peers: Iterable[str], now: float) -> list[str]:
        """``worker`` could not reach ``peers`` at ``now``: cut each pair (both ways) for
        :attr:`for_s`; return the peers that were not cut already, sorted."""
        fresh = []
        until = now + self.for_s
        for peer in set(peers) - {worker}:
            if not self.cut(worker, peer, now):
                fresh.append(peer)
            self._until.setdefault(worker, {})[peer] = until
            self._until.setdefault(peer, {})[worker] = until
        return sorted(fresh)

    def cut(self, a: str, b: str, now: float) -> bool:
        """Whether ``a`` and ``b`` are reported unreachable at ``now`` (O(1))."""
        peers = self._until.get(a)
        return peers is not None and peers.get(b, now) > now

    def peers(self, worker: str, now: float) -> list[str]:
        """The workers ``worker`` cannot reach at ``now``, sorted; pairs whose time ran out
        are dropped (O(its reported peers))."""
        peers = self._until.get(worker)
        if not peers:
            return []
        for peer in [p for p, until in peers.items() if until <= now]:
            del peers[peer]
            other = self._until.get(peer)
            if other is not None:
                other.pop(worker, None)
        return sorted(peers)

    def reported(self) -> list[str]:
        """Workers with a cut pair (some may have run out: see :meth:`peers`), sorted."""
        return sorted(worker for worker, peers in self._until.items() if peers)

    def forget(self, worker: str) -> None:
        """``worker`` left: drop its pairs (O(its reported peers))."""
        for peer in self._until.pop(worker, {}):
            other = self._until.get(peer)
            if other is not None:
                other.pop(worker, None)
