"""ShardClient inside real Dask tasks: batching, synced offsets, revocation."""

from __future__ import annotations

import asyncio
from typing import Any

import dask
import pytest
from distributed import Client, Scheduler, Worker, get_client, get_worker
from distributed.utils import sync
from distributed.utils_test import gen_cluster

from antdt.errors import LedgerError
from antdt.monitor import BATCHES, BUSY
from antdt.sharding import Claim, CommitEvent, Lease, Revoked
from antdt.sharding.client import ShardClient
from antdt.sharding.service import PLUGIN_NAME, ShardingService


class StepClock:
    """Monotonic seconds that the simulated training moves forward."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class LaggingSync:
    """A model sync that is ``lag`` rows behind training and catches up 35 rows per look while
    training has stopped (as a background sync thread would)."""

    def __init__(self, lag: int) -> None:
        self.lag = lag
        self.shards: ShardClient | None = None

    def __call__(self) -> int:
        assert self.shards is not None
        synced = max(0, self.shards.trained_rows - self.lag)
        if self.shards.current is None:
            self.lag = max(0, self.lag - 35)
        return synced


def agent(job: str, batch_rows: int, batch_s: float, lag_rows: int = 0,
          lease_wait_s: float = 0.0, drain_wait_s: float = 0.0) -> dict[str, Any]:
    """A minimal agent: train batches of ``batch_s`` simulated seconds while the model sync lags
    ``lag_rows`` behind, then sync everything at the end."""
    clock = StepClock()
    source = LaggingSync(lag_rows)
    shards = ShardClient(job, commit_interval_s=1.0, lease_wait_s=lease_wait_s,
                         drain_wait_s=drain_wait_s, clock=clock, synced_rows=source)
    source.shards = shards
    commits = 0
    most_draining = 0
    replies: set[str] = set()
    while (lease := shards.lease()) is not None:
        offset, stop = lease.start, lease.claim_stop
        while True:
            end = min(offset + batch_rows, stop)
            before = clock.now
            clock.now += batch_s * (end - offset) / batch_rows
            reply = shards.commit(end, stats={BUSY: clock.now - before, BATCHES: 1.0})
            commits += 1
            replies.add(type(reply).__name__)
            most_draining = max(most_draining, len(shards.draining))
            if not isinstance(reply, Claim):
                break
            offset, stop = end, reply.stop
    lag_left = source.lag
    shards.close(synced_rows=shards.trained_rows)
    return {"commits": commits, "rpcs": shards.rpcs, "trained": shards.trained_rows,
            "most_draining": most_draining, "lag_left": lag_left, "replies": sorted(replies)}


async def register(c: Client, s: Scheduler, **kwargs: Any) -> ShardingService:
    await c.register_plugin(ShardingService())
    reply = await c.scheduler.antdt_register_job(job="j", **kwargs)
    assert reply["status"] == "OK", reply
    plugin = s.plugins[PLUGIN_NAME]
    assert isinstance(plugin, ShardingService)
    return plugin


@gen_cluster(client=True)
async def test_commits_are_batched_to_about_one_rpc_per_second(c: Client, s: Scheduler,
                                                               a: Worker, b: Worker) -> None:
    with dask.config.set({"antdt.sharding.guided-end": False}):  # a lease per shard to the end
        await register(c, s, row_groups=[["f", g, 2000] for g in range(4)], shard_rows=1000,
                       batch_rows=10, max_claim_rows=1000)
    futures = [c.submit(agent, "j", 10, 0.01, workers=[w.address], pure=False)
               for w in (a, b)]
    results = await c.gather(futures)
    trained = sum(r["trained"] for r in results)
    assert trained == 8000
    commits = sum(r["commits"] for r in results)
    rpcs = sum(r["rpcs"] for r in results)
    simulated_seconds = 8000 / 1000  # 10 rows per 0.01 s
    assert commits == 800
    assert rpcs <= 8 + 2 * simulated_seconds + 4, results  # a lease per shard + ~1 commit/s
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 8000
    assert state["rows_trained"] == 8000 and state["rows_retrained"] == 0


@gen_cluster(client=True)
async def test_lagging_synced_rows_keep_leases_draining_until_flushed(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    plugin = await register(c, s, row_groups=[["f", 0, 300]], shard_rows=50, batch_rows=10)
    result = await c.submit(agent, "j", 10, 0.01, lag_rows=70, workers=[a.address], pure=False)
    assert result["trained"] == 300
    assert result["most_draining"] >= 1
    assert result["lag_left"] == 0  # lease() waited until its own draining leases synced
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished", state
    assert state["rows_done"] == 300 and state["rows_retrained"] == 0
    assert plugin.jobs["j"].leases() == []


@gen_cluster(client=True)
async def test_each_commit_carries_the_busy_time_of_its_own_rows(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    # With the sync lagging, a lease's last rows ride the next lease request beside draining
    # leases' synced offsets: the stats must go with the rows, or the monitor sees a BPT of ~0.
    plugin = await register(c, s, row_groups=[["f", 0, 300]], shard_rows=50, batch_rows=10)
    events: list[CommitEvent] = []
    plugin.subscribe(lambda job, event: events.append(event))
    result = await c.submit(agent, "j", 10, 0.01, lag_rows=70, workers=[a.address], pure=False)
    assert result["trained"] == 300 and result["most_draining"] >= 1
    trained = [e for e in events if e.rows > 0]
    assert sum(e.rows for e in trained) == 300
    for event in trained:
        assert event.stats[BUSY] == pytest.approx(0.01 * event.rows / 10), event
        assert event.stats[BATCHES] == pytest.approx(event.rows / 10), event
    assert sum(e.stats.get(BATCHES, 0.0) for e in events) == pytest.approx(30)


@gen_cluster(client=True, timeout=60)
async def test_a_draining_worker_does_not_sit_out_the_lease_wait(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    # Only this worker's own sync can finish the job, and the scheduler cannot see it advance:
    # with an hour-long lease wait the job ends only because draining requests wait drain_wait_s.
    await register(c, s, row_groups=[["f", 0, 300]], shard_rows=50, batch_rows=10)
    result = await c.submit(agent, "j", 10, 0.01, lag_rows=70, lease_wait_s=3600.0,
                            drain_wait_s=0.0, workers=[a.address], pure=False)
    assert result["trained"] == 300 and result["lag_left"] == 0
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 300


ACKS: dict[str, int] = {}  # job -> looks the idle peer took (its acknowledgements)


def trainer(job: str) -> int:
    """Train the job's only lease; its rows count as synced only as far as the idle peer
    acknowledged them (30 rows per look the peer takes at its own sync)."""
    shards = ShardClient(job, commit_interval_s=1.0, lease_wait_s=3600.0, drain_wait_s=0.0,
                         clock=StepClock(), synced_rows=lambda: min(shards.trained_rows,
                                                                    30 * ACKS[job]))
    lease = shards.lease()
    assert lease is not None
    stop = lease.claim_stop
    while isinstance(reply := shards.commit(stop), Claim):
        stop = reply.stop
    assert shards.lease() is None  # every row synced: the job is over
    return shards.trained_rows


def idle_peer(job: str) -> int:
    """Lease nothing (the trainer holds every row) until the job ends; count its looks."""
    def look() -> int:
        ACKS[job] += 1
        return 0

    shards = ShardClient(job, commit_interval_s=1.0, lease_wait_s=300.0, drain_wait_s=0.0,
                         clock=StepClock(), synced_rows=look)
    assert shards.lease() is None
    return ACKS[job]


@gen_cluster(client=True, timeout=60)
async def test_an_idle_worker_keeps_syncing_while_a_peers_rows_wait_for_it(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    # A row is synced once every peer applied it: here the trainer's rows wait only for the
    # idle peer's looks. With a 5-minute lease wait the job ends only because the ledger
    # tells the idle peer that rows await sync, so it asks again every drain_wait_s.
    plugin = await register(c, s, row_groups=[["f", 0, 300]], shard_rows=300, batch_rows=10)
    ACKS["j"] = 0
    trained = c.submit(trainer, "j", workers=[a.address], pure=False)
    while plugin.jobs["j"].rows_unsynced == 0:  # bounded by the test's timeout
        await asyncio.sleep(0.01)
    looks = await c.submit(idle_peer, "j", workers=[b.address], pure=False)
    assert await trained == 300 and looks >= 10
    state = await c.scheduler.antdt_job_state(job="j")
    assert state["state"] == "finished" and state["rows_done"] == 300


def revoked_agent(job: str) -> list[str]:
    """Lease, let the test revoke, and see the reply change."""
    clock = StepClock()
    shards = ShardClient(job, commit_interval_s=1.0, lease_wait_s=0.0, clock=clock)
    lease = shards.lease()
    assert lease is not None
    seen = [type(shards.commit(lease.start + 5)).__name__]  # local: claim and interval left
    worker = get_worker()
    sync(worker.loop, worker.scheduler.antdt_revoke, job=job, lease_id=lease.lease_id)
    clock.now += 2.0
    reply = shards.commit(lease.start + 10)
    seen.append(type(reply).__name__)
    assert isinstance(reply, Revoked) and reply.stop == lease.start + 10 and reply.retired
    assert shards.draining == []
    return seen


@gen_cluster(client=True)
async def test_revoked_lease_is_seen_on_the_next_rpc(c: Client, s: Scheduler, a: Worker,
                                                    b: Worker) -> None:
    plugin = await register(c, s, row_groups=[["f", 0, 100]], shard_rows=100, batch_rows=10,
                            max_claim_rows=20)
    seen = await c.submit(revoked_agent, "j", workers=[a.address], pure=False)
    assert seen == ["Claim", "Revoked"]
    ledger = plugin.jobs["j"]
    assert ledger.rows_leased == 0 and ledger.rows_todo == 90 and ledger.rows_done == 10


def train_lease(shards: ShardClient, lease: Lease) -> None:
    """Commit ``lease`` batch by batch (10 rows) to its end, claim by claim."""
    offset, limit = lease.start, lease.claim_stop
    while True:
        end = min(offset + 10, limit)
        reply = shards.commit(end)
        offset = end
        if not isinstance(reply, Claim):
            return
        limit = reply.stop


def polling_agent(job: str, other: str) -> list[str]:
    """This worker holds a lease while it polls for another worker (``other``):
    ``poll_lease`` answers at once while the holder has the last rows, then says the job is
    over."""
    holder = ShardClient(job, lease_wait_s=0.0)
    poller = ShardClient(job, client=get_client(), worker_address=other, lease_wait_s=0.0)
    held = holder.lease()
    assert held is not None
    seen = []
    first = poller.poll_lease()
    seen.append(type(first).__name__)
    assert isinstance(first, Lease)
    train_lease(poller, first)
    seen.append(type(poller.poll_lease(wait_s=0.0)).__name__)  # the holder has the rest
    train_lease(holder, held)
    holder.flush()
    seen.append(type(poller.poll_lease(wait_s=0.0)).__name__)
    return seen


@gen_cluster(client=True)
async def test_poll_lease_does_not_wait_for_rows_another_worker_holds(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    with dask.config.set({"antdt.sharding.guided-end": False}):  # two whole shards
        await register(c, s, row_groups=[["f", 0, 100]], shard_rows=50, batch_rows=10)
    seen = await c.submit(polling_agent, "j", b.address, workers=[a.address], pure=False)
    assert seen == ["Lease", "Wait", "NoneType"]


def claiming_agent(job: str) -> list[int]:
    """Two commits well within the commit interval: the claim's end (from the lease's start)
    and the RPCs each took."""
    shards = ShardClient(job, commit_interval_s=60.0, lease_wait_s=0.0, clock=StepClock())
    lease = shards.lease()
    assert lease is not None
    seen = []
    for end, ahead in ((5, 5), (6, 8)):
        rpcs = shards.rpcs
        reply = shards.commit(lease.start + end, claim_ahead=ahead)
        assert isinstance(reply, Claim)
        seen += [reply.stop - lease.start, shards.rpcs - rpcs]
    return seen


@gen_cluster(client=True)
async def test_a_claim_short_of_the_next_step_is_extended_at_once(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """A sync rank's next local batch must fit its claim: 5 rows claimed past the offset serve
    a batch of 5 without an RPC; 4 left for a batch of 8 are extended now, not a minute later."""
    await register(c, s, row_groups=[["f", 0, 100]], shard_rows=50, batch_rows=10)
    seen = await c.submit(claiming_agent, "j", workers=[a.address], pure=False)
    assert seen == [10, 0, 16, 1]


def leasing_ahead_agent(job: str) -> dict[str, Any]:
    """A sync rank's step across a lease's end: lease 30 rows, train 25 in steps of 5, lease
    the next while 5 are left, then train those 5 and the next lease's first 5 as one step."""
    shards = ShardClient(job, commit_interval_s=60.0, lease_wait_s=0.0, clock=StepClock())
    first = shards.poll_lease(max_rows=30)
    assert isinstance(first, Lease)
    for end in range(5, 30, 5):
        shards.commit(first.start + end, claim_ahead=5)
    second = shards.poll_lease(max_rows=30, ahead=True)
    assert isinstance(second, Lease)
    try:
        shards.poll_lease(ahead=True)
        twice = "no error"
    except LedgerError as exc:
        twice = str(exc)
    draining = list(shards.draining)
    ended = shards.commit(first.start + 30)
    current = shards.current
    went_on = shards.commit(second.start + 5)
    shards.flush()
    return {"first": (first.start, first.stop), "second": (second.start, second.stop),
            "twice": twice, "draining": draining, "ended": type(ended).__name__,
            "current": None if current is None else current.lease_id,
            "went_on": type(went_on).__name__, "trained": shards.trained_rows,
            "second_id": second.lease_id}


@gen_cluster(client=True)
async def test_a_lease_asked_ahead_follows_the_current_one_in_the_same_step(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """The lease asked ahead takes over once the current lease is trained to its end, and the
    ledger counts both leases' rows; a second lease ahead is refused."""
    plugin = await register(c, s, row_groups=[["f", 0, 100]], shard_rows=50, batch_rows=10)
    seen = await c.submit(leasing_ahead_agent, "j", workers=[a.address], pure=False)
    first, second = seen["first"], seen["second"]
    assert first[1] - first[0] == 30 and second[0] != first[0]
    assert "is not finished" in seen["twice"]
    assert seen["draining"] == []
    assert (seen["ended"], seen["current"], seen["went_on"]) == \
        ("Finished", seen["second_id"], "Claim")
    assert seen["trained"] == 35
    assert plugin.jobs["j"].rows_trained == 35
