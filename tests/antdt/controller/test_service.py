"""The ControllerService on a real scheduler: ShardClients in tasks on two workers; one hangs (it
waits on a Dask Event the test sets), the controller revokes its lease, the other worker leases
the rows."""

from __future__ import annotations

from typing import Any

import dask
from distributed import Client, Event, Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.controller import PLUGIN_NAME, BalanceBatch, ControllerService, JobAgents
from antdt.monitor import MonitorSettings
from antdt.sharding import Claim
from antdt.sharding.client import ShardClient
from antdt.sharding.service import ShardingService
from waits import until

CONFIG = {"antdt.monitor.hang-floor": "0.3s", "antdt.monitor.hang-factor": 2,
          "antdt.controller.interval": "1h",
          "antdt.sharding.guided-end": False}  # whole shards: the rows the controller moves


def train(shards: ShardClient, offset: int, stop: int) -> list[str]:
    """Train the current lease from ``offset`` batch by batch up to where the ledger lets it;
    returns the names of the replies that ended it."""
    while True:
        offset = min(offset + 10, stop)
        reply = shards.commit(offset)
        if not isinstance(reply, Claim):
            return [type(reply).__name__]
        stop = reply.stop


def hanging_agent(job: str, event: str) -> dict[str, Any]:
    """Train two batches of 10 rows committing each (claims stay one batch ahead), wait for
    ``event`` (the hang), then finish the lease as far as allowed and lease until the job ends."""
    shards = ShardClient(job, commit_interval_s=0.0, lease_wait_s=0.0)
    lease = shards.lease()
    assert lease is not None
    offset = lease.start
    for _ in range(2):
        offset += 10
        shards.commit(offset)
    assert Event(event).wait(timeout=30)
    replies = train(shards, offset, offset + 10)
    while (more := shards.lease()) is not None:
        train(shards, more.start, more.claim_stop)
    shards.close()
    return {"lease": (lease.row_group, lease.start, lease.stop), "trained": shards.trained_rows,
            "replies": replies}


def one_lease_agent(job: str) -> tuple[int, int, int, int]:
    """Lease once, train the lease to its end batch by batch, give everything back."""
    shards = ShardClient(job, commit_interval_s=0.0, lease_wait_s=0.0)
    lease = shards.lease()
    assert lease is not None
    train(shards, lease.start, lease.claim_stop)
    shards.close()
    return lease.row_group, lease.start, lease.stop, shards.trained_rows


async def setup(c: Client, s: Scheduler, groups: int = 2) -> ControllerService:
    """Plugins and job "j": ``groups`` row groups of one 100-row shard each."""
    await c.register_plugin(ShardingService())
    await c.register_plugin(ControllerService())
    reply = await c.scheduler.antdt_register_job(
        job="j", row_groups=[["f.parquet", g, 100] for g in range(groups)], shard_rows=100,
        batch_rows=10)
    assert reply["status"] == "OK", reply
    plugin = s.plugins[PLUGIN_NAME]
    assert isinstance(plugin, ControllerService)
    return plugin


