"""The sharding service over real Dask RPC (gen_cluster: scheduler and workers in one loop)."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from typing import Any

import dask.config
from distributed import Client, Scheduler, Worker, get_worker
from distributed.utils import sync
from distributed.utils_test import gen_cluster

from antdt.fencing import fences
from antdt.sharding import Claim, CommitEvent
from antdt.sharding.client import ShardClient
from antdt.sharding.service import PLUGIN_NAME, ShardingService

GROUPS = [["a.parquet", 0, 10], ["a.parquet", 1, 7], ["b.parquet", 0, 5]]
TOTAL = 22


async def setup_job(c: Client, s: Scheduler, job: str = "j", **kwargs: Any) -> ShardingService:
    if PLUGIN_NAME not in s.plugins:
        await c.register_plugin(ShardingService())
    options: dict[str, Any] = {"row_groups": GROUPS, "shard_rows": 4, "batch_rows": 2}
    options.update(kwargs)
    reply = await c.scheduler.antdt_register_job(job=job, **options)
    assert reply["status"] == "OK", reply
    plugin = s.plugins[PLUGIN_NAME]
    assert isinstance(plugin, ShardingService)
    return plugin


async def train_all(c: Client, job: str, worker: str, rows: Counter) -> dict:
    """Lease and commit batch by batch through the scheduler until the job says stop."""
    commits: list[dict] = []
    while True:
        reply = await c.scheduler.antdt_lease(job=job, worker=worker, commits=commits, wait_s=0)
        assert reply["status"] == "OK", reply
        assert all(r["kind"] in ("finished", "revoked") for r in reply["replies"]), reply
        lease = reply["lease"]
        if lease["kind"] != "lease":
            return lease
        offset, stop = lease["start"], lease["claim_stop"]
        while True:
            rows.update((lease["epoch"], lease["path"], lease["row_group"], r)
                        for r in range(offset, stop))
            commit = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": stop,
                      "synced_offset": stop, "stats": {"rows": stop - offset}}
            if stop == lease["stop"]:
                commits = [commit]  # the last commit rides on the next lease call
                break
            answer = await c.scheduler.antdt_commit(job=job, commits=[commit])
            (claim,) = answer["replies"]
            if claim["kind"] != "claim":
                commits = []
                break
            offset, stop = stop, claim["stop"]


def worker_trains(job: str) -> int:
    """Runs as a task: lease/commit from the worker's thread through ``worker.scheduler``."""
    worker = get_worker()
    trained = 0
    while True:
        reply = sync(worker.loop, worker.scheduler.antdt_lease, job=job, worker=worker.address,
                     wait_s=0)
        lease = reply["lease"]
        if lease["kind"] != "lease":
            return trained
        offset = lease["start"]
        stop = lease["claim_stop"]
        while True:
            trained += stop - offset
            answer = sync(worker.loop, worker.scheduler.antdt_commit, job=job, commits=[{
                "lease_id": lease["lease_id"], "token": lease["token"], "offset": stop,
                "synced_offset": stop}])
            claim = answer["replies"][0]
            if claim["kind"] != "claim":
                break
            offset, stop = stop, claim["stop"]


@gen_cluster(client=True)
async def test_lease_and_commit_from_worker_tasks(c: Client, s: Scheduler, a: Worker,
                                                  b: Worker) -> None:
    plugin = await setup_job(c, s, epochs=2)
    events: list[tuple[str, CommitEvent]] = []
    plugin.subscribe(lambda job, event: events.append((job, event)))
    futures = [c.submit(worker_trains, "j", workers=[w.address], pure=False) for w in (a, b)]
    trained = await c.gather(futures)
    assert sum(trained) == 2 * TOTAL
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished"
    assert state["rows_trained"] == state["rows_done"] == 2 * TOTAL
    assert state["rows_retrained"] == state["rows_lost"] == 0
    assert sum(event.rows for _, event in events) == 2 * TOTAL
    assert {job for job, _ in events} == {"j"}
    assert {event.worker for _, event in events} <= {a.address, b.address}


