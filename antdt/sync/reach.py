"""Which sync members cannot reach each other (:class:`Reach`): a worker whose pull of a peer went
unanswered (``antdt.sync.pull-timeout``) reports the peer with its next group ask, and the
:class:`~antdt.sync.SyncScheduler` does not group the pair for a pull timeout; then the pair is
grouped again, so that both sides test the link again, and a pull that still fails reports it
again. Kept apart longer, a pair whose link healed (a cut healed, a round that straddled the
moment of a cut or a heal, a pull slow to answer on a busy machine) could not sync: where it
had no other partner, both members waited at their staleness bound until the monitor called
them hung, and a one-sided report could never be confirmed.

A pair both sides reported within ``antdt.sync.unreachable-for`` is *confirmed* (a link cut
between two hosts is cut both ways, and each side pulls the other in the round that fails). A
worker whose pair with every other member is confirmed reaches no other member (its link to
its peers is cut, its link to the scheduler is not): it is *isolated*, nothing it trains can
ever be synced (a row is synced once every peer applied it), so the scheduler answers its group
asks with ``cut`` (its training waits at its staleness bound), and the monitor calls it
partitioned (the controller retires it; its unsynced rows are trained again elsewhere). One
pull slow to answer only keeps a pair apart a moment. A worker cut from the scheduler as well
reports no peer (:class:`~antdt.sync.background.BackgroundSync` checks the scheduler when a
pull fails): that is the monitor's hung worker, not a partition of its peers.
"""

from __future__ import annotations

from collections.abc import Iterable

from antdt.errors import SyncError


class Reach:
    """The pairs of workers reported unreachable, each report counted for ``for_s`` seconds
    after it; a reported pair is kept apart (:meth:`cut`) for ``apart_s`` seconds after its
    newest report. Time comes in as ``now``.

    >>> reach = Reach(for_s=30.0, apart_s=5.0)
    >>> reach.report("a", ["x"], now=0.0)
    ['x']
    >>> reach.cut("x", "a", now=4.0), reach.cut("x", "a", now=5.0), reach.confirmed("a", now=5.0)
    (True, False, [])
    >>> reach.report("x", ["a"], now=10.0), reach.confirmed("a", now=10.0)
    (['a'], ['x'])
    >>> reach.cut("a", "x", now=14.0), reach.peers("a", now=14.0), reach.cut("a", "x", now=15.0)
    (True, ['x'], False)
    >>> reach.confirmed("a", now=29.0), reach.confirmed("a", now=31.0)  # a's report ran out
    (['x'], [])
    """

    def __init__(self, for_s: float, apart_s: float) -> None:
        if for_s <= 0 or not 0 < apart_s <= for_s:
            raise SyncError(f"unreachable_for_s must be > 0 and apart_s in (0, "
                            f"unreachable_for_s], found {for_s} and {apart_s}")
        self.for_s = for_s
        self.apart_s = apart_s
        self._said: dict[str, dict[str, float]] = {}  # reporter -> peer -> when it reported
        self._heard: dict[str, set[str]] = {}  # peer -> the workers that reported it

    def report(self, worker: str, peers: Iterable[str], now: float) -> list[str]:
        """``worker`` could not reach ``peers`` at ``now``: the pairs are kept apart (see
        :meth:`cut`); return the peers that were not kept apart already, sorted."""
        fresh = []
        said = self._said.setdefault(worker, {})
        for peer in set(peers) - {worker}:
            if not self.cut(worker, peer, now):
                fresh.append(peer)
            said[peer] = now
            self._heard.setdefault(peer, set()).add(worker)
        return sorted(fresh)

    def cut(self, a: str, b: str, now: float) -> bool:
        """Whether ``a`` and ``b`` are kept apart at ``now``: either reported the other within
        :attr:`apart_s` (O(1))."""
        said = [at for at in (self._live(a, b, now), self._live(b, a, now)) if at is not None]
        return bool(said) and now < max(said) + self.apart_s

    def peers(self, worker: str, now: float) -> list[str]:
        """The workers ``worker`` is kept apart from at ``now`` (see :meth:`cut`), sorted;
        reports whose time ran out are dropped (O(the reports naming it or by it))."""
        self._expire(worker, now)
        named = set(self._said.get(worker, ())) | self._heard.get(worker, set())
        return sorted(peer for peer in named if self.cut(worker, peer, now))

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

    def _live(self, reporter: str, peer: str, now: float) -> float | None:
        """When ``reporter`` reported ``peer``, if that report still lives at ``now``."""
        at = self._said.get(reporter, {}).get(peer)
        return at if at is not None and now < at + self.for_s else None

    def _expire(self, worker: str, now: float) -> None:
        """Drop the reports by or of ``worker`` whose time ran out."""
        said = self._said.get(worker, {})
        for peer in [p for p, at in said.items() if at + self.for_s <= now]:
            del said[peer]
            self._heard.get(peer, set()).discard(worker)
        for reporter in list(self._heard.get(worker, ())):
            if self._live(reporter, worker, now) is None:
                self._said.get(reporter, {}).pop(worker, None)
                self._heard[worker].discard(reporter)
