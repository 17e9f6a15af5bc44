"""Partitions and zombies in the async mode's model sync: pairs reported unreachable are not grouped
(for a while), a member that reaches no other is told ``cut`` and named partitioned, its training
is held at its staleness bound; a payload or a request from a worker that is no member is refused
and counted, on the replica, on the worker's handlers and on the scheduler's."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.sync import ReplicaSync, Staleness, SyncError, SyncScheduler
from antdt.sync.background import BackgroundSync, CutOff
from antdt.sync.replica import PeerPayload
from antdt.sync.serving import SyncWorkerPlugin
from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME
from pipeline.bench.processes import DaskProcesses, freeze, thaw
from sync_cluster import initial_dense, initial_tables, ok, refused, service
from sync_replicas import make_dense, make_tables


def joined(names: list[str], group_size: int = 2, max_wait_s: float = 10.0) -> SyncScheduler:
    scheduler = SyncScheduler(group_size, max_wait_s, None, 0, unreachable_for_s=30.0)
    for name in names:
        scheduler.join(name)
    return scheduler


def test_a_pair_reported_unreachable_is_kept_apart_for_a_pull_s_timeout_then_tried_again(
        ) -> None:
    s = joined(["a", "b", "x"])  # kept apart for antdt.sync.pull-timeout: 5 s
    assert s.unreachable("a", ["x", "nobody"], now=0.0) == ["x"]  # non-members are ignored
    assert s.unreachable("x", ["a"], now=1.0) == []  # cut already: one link, both ways
    assert s.isolated(now=1.0) == {}  # each still reaches b
    assert s.ready("x", 10, now=1.0).kind == "wait"
    answer = s.ready("a", 10, now=2.0)  # x is ready and nearest, but a cannot reach it
    assert answer.kind == "wait"
    answer = s.ready("b", 0, now=2.5)
    assert answer.group is not None and answer.group.members == ("b", "x")
    assert s.ready("x", 10, now=3.0) == answer  # x picks its group up
    assert s.ready("x", 10, now=5.9).kind == "wait"  # a still waits, apart from x...
    answer = s.ready("x", 10, now=6.1)  # ...until the pair's time apart ran out
    assert answer.group is not None and answer.group.members == ("a", "x")


def test_a_group_waits_for_none_of_the_caller_s_unreachable_peers() -> None:
    s = joined(["a", "b", "x"], group_size=3, max_wait_s=3600.0)
    s.unreachable("x", ["a"], now=0.0)
    assert s.ready("a", 0, now=1.0).kind == "wait"  # a waits for b only, not for x
    answer = s.ready("b", 0, now=1.0)  # b waits for x, which a cannot reach...
    assert answer.kind == "wait"
    answer = s.ready("x", 0, now=1.5)  # ...x is grouped with b, a is left out
    assert answer.group is not None and answer.group.members == ("b", "x")


def test_a_member_that_reaches_no_other_is_cut_and_named_isolated() -> None:
    s = joined(["a", "b", "x"])
    s.unreachable("a", ["x"], now=0.0)
    assert s.ready("x", 0, now=0.5).kind == "wait"
    s.unreachable("b", ["x"], now=1.0)
    assert s.isolated(now=1.0) == {}  # only one side of each pair said so: a slow pull?
    s.unreachable("x", ["a", "b"], now=1.0)
    assert s.isolated(now=1.0) == {"x": ["a", "b"]}
    assert s.ready("x", 0, now=1.0).kind == "cut"  # taken out of the pool it waited in
    assert s.ready("a", 0, now=1.1).kind == "wait"  # for b only
    answer = s.ready("b", 0, now=1.2)
    assert answer.group is not None and answer.group.members == ("a", "b")
    s.leave("b")
    assert s.isolated(now=1.3) == {"a": ["x"], "x": ["a"]}  # two left, cut from each other
    s.leave("a")
    assert s.isolated(now=1.4) == {}  # alone: nobody to reach
    assert s.ready("x", 0, now=1.5).kind == "alone"


def test_two_members_cut_from_each_other_are_both_isolated() -> None:
    s = joined(["a", "b"])
    s.unreachable("a", ["b"], now=0.0)
    assert s.isolated(now=0.0) == {}
    assert s.ready("a", 0, now=0.1).kind == "alone"  # not grouped with b meanwhile
    s.unreachable("b", ["a"], now=0.2)
    assert s.isolated(now=0.2) == {"a": ["b"], "b": ["a"]}  # retiring either one mends it
    assert s.isolated(now=30.1) == {}  # a's report ran out
    s.leave("a")
    assert s.isolated(now=0.0) == {}


def test_a_held_gate_waits_past_its_timeout_until_a_round_ends() -> None:
    gate = Staleness(bound=0)
    gate.trained()
    assert gate.wait(timeout_s=0.01) > 0  # a plain wait gives up
    gate.hold(True)
    covered = gate.round_started()
    waiter = threading.Thread(target=gate.wait, args=(0.01,))
    waiter.start()
    waiter.join(timeout=0.5)  # the one wait for a duration: that the gate holds
    assert waiter.is_alive()
    gate.round_ended(covered)
    waiter.join(timeout=60)
    assert not waiter.is_alive()
    gate.trained()
    gate.hold(False)
    assert gate.wait(timeout_s=0.01) > 0  # no longer held: it gives up again


def test_a_payload_from_a_worker_that_is_no_member_is_refused_and_counted() -> None:
    a = ReplicaSync("a", make_dense(), make_tables(), peers=["b", "c"])
    c = ReplicaSync("c", make_dense(), make_tables(), peers=["a", "b"])
    with c.lock:
        c.tables["a"][0] += 1.0
        c.touch({"a": torch.tensor([0])}, rows_offset=10)
    a.set_peers(["b"], departed={"c": 0})  # the scheduler removed c
    stale = c.serve("a", 1, 0)
    before = a.tables["a"].clone()
    report = a.merge(1, a.prepare(1), [stale, PeerPayload("z", [], None, a.log.space.layout)])
    assert report.failed == ["c", "z"] and report.merged == [] and a.refused == 2
    torch.testing.assert_close(a.tables["a"], before)


def test_a_pull_from_a_worker_that_is_no_member_is_refused_and_counted() -> None:
    b = ReplicaSync("b", make_dense(), make_tables(), peers=["a"])
    with pytest.raises(SyncError, match="'z' refused by 'b': it is no member"):
        b.serve("z", 1, 0)
    assert b.refused == 1
    b.serve("a", 1, 0)
    b.set_peers([])  # a left
    with pytest.raises(SyncError, match="no member"):
        b.serve("a", 2, 0)
    assert b.refused == 2


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=60)
async def test_stale_sync_messages_are_refused_and_counted_per_job(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await c.register_plugin(SyncService(poll_s=0.2))
    sched, zombie = c.scheduler, "tcp://10.9.9.9:1"
    ok(await sched.antdt_sync_start(job="j", workers=[a.address, b.address], max_wait_s=0.05))
    refused(await sched.antdt_sync_group(job="j", worker=zombie, progress=0), "no member")
    refused(await sched.antdt_sync_complete(job="j", worker=zombie), "no member")
    refused(await sched.antdt_sync_started(job="j", worker=zombie), "no member")
    refused(await sched.antdt_sync_join(job="j", worker=zombie), "not in the cluster")
    assert service(s).stale_refused("j") == 4
    plugin = b.plugins[PLUGIN_NAME]
    assert isinstance(plugin, SyncWorkerPlugin)
    plugin.attach("j", ReplicaSync(b.address, initial_dense(), initial_tables(),
                                   peers=[a.address]))
    pull = a.rpc(b.address).antdt_sync_pull
    ok(await pull(job="j", requester=a.address, round=1, since_seq=0))
    refused(await pull(job="j", requester=zombie, round=1, since_seq=0), "no member")
    refused(await a.rpc(b.address).antdt_sync_snapshot(job="j", requester=zombie), "no member")
    assert plugin.refused("j") == 2
    ok(await sched.antdt_sync_group(job="j", worker=b.address, progress=0,
                                    refused=plugin.refused("j")))  # reported with its ask
    assert service(s).stale_refused("j") == 6
    plugin.detach("j")
    assert plugin.refused("j") == 2 and plugin.refused("other") == 0
    ok(await sched.antdt_sync_group(job="j", worker=a.address, progress=0,
                                    unreachable=[b.address]))
    assert service(s).partitioned("j") == {}  # b has not said so
    ok(await sched.antdt_sync_group(job="j", worker=b.address, progress=0,
                                    unreachable=[a.address]))
    assert service(s).partitioned("j") == {
        w: f"reaches no sync peer (1 unreachable: {o})"
        for w, o in ((a.address, b.address), (b.address, a.address))}
    reply = ok(await sched.antdt_sync_group(job="j", worker=b.address, progress=0))
    assert reply["kind"] == "cut"
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress=0,
                                         unreachable="b"), "unreachable must be a list")
    ok(await sched.antdt_sync_stop(job="j"))
    assert service(s).stale_refused("j") == 6 and service(s).partitioned("j") == {}


def test_a_pair_one_side_reported_is_grouped_again_after_a_pull_s_timeout() -> None:
    s = SyncScheduler(2, 10.0, None, 0, unreachable_for_s=30.0, apart_s=1.0)
    for name in ("a", "b", "x"):
        s.join(name)
    s.unreachable("a", ["x"], now=0.0)  # x did not pull a in that round: cut off, or healed
    s.unreachable("b", ["x"], now=0.0)
    assert s.ready("x", 0, now=0.5).kind == "alone"  # kept apart from both for now
    assert s.ready("a", 0, now=0.6).kind == "wait"
    answer = s.ready("x", 0, now=1.1)  # x's link healed: it syncs again, no 30 s apart
    assert answer.group is not None and answer.group.members == ("a", "x")
    assert s.ready("a", 0, now=1.2) == answer
    s.unreachable("a", ["x"], now=3.0)  # it did not heal: the round failed on both sides...
    s.unreachable("x", ["a"], now=3.1)
    assert s.isolated(now=3.1) == {}  # ...b was not tried yet
    s.unreachable("b", ["x"], now=4.0)
    s.unreachable("x", ["b"], now=4.0)
    assert s.isolated(now=4.0) == {"x": ["a", "b"]}
    assert s.ready("x", 0, now=30.0).kind == "cut"  # isolated while the reports count: 30 s


def test_a_pull_that_fails_while_the_scheduler_is_unreachable_too_reports_no_peer(
        tmp_path: Path) -> None:
    """A worker cut from everyone reports none of its peers (it is the monitor's hung worker):
    otherwise, once its link heals, its reports would confirm its peers' and retire it as
    partitioned. The scheduler is a process of its own here, stopped as a cut link is silent."""
    async def main(cluster: DaskProcesses) -> None:
        async with Client(cluster.address, asynchronous=True) as c, \
                Worker(cluster.address, nthreads=1) as a, Worker(cluster.address, nthreads=1) as b:
            await c.register_plugin(SyncService(poll_s=0.2))
            ok(await c.scheduler.antdt_sync_start(job="j", workers=[a.address, b.address]))
            replica = ReplicaSync(a.address, initial_dense(), initial_tables(), peers=[b.address])
            sync = BackgroundSync(replica, "j", worker=a, pull_timeout_s=0.5)
            loop = asyncio.get_running_loop()
            await b.close()  # the peer is gone, and the scheduler says so: no report either
            report = await loop.run_in_executor(None, sync._exchange, 1, [a.address, b.address])
            assert report.failed == [b.address] and sync._unreachable == set()
            freeze(cluster.scheduler.pid)  # now the scheduler does not answer
            try:
                results = await sync._fetch_all(2, {b.address: 0}, 0.5)
                report = await loop.run_in_executor(None, sync._exchange, 3,
                                                    [a.address, b.address])
            finally:
                thaw(cluster.scheduler.pid)
            assert isinstance(results[b.address], CutOff), results
            assert report.failed == [b.address] and sync._unreachable == set()

    with DaskProcesses(tmp_path) as cluster:
        asyncio.run(main(cluster))