@gen_cluster(client=True, config=CONFIG)
async def test_hung_lease_is_revoked_and_leased_by_the_other_worker(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await setup(c, s)
    release = Event("release-a")
    hanging = c.submit(hanging_agent, "j", "release-a", workers=[a.address], pure=False)

    async def trained_20() -> bool:
        return (await c.scheduler.antdt_job_state(job="j"))["rows_trained"] == 20

    await until(trained_20, "a to train two batches")

    async def revoked() -> list:
        reply = await c.scheduler.antdt_controller_tick(job="j")
        assert reply["status"] == "OK", reply
        return reply["applied"]

    (record,) = await until(revoked, "the controller to revoke a's lease")
    assert (record["action"], record["policy"], record["worker"]) == (
        "revoke", "RevokeHung", a.address)
    assert record["rows"] == 70 and record["silent_s"] > 0.3 and "hung" in record["reason"]
    health = await c.scheduler.antdt_worker_health(job="j")
    assert health["workers"][a.address]["state"] == "hung"

    group, start, stop, trained = await c.submit(one_lease_agent, "j", workers=[b.address],
                                                 pure=False)
    assert (start, stop, trained) == (30, 100, 70)  # a's unclaimed rows, past its claim
    await release.set()
    result = await hanging
    assert result["lease"] == (group, 0, 100)
    assert result["replies"] == ["Revoked"]
    assert result["trained"] == 30 + 100  # its claim, then the other row group

    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 200
    assert state["rows_trained"] == 200 and state["rows_retrained"] == 0
    actions = await c.scheduler.antdt_controller_actions(job="j")
    assert actions["count"] == 1 and actions["counts"] == {"revoke": 1}
    assert list(actions["records"]) == [record] and actions["enabled"] is True
    events = [msg for _, msg in await c.get_events("antdt")]
    assert events == [record] and record["stimulus_id"].startswith("antdt-controller-j-")
    assert plugin.jobs["j"].controller.count == 1


@gen_cluster(client=True, config=CONFIG)
async def test_a_job_enabled_with_its_own_monitor_settings_is_monitored_with_them(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """A sync job's monitor warms up in steps (``antdt.sync-steps.warm-up-steps``); another
    job's follows ``antdt.monitor``."""
    plugin = await setup(c, s)
    with dask.config.set({"antdt.sync-steps.warm-up-steps": 1}):
        settings = MonitorSettings.synchronous()
    assert settings.warm_up_batches == 1 != MonitorSettings.from_config().warm_up_batches
    assert settings.window_s == MonitorSettings.from_config().window_s
    plugin.tick("j")
    assert plugin.jobs["j"].monitor.settings == MonitorSettings.from_config()
    plugin.enable("j", True, [BalanceBatch(20)], settings)
    plugin.tick("j")
    assert plugin.jobs["j"].monitor.settings == settings


@gen_cluster(client=True, config={**CONFIG, "antdt.controller.interval": "50ms"})
async def test_disabled_job_is_monitored_but_not_controlled(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup(c, s)
    reply = await c.scheduler.antdt_controller_enable(job="j", enabled=False)
    assert reply == {"status": "OK", "job": "j", "enabled": False}
    release = Event("release-a")
    hanging = c.submit(hanging_agent, "j", "release-a", workers=[a.address], pure=False)

    async def hung() -> bool:
        health = await c.scheduler.antdt_worker_health(job="j")
        worker = health["workers"].get(a.address)
        return worker is not None and worker["state"] == "hung"

    await until(hung, "the periodic monitor update to see a hang")
    actions = await c.scheduler.antdt_controller_actions(job="j")
    assert actions["count"] == 0 and actions["enabled"] is False
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert [lease["revoked"] for lease in state["live"]] == [False]

    await c.scheduler.antdt_controller_enable(job="j", enabled=True)

    async def acted() -> bool:
        return (await c.scheduler.antdt_controller_actions(job="j"))["count"] > 0

    await until(acted, "the periodic tick to act once enabled")
    actions = await c.scheduler.antdt_controller_actions(job="j")
    assert actions["records"][0]["action"] == "revoke"
    await release.set()
    result = await hanging
    assert result["replies"] == ["Revoked"]
    reply = await c.scheduler.antdt_controller_actions(job="nope")
    assert reply["status"] == "error" and "unknown job 'nope'" in reply["message"]


@gen_cluster(client=True, config=CONFIG)
async def test_worker_hung_in_the_tail_is_retired_and_its_claim_requeued(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await setup(c, s, groups=1)  # one shard: a holds every row, the job is in its tail
    c.submit(hanging_agent, "j", "never-set", workers=[a.address], pure=False)

    async def trained_20() -> bool:
        return (await c.scheduler.antdt_job_state(job="j"))["rows_trained"] == 20

    await until(trained_20, "a to train two batches")

    async def acted() -> list:
        return (await c.scheduler.antdt_controller_tick(job="j"))["applied"]

    (record,) = await until(acted, "the controller to retire a")
    assert (record["action"], record["policy"], record["worker"]) == (
        "retire", "RetireHung", a.address)
    assert "hung in the tail" in record["reason"]

    async def gone() -> bool:
        return a.address not in s.workers

    await until(gone, "the scheduler to retire a")
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert not state["live"] and state["rows_todo"] == 80  # a's trained rows stay done
    group, start, stop, trained = await c.submit(one_lease_agent, "j", workers=[b.address],
                                                 pure=False)
    assert (start, stop, trained) == (20, 100, 80)
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 100
    assert state["rows_retrained"] == 0
    actions = await c.scheduler.antdt_controller_actions(job="j")
    assert actions["counts"] == {"retire": 1}


async def hang_until_acted(c: Client, a: Worker) -> list[dict[str, Any]]:
    """Job j's agent on ``a`` trains two batches and hangs; tick j's controller until it acts:
    the actions it applied."""
    c.submit(hanging_agent, "j", "never-set", workers=[a.address], pure=False)

    async def trained_20() -> bool:
        return (await c.scheduler.antdt_job_state(job="j"))["rows_trained"] == 20

    await until(trained_20, "a to train two batches of j")

    async def acted() -> list[dict[str, Any]]:
        return list((await c.scheduler.antdt_controller_tick(job="j"))["applied"])

    return await until(acted, "j's controller to act on a")


@gen_cluster(client=True, config=CONFIG)
async def test_a_worker_another_job_trains_on_is_kept_and_only_this_jobs_leases_leave_it(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """Job j hangs on a in its tail; job k holds a lease on a too. j's controller would retire
    a: it takes j's leases off a instead, and a stays up with k's lease."""
    plugin = await setup(c, s, groups=1)
    reply = await c.scheduler.antdt_register_job(job="k", row_groups=[["k.parquet", 0, 100]],
                                                 shard_rows=100, batch_rows=10)
    assert reply["status"] == "OK", reply
    reply = await c.scheduler.antdt_lease(job="k", worker=a.address, wait_s=0)
    assert reply["lease"]["kind"] == "lease", reply  # k trains on a
    (record,) = await hang_until_acted(c, a)
    assert (record["action"], record["worker"]) == ("retire", a.address)
    assert record["reason"].endswith(f"{a.address} also trains job(s) k: stopped this job's "
                                     "agent there, the worker stays")
    state = await c.scheduler.antdt_job_state(job="j", leases=True)
    assert not state["live"] and state["rows_todo"] == 80  # j's rows left a, as if it died
    group, start, stop, trained = await c.submit(one_lease_agent, "j", workers=[b.address],
                                                 pure=False)
    assert (start, stop, trained) == (20, 100, 80)
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 100
    # a was never retired: it still runs, k's lease on it is live, j's controller has done
    assert a.address in s.workers and a.status.name == "running"
    k = await c.scheduler.antdt_job_state(job="k", leases=True)
    assert [lease["worker"] for lease in k["live"]] == [a.address]
    reply = await c.scheduler.antdt_controller_tick(job="j")
    assert not reply["applied"] and plugin.own_workers("j") == [b.address]


@gen_cluster(client=True, config=CONFIG)
async def test_a_jobs_retirement_budget_counts_its_own_workers_not_the_clusters(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """Job j trains on a alone (its master says so); the cluster has two workers. j hung on
    a in its tail: retiring a would leave j no worker (min_workers 1), so its controller only
    revokes a's lease."""
    plugin = await setup(c, s, groups=1)
    stopped: list[str] = []
    plugin.attach("j", JobAgents(lambda: [a.address], lambda worker, why: stopped.append(worker)))
    (record,) = await hang_until_acted(c, a)
    assert (record["action"], record["worker"]) == ("revoke", a.address)
    assert plugin.own_workers("j") == [a.address] and stopped == []
    actions = await c.scheduler.antdt_controller_actions(job="j")
    assert actions["counts"] == {"revoke": 1}
    assert a.address in s.workers


@gen_cluster(client=True, nthreads=[])
async def test_plugin_needs_the_sharding_service(c: Client, s: Scheduler) -> None:
    try:
        await c.register_plugin(ControllerService())
    except Exception as e:  # the scheduler's error comes back to the client
        assert "register it first" in str(e)
    else:
        raise AssertionError("registering without the ShardingService succeeded")
    assert PLUGIN_NAME not in s.plugins
