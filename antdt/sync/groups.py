"""Who syncs with whom, and when: the central half of SDPipe-style grouping
(:class:`SyncScheduler`, a plain class with an injected clock; :mod:`antdt.sync.service` runs one
per job on the Dask scheduler).

Joiners: a worker that joins a running job may take a member's snapshot only once every other
member has applied a member list naming the joiner (:meth:`SyncScheduler.settled`): a source drops
an entry only when every peer it knows acknowledged it, so from then on each source keeps what
the joiner needs (and it never dropped past the snapshot's cursor: the snapshot's member is one of
those peers, and it acknowledges only entries it applied); before, a source unaware of the joiner
could drop entries after the snapshot's cursor.

Departures: a member that leaves (its worker died, or its agent stopped) is recorded with the
rows the ledger counts synced for it then (:meth:`SyncScheduler.departed`); every replica takes
the departed member's entries past them out of its tables (:mod:`antdt.sync.embeddings`), so the
replicas hold its rows exactly as far as the ledger counts them done.

The end: once every live member finished training, one final group of all members forms and one
of them is named its leader (:meth:`SyncScheduler.final_leader`, the smallest address). The
leader pulls every other member's entries and dense snapshot and says it
:meth:`~SyncScheduler.gathered`; then each other member copies from it the rows in which they may
differ and its dense parameters, and says it :meth:`~SyncScheduler.adopted` them. A leader that
leaves is replaced by the next one in that order, which gathers again; the members adopt from it
again.

Partitions: a worker reports the peers its pulls could not reach (:meth:`SyncScheduler.unreachable`,
see :mod:`antdt.sync.reach`); such pairs are not grouped for a while, groups form without them, and
a worker that reaches no other member is told ``cut`` (:meth:`SyncScheduler.isolated`).
"""

from __future__ import annotations

import bisect
import collections
import enum
import itertools
import logging
import math
from dataclasses import dataclass
from collections.abc import Sequence
from typing import Literal, NamedTuple

from antdt import config
from antdt.errors import SyncError
from antdt.sync.reach import Reach

logger = logging.getLogger(__name__)


class MemberState(enum.Enum):
    """Where a sync member stands with the scheduler."""

    IDLE = "idle"  # training, not asking to sync
    READY = "ready"  # waiting in the pool for partners
    ASSIGNED = "assigned"  # put in a group by a partner's call; told on its next call
    FINISHED = "finished"  # done training, waiting for the final all-member round
    DONE = "done"  # received the final round


SPAN_WEIGHT = 0.1
"""Weight of the newest span in the running mean of every member's spans."""

WAIT_SPANS = 0.5
"""A caller waits for the members expected to ask within this many of its own spans: members
that train in step with it (whose asks jitter around its own) are waited for, one 1.5x slower
or more is late."""

MEMBER_SPAN_WEIGHT = 0.25
"""Weight of a member's newest span in the running mean of its own spans (a member that slows
down or recovers is judged by its new pace within a few spans)."""

FinalStep = Literal["gather", "adopt", "wait", "done"]
"""What a member of the final round does next (:meth:`SyncScheduler.final_step`)."""


class SyncGroup(NamedTuple):
    """A group the scheduler formed: ``members`` (sorted worker ids) exchange in ``round``."""

    round: int
    members: tuple[str, ...]
    final: bool


@dataclass(frozen=True)
class Answer:
    """The scheduler's answer to one worker: sync with ``group``, ``wait`` and ask again, go
    on ``alone`` (waited ``max_wait_s`` without a partner: nothing to exchange), or ``cut``: it
    reaches no other member (see :mod:`antdt.sync.reach`), nothing it trains can be synced."""

    kind: Literal["group", "wait", "alone", "cut"]
    group: SyncGroup | None = None