@gen_cluster(client=True)
async def test_removed_worker_rows_are_leased_again_and_trained_once(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await setup_job(c, s, row_groups=[["f", 0, 8]], shard_rows=8)
    reply = await c.scheduler.antdt_lease(job="j", worker=a.address, claim_rows=4)
    lease = reply["lease"]
    assert (lease["start"], lease["stop"], lease["claim_stop"]) == (0, 8, 4)
    commit = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": 4,
              "synced_offset": 2}
    answer = await c.scheduler.antdt_commit(job="j", commits=[commit])
    assert answer["replies"][0]["kind"] == "claim"
    await a.close()
    assert a.address not in s.workers
    assert plugin.jobs["j"].leases() == []
    rows: Counter = Counter()
    assert (await train_all(c, "j", b.address, rows))["reason"] == "finished"
    assert sorted(r for *_, r in rows) == list(range(2, 8))
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["rows_retrained"] == 2 and state["rows_trained"] == 10
    assert state["rows_done"] == 8 and state["rows_lost"] == 0
    answer = await c.scheduler.antdt_commit(job="j", commits=[commit])
    assert answer["replies"][0]["kind"] == "error"
    assert "no longer live" in answer["replies"][0]["message"]


@gen_cluster(client=True)
async def test_two_jobs_side_by_side(c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await setup_job(c, s, job="one", seed=1)
    await setup_job(c, s, job="two", row_groups=[["z", 0, 30]], shard_rows=10, epochs=3)
    held = (await c.scheduler.antdt_lease(job="one", worker=a.address))["lease"]
    rows_two: Counter = Counter()
    assert (await train_all(c, "two", b.address, rows_two))["reason"] == "finished"
    assert sum(rows_two.values()) == 90 and len(rows_two) == 90
    await a.close()  # a held a lease of job one only
    assert plugin.jobs["one"].leases() == []
    assert (await c.scheduler.antdt_job_state(job="two"))["rows_retrained"] == 0
    rows_one: Counter = Counter()
    assert (await train_all(c, "one", b.address, rows_one))["reason"] == "finished"
    assert len(rows_one) == TOTAL
    assert held["path"] in {p for _, p, _, _ in rows_one}
    one = await c.scheduler.antdt_job_state(job="one")
    assert one["state"] == "finished" and one["rows_done"] == TOTAL


@gen_cluster(client=True)
async def test_restore_into_a_new_scheduler(c: Client, s: Scheduler, a: Worker,
                                            b: Worker) -> None:
    await setup_job(c, s, epochs=2, quarantine=[["b.parquet", 0, "bad label"]])
    rows: Counter = Counter()
    first = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    done = {"lease_id": first["lease_id"], "token": first["token"],
            "offset": first["claim_stop"], "synced_offset": first["claim_stop"]}
    assert (await c.scheduler.antdt_commit(job="j", commits=[done]))["status"] == "OK"
    rows.update((first["epoch"], first["path"], first["row_group"], r)
                for r in range(first["start"], first["claim_stop"]))
    root = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ledgers-{os.getpid()}-{id(s)}")
    path = os.path.join(root, "j", "ledger.bin")  # job j's folder under the checkpoint root
    unset = await c.scheduler.antdt_checkpoint(job="j", path=path)
    assert unset["status"] == "error" and "no checkpoint folder" in unset["message"]
    with dask.config.set({"antdt.sharding.checkpoint-root": root}):
        await restore_elsewhere(c, path, first, rows)


async def restore_elsewhere(c: Client, path: str, first: dict[str, Any], rows: Counter) -> None:
    """Checkpoint job j to ``path``, restore it on a new scheduler, train it there to its end."""
    saved = await c.scheduler.antdt_checkpoint(job="j", path=path)
    assert saved["status"] == "OK" and 0 < saved["bytes"] == os.path.getsize(path)
    try:
        async with Scheduler(dashboard_address=":0") as s2, \
                Worker(s2.address) as w2, \
                Client(s2.address, asynchronous=True) as c2:
            await c2.register_plugin(ShardingService())
            restored = await c2.scheduler.antdt_restore(job="j", path=path)
            assert restored["status"] == "OK"
            assert restored["rows_done"] == first["claim_stop"] - first["start"]
            assert restored["rows_quarantined"] == 10
            assert (await train_all(c2, "j", w2.address, rows))["reason"] == "finished"
            state = await c2.scheduler.antdt_job_state(job="j")
            assert state["rows_done"] == 2 * (TOTAL - 5) == len(rows)
            assert state["rows_trained"] == sum(rows.values())
    finally:
        os.remove(path)
    other = os.path.join(os.path.dirname(os.path.dirname(path)), "k", "ledger.bin")
    missing = await c.scheduler.antdt_restore(job="k", path=other)
    assert missing["status"] == "error" and "does not exist" in missing["message"]
    foreign = await c.scheduler.antdt_restore(job="k", path=path)  # job j's folder, not k's
    assert foreign["status"] == "error" and "outside the job's checkpoint folder" in \
        foreign["message"]


@gen_cluster(client=True)
async def test_malformed_calls_return_errors_and_the_scheduler_keeps_serving(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await setup_job(c, s)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    before = plugin.jobs["j"].summary()
    bad_calls: list[tuple[str, dict[str, Any], str]] = [
        ("antdt_lease", {"job": "nope", "worker": a.address}, "unknown job"),
        ("antdt_lease", {"job": 5, "worker": a.address}, "job must be a str"),
        ("antdt_lease", {"job": "j", "worker": "tcp://1.2.3.4:5"}, "not a worker"),
        ("antdt_lease", {"job": "j", "worker": a.address, "wait_s": -1}, "wait_s"),
        ("antdt_lease", {"job": "x" * 10_000, "worker": a.address}, "1 to 256"),
        ("antdt_commit", {"job": "j", "commits": "all"}, "commits must be a list"),
        ("antdt_commit", {"job": "j", "commits": [{}] * 5000}, "at most 1024"),
        ("antdt_register_job", {"job": "j", "row_groups": GROUPS, "shard_rows": 4,
                                "batch_rows": 2}, "already registered"),
        ("antdt_register_job", {"job": "k", "row_groups": [["f", "zero", 3]], "shard_rows": 4,
                                "batch_rows": 2}, "row_group must be an int"),
        ("antdt_register_job", {"job": "k", "row_groups": "f.parquet", "shard_rows": 4,
                                "batch_rows": 2}, "row_groups must be a list"),
        ("antdt_register_job", {"job": "k", "row_groups": GROUPS, "shard_rows": -4,
                                "batch_rows": 2}, "shard_rows"),
        ("antdt_release", {"job": "j", "lease_id": lease["lease_id"], "token": "guess"},
         "wrong token"),
        ("antdt_split", {"job": "j", "lease_id": lease["lease_id"], "parts": "2"}, "parts"),
        ("antdt_revoke", {"job": "j", "lease_id": 99}, "never issued"),
        ("antdt_quarantine", {"job": "j", "lease_id": lease["lease_id"],
                              "token": lease["token"], "stop": 10**9, "reason": "x"}, "stop"),
    ]
    for op, kwargs, message in bad_calls:
        reply = await getattr(c.scheduler, op)(**kwargs)
        assert reply["status"] == "error" and message in reply["message"], (op, reply)
    bad_commits = [
        {"lease_id": lease["lease_id"], "token": lease["token"], "offset": -1,
         "synced_offset": 0},
        {"lease_id": lease["lease_id"], "token": lease["token"], "offset": lease["claim_stop"],
         "synced_offset": lease["start"], "stats": {"rows": "many"}},
        {"lease_id": lease["lease_id"], "token": lease["token"]},
        ["not", "a", "dict"],
    ]
    bogus = await c.scheduler.antdt_lease(job="j", worker=a.address, bogus=1)
    assert bogus["status"] == "error" and "unexpected keyword argument 'bogus'" in \
        bogus["message"]
    reply = await c.scheduler.antdt_commit(job="j", commits=bad_commits)
    assert [r["kind"] for r in reply["replies"]] == ["error"] * 4
    assert plugin.jobs["j"].summary() == before
    assert "k" not in plugin.jobs
    rows: Counter = Counter()
    released = await c.scheduler.antdt_release(job="j", lease_id=lease["lease_id"],
                                                token=lease["token"])
    assert released == {"status": "OK", "rows": lease["stop"] - lease["start"]}
    assert (await train_all(c, "j", b.address, rows))["reason"] == "finished"
    assert len(rows) == TOTAL == sum(rows.values())


@gen_cluster(client=True)
async def test_revoke_split_and_restart_over_rpc(c: Client, s: Scheduler, a: Worker,
                                                 b: Worker) -> None:
    plugin = await setup_job(c, s, row_groups=[["f", 0, 40]], shard_rows=40)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    split = await c.scheduler.antdt_split(job="j", lease_id=lease["lease_id"], parts=4)
    assert split["status"] == "OK"
    assert [list(p) for p in split["pieces"]] == [[0, 0, 10, 20], [0, 0, 20, 30], [0, 0, 30, 40]]
    revoke = await c.scheduler.antdt_revoke(job="j", lease_id=lease["lease_id"])
    assert [list(p) for p in revoke["pieces"]] == [[0, 0, 2, 10]]
    commit = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": 2,
              "synced_offset": 2}
    reply = await c.scheduler.antdt_commit(job="j", commits=[commit])
    assert list(reply["replies"]) == [{"kind": "revoked", "lease_id": lease["lease_id"], "stop": 2,
                                 "retired": True}]
    other = (await c.scheduler.antdt_lease(job="j", worker=b.address))["lease"]
    assert (other["start"], other["stop"]) == (2, 10)
    plugin.restart(s)
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert len(state["live"]) == 0 and state["rows_todo"] == 38
    stopped = await c.scheduler.antdt_stop_job(job="j", reason="user cancelled")
    assert stopped["state"] == "stopped" and stopped["rows_lost"] == 38
    reply = await c.scheduler.antdt_lease(job="j", worker=b.address)
    assert reply["lease"] == {"kind": "stop", "reason": "user cancelled"}
    forgotten = await c.scheduler.antdt_forget_job(job="j")
    assert forgotten["rows_lost"] == 38 and "j" not in plugin.jobs


@gen_cluster(client=True)
async def test_a_worker_removed_while_its_lease_call_waits_is_handed_no_rows(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup_job(c, s, row_groups=[["f", 0, 4]], shard_rows=4)
    held = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    waiting = asyncio.ensure_future(c.scheduler.antdt_lease(job="j", worker=b.address,
                                                            wait_s=30))
    while not s.plugins[PLUGIN_NAME]._changed["j"]._waiters:  # b's call waits for rows
        await asyncio.sleep(0.01)
    await s.remove_worker(b.address, stimulus_id="test", close=False)
    await c.scheduler.antdt_release(job="j", lease_id=held["lease_id"], token=held["token"])
    reply = await waiting
    assert reply["lease"] == {"kind": "stop", "reason": f"{b.address} left the cluster"}
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert list(state["live"]) == [] and state["rows_todo"] == 4  # for a live worker to lease


@gen_cluster(client=True)
async def test_a_waiting_lease_gets_rows_requeued_by_a_dying_worker(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup_job(c, s, row_groups=[["f", 0, 4]], shard_rows=4)
    held = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    assert held["kind"] == "lease"
    waiting = c.scheduler.antdt_lease(job="j", worker=b.address, wait_s=30)
    closing = a.close()
    reply, _ = await asyncio.gather(waiting, closing)
    assert reply["lease"]["kind"] == "lease" and reply["lease"]["start"] == 0


@gen_cluster(client=True, timeout=60)
async def test_a_long_lease_wait_ends_once_rows_await_sync(c: Client, s: Scheduler, a: Worker,
                                                           b: Worker) -> None:
    # b waits the long way for rows while nothing awaits sync; once a's trained rows await it
    # (perhaps only b's look at them), b must hear it now, not after its 300 s wait.
    plugin = await setup_job(c, s, row_groups=[["f", 0, 300]], shard_rows=300, batch_rows=10)
    first = await c.scheduler.antdt_lease(job="j", worker=a.address, wait_s=0)
    lease = first["lease"]
    assert lease["kind"] == "lease"
    waiting = asyncio.ensure_future(c.scheduler.antdt_lease(job="j", worker=b.address,
                                                            wait_s=300))
    while b.address not in plugin.waiting.get("j", set()):  # bounded by the test's timeout
        await asyncio.sleep(0.01)
    trained = lease["claim_stop"] - lease["start"]
    answer = await c.scheduler.antdt_commit(job="j", commits=[{
        "lease_id": lease["lease_id"], "token": lease["token"], "offset": lease["claim_stop"],
        "synced_offset": lease["start"]}])
    assert answer["replies"][0]["kind"] == "claim" and trained > 0
    reply = await waiting
    assert reply["lease"] == {"kind": "wait", "unsynced": trained}
    assert b.address not in plugin.waiting["j"]



@gen_cluster(client=True, timeout=60)
async def test_a_long_lease_wait_asked_after_rows_came_to_await_sync_ends_at_once(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    # b heard that nothing awaits sync, so it asks the long way; rows came to await sync
    # between its two requests (perhaps only b's look at them): the second must end now.
    plugin = await setup_job(c, s, row_groups=[["f", 0, 300]], shard_rows=300, batch_rows=10)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address, wait_s=0))["lease"]
    assert lease["kind"] == "lease"
    told = await c.scheduler.antdt_lease(job="j", worker=b.address, wait_s=0)
    assert told["lease"] == {"kind": "wait", "unsynced": 0}
    trained = lease["claim_stop"] - lease["start"]
    await c.scheduler.antdt_commit(job="j", commits=[{
        "lease_id": lease["lease_id"], "token": lease["token"], "offset": lease["claim_stop"],
        "synced_offset": lease["start"]}])
    assert plugin.jobs["j"].rows_unsynced == trained > 0
    reply = await c.scheduler.antdt_lease(job="j", worker=b.address, wait_s=300)
    assert reply["lease"] == {"kind": "wait", "unsynced": trained}


# ---- fencing (antdt.fencing): a removed worker's calls refused and counted; retries safe -----


@gen_cluster(client=True)
async def test_a_removed_worker_has_its_leases_and_commits_refused_and_counted(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup_job(c, s, row_groups=[["f", 0, 8]], shard_rows=4)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address,
                                           incarnation=a.id))["lease"]
    commit = {"lease_id": lease["lease_id"], "token": lease["token"], "offset": 2,
              "synced_offset": 2}
    await s.remove_worker(a.address, stimulus_id="test", close=False)  # a lives on: a zombie

    refused = await c.scheduler.antdt_commit(job="j", commits=[commit], worker=a.address,
                                             incarnation=a.id)
    assert refused["status"] == "error" and "not a worker of this cluster" in refused["message"]
    refused = await c.scheduler.antdt_lease(job="j", worker=a.address, incarnation=a.id)
    assert refused["status"] == "error"
    assert fences(s).counts("j") == {"commits": 1, "leases": 1}
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["rows_done"] == 0 and state["rows_todo"] == 8  # nothing of a's counted

    impostor = await c.scheduler.antdt_lease(job="j", worker=b.address, incarnation=a.id)
    assert impostor["status"] == "error" and f"{b.address} is {b.id} now" in impostor["message"]
    assert fences(s).counts("j") == {"commits": 1, "leases": 2}
    assert (await c.scheduler.antdt_lease(job="j", worker=b.address,
                                          incarnation=b.id))["lease"]["kind"] == "lease"


@gen_cluster(client=True)
async def test_a_lease_request_sent_again_gets_the_same_lease(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup_job(c, s, row_groups=[["f", 0, 8]], shard_rows=4)
    first = await c.scheduler.antdt_lease(job="j", worker=a.address, seq=1)
    again = await c.scheduler.antdt_lease(job="j", worker=a.address, seq=1)
    assert again == first
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert len(state["live"]) == 1  # one lease, not two: the retry leased nothing
    following = await c.scheduler.antdt_lease(job="j", worker=a.address, seq=2)
    assert following["lease"]["lease_id"] != first["lease"]["lease_id"]


@gen_cluster(client=True)
async def test_a_release_sent_again_requeues_its_rows_once(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """The agent's release is sent again when its reply was lost: the second changes nothing
    (a lease never issued is still an error)."""
    await setup_job(c, s, row_groups=[["f", 0, 8]], shard_rows=4)
    lease = (await c.scheduler.antdt_lease(job="j", worker=a.address))["lease"]
    held = {"lease_id": lease["lease_id"], "token": lease["token"]}
    assert await c.scheduler.antdt_release(job="j", **held) == {"status": "OK", "rows": 4}
    assert await c.scheduler.antdt_release(job="j", **held) == {"status": "OK", "rows": 0}
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["rows_todo"] == 8 and state["rows_leased"] == 0
    never = await c.scheduler.antdt_release(job="j", lease_id=99, token=lease["token"])
    assert never["status"] == "error" and "never issued" in never["message"]


@gen_cluster(client=True)
async def test_an_agents_call_that_fails_on_the_link_is_sent_again(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """The agent's side: the first sends of its calls fail as a cut link fails (``OSError``),
    the next go through; every row is trained once and counted done once."""
    await setup_job(c, s, row_groups=[["f", 0, 8]], shard_rows=4)
    shards = ShardClient("j", worker=a, commit_interval_s=0.0, lease_wait_s=0.0)
    send, failed = shards._send, []

    def flaky(op: str, **kwargs: Any) -> dict[str, Any]:
        if len(failed) < 3:
            failed.append(op)
            raise OSError("the link is down")
        return send(op, **kwargs)

    shards._send = flaky

    def train() -> int:
        rows = 0
        while (lease := shards.lease()) is not None:
            offset, stop = lease.start, lease.claim_stop
            while True:
                end = min(offset + 2, stop)
                rows += end - offset
                reply = shards.commit(end)
                if not isinstance(reply, Claim):
                    break
                offset, stop = end, reply.stop
        shards.close()
        return rows

    rows = await asyncio.to_thread(train)
    assert failed == ["antdt_lease"] * 3
    state = await c.scheduler.antdt_job_state(job="j")
    assert rows == state["rows_done"] == 8 and state["rows_retrained"] == 0
