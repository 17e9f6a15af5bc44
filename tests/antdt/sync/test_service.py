"""SyncService's handlers on a gen_cluster, called as workers call them: their argument checks (and
SyncWorkerPlugin's), joins settled by acknowledgements, groups and final rounds formed at once."""

from __future__ import annotations

import asyncio

import numpy as np
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.sync import ReplicaSync
from antdt.sync.serving import SyncWorkerPlugin
from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME, msg_to_rows
from sync_cluster import initial_dense, initial_tables, ok, refused, service


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=60)
async def test_a_member_that_finishes_lets_the_waiting_ones_group_at_once(
        c: Client, s: Scheduler, a: Worker, b: Worker, w: Worker) -> None:
    """Three members in groups of three: two wait for a full group; when the third finishes
    training, two make a full group and they are told now, not when their wait (an hour)
    runs out."""
    await c.register_plugin(SyncService(poll_s=3600.0))
    sched = c.scheduler
    ok(await sched.antdt_sync_start(job="j", workers=[a.address, b.address, w.address],
                                    group_size=3, max_wait_s=3600.0))
    waiting = [asyncio.create_task(sched.antdt_sync_group(job="j", worker=x.address,
                                                          progress=10)) for x in (a, b)]
    groups = s.plugins[PLUGIN_NAME].jobs["j"]

    async def both_wait() -> None:
        while len(groups.waiting()) < 2:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(both_wait(), 30)
    assert not any(task.done() for task in waiting)
    finished = asyncio.create_task(sched.antdt_sync_group(job="j", worker=w.address,
                                                          progress=10, final=True))
    answers = [ok(answer) for answer in await asyncio.wait_for(asyncio.gather(*waiting), 30)]
    assert [answer["kind"] for answer in answers] == ["group", "group"]
    assert sorted(answers[0]["members"]) == sorted([a.address, b.address])
    assert not finished.done()  # the others have not finished: no final round yet
    finished.cancel()


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2)
async def test_handlers_validate_their_arguments(c: Client, s: Scheduler, a: Worker,
                                                 b: Worker) -> None:
    await c.register_plugin(SyncService(poll_s=1.0))
    sched = c.scheduler
    refused(await sched.antdt_sync_start(job="j", workers=["tcp://nowhere:1"]),
            "not in the cluster")
    refused(await sched.antdt_sync_start(job="j", workers="abc"), "list of addresses")
    refused(await sched.antdt_sync_start(job="j", workers=[a.address], group_size="four"),
            "group_size must be")
    refused(await sched.antdt_sync_start(job=5, workers=[a.address]), "job must be a str")
    ok(await sched.antdt_sync_start(job="j", workers=[a.address, b.address], max_wait_s=0.1))
    refused(await sched.antdt_sync_start(job="j", workers=[a.address]), "already started")
    refused(await sched.antdt_sync_group(job="nope", worker=a.address, progress=0),
            "unknown sync job")
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress=-1),
            "progress must be")
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress="1"),
            "progress must be")
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress=0,
                                         members_version="2"), "members_version must be")
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress=0, batches=-1),
            "batches must be")
    refused(await sched.antdt_sync_group(job="j", worker=["w"], progress=0),
            "worker must be a str")
    refused(await sched.antdt_sync_group(job="j", worker=a.address, progress=0, final=1),
            "final must be a bool")
    refused(await sched.antdt_sync_members(job="nope"), "unknown sync job")
    refused(await sched.antdt_sync_complete(job="j", worker=a.address), "received the final")
    refused(await sched.antdt_sync_complete(job="j", worker=a.address, gathered="yes"),
            "gathered must be a bool")
    refused(await sched.antdt_sync_leave(job={}, worker=a.address), "job must be a str")
    answer = ok(await sched.antdt_sync_group(job="j", worker=a.address, progress=0))
    assert answer["kind"] == "alone" and answer["members_version"] == 2  # waited max_wait_s
    pull = a.rpc(b.address).antdt_sync_pull
    refused(await pull(job="j", requester=a.address, round=1, since_seq=0), "no replica")
    refused(await pull(job="j", requester=a.address, round=-1, since_seq=0),
            "round must be an int >= 0")
    refused(await pull(job="j", requester=None, round=1, since_seq=0), "requester must be")
    rows = a.rpc(b.address).antdt_sync_rows
    refused(await rows(job="j", requester=a.address, changed=b"\0"), "no replica")
    plugin = b.plugins[PLUGIN_NAME]
    assert isinstance(plugin, SyncWorkerPlugin)
    plugin.attach("j", ReplicaSync(b.address, initial_dense(), initial_tables(),
                                   peers=[a.address]))
    refused(await rows(job="j", requester=a.address, changed=np.zeros(3, dtype=np.uint8)),
            r"8 bytes of bits for 60 rows, found uint8 \(3,\)")
    refused(await rows(job="j", requester=a.address, changed="bits"), "bytes of bits")
    reply = ok(await rows(job="j", requester=a.address, changed=np.zeros(8, dtype=np.uint8)))
    assert msg_to_rows(reply).ids.tolist() == []  # nothing changed on either side: no rows


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3)
async def test_join_handler_waits_for_acknowledgements(c: Client, s: Scheduler, a: Worker,
                                                       b: Worker, late: Worker) -> None:
    await c.register_plugin(SyncService(poll_s=0.2))
    await c.scheduler.antdt_sync_start(job="j", workers=[a.address, b.address], max_wait_s=0.05)
    listed = await c.scheduler.antdt_sync_join(job="j", worker=a.address)
    assert listed["settled"] and not listed["bootstrap"]  # a listed member needs no snapshot
    refused(await c.scheduler.antdt_sync_join(job="j", worker="tcp://nowhere:1"),
            "not in the cluster")
    msg = await c.scheduler.antdt_sync_join(job="j", worker=late.address)
    assert not msg["settled"] and msg["bootstrap"] and list(msg["waiting"]) == sorted(
        [a.address, b.address])
    for w in (a, b):
        await c.scheduler.antdt_sync_group(job="j", worker=w.address, progress=0,
                                           members_version=msg["members_version"])
    msg = await c.scheduler.antdt_sync_join(job="j", worker=late.address)
    assert msg["settled"] and list(msg["members"]) == sorted([a.address, b.address,
                                                              late.address])
    await c.scheduler.antdt_sync_leave(job="j", worker=late.address)
    await c.scheduler.antdt_sync_leave(job="unknown", worker=late.address)  # idempotent
    members = await c.scheduler.antdt_sync_members(job="j")
    assert list(members["members"]) == sorted([a.address, b.address])
    for w in (a, b):
        await c.scheduler.antdt_sync_group(job="j", worker=w.address, progress=0, final=True)
    refused(await c.scheduler.antdt_sync_join(job="j", worker=late.address), "final round")
    refused(await a.rpc(b.address).antdt_sync_snapshot(job="j", requester=a.address),
            "no replica")


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 4)
async def test_the_final_round_forms_without_a_joiner_still_taking_its_snapshot(
        c: Client, s: Scheduler, a: Worker, b: Worker, started: Worker, late: Worker) -> None:
    await c.register_plugin(SyncService(poll_s=0.5))
    await c.scheduler.antdt_sync_start(job="j", workers=[a.address, b.address])
    for joiner in (started, late):  # nobody acknowledges them: they wait to be settled
        assert not ok(await c.scheduler.antdt_sync_join(job="j", worker=joiner.address))[
            "settled"]
    ok(await c.scheduler.antdt_sync_started(job="j", worker=started.address))
    joining = asyncio.ensure_future(c.scheduler.antdt_sync_join(job="j", worker=late.address))
    finals = await asyncio.gather(*(c.scheduler.antdt_sync_group(
        job="j", worker=w.address, progress=0, final=True) for w in (a, b, started)))
    members = sorted([a.address, b.address, started.address])
    assert [(m["final"], list(m["members"])) for m in finals] == [(True, members)] * 3
    refused(await joining, "formed while it was joining")
    refused(await c.scheduler.antdt_sync_started(job="j", worker=late.address),
            r"final round \d+ formed while it was joining")
    assert service(s).jobs["j"].members() == members
