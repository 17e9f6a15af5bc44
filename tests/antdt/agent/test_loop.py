"""The agent loop against the real sharding and sync services, on a LocalCluster whose workers
run in this process (so a test's gate can pause a trainer), with a trivial trainer whose "model"
counts the rows it trained."""

from __future__ import annotations

import gc
import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import dask.config
import pytest
import torch
from distributed import Client, Event, Future, LocalCluster, Worker

from antdt import agent
from antdt.agent import AgentPlugin, AgentReport, AgentSpec, Faults
from antdt.errors import AntdtError, ConfigError
from antdt.sharding import service
from antdt.sync import SyncPeriod
from antdt.sync import service as sync_service
from fakes import (BATCH_ROWS, FIRST_ID, GATES, GROUPS, SHARD_ROWS, TOTAL, MakeReader,
                   MakeTrainer, Range)
from waits import bounded

EVERY_20MS = SyncPeriod(seconds=0.02)


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    """Two single-thread workers in this process, with the antdt services and plugins."""
    settings = {"antdt.sharding.lease-wait": "100ms", "antdt.sharding.commit-interval": "100ms",
                "antdt.agent.report-interval": "50ms", "antdt.agent.final-sync-timeout": "30s"}
    with dask.config.set(settings), \
            LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                         dashboard_address=":0") as cluster, Client(cluster) as c:
        c.register_plugin(service.ShardingService())
        c.register_plugin(sync_service.SyncService(poll_s=0.5))
        agent.register(c)
        yield c


_jobs = iter(range(1_000_000))


def new_job(c: Client, epochs: int = 1, sync: list[str] | None = None) -> str:
    """A job over GROUPS; with ``sync``, those workers are its model-sync members."""
    job = f"job{next(_jobs)}"
    service.register_job(c, job, GROUPS, shard_rows=SHARD_ROWS, batch_rows=BATCH_ROWS,
                         epochs=epochs, seed=3)
    if sync is not None:
        sync_service.start_job(c, job, sync, group_size=2, max_wait_s=0.05)
    return job


def workers(c: Client) -> list[str]:
    return sorted(c.sync(c.scheduler.identity, n_workers=-1)["workers"])


def start(c: Client, job: str, worker: str, *, sync_period: SyncPeriod | None = None,
          join: bool = False, faults: Faults = Faults(), gate: str | None = None,
          step_s: float = 0.0, merged_after: int | None = None) -> Any:
    spec = AgentSpec(job=job, batch_rows=BATCH_ROWS, sync_period=sync_period, join=join,
                     faults=faults)
    future: Future = c.submit(agent.run_agent, spec, MakeTrainer(step_s),
                              MakeReader(gate, merged_after),
                              workers=[worker], allow_other_workers=False, pure=False)
    return future


def cancel(c: Client, job: str) -> None:
    """Ask ``job``'s agents on every worker to stop at their next check."""
    c.run(agent.cancel_here, job, on_error="ignore")


def _state_here(job: str, dask_worker: Worker) -> Any:
    return agent.plugin_of(dask_worker).state(job)


def live_leases(c: Client, job: str) -> list[dict[str, Any]]:
    leases: list[dict[str, Any]] = service.job_state(c, job, leases=True)["live"]
    return leases


def trained(c: Client, job: str, worker: str) -> dict[str, Any]:
    state: dict[str, Any] = c.run(_state_here, job, workers=[worker])[worker]
    return state


def row_counts(ranges: list[Range]) -> Counter[int]:
    return Counter(FIRST_ID[(p, g)] + r for p, g, start, stop in ranges for r in range(start, stop))


def both_leasing(c: Client, job: str) -> None:
    """Open ``job``'s gate (its agents' readers wait on it) once both agents hold a lease: each
    then trains at least that lease, however late a loaded machine started one of them (one
    agent alone could otherwise train every row before the other's first lease)."""
    bounded.until(lambda: len({lease["worker"] for lease in live_leases(c, job)}) == 2,
                  "both agents hold a lease")
    GATES[job].set()


