"""The worker's active side of the async mode's model sync: :class:`BackgroundSync` is ShadowSync's
background thread that exchanges with the groups the scheduler names while the training thread
goes on (:class:`~antdt.sync.serving.SyncWorkerPlugin` answers the peers meanwhile).

Joining a running job (a replacement worker the nanny started, or an added one): the agent builds
its :class:`~antdt.sync.replica.ReplicaSync` from a freshly built model as usual and, before its
first training step, calls::

    sync = BackgroundSync(replica, job)           # inside the agent's task on the new worker
    peer = sync.start(join=True)                  # blocks until the replica is current
    ...train as usual...

``start(join=True)`` asks the scheduler to add the worker (``antdt_sync_join``), waits until every
other member applied a member list naming it (so no source drops entries it still needs), then
pulls a whole :class:`~antdt.sync.replica.ReplicaSnapshot` from a live member
(``antdt_sync_snapshot``: its tables and dense parameters and its cursor per source, taken under
its replica lock), copies it into the replica in place and starts syncing; newer entries are
pulled as usual. Until it says it started (``antdt_sync_started``), nobody's group and not the
final round wait for it. It returns the peer it bootstrapped from (None for a member listed in
``start_job``: those need no snapshot, so ``join=True`` is harmless there). It raises
:class:`~antdt.errors.SyncError` when the job's final round formed first, when no member
acknowledged within ``antdt.sync.join-timeout``, or when no live member could serve a snapshot
(then the model only lives in a checkpoint); the worker has left the job's sync again by then.

The end (:meth:`BackgroundSync.finish`, once the agent's training ended): one final round of all
members. Its leader (:meth:`~antdt.sync.SyncScheduler.final_leader`) pulls every other member's
entries and dense snapshot, retrying while a failed peer is still a member, and merges them: one
dense average over all, every live member's entries. Each other member then sends the leader the
mask of its changed rows (``antdt_sync_rows``, 1/8 byte a row) and writes the leader's values of
the rows either of them changed, and its dense parameters, in place: the replicas end
bit-identical, and what crosses the network is the rows trained during the job, not the tables.

Partitions: a regular round's pull of a peer unanswered for ``antdt.sync.pull-timeout`` fails the
exchange with that peer, and the worker reports the peer unreachable with its next group ask
(unless the scheduler did not answer it either: :class:`CutOff`); the scheduler then groups
neither of the pair for a while (:mod:`antdt.sync.reach`). A worker that
reaches no other member is answered ``cut``: its rounds do not count for the staleness bound,
whose wait then holds its training past ``antdt.sync.max-wait`` (nothing it trains could be
synced) until a round ends again, the scheduler answers anything else, or the sync stops; the
monitor calls it partitioned and the controller retires it.

Defaults (period, timeouts) come from ``antdt.sync`` in dask config.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, cast

from distributed import Worker, get_worker
from distributed.metrics import time
from distributed.protocol import to_serialize
from distributed.utils import sync

from antdt import config, rpc
from antdt.errors import SyncError
from antdt.sync.period import Staleness, SyncPeriod
from antdt.sync.replica import (PEER_FAILURES, ExchangeReport, PeerPayload, ReplicaSnapshot,
                                ReplicaSync)
from antdt.sync.serving import SyncWorkerPlugin
from antdt.sync.wire import (PLUGIN_NAME, FinalMsg, GroupMsg, JoinMsg, MembersMsg, PullMsg,
                             RowsMsg, SnapshotMsg, mask_to_bits, msg_to_payload, msg_to_rows,
                             msg_to_snapshot)

logger = logging.getLogger(__name__)

MEMBER_CHECK_S = 1.0
"""A pull unanswered this long makes the puller check that the peer is still a member."""


class CutOff(TimeoutError):
    """A peer's pull went unanswered and so did the scheduler's: this worker's own link is cut
    (from everyone, not from that peer), so the peer is not reported unreachable. The scheduler
    judges the worker by its hang rule; its peers' reports of it are confirmed only by its own
    (:mod:`antdt.sync.reach`), so a link that heals costs it no partition verdict."""


CUT_RETRY_S = 0.5
"""A worker the scheduler finds cut from every other member asks again after this long (its
training waits at its staleness bound meanwhile)."""

LEADER_RETRY_S = 0.5
"""In the final round, wait this long before asking again after a failed pull of a member (by
the leader) or of the leader's rows."""