@dataclass
class _Member:
    state: MemberState = MemberState.IDLE
    key: tuple[int, int, str] | None = None  # position in the ready pool while READY
    ready_since: float = 0.0
    queued: int = -1  # ticket of its entry in the FIFO of waiting workers while READY
    since: float = 0.0  # when it went back to training (while IDLE with an expected ask)
    span: float | None = None  # running mean of its own spans (None: none measured yet)
    expect: tuple[float, int, str] | None = None  # (expected ask, ticket, worker) while training
    away_at: tuple[float, int, str] | None = None  # (when it goes away, ticket, worker) likewise
    pending: SyncGroup | None = None
    acked: int = -1  # members_version of the newest member list it applied (-1: none reported)
    joined_version: int | None = None  # members_version its mid-job join created; None: listed
    bootstrapping: bool = False  # joined mid-job, not training yet (see SyncScheduler.started)
    progress: int | None = None  # its progress at its newest ask (None: it never asked)
    batches: int | None = None  # the batches it had trained at its newest ask (None: not told)
    idle: bool = False  # while READY: it trained nothing since its previous ask


class SyncScheduler:
    """Central half of SDPipe-style grouping: who syncs with whom, and when.

    Workers :meth:`join` before training starts, then call :meth:`ready` whenever they want to
    sync (with their progress in rows); the scheduler groups up to ``group_size`` ready workers of
    similar progress: the nearest ones, and with ``max_progress_gap`` set, only partners within
    that many rows of the caller until it has waited ``max_wait_s``. A full group is every
    member still training, up to ``group_size``, less two kinds the caller does not wait for.
    Each member's *span* is the running mean of the time it trains between two asks (its own
    pace). A member is *late* when it is not expected to ask within half the caller's own span
    (a worker twice as slow as the caller, mid-batch), and *away* once it trained
    ``away_spans`` of its spans (at most ``max_wait_s``) without asking (a hung worker, one
    waiting for a lease). So the others' rounds (and their training, which waits for a round
    once its replica runs too far ahead) keep their own pace, not the slowest member's; a late
    or away member is grouped when it asks, and then waits for the members due within half its
    span. A caller that trained nothing since its previous ask (an *idle* one: no lease left,
    asking so that its rows get synced) waits for every member not away, late ones too: it
    loses no training by waiting, and its rows are synced only once they applied them (with a
    period of several batches the others ask seldom, and every ask of two idle workers found
    the other just gone, late). ``away_spans=0`` waits for every member (up to ``max_wait_s``).
    A worker put in a group by a partner's call learns it on its next call.
    A worker that waited ``max_wait_s`` takes whichever ready partners there are, or is told to
    go on ``alone``: nobody ever blocks on a straggler. ``ready(..., final=True)``
    says the worker is done training; once
    every live member has said so, one final group of all members forms with a
    :meth:`final_leader`. The leader pulls every member's entries and dense snapshot and says so
    with :meth:`gathered`; each other member then adopts the leader's rows and says so with
    :meth:`adopted`; :meth:`final_step` tells each member what to do next, and
    :meth:`final_done` turns True once every one adopted the current leader's rows.

    Whether a caller is idle is judged by the batches it says it trained (``batches``, a count
    that only grows) when it says them, else by its progress: a worker whose progress does not
    follow its training (the hybrid mode's replica holds only the dense part and counts no rows)
    would otherwise look idle at every ask, and every group would wait for the slowest member
    (``antdt bench hybrid --big``, one of 4 workers 4x slower: the fast ones waited 45% of
    their training for it and trained 1.5x its batches; judged by batches, 5% and 4.6x).

    A pair of members reported unreachable (:meth:`unreachable`) is not put in one group for
    ``apart_s`` after the newest report (default ``antdt.sync.pull-timeout``; then both test
    the link again), and a group waits for none of the caller's unreachable peers; a caller
    whose every pair both sides reported within ``unreachable_for_s`` (default
    ``antdt.sync.unreachable-for``) reaches no other member and is answered ``cut``
    (:meth:`isolated`; :mod:`antdt.sync.reach`).

    A worker that joins a running job calls :meth:`join_running`; it may take a snapshot once
    :meth:`settled`, i.e. once every other member reported (:meth:`acknowledge`) that it applied
    a member list naming the joiner (see the module docstring for why), and says it
    :meth:`started` training once it adopted the snapshot. Until then neither the others' groups
    nor the final round wait for it: a final round that forms first drops it (every row is done).

    Each call costs O(log n + group_size) (a sorted pool of ready workers; the insert/delete
    moves pointers, no Python-level scan over workers). Time comes in as ``now``.

    >>> s = SyncScheduler(group_size=2, max_wait_s=5.0)
    >>> for w in ("a", "b", "c"):
    ...     s.join(w)
    >>> s.ready("a", progress=100, now=0.0)
    Answer(kind='wait', group=None)
    >>> s.ready("b", progress=90, now=0.1)
    Answer(kind='group', group=SyncGroup(round=1, members=('a', 'b'), final=False))
    >>> s.ready("a", progress=100, now=0.2).group.round
    1
    >>> s.ready("c", progress=10, now=1.0).kind, s.ready("c", progress=10, now=6.0).kind
    ('wait', 'alone')
    """

    def __init__(self, group_size: int | None = None, max_wait_s: float | None = None,
                 max_progress_gap: int | None = None, away_spans: float | None = None,
                 unreachable_for_s: float | None = None,
                 apart_s: float | None = None) -> None:
        if group_size is None:
            group_size = int(config.number("antdt.sync.group-size", integer=True))
        if max_wait_s is None:
            max_wait_s = config.seconds("antdt.sync.max-wait")
        if away_spans is None:
            away_spans = config.number("antdt.sync.away-spans", low=0.0)
        if unreachable_for_s is None:
            unreachable_for_s = config.seconds("antdt.sync.unreachable-for")
        if apart_s is None:
            apart_s = min(config.seconds("antdt.sync.pull-timeout"), unreachable_for_s)
        if away_spans < 0:
            raise SyncError(f"away_spans must be >= 0 (0: nobody is away), found {away_spans}")
        if group_size < 2:
            raise SyncError(f"group_size must be >= 2, found {group_size}")
        if max_wait_s < 0:
            raise SyncError(f"max_wait_s must be >= 0, found {max_wait_s}")
        if max_progress_gap is not None and max_progress_gap < 0:
            raise SyncError(f"max_progress_gap must be >= 0 or None, found {max_progress_gap}")
        self.group_size = group_size
        self.max_wait_s = max_wait_s
        self.max_progress_gap = max_progress_gap
        self.away_spans = away_spans
        self.reach = Reach(unreachable_for_s, apart_s)
        self._members: dict[str, _Member] = {}
        self._pool: list[tuple[int, int, str]] = []  # sorted (progress, ticket, worker)
        self._waiting: collections.deque[tuple[int, str]] = collections.deque()  # FIFO, lazy
        self._expect: list[tuple[float, int, str]] = []  # training members by expected ask
        self._away_at: list[tuple[float, int, str]] = []  # ... by when they go away
        self._span: float | None = None  # running mean of the time members train between asks
        self._tickets = itertools.count()
        self._round = 0
        self._finished = 0
        self._final: SyncGroup | None = None
        self._departed: dict[str, int] = {}  # departed member -> its rows synced then
        self._leader: str | None = None
        self._gathered = False  # the current leader merged every member's entries
        self._adopted: dict[str, str] = {}  # member -> leader whose rows it adopted last
        self._adopting = 0  # members other than the leader that adopted the current leader
        self._joining: dict[str, set[str]] = {}  # joiner -> members yet to acknowledge it
        self._bootstrapping = 0  # members that joined mid-job and do not train yet
        self._declined: dict[str, int] = {}  # joiner dropped when the final formed -> its round
        self.members_version = 0

    # -- membership ------------------------------------------------------------------------
    def join(self, worker: str) -> None:
        """Add ``worker`` as a sync member before training starts (idempotent)."""
        if worker in self._members:
            return
        if self._final is not None:
            raise SyncError(f"join {worker!r}: the final round {self._final.round} already "
                            "formed")
        self._members[worker] = _Member()
        self.members_version += 1

    def join_running(self, worker: str) -> None:
        """Add ``worker`` to the running job: it bootstraps from a member's snapshot once
        :meth:`settled` (O(members), once per joiner). Idempotent; a member already listed is
        left as it is (it needs no snapshot: every member kept its log for it)."""
        if worker in self._members:
            return
        self.join(worker)
        self._members[worker].joined_version = self.members_version
        self._members[worker].bootstrapping = True
        self._bootstrapping += 1
        waiting = {other for other, member in self._members.items()
                   if other != worker and member.acked < self.members_version}
        if waiting:
            self._joining[worker] = waiting
        logger.info("%s joins the running sync job: %d members, %d to acknowledge it", worker,
                    len(self._members), len(waiting))

    def acknowledge(self, worker: str, members_version: int) -> bool:
        """``worker`` applied the member list of ``members_version``; True when this settled a
        joiner (O(joiners))."""
        member = self._member(worker)
        if not -1 <= members_version <= self.members_version:
            raise SyncError(f"acknowledge {worker!r}: members_version must be in [-1, "
                            f"{self.members_version}], found {members_version}")
        member.acked = max(member.acked, members_version)
        settled = False
        for joiner, waiting in list(self._joining.items()):
            joined = self._members[joiner].joined_version
            if worker in waiting and joined is not None and joined <= member.acked:
                waiting.discard(worker)
                if not waiting:
                    del self._joining[joiner]
                    settled = True
        return settled

    def settled(self, worker: str) -> bool:
        """Whether every other member applied a member list naming ``worker``."""
        self._member(worker)
        return worker not in self._joining

    def waiting_for(self, worker: str) -> list[str]:
        """The members that have not acknowledged ``worker``'s join yet, sorted."""
        return sorted(self._joining.get(worker, ()))

    def started(self, worker: str, now: float) -> None:
        """The joiner ``worker`` adopted its snapshot and trains from ``now`` on: groups and
        the final round wait for it like for any member, expecting its first ask after the
        members' typical span (O(log n), idempotent). Raises :class:`SyncError` when the final
        round formed first (the joiner was dropped then: it must train nothing, every row is
        done)."""
        member = self._member(worker)
        if member.bootstrapping:
            self._trains(member)
            self._idle_from(member, worker, now)

    def _trains(self, member: _Member) -> None:
        member.bootstrapping = False
        self._bootstrapping -= 1

    def joined_running(self, worker: str) -> bool:
        """Whether ``worker`` joined the running job (so it must bootstrap from a snapshot)."""
        return self._member(worker).joined_version is not None

    def leave(self, worker: str, synced_rows: int = 0) -> SyncGroup | None:
        """Forget ``worker`` (it left or died) and record it departed with ``synced_rows`` (the
        rows the ledger counts synced for it); return the final group if this completes it."""
        if not self._forget(worker):
            return None
        self._departed[worker] = synced_rows
        return self._maybe_final(caller=None)

    def departed(self) -> dict[str, int]:
        """The members that left, each with the rows the ledger counted synced for it then (a
        copy)."""
        return dict(self._departed)

    def _forget(self, worker: str) -> bool:
        """Drop ``worker`` from every structure; False when it was no member."""
        member = self._members.pop(worker, None)
        if member is None:
            return False
        self.members_version += 1
        self.reach.forget(worker)
        if member.bootstrapping:
            self._bootstrapping -= 1
        if member.state is MemberState.READY:
            self._pool_remove(member)
        self._idle_remove(member)
        if member.state in (MemberState.FINISHED, MemberState.DONE):
            self._finished -= 1
        adopted = self._adopted.pop(worker, None)
        if adopted is not None and adopted == self._leader and worker != self._leader:
            self._adopting -= 1
        self._joining.pop(worker, None)
        for joiner, waiting in list(self._joining.items()):
            waiting.discard(worker)
            if not waiting:
                del self._joining[joiner]
        if worker == self._leader:
            self._name_leader()
        return True

    def members(self) -> list[str]:
        """The live members, sorted."""
        return sorted(self._members)

    def is_member(self, worker: str) -> bool:
        """Whether ``worker`` is a live member (O(1))."""
        return worker in self._members

    def declined(self, worker: str) -> bool:
        """Whether ``worker`` was dropped while joining, as the final round formed (O(1))."""
        return worker in self._declined

    # -- partitions ------------------------------------------------------------------------
    def unreachable(self, worker: str, peers: Sequence[str], now: float) -> list[str]:
        """The member ``worker``'s pulls of ``peers`` went unanswered at ``now``: no group
        holds one of these pairs for ``unreachable_for_s`` (non-members are ignored); return
        the peers newly cut, sorted (O(peers))."""
        self._member(worker)
        return self.reach.report(worker, [p for p in peers if p in self._members], now)

    def isolated(self, now: float) -> dict[str, list[str]]:
        """The members that reach no other member at ``now`` (each pair reported by both
        sides), each with the members it cannot reach (O(members that reported a peer)):
        nothing they train can be synced."""
        return {worker: self.reach.confirmed(worker, now) for worker in self.reach.reported()
                if worker in self._members and self._cut_off(worker, now)}

    def _cut_off(self, worker: str, now: float) -> bool:
        """Whether ``worker`` reaches none of the other members that serve pulls (every member
        but the joiners still bootstrapping), by both sides' reports; O(its reports)."""
        cut = [p for p in self.reach.confirmed(worker, now)
               if p in self._members and not self._members[p].bootstrapping]
        others = len(self._members) - 1 - self._bootstrapping \
            + self._members[worker].bootstrapping
        return bool(cut) and len(cut) >= others

    def waiting(self) -> list[str]:
        """The READY workers (O(ready)): when a member finishes or leaves, fewer partners make
        a full group, so they should ask again now rather than when their wait runs out."""
        return [worker for _, _, worker in self._pool]

    def state(self, worker: str) -> MemberState:
        """``worker``'s state (raises :class:`SyncError` for a non-member)."""
        return self._member(worker).state

    # -- the final round ---------------------------------------------------------------------
    @property
    def final(self) -> SyncGroup | None:
        """The final group once it formed (every member that trains finished), else None."""
        return self._final

    def final_leader(self) -> str | None:
        """The member that gathers the final round and whose rows the others adopt, named when
        the final group forms: the smallest address; the next one if it leaves. None before."""
        return self._leader

    def gathered(self, worker: str) -> None:
        """The final leader ``worker`` merged every other member's entries and dense snapshot:
        the others may adopt its rows now."""
        self._final_member(worker, "gathered")
        if worker != self._leader:
            raise SyncError(f"gathered {worker!r}: expected the final leader {self._leader!r}")
        self._gathered = True

    def adopted(self, worker: str, leader: str) -> None:
        """``worker`` adopted ``leader``'s rows after the leader gathered (O(1))."""
        self._final_member(worker, "adopted")
        previous = self._adopted.get(worker)
        self._adopted[worker] = leader
        if worker != self._leader:
            self._adopting += (leader == self._leader) - (previous == self._leader)

    def adopted_from(self, worker: str) -> str | None:
        """The leader whose rows ``worker`` reported adopting last, if any."""
        return self._adopted.get(worker)

    def final_step(self, worker: str) -> FinalStep:
        """What ``worker``, which received the final round, does next (O(1)): "gather" when it
        leads and has not gathered, "adopt" once the leader gathered and until it adopted the
        leader's rows, "done" once :meth:`final_done`, else "wait" (and go on serving peers)."""
        self._final_member(worker, "final_step")
        if self.final_done():
            return "done"
        if worker == self._leader:
            return "wait" if self._gathered else "gather"
        if self._gathered and self._adopted.get(worker) != self._leader:
            return "adopt"
        return "wait"

    def final_done(self) -> bool:
        """The leader gathered and every other live member adopted its rows: the replicas are
        identical, members may stop serving."""
        return self._gathered and self._adopting == len(self._members) - 1

    def wait_left(self, worker: str, now: float) -> float:
        """Seconds until a READY ``worker`` stops waiting for partners (0 when not READY)."""
        member = self._member(worker)
        if member.state is not MemberState.READY:
            return 0.0
        left = member.ready_since + self.max_wait_s - now
        pos = bisect.bisect_right(self._away_at, (now, math.inf))
        if pos < len(self._away_at):  # the next member to go away may complete a group
            left = min(left, self._away_at[pos][0] - now)
        return max(0.0, left)

    # -- the one call workers make ---------------------------------------------------------
    def ready(self, worker: str, progress: int, now: float, final: bool = False,
              batches: int | None = None) -> Answer:
        """``worker`` (at ``progress`` rows, having trained ``batches`` batches when given) asks
        whom to sync with; see the class docstring."""
        member = self._member(worker)
        if member.bootstrapping:  # a joiner that asks to sync trains
            self._trains(member)
        if member.state is MemberState.ASSIGNED:
            return self._hand_over(worker, member, now)
        if member.state is MemberState.DONE:
            assert self._final is not None
            return Answer("group", self._final)
        if final:
            return self._finish(worker, member)
        if member.state is MemberState.FINISHED:
            raise SyncError(f"ready {worker!r}: already finished training, expected "
                            "final=True")
        if self._cut_off(worker, now):
            if member.state is MemberState.READY:
                self._pool_remove(member)
                self._idle_from(member, worker, now)
            return Answer("cut")
        if member.state is MemberState.READY:
            self._pool_remove(member)
        else:
            self._busy(member, now)
            member.idle = progress == member.progress if batches is None \
                else batches == member.batches
            member.progress, member.batches = progress, batches
            member.state = MemberState.READY
            member.ready_since = now
            member.queued = next(self._tickets)
            self._waiting.append((member.queued, worker))
        member.key = (progress, next(self._tickets), worker)
        bisect.insort(self._pool, member.key)
        return self._try_group(worker, member, now)

    # -- transitions -----------------------------------------------------------------------
    def _try_group(self, worker: str, member: _Member, now: float) -> Answer:
        size = min(self.group_size, self._awaited(worker, member, now))
        expired = now - member.ready_since >= self.max_wait_s
        if len(self._pool) < size and not expired:
            return Answer("wait")
        gap = None if expired else self.max_progress_gap
        count = min(size, len(self._pool)) - 1
        overdue = self._overdue(worker, now) if count > 0 else None
        partners = [] if overdue is None else [overdue]
        partners += self._nearest(member, count - len(partners), gap, partners, now)
        if not expired and len(partners) < size - 1:
            return Answer("wait")
        if not partners:
            self._pool_remove(member)
            self._idle_from(member, worker, now)
            return Answer("alone")
        self._round += 1
        group = SyncGroup(self._round, tuple(sorted([worker, *partners])), final=False)
        for partner in partners:
            other = self._members[partner]
            self._pool_remove(other)
            other.state = MemberState.ASSIGNED
            other.pending = group
        self._pool_remove(member)
        self._idle_from(member, worker, now)
        return Answer("group", group)

    def _overdue(self, caller: str, now: float) -> str | None:
        """The longest-waiting READY worker, unless it is ``caller``, if it waited
        ``max_wait_s``: it joins the next group formed, so nobody starves because the others'
        progress is closer. Stale FIFO entries are dropped on the way (amortised O(1))."""
        while self._waiting:
            ticket, worker = self._waiting[0]
            member = self._members.get(worker)
            if member is None or member.state is not MemberState.READY or member.queued != ticket:
                self._waiting.popleft()
                continue
            if worker == caller or now - member.ready_since < self.max_wait_s \
                    or self.reach.cut(worker, caller, now):
                return None
            return worker
        return None

    def _nearest(self, member: _Member, count: int, gap: int | None, chosen: Sequence[str],
                 now: float) -> list[str]:
        """Up to ``count`` READY workers closest in progress to ``member``, other than the
        partners ``chosen`` already, none further than ``gap`` rows when given, none that cannot
        reach ``member`` or a partner (O(log n + count), plus those skipped as unreachable)."""
        assert member.key is not None
        group = [member.key[2], *chosen]
        pos = bisect.bisect_left(self._pool, member.key)
        left, right = pos - 1, pos + 1
        progress = member.key[0]
        picked: list[str] = []
        while len(picked) < count and (left >= 0 or right < len(self._pool)):
            take_left = right >= len(self._pool) or (
                left >= 0 and progress - self._pool[left][0] <= self._pool[right][0] - progress)
            index = left if take_left else right
            if gap is not None and abs(self._pool[index][0] - progress) > gap:
                break
            candidate = self._pool[index][2]
            if candidate not in group and not any(self.reach.cut(candidate, other, now)
                                                  for other in group):
                picked.append(candidate)
                group.append(candidate)
            if take_left:
                left -= 1
            else:
                right += 1
        return picked

    def _hand_over(self, worker: str, member: _Member, now: float) -> Answer:
        group = member.pending
        assert group is not None
        member.pending = None
        if group.final:
            member.state = MemberState.DONE
        else:
            self._idle_from(member, worker, now)
        return Answer("group", group)

    def _finish(self, worker: str, member: _Member) -> Answer:
        if member.state is MemberState.READY:
            self._pool_remove(member)
        self._idle_remove(member)
        if member.state is not MemberState.FINISHED:
            member.state = MemberState.FINISHED
            self._finished += 1
        group = self._maybe_final(caller=worker)
        return Answer("wait") if group is None else Answer("group", group)

    def _maybe_final(self, caller: str | None) -> SyncGroup | None:
        """Form the final group once every live member that trains finished (O(n), once per
        job). Joiners still bootstrapping are dropped then: every row is done, they would only
        hold up the end (their snapshot and first ask take seconds)."""
        if self._final is not None or self._finished == 0:
            return None
        if self._finished < len(self._members) - self._bootstrapping:
            return None
        self._round += 1
        for worker in [w for w, m in self._members.items() if m.bootstrapping]:
            self._forget(worker)
            self._declined[worker] = self._round
            logger.info("final sync round %d forms without %s, which was still joining",
                        self._round, worker)
        self._final = SyncGroup(self._round, tuple(sorted(self._members)), final=True)
        for worker, member in self._members.items():
            if worker == caller:
                member.state = MemberState.DONE
            else:
                member.state = MemberState.ASSIGNED
                member.pending = self._final
        logger.info("final sync round %d with %d members", self._round, len(self._members))
        self._name_leader()
        return self._final

    def _name_leader(self) -> None:
        """(Re)name the final leader (O(members): once per job, and once per leader lost)."""
        self._leader = min(self._members, default=None)
        self._gathered = False
        self._adopting = sum(1 for worker, leader in self._adopted.items()
                             if leader == self._leader and worker != self._leader)
        if self._leader is not None:
            logger.info("final sync round %d: %s leads", self._round, self._leader)

    def _final_member(self, worker: str, what: str) -> None:
        """Raise :class:`SyncError` unless ``worker`` received the final round."""
        if self._member(worker).state is not MemberState.DONE:
            raise SyncError(f"{what} {worker!r}: expected a member that received the final "
                            f"round, found state {self.state(worker).value}")

    # -- who is waited for ----------------------------------------------------------------------
    def _idle_from(self, member: _Member, worker: str, now: float) -> None:
        """``member`` goes back to training at ``now``: file when it is expected to ask again
        (after its own typical span) and when it goes away (O(log n))."""
        member.state = MemberState.IDLE
        member.since = now
        span = member.span if member.span is not None else self._span
        ticket = next(self._tickets)
        if span is None or self.away_spans == 0:  # nothing to expect: wait for it
            member.expect, member.away_at = (now, ticket, worker), (math.inf, ticket, worker)
        else:
            away_at = now + min(self.max_wait_s, self.away_spans * span)
            member.expect = (min(now + span, away_at), ticket, worker)
            member.away_at = (away_at, ticket, worker)
        bisect.insort(self._expect, member.expect)
        bisect.insort(self._away_at, member.away_at)

    def _busy(self, member: _Member, now: float) -> None:
        """``member`` asks again: its span of training ends (O(log n))."""
        if member.expect is None:
            return
        span = max(0.0, now - member.since)
        self._span = span if self._span is None else \
            self._span + SPAN_WEIGHT * (span - self._span)
        member.span = span if member.span is None else \
            member.span + MEMBER_SPAN_WEIGHT * (span - member.span)
        self._idle_remove(member)

    def _idle_remove(self, member: _Member) -> None:
        for ordered, key in ((self._expect, member.expect), (self._away_at, member.away_at)):
            if key is None:
                continue
            pos = bisect.bisect_left(ordered, key)
            assert ordered[pos] == key
            del ordered[pos]
        member.expect = member.away_at = None

    def _awaited(self, worker: str, caller: _Member, now: float) -> int:
        """The members a group formed for ``caller`` (``worker``) at ``now`` waits for
        (O(log n + its unreachable peers)): every member still training, less those away, those
        it cannot reach and, unless the caller is idle, those not expected to ask within
        ``WAIT_SPANS`` of the caller's own spans (they would hold up its rounds; they are
        grouped when they ask)."""
        active = len(self._members) - self._finished - self._bootstrapping
        span = caller.span if caller.span is not None else self._span
        due = math.inf if self.away_spans == 0 or span is None or caller.idle \
            else now + WAIT_SPANS * span
        cut = sum(self._awaitable(self._members.get(peer), now, due)
                  for peer in self.reach.peers(worker, now))
        if self.away_spans == 0:
            return active - cut
        away = bisect.bisect_right(self._away_at, (now, math.inf))
        late = len(self._expect) - bisect.bisect_right(self._expect, (due, math.inf))
        return active - away - late - cut

    def _awaitable(self, member: _Member | None, now: float, due: float) -> bool:
        """Whether :meth:`_awaited` counts ``member`` (training, not away, expected before
        ``due``)."""
        if member is None or member.bootstrapping or member.state in (MemberState.FINISHED,
                                                                       MemberState.DONE):
            return False
        if self.away_spans == 0:
            return True
        return not ((member.away_at is not None and member.away_at[0] <= now)
                    or (member.expect is not None and member.expect[0] > due))

    def _pool_remove(self, member: _Member) -> None:
        assert member.key is not None
        pos = bisect.bisect_left(self._pool, member.key)
        assert self._pool[pos] == member.key
        del self._pool[pos]
        member.key = None

    def _member(self, worker: str) -> _Member:
        member = self._members.get(worker)
        if member is None:
            if worker in self._declined:
                raise SyncError(f"{worker!r} is no longer a sync member: the final round "
                                f"{self._declined[worker]} formed while it was joining (every "
                                "row is done; it trains nothing)")
            raise SyncError(f"{worker!r} is not a sync member ({len(self._members)} members); "
                            "call join first")
        return member