def _set_batch_rows(job: str, worker: str, rows: int, dask_scheduler: Any) -> None:
    dask_scheduler.plugins[service.PLUGIN_NAME].jobs[job].set_batch_rows(worker, rows)


def test_an_agent_trains_in_the_batch_size_the_controller_set_it(client: Client) -> None:
    """The hook of the controller's batch policy (AdjustBatch sets a worker's size on the
    ledger): the worker's leases carry the size, and its agent cuts its batches by it."""
    job = new_job(client)
    small, other = workers(client)
    client.run_on_scheduler(_set_batch_rows, job, small, 3)
    GATES[job] = threading.Event()
    futures = [start(client, job, w, gate=job) for w in (small, other)]
    both_leasing(client, job)
    reports: list[AgentReport] = bounded.gather(client, futures)

    sizes = {w: Counter(stop - start for _, _, start, stop in trained(client, job, w)["ranges"])
             for w in (small, other)}
    assert max(sizes[small]) == 3 and sizes[small].most_common(1)[0][0] == 3
    assert max(sizes[other]) == BATCH_ROWS
    counts = row_counts([b for w in (small, other) for b in trained(client, job, w)["ranges"]])
    assert counts == Counter({row: 1 for row in range(TOTAL)})
    assert sum(r.rows for r in reports) == TOTAL