class BackgroundSync:
    """ShadowSync's background thread on one worker: every ``period`` (seconds, or batches the
    training thread reports with :meth:`batch_done`; a period in peer batches follows the
    members it learns) ask the scheduler for a group and exchange with it, while the training
    thread goes on.

    The agent builds the :class:`~antdt.sync.ReplicaSync`, calls :meth:`start` (``join=True``
    on a worker that joins a running job; see the module docstring) before its first training
    step, trains while holding ``replica.lock`` per step and calls ``replica.touch`` under it;
    it reports ``replica.ledger_offset()`` to the ledger and passes what the ledger accepted to
    ``replica.confirm``. Before each step it calls :meth:`before_step`, which waits while the
    replica is more than ``max_staleness`` (batches, or peer batches) past the period ahead of
    its newest finished round (:class:`~antdt.sync.Staleness`). At the end it calls
    :meth:`finish` (the final all-member round), or, to abandon the job, :meth:`stop`, then its
    last report to the ledger, then :meth:`leave`. An error in the thread that is not a peer's
    or the scheduler's failure is re-raised there.

    ``worker`` defaults to the worker running the calling task; ``period``,
    ``rpc_timeout_s``, ``pull_timeout_s`` (a regular round's pull) and ``max_staleness`` to
    ``antdt.sync.period``, ``antdt.sync.rpc-timeout``, ``antdt.sync.pull-timeout`` and
    ``antdt.sync.max-staleness``.
    """

    def __init__(self, replica: ReplicaSync, job: str, *, worker: Worker | None = None,
                 period: SyncPeriod | None = None, rpc_timeout_s: float | None = None,
                 pull_timeout_s: float | None = None,
                 max_staleness: int | str | None = "config") -> None:
        self.staleness = Staleness(config.get("antdt.sync.max-staleness")
                                   if max_staleness == "config" else max_staleness)
        self._staleness_wait_s = config.seconds("antdt.sync.max-wait")
        self.waited_s = 0.0  # seconds the training thread waited for rounds
        if period is None:
            period = SyncPeriod.parse(config.get("antdt.sync.period"),
                                      where="dask config antdt.sync.period")
        if rpc_timeout_s is None:
            rpc_timeout_s = config.seconds("antdt.sync.rpc-timeout")
        if pull_timeout_s is None:
            pull_timeout_s = config.seconds("antdt.sync.pull-timeout")
        if rpc_timeout_s <= 0 or pull_timeout_s <= 0:
            raise SyncError(f"rpc_timeout_s and pull_timeout_s must be > 0, found "
                            f"{rpc_timeout_s} and {pull_timeout_s}")
        self.worker = worker if worker is not None else get_worker()
        plugin = self.worker.plugins.get(PLUGIN_NAME)
        if not isinstance(plugin, SyncWorkerPlugin):
            raise SyncError(f"worker {self.worker.address} has no {PLUGIN_NAME!r} plugin: "
                            "register antdt.sync.service.SyncService on the scheduler first")
        if replica.worker != self.worker.address:
            raise SyncError(f"replica belongs to {replica.worker!r}, this worker is "
                            f"{self.worker.address!r}")
        self.replica = replica
        self.job = job
        self.period = period
        self.rpc_timeout_s = rpc_timeout_s
        self.pull_timeout_s = pull_timeout_s
        self.cut_off = False  # the scheduler's last answer: this worker reaches no member
        self._unreachable: set[str] = set()  # peers to report with the next group ask
        self.exchanges = 0  # exchanges done (regular and final)
        self.peers_merged = 0  # peers merged over all exchanges
        self.peers_failed = 0  # peers skipped over all exchanges
        self.bytes_received = 0  # tensor bytes pulled over all exchanges (what the job moved)
        self.last_report: ExchangeReport | None = None
        self.bootstrapped_from: str | None = None  # the member a joiner adopted the state of
        self.final_leader: str | None = None  # the final leader this replica ended equal to
        self._plugin = plugin
        self._members_version = -1
        self._members: list[str] = []
        self._stop = threading.Event()
        self._hurry = threading.Event()
        self._batches = 0  # batches trained since the last round began (a period in batches)
        self.batches_trained = 0  # by the training thread; the scheduler tells idle asks by it
        self._every = period.batches_for(1)  # ...and how many start the next one
        self.staleness.follow(self._every)
        self._batches_lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"antdt-sync-{job}", daemon=True)

    @property
    def synced_offset(self) -> int:
        """See :meth:`antdt.sync.EmbeddingDeltaLog.synced_offset`."""
        return self.replica.synced_offset()

    @property
    def thread_id(self) -> int | None:
        """The background thread's identifier (None before it started)."""
        return self._thread.ident

    def start(self, *, join: bool = False, timeout_s: float | None = None) -> str | None:
        """Learn the members, start serving peers and start the background thread.

        With ``join``, first join the running job and adopt a live member's snapshot (within
        ``timeout_s``, default ``antdt.sync.join-timeout``); return that member, or None when
        this worker was listed in ``start_job`` (no snapshot needed). See the module docstring.
        """
        if join:
            self.bootstrapped_from = self._join(
                config.seconds("antdt.sync.join-timeout") if timeout_s is None else timeout_s)
        else:
            msg: MembersMsg = self._ask("antdt_sync_members", job=self.job)
            self._set_members(msg)
        self._plugin.attach(self.job, self.replica)
        self._thread.start()
        return self.bootstrapped_from

    def stop(self) -> None:
        """Stop exchanging and serving without a final round. Then make the last report to the
        ledger, give the leases back, :meth:`leave` and :meth:`raise_if_failed`."""
        self._halt()
        self._plugin.detach(self.job)

    def leave(self) -> None:
        """Leave the job's sync after :meth:`stop` and the worker's last report to the ledger:
        the others' final round no longer waits for this worker, and they take its entries
        past the rows the ledger counts synced out again (it trains those again)."""
        try:
            self._ask("antdt_sync_leave", job=self.job, worker=self.worker.address)
        except (OSError, TimeoutError) as exc:  # the scheduler drops us when we go anyway
            logger.warning("sync job %s: could not leave (scheduler unreachable): %r", self.job,
                           exc)

    def finish(self, timeout_s: float | None = None) -> ExchangeReport:
        """Stop the periodic exchanges and take part in the final all-member round (see the
        module docstring): gather it as its leader, or adopt the leader's rows, so the replicas
        end bit-identical; keep serving peers until every member did (or ``timeout_s``, default
        ``antdt.sync.final-timeout``, passed: logged). Returns this worker's part of the final
        round: the leader's merge, or the rows copied from the leader, with the bytes received
        and sent."""
        if timeout_s is None:
            timeout_s = config.seconds("antdt.sync.final-timeout")
        self._halt()
        self.raise_if_failed()
        deadline = time() + timeout_s
        try:
            round = self._final_group(deadline, timeout_s)
            report = self._final_round(round, deadline)
        finally:
            self._plugin.detach(self.job)
        self._record(report)
        return report

    # -- joining and the end -------------------------------------------------------------------
    def _join(self, timeout_s: float) -> str | None:
        """Join the running job and adopt a live member's snapshot (see the module docstring);
        on failure leave the job again, so nobody's final round waits for this worker."""
        deadline = time() + timeout_s
        try:
            msg: JoinMsg = self._ask("antdt_sync_join", job=self.job,
                                      worker=self.worker.address)
            while not msg["settled"]:
                if time() > deadline:
                    raise SyncError(f"sync job {self.job}: members {msg['waiting'][:10]} did not "
                                    f"acknowledge {self.worker.address} within {timeout_s}s")
                msg = self._ask("antdt_sync_join", job=self.job,
                                 worker=self.worker.address)
            self._set_members(msg)
            if not msg["bootstrap"]:
                return None
            peers = [m for m in msg["members"] if m != self.worker.address]
            for peer in peers:
                try:
                    snapshot = self._snapshot_of(peer, max(deadline - time(),
                                                           self.rpc_timeout_s))
                except PEER_FAILURES as exc:
                    logger.warning("sync job %s: no snapshot from %s: %r", self.job, peer, exc)
                    continue
                self.replica.adopt(snapshot)
                # the snapshot's provisional entries of members that left: out again
                self._set_members(self._ask("antdt_sync_members", job=self.job))
                self._ask("antdt_sync_started", job=self.job, worker=self.worker.address)
                logger.info("sync job %s: %s joined from %s's snapshot", self.job,
                            self.worker.address, peer)
                return peer
            raise SyncError(f"sync job {self.job}: no live member of {peers} could serve a "
                            f"snapshot to {self.worker.address}; the model only lives in a "
                            "checkpoint now")
        except BaseException:
            with contextlib.suppress(OSError, TimeoutError):
                self._ask("antdt_sync_leave", job=self.job,
                           worker=self.worker.address)
            raise

    def _final_group(self, deadline: float, timeout_s: float) -> int:
        """Ask for the final group until it forms; return its round. A regular group a partner
        put this worker in before it finished is exchanged with first."""
        while True:
            if time() > deadline:
                raise TimeoutError(f"sync job {self.job}: no final round within {timeout_s}s")
            msg = self._ask_group(final=True)
            if msg is None or msg["kind"] != "group":
                continue
            assert msg["round"] is not None
            if msg["final"]:
                return msg["round"]
            self._record(self._exchange(msg["round"], msg["members"]))

    def _final_round(self, round: int, deadline: float) -> ExchangeReport:
        """This worker's part of the final round, step by step as the scheduler says, serving
        peers meanwhile, until every member adopted the leader's rows (or ``deadline``: logged).
        A leader that leaves is replaced: the new one gathers, the others adopt from it."""
        report = ExchangeReport(round)
        gathered = False
        adopted: str | None = None
        while True:
            msg: FinalMsg = self._ask("antdt_sync_complete", job=self.job,
                                       worker=self.worker.address, gathered=gathered,
                                       adopted_from=adopted)
            leader = msg["leader"]
            if msg["step"] == "done":
                self.final_leader = leader
                return report
            if msg["step"] == "gather":
                self._gather(report, deadline)
                gathered = True
            elif msg["step"] == "adopt" and leader is not None:
                try:
                    self._adopt_rows(leader, report, deadline)
                    adopted = leader
                except PEER_FAILURES as exc:
                    logger.warning("sync job %s: no rows from the final leader %s: %r", self.job,
                                   leader, exc)
                    # back off: the scheduler names a new leader once it notices the death
                    threading.Event().wait(LEADER_RETRY_S)
            if time() > deadline:
                logger.warning("sync job %s: members still finishing after the final timeout; "
                               "stop serving anyway", self.job)
                return report

    def _gather(self, report: ExchangeReport, deadline: float) -> None:
        """As the final leader: pull every other member's entries and dense snapshot of the
        final round, then merge them at once (one dense average over all). A pull that failed on
        the way (the peer slow or unreachable) is tried again while the peer is still a member
        and ``deadline`` allows, so the leader holds every live member's entries."""
        own = self.replica.prepare(report.round)
        payloads: dict[str, PeerPayload] = {}
        failed: list[str] = []
        while True:
            self._set_members(self._ask("antdt_sync_members", job=self.job))
            since = {peer: self.replica.log.applied_seq(peer) for peer in self._members
                     if peer != self.worker.address and peer not in payloads}
            results = self._call(self._fetch_all, report.round, since, self.rpc_timeout_s)
            payloads.update((peer, r) for peer, r in results.items() if isinstance(r, PeerPayload))
            failed = [peer for peer, r in results.items() if not isinstance(r, PeerPayload)]
            if time() > deadline or not any(isinstance(results[peer], (OSError, TimeoutError))
                                            for peer in failed):
                break
            threading.Event().wait(LEADER_RETRY_S)
        merged = self.replica.merge(report.round, own, list(payloads.values()))
        report.merged += merged.merged
        report.failed += failed + merged.failed
        report.rows_applied += merged.rows_applied
        report.bytes_received += merged.bytes_received
        logger.info("sync job %s: %s gathered the final round from %d members (%d failed)",
                    self.job, self.worker.address, len(merged.merged), len(report.failed))

    def _adopt_rows(self, leader: str, report: ExchangeReport, deadline: float) -> None:
        """Send the final leader our changed rows and write its answer in place (see
        :meth:`ReplicaSync.adopt_rows`)."""
        bits = mask_to_bits(self.replica.changed_rows())
        timeout_s = max(deadline - time(), self.rpc_timeout_s)

        async def fetch() -> RowsMsg:
            return cast(RowsMsg, rpc.ok(await asyncio.wait_for(
                self.worker.rpc(leader).antdt_sync_rows(job=self.job,
                                                        requester=self.worker.address,
                                                        changed=to_serialize(bits)),
                timeout_s), error=SyncError))

        rows = msg_to_rows(self._call(fetch, callback_timeout=timeout_s + self.rpc_timeout_s))
        copied = self.replica.adopt_rows(rows)
        report.merged.append(leader)
        report.rows_copied += copied
        report.bytes_received += rows.nbytes
        report.bytes_sent += bits.nbytes
        logger.info("sync job %s: %s adopted %d rows of %s (%d bytes)", self.job,
                    self.worker.address, copied, leader, rows.nbytes + bits.nbytes)

    def _snapshot_of(self, peer: str, timeout_s: float) -> ReplicaSnapshot:
        async def fetch() -> SnapshotMsg:
            msg = cast(SnapshotMsg, rpc.ok(await asyncio.wait_for(
                self.worker.rpc(peer).antdt_sync_snapshot(job=self.job,
                                                          requester=self.worker.address),
                timeout_s), error=SyncError))
            return msg

        return msg_to_snapshot(self._call(fetch, callback_timeout=timeout_s + self.rpc_timeout_s))

    # -- the thread ----------------------------------------------------------------------------
    def hurry(self) -> None:
        """Start the next round now rather than at the end of the period (e.g. the worker is
        idle, waiting for its rows to be synced)."""
        self._hurry.set()

    def before_step(self) -> float:
        """The training thread is about to step: wait while its replica runs more than the
        staleness bound past the period ahead of the newest finished round (at most
        ``antdt.sync.max-wait``); return the seconds waited."""
        limit = self.staleness.limit
        if self._every is None and limit is not None and self.staleness.lag > limit:
            # a period in seconds may not start the round soon enough; one in batches started
            # it at the period's last batch, and a second hurry would start an empty round
            # right after it
            self._hurry.set()
        waited = self.staleness.wait(self._staleness_wait_s)
        self.waited_s += waited
        return waited

    def batch_done(self) -> None:
        """The training thread finished a batch. With a period in (peer) batches, the period's
        last batch starts the next round (at once if the thread is idle, else when its round
        ends), and the training thread cuts the round's deltas and dense snapshot itself
        (:meth:`ReplicaSync.cut`): it is between two steps, so the round need not wait for
        the replica lock through the next one."""
        self.staleness.trained()
        self.batches_trained += 1  # only the training thread writes it
        every = self._every
        if every is None:
            return
        with self._batches_lock:
            self._batches += 1
            due = self._batches >= every
        if due:
            self.replica.cut()
            self._hurry.set()

    def _run(self) -> None:
        pages = self.replica.page_steps()
        try:
            while True:
                due = None if self.period.seconds is None else time() + self.period.seconds
                self._move_pages(pages, due)
                # in batches (due None): until batch_done wakes it
                self._hurry.wait(None if due is None else max(0.0, due - time()))
                self._hurry.clear()
                if self._stop.is_set():
                    break
                with self._batches_lock:
                    self._batches = 0
                covered = self.staleness.round_started()
                ended = True
                try:
                    ended = self._round()
                except PEER_FAILURES as exc:  # a background round is only retried later
                    logger.warning("sync job %s: round failed, next one in %s: %r", self.job,
                                   self.period, exc)
                finally:
                    if ended:  # whatever else happened, the scheduler did not say cut
                        self.staleness.hold(False)
                        self.staleness.round_ended(covered)
        except BaseException as exc:  # handed to the agent (raise_if_failed, stop, finish)
            logger.error("sync thread of job %s failed", self.job, exc_info=True)
            self._error = exc
            self.staleness.release()

    def _move_pages(self, pages: Iterator[int], due: float | None) -> None:
        """Take steps of moving the replica onto huge pages until a round is due (woken, or at
        ``due``) or none are left: a step is a few ms, a round waits for one at most."""
        while not self._hurry.is_set() and (due is None or time() < due):
            if next(pages, None) is None:
                return

    def _halt(self) -> None:
        self.replica.drop_cut()
        self.staleness.release()
        self._stop.set()
        self._hurry.set()
        if self._thread.is_alive():
            self._thread.join()

    def raise_if_failed(self) -> None:
        """Raise :class:`SyncError` if the background thread died (its error is the cause)."""
        if self._error is not None:
            raise SyncError(f"sync thread of job {self.job} failed") from self._error

    def _round(self) -> bool:
        """One background round: ask for a group and exchange with it; False when the
        scheduler answered that this worker reaches no other member (the round does not count
        for the staleness bound, which holds the training until a round that is not cut ends;
        another ask follows after ``CUT_RETRY_S``). A period in batches counts from the moment
        the group formed, the same for all its members, so that they are due together again
        (counted from each one's ask, the first to ask would wait for the others in every
        round).

        A group that forms once the thread is being stopped is not exchanged with: the final
        round follows (or the worker leaves), and it subsumes the group's merge, as its leader
        gathers every member's entries and the others adopt its rows. The partners still pull
        from this replica, which serves them until the final round ends. At a job's end that
        round of every member cost the tail 60–130 ms with 4 workers on 2 cores."""
        msg = self._ask_group(final=False)
        cut = msg is not None and msg["kind"] == "cut"
        if cut != self.cut_off:
            logger.warning("sync job %s: %s %s", self.job, self.worker.address,
                           "reaches no other member: training waits" if cut
                           else "reaches its peers again")
        self.cut_off = cut
        if cut:
            self.staleness.hold(True)
            if not self._stop.wait(CUT_RETRY_S):
                self._hurry.set()
            return False
        if msg is None or msg["kind"] != "group":
            return True
        assert msg["round"] is not None
        with self._batches_lock:
            self._batches = 0
            self._hurry.clear()  # a wake-up for the period that just ended is stale...
        if self._stop.is_set():
            self._hurry.set()  # ...but _halt's (it sets the stop first) must not be lost
            return True
        self._record(self._exchange(msg["round"], msg["members"]))
        return True

    def _ask_group(self, final: bool) -> GroupMsg | None:
        """The scheduler's answer to ``antdt_sync_group`` (None when it is unreachable); a new
        member list is applied before the group is exchanged with. The ask reports the peers
        whose pulls went unanswered since the last one, and the stale messages the replica
        refused so far."""
        unreachable = sorted(self._unreachable)
        try:
            msg: GroupMsg = self._ask("antdt_sync_group", job=self.job,
                                       worker=self.worker.address,
                                       progress=self.replica.rows_offset, final=final,
                                       members_version=self._members_version,
                                       batches=self.batches_trained, unreachable=unreachable,
                                       refused=self.replica.refused)
        except (OSError, TimeoutError) as exc:
            logger.warning("sync job %s: scheduler unreachable, retrying: %r", self.job, exc)
            return None
        self._unreachable.difference_update(unreachable)
        if msg["members_version"] != self._members_version:
            self._set_members(self._ask("antdt_sync_members", job=self.job))
        return msg

    def _record(self, report: ExchangeReport) -> None:
        self.exchanges += 1
        self.bytes_received += report.bytes_received
        self.peers_merged += len(report.merged)
        self.peers_failed += len(report.failed)
        self.last_report = report
        if report.failed:
            logger.warning("sync job %s round %d: skipped peers %s", self.job, report.round,
                           report.failed)

    def _exchange(self, round: int, members: Sequence[str]) -> ExchangeReport:
        own = self.replica.prepare(round)
        peers = [m for m in members if m != self.worker.address]
        since = {peer: self.replica.log.applied_seq(peer) for peer in peers}
        results = self._call(self._fetch_all, round, since, self.pull_timeout_s)
        self._unreachable.update(peer for peer, r in results.items()
                                 if isinstance(r, (OSError, TimeoutError))
                                 and not isinstance(r, CutOff))
        payloads = [r for r in results.values() if isinstance(r, PeerPayload)]
        failed = [peer for peer, r in results.items() if not isinstance(r, PeerPayload)]
        report = self.replica.merge(round, own, payloads)
        report.failed[:0] = failed
        return report

    async def _fetch_all(self, round: int, since: Mapping[str, int],
                         timeout_s: float) -> dict[str, PeerPayload | BaseException]:
        """Pull every peer at once; a peer's failure is its result, not the exchange's. A pull
        unanswered for ``timeout_s`` fails (a ``TimeoutError``), and one that is slow to answer
        is given up sooner once the peer is no longer a member (its worker left the cluster,
        e.g. retired while hung). A pull that failed on the link is checked against the
        scheduler: when it does not answer either, this worker's own link is cut, and the
        failure is a :class:`CutOff` (the peer is not reported)."""
        async def fetch(peer: str) -> PeerPayload:
            try:
                return await self._pull(peer, round, since[peer], timeout_s)
            except (OSError, TimeoutError) as exc:
                members = await self._members_within(self.pull_timeout_s)
                if members is None:
                    raise CutOff(f"{peer}: {exc!r}, and the scheduler did not answer in "
                                 f"{self.pull_timeout_s:g}s either") from exc
                if peer not in members:
                    raise SyncError(f"{peer} left the job's members while we pulled") from exc
                raise

        results = await asyncio.gather(*(fetch(peer) for peer in since), return_exceptions=True)
        out: dict[str, PeerPayload | BaseException] = {}
        for peer, result in zip(since, results):
            if isinstance(result, BaseException) and not isinstance(result, PEER_FAILURES):
                raise result
            if isinstance(result, BaseException):
                logger.warning("sync job %s round %d: peer %s skipped: %r", self.job, round,
                               peer, result)
            out[peer] = result
        return out

    async def _pull(self, peer: str, round: int, since_seq: int, timeout_s: float
                    ) -> PeerPayload:
        """``peer``'s entries past ``since_seq`` for ``round``, within ``timeout_s`` (else a
        ``TimeoutError``), checking every ``MEMBER_CHECK_S`` that it is still a member."""
        pull = asyncio.ensure_future(self.worker.rpc(peer).antdt_sync_pull(
            job=self.job, requester=self.worker.address, round=round, since_seq=since_seq))
        deadline = time() + timeout_s
        try:
            while (left := deadline - time()) > 0:
                done, _ = await asyncio.wait([pull], timeout=min(left, MEMBER_CHECK_S))
                if done:
                    return msg_to_payload(cast(PullMsg, rpc.ok(pull.result(), error=SyncError)))
                members = await self._members_within(deadline - time())
                if members is not None and peer not in members:
                    raise SyncError(f"{peer} left the job's members while we pulled")
            raise TimeoutError(f"{peer} did not answer in {timeout_s:g}s")
        finally:
            pull.cancel()

    async def _members_within(self, timeout_s: float) -> list[str] | None:
        """The job's members, or None when the scheduler did not answer within ``timeout_s``
        (this worker's own link is cut, or the scheduler is busy)."""
        ask = self.worker.scheduler.antdt_sync_members(job=self.job)
        try:
            msg = await asyncio.wait_for(ask, timeout=max(timeout_s, 0.0))
        except (OSError, TimeoutError):
            return None
        return list(cast(MembersMsg, rpc.ok(msg, error=SyncError))["members"])

    def _set_members(self, msg: MembersMsg | JoinMsg) -> None:
        """Apply a member list (and a period in peer batches to its size) and the departures
        (their entries past the rows the ledger counts synced go out of the replica); the next
        group call acknowledges its version."""
        members = msg["members"]
        self.replica.set_peers(members, msg["departed"])
        self._members = list(members)
        self._members_version = msg["members_version"]
        every = self.period.batches_for(len(members))
        if every != self._every:
            logger.info("sync job %s: %s starts a round every %s batch(es) with %d member(s) "
                        "(period %s)", self.job, self.worker.address, every, len(members),
                        self.period)
        self._every = every
        self.staleness.follow(every, len(members))

    def _ask(self, handler: str, **kwargs: Any) -> Any:
        """The scheduler's reply to ``handler`` (a :class:`SyncError` when it refused)."""
        return rpc.ok(self._call(getattr(self.worker.scheduler, handler), **kwargs),
                      error=SyncError)

    def _call(self, func: Callable[..., Awaitable[Any]], *args: Any,
              callback_timeout: float | None = None, **kwargs: Any) -> Any:
        """Run ``func`` on the worker's event loop from this (non-loop) thread."""
        return sync(self.worker.loop, func, *args,
                    callback_timeout=self.rpc_timeout_s * 2 if callback_timeout is None
                    else callback_timeout, **kwargs)