def test_agents_train_every_row_once_per_epoch_and_count_exactly(client: Client) -> None:
    job = new_job(client, epochs=2)
    GATES[job] = threading.Event()
    futures = [start(client, job, w, gate=job) for w in workers(client)]
    both_leasing(client, job)
    reports: list[AgentReport] = bounded.gather(client, futures)

    assert [r.outcome for r in reports] == ["finished", "finished"]
    counts = row_counts([b for w in workers(client) for b in trained(client, job, w)["ranges"]])
    assert counts == Counter({row: 2 for row in range(TOTAL)})
    assert sum(r.rows for r in reports) == 2 * TOTAL
    shards = sum(-(-rows // SHARD_ROWS) for _, _, rows in GROUPS)
    assert sum(r.batches for r in reports) == 2 * shards * -(-SHARD_ROWS // BATCH_ROWS)
    assert all(r.seconds >= r.busy_s >= r.cpu_s > 0 for r in reports)
    for report in reports:  # the mean of the losses the trainer returned, batch by batch
        losses = trained(client, job, report.worker)["losses"]
        assert len(losses) == report.batches and len(set(losses)) > 1
        assert report.loss == pytest.approx(sum(losses) / len(losses))
    state = service.job_state(client, job)
    assert state["state"] == "finished"
    assert (state["rows_trained"], state["rows_done"], state["rows_retrained"],
            state["rows_lost"]) == (2 * TOTAL, 2 * TOTAL, 0, 0)
    events = [m for _, m in client.get_events(agent.event_topic(job))]
    progress = [m for m in events if m["kind"] == "progress"]
    assert {m["worker"] for m in progress} == set(workers(client))
    for worker in workers(client):  # each reports right after its first batch
        assert next(m for m in progress if m["worker"] == worker)["batches"] == 1
    assert max(m["rows"] for m in progress if m["worker"] == reports[0].worker) == reports[0].rows
    spans = [m for m in events if m["kind"] == "lease" and m["phase"] == "end"]
    assert len(spans) == sum(r.leases for r in reports)
    assert sum(m["rows"] for m in spans) == 2 * TOTAL
    assert all(m["outcome"] == "finished" and m["time"] >= m["start"] for m in spans)


@pytest.mark.parametrize("period", [EVERY_20MS, SyncPeriod(batches=2)], ids=str)
def test_async_agents_end_with_identical_replicas_holding_every_update(
        client: Client, period: SyncPeriod) -> None:
    job = new_job(client, epochs=2, sync=workers(client))
    GATES[job] = threading.Event()
    # each reads its fourth batch only once its replica merged rows the other trained: the
    # period's rounds must run during training (the final round comes after the last step)
    futures = [start(client, job, w, sync_period=period, gate=job, merged_after=3)
               for w in workers(client)]
    # both train at once from their first batch on: neither can take every row alone
    bounded.until(lambda: len(live_leases(client, job)) == 2, "both agents hold a lease")
    GATES[job].set()
    reports: list[AgentReport] = bounded.gather(client, futures, timeout_s=180)

    assert [r.outcome for r in reports] == ["finished", "finished"]
    states = [trained(client, job, w) for w in workers(client)]
    # each replica stepped on rows the other trained
    assert all(state["merged_while_training"] > 0 for state in states)
    assert all(r.exchanges >= 2 for r in reports)  # background rounds, and the final one
    # each replica trained only its own rows, yet holds every row's two updates (deltas pulled)
    for state in states:
        assert torch.equal(state["table"], torch.full((TOTAL, 1), 2.0))
    assert torch.equal(states[0]["bias"], states[1]["bias"])  # dense: averaged to consensus
    mine = [row_counts(s["ranges"]) for s in states]
    assert mine[0] + mine[1] == Counter({row: 2 for row in range(TOTAL)})
    state = service.job_state(client, job)
    assert (state["rows_done"], state["rows_retrained"]) == (2 * TOTAL, 0)


def test_a_joiner_copies_the_model_trains_and_ends_identical(client: Client) -> None:
    first, joiner = workers(client)
    job = new_job(client, epochs=2, sync=[first])
    GATES[job] = threading.Event()
    futures = [start(client, job, first, sync_period=EVERY_20MS, gate=job)]
    bounded.until(lambda: len(live_leases(client, job)) == 1, "the first agent holds a lease")
    futures.append(start(client, job, joiner, sync_period=EVERY_20MS, join=True))
    bounded.until(lambda: service.job_state(client, job)["rows_trained"] > 0,
                  "the joiner trains")
    GATES[job].set()
    reports: list[AgentReport] = bounded.gather(client, futures)

    assert [r.outcome for r in reports] == ["finished", "finished"]
    assert reports[0].rows >= BATCH_ROWS and reports[1].rows > 0
    assert (reports[0].joined_from, reports[1].joined_from) == (None, first)
    states = [trained(client, job, w) for w in (first, joiner)]
    mine = [row_counts(s["ranges"]) for s in states]
    assert mine[0] + mine[1] == Counter({row: 2 for row in range(TOTAL)})
    for state in states:
        assert torch.equal(state["table"], torch.full((TOTAL, 1), 2.0))
    assert torch.equal(states[0]["bias"], states[1]["bias"])


def test_a_joiner_declines_a_job_whose_sync_is_over(client: Client) -> None:
    job = new_job(client, sync=[workers(client)[0]])
    first = bounded.result(start(client, job, workers(client)[0], sync_period=EVERY_20MS))
    assert first.rows == TOTAL
    report: AgentReport = bounded.result(start(client, job, workers(client)[1],
                                               sync_period=EVERY_20MS, join=True))
    assert (report.outcome, report.rows, report.leases) == ("declined", 0, 0)


def test_revoked_lease_ends_at_its_claim_and_the_rest_is_trained_once(client: Client) -> None:
    job = new_job(client)
    GATES[job] = threading.Event()
    worker = workers(client)[0]
    future = start(client, job, worker, gate=job)
    (lease,) = bounded.until(lambda: live_leases(client, job),
                             "leased, blocked in its first step")
    assert lease["claim_stop"] == lease["start"] + BATCH_ROWS < lease["stop"]
    reply = client.sync(client.scheduler.antdt_revoke, job=job, lease_id=lease["lease_id"])
    (piece,) = reply["pieces"]  # (epoch, shard, start, stop): the unclaimed rest, requeued
    assert piece[2:] == [lease["claim_stop"], lease["stop"]]
    GATES[job].set()
    report: AgentReport = bounded.result(future)

    ranges = trained(client, job, worker)["ranges"]
    assert ranges[0] == (lease["path"], lease["row_group"], lease["start"], lease["claim_stop"])
    assert row_counts(ranges) == Counter({row: 1 for row in range(TOTAL)})
    shards = sum(-(-rows // SHARD_ROWS) for _, _, rows in GROUPS)
    assert report.leases == shards + 1  # the revoked rest came back as one more lease
    assert service.job_state(client, job)["rows_retrained"] == 0


def test_stop_is_obeyed_by_every_agent(client: Client) -> None:
    job = new_job(client, epochs=2)
    GATES[job] = threading.Event()
    futures = [start(client, job, w, gate=job) for w in workers(client)]
    bounded.until(lambda: len(live_leases(client, job)) == 2, "both agents hold a lease")
    service.stop_job(client, job, "test stops it")  # both hold a lease, in their first read
    GATES[job].set()
    reports: list[AgentReport] = bounded.gather(client, futures)

    assert [r.outcome for r in reports] == ["stopped", "stopped"]
    # each trained the one batch it had claimed, and the commit after it said stop
    assert [(r.rows, r.batches, r.leases) for r in reports] == [(BATCH_ROWS, 1, 1)] * 2
    state = service.job_state(client, job)
    assert state["state"] == "stopped"
    assert state["rows_lost"] == 2 * TOTAL - state["rows_done"] - state["rows_quarantined"] > 0


def test_slowdown_sleeps_in_proportion_to_each_batch(client: Client) -> None:
    job = new_job(client)
    step_s = 0.01
    future = start(client, job, workers(client)[0], faults=Faults(slowdown=3.0), step_s=step_s)
    report: AgentReport = bounded.result(future)

    assert report.rows == TOTAL and report.outcome == "finished"
    assert report.busy_s >= report.batches * 3 * step_s  # each batch: compute, then 2x asleep
    assert 0 < report.cpu_s < report.busy_s / 3  # asleep is busy, but not on the CPU
    health = [m for _, m in client.get_events(agent.event_topic(job)) if m["kind"] == "progress"]
    assert all(m["samples_per_s"] < BATCH_ROWS / (3 * step_s) for m in health if m["batches"])


def test_hang_stops_progress_until_cancelled_and_gives_the_lease_back(client: Client) -> None:
    job = new_job(client)
    worker = workers(client)[1]
    future = start(client, job, worker, faults=Faults(hang_after_rows=2 * BATCH_ROWS))

    def hung() -> bool:
        return any(m.get("fault") == "hang" for _, m in client.get_events(agent.event_topic(job)))

    bounded.until(hung, "the injected hang")
    assert not future.done()
    cancel(client, job)
    report: AgentReport = bounded.result(future)

    assert (report.outcome, report.rows, report.batches) == ("cancelled", 2 * BATCH_ROWS, 2)
    state = service.job_state(client, job, leases=True)
    assert state["live"] == []  # its lease was released: the rest is leasable again
    assert (state["rows_trained"], state["rows_done"]) == (2 * BATCH_ROWS, 2 * BATCH_ROWS)
    assert state["rows_todo"] == TOTAL - 2 * BATCH_ROWS


def test_a_paused_agent_holds_no_lease_until_its_event_is_set(client: Client) -> None:
    job = new_job(client)
    gate = f"{job}-go"
    future = start(client, job, workers(client)[0],
                   faults=Faults(pause_until=gate, pause_after_rows=SHARD_ROWS))

    def paused() -> list[dict[str, Any]]:
        return [m for _, m in client.get_events(agent.event_topic(job))
                if m.get("fault") == "pause"]

    bounded.until(lambda: len(paused()) == 1, "the agent pauses")
    state = service.job_state(client, job, leases=True)
    assert paused()[0]["rows"] == SHARD_ROWS == state["rows_trained"]  # its first shard only
    assert state["live"] == [] and not future.done()
    Event(gate, client=client).set()
    report: AgentReport = bounded.result(future)

    assert (report.outcome, report.rows) == ("finished", TOTAL)
    assert service.job_state(client, job)["rows_done"] == TOTAL


def test_cancelled_before_leasing_trains_nothing(client: Client) -> None:
    job = new_job(client)
    cancel(client, job)
    report: AgentReport = bounded.result(start(client, job, workers(client)[0]))
    assert (report.outcome, report.rows, report.leases) == ("cancelled", 0, 0)


def test_plugin_refuses_state_of_an_unknown_job() -> None:
    plugin = AgentPlugin()
    with pytest.raises(AntdtError, match="no finished agent of job 'nope'"):
        plugin.state("nope")


@pytest.mark.parametrize("faults, message", [
    (dict(slowdown=0.5), "slowdown must be a finite number >= 1"),
    (dict(hang_after_rows=-1), "hang_after_rows must be an int >= 0"),
    (dict(crash_after_rows=1.5), "crash_after_rows must be an int >= 0"),
    (dict(pause_until=""), "pause_until must be the name of a Dask Event"),
    (dict(pause_until="go", pause_after_rows=-2), "pause_after_rows must be an int >= 0"),
])
def test_faults_are_validated(faults: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Faults(**faults)


def test_spec_is_validated() -> None:
    with pytest.raises(ConfigError, match="batch_rows must be an int >= 1, found 0"):
        AgentSpec(job="j", batch_rows=0)
    with pytest.raises(ConfigError, match="sync_period must be a SyncPeriod or None, found 0"):
        AgentSpec(job="j", batch_rows=1, sync_period=0)  # type: ignore[arg-type]


def profiling(c: Client, worker: str) -> bool:
    """Whether ``worker``'s Dask statistical profiler samples its threads now."""
    running: bool = c.run(lambda dask_worker: dask_worker.periodic_callbacks[
        "profile"].is_running(), workers=[worker])[worker]
    return running


@pytest.mark.parametrize("keep", [False, True])
def test_dask_profiler_pauses_while_an_agent_trains_unless_kept(client: Client,
                                                                keep: bool) -> None:
    worker = workers(client)[0]
    assert profiling(client, worker)
    job = new_job(client)
    GATES[job] = threading.Event()
    with dask.config.set({"antdt.agent.dask-profiler": keep}):
        future = start(client, job, worker, gate=job)
        bounded.until(lambda: live_leases(client, job), "the agent holds a lease")
        if keep:
            assert profiling(client, worker)
        else:
            bounded.until(lambda: not profiling(client, worker), "the profiler paused")
    GATES[job].set()
    assert bounded.result(future).outcome == "finished"
    bounded.until(lambda: profiling(client, worker), "the profiler runs again")


def test_the_heap_is_frozen_while_an_agent_trains(client: Client) -> None:
    """A full collection would scan the imports and the model every time (the workers share
    this process, so the test sees their heap)."""
    assert gc.get_freeze_count() == 0
    job = new_job(client)
    GATES[job] = threading.Event()
    future = start(client, job, workers(client)[0], gate=job)
    bounded.until(lambda: live_leases(client, job), "the agent holds a lease")
    frozen = gc.get_freeze_count()
    GATES[job].set()
    assert bounded.result(future).outcome == "finished"
    assert frozen > 100_000 and gc.get_freeze_count() == 0


def test_a_setting_that_is_not_a_flag_is_refused(client: Client) -> None:
    job = new_job(client)
    with dask.config.set({"antdt.agent.dask-profiler": "sometimes"}):
        future = start(client, job, workers(client)[0])
        with pytest.raises(ConfigError, match="antdt.agent.dask-profiler: expected true or "
                                              "false, found 'sometimes'"):
            bounded.result(future)
