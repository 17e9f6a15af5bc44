"""BackgroundSync on a gen_cluster: agents train small replicas while their sync threads exchange
in the groups SyncService forms, and end bit-identical (a real process death, and the model held
against the ledger after it: ``antdt bench chaos``, tests/pipeline/bench/test_chaos.py)."""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import dask.config
import pytest
import torch
from distributed import Client, Scheduler, Worker
from distributed.metrics import time
from distributed.utils_test import gen_cluster

from antdt import config
from antdt.errors import ConfigError
from antdt.sync import ExchangeReport, LogEntry, MemberState, ReplicaSync, SyncPeriod
from antdt.sync.background import BackgroundSync
from antdt.sync.serving import SyncWorkerPlugin
from antdt.sync.replica import tensor_bytes
from antdt.sync.service import SyncService
from antdt.sync.wire import PLUGIN_NAME
from pages import kernel_collapses, on_huge_pages
from sync_cluster import DENSE_SHAPES, DIM, ROWS, initial_dense, initial_tables, ok, service
from waits import until


def draw_step(gen: torch.Generator, hot: int = ROWS
              ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """One training-like step's changes: 4 of the first ``hot`` rows of each table and every
    dense parameter."""
    rows = {}
    for name in ("user", "item"):
        ids = torch.randperm(hot, generator=gen)[:4]
        rows[name] = (ids, 0.01 * torch.randn(len(ids), DIM, generator=gen))
    return rows, [0.01 * torch.randn(shape, generator=gen) for shape in DENSE_SHAPES]


class Agent:
    """A stand-in for the training agent: random in-place steps under the replica lock (the
    touch too, so every published entry holds whole steps), on the first ``hot`` of the tables'
    ``rows`` rows."""

    def __init__(self, worker: Worker, seed: int, rows: int = ROWS, hot: int = ROWS) -> None:
        self.replica = ReplicaSync(worker.address, initial_dense(), initial_tables(rows))
        self.rows_per_table, self.hot = rows, hot
        self.total = {t: torch.zeros(rows, DIM, dtype=torch.float64) for t in self.replica.tables}
        self.gen = torch.Generator().manual_seed(seed)
        self.rows = 0
        self.worker = worker
        self.sync: BackgroundSync | None = None
        self.peer: str | None = None
        self.starts: list[tuple[int, float]] = []  # per step: the lag it started with, waited

    def step(self) -> None:
        if self.sync is not None:
            waited = self.sync.before_step()
            self.starts.append((self.sync.staleness.lag, waited))
        rows, dense = draw_step(self.gen, self.hot)
        with self.replica.lock.training():
            for name, (ids, delta) in rows.items():
                self.replica.tables[name][ids] += delta
                self.total[name][ids] += delta.double()
            for p, d in zip(self.replica.dense, dense):
                p += d
            self.rows += 32
            self.replica.touch({name: ids for name, (ids, _) in rows.items()}, self.rows)
        if self.sync is not None:
            self.sync.batch_done()

    def run(self, min_merges: int, together: threading.Barrier | None = None, die: bool = False,
            timeout_s: float = 30.0, *, join: bool = False,
            until: Callable[[], bool] | None = None,
            ready: Callable[[], object] | None = None,
            period: SyncPeriod = SyncPeriod(seconds=0.01),
            hurry: bool = False, max_staleness: int | None = None) -> ExchangeReport | None:
        """Train until the background thread merged ``min_merges`` peers (then call ``ready``)
        and ``until()`` holds, wait for the agents sharing ``together`` (still syncing: a
        finished worker only takes the final round, so the last one would find no partner), then
        take part in the final round; with ``die``, stop syncing instead (the worker is about to
        be killed). ``join``: join the running job first. ``hurry``: ask for a round after every
        step (as an agent waiting for its rows to sync does). ``max_staleness``: the replica's
        bound (None: training never waits for a round)."""
        sync = self.sync = BackgroundSync(self.replica, "job", worker=self.worker,
                                          period=period, rpc_timeout_s=10.0,
                                          max_staleness=max_staleness)
        self.peer = sync.start(join=join)
        deadline = time() + timeout_s
        while sync.peers_merged < min_merges:
            assert time() < deadline, "no background exchange happened"
            self.step()
            if hurry:
                sync.hurry()
        if ready is not None:
            ready()
        while until is not None and not until():
            assert time() < deadline, "never told to stop training"
            self.step()
        if die:
            sync.stop()
            return None
        if together is not None:
            together.wait(timeout=timeout_s)
        assert sync.synced_offset <= self.rows
        return sync.finish(timeout_s=timeout_s)


async def run_agents(agents: list[Agent], min_merges: int) -> list[ExchangeReport]:
    loop = asyncio.get_running_loop()
    together = threading.Barrier(len(agents))
    with ThreadPoolExecutor(len(agents)) as pool:
        futures = [loop.run_in_executor(pool, functools.partial(a.run, min_merges, together))
                   for a in agents]
        reports = await asyncio.gather(*futures)
    assert all(r is not None for r in reports)
    return [r for r in reports if r is not None]


async def run_pair(c: Client, s: Scheduler, workers: tuple[Worker, ...],
                   **run: Any) -> tuple[list[Agent], list[ExchangeReport | None]]:
    """Two agents on ``workers`` synced in groups of two, each ``Agent.run(**run)`` until
    both may take the final round; the agents and their reports."""
    await start_service(c, s, workers, group_size=2, max_wait_s=5.0)
    agents = [Agent(w, seed=i) for i, w in enumerate(workers)]
    loop = asyncio.get_running_loop()
    job = functools.partial(Agent.run, together=threading.Barrier(len(agents)), **run)
    with ThreadPoolExecutor(len(agents)) as pool:
        reports = await asyncio.gather(*[loop.run_in_executor(pool, job, a) for a in agents])
    return agents, list(reports)


def served(w: Worker) -> dict[str, ReplicaSync]:
    plugin = w.plugins[PLUGIN_NAME]
    assert isinstance(plugin, SyncWorkerPlugin)
    return plugin.replicas


def expected_tables(agents: list[Agent]) -> dict[str, torch.Tensor]:
    initial = initial_tables(agents[0].rows_per_table)
    return {name: initial[name].double() + sum(a.total[name] for a in agents)
            for name in initial}


def assert_bit_identical(replicas: list[ReplicaSync]) -> None:
    first = replicas[0]
    for replica in replicas[1:]:
        for name, table in replica.tables.items():
            assert torch.equal(table, first.tables[name]), name
        for p, q in zip(replica.dense, first.dense):
            assert torch.equal(p, q)


async def start_service(c: Client, s: Scheduler, workers: tuple[Worker, ...],
                        **kwargs: object) -> None:
    await c.register_plugin(SyncService(poll_s=1.0))
    await c.scheduler.antdt_sync_start(job="job", workers=[w.address for w in workers],
                                       **kwargs)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=90)
async def test_background_rounds_then_final_round_give_identical_replicas(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    await start_service(c, s, workers, group_size=2, max_wait_s=0.05)
    assert all(PLUGIN_NAME in w.plugins for w in workers)
    agents = [Agent(w, seed=i) for i, w in enumerate(workers)]
    reports = await run_agents(agents, min_merges=2)
    leader = min(w.address for w in workers)  # no member died: the smallest address leads
    assert all(a.sync is not None and a.sync.final_leader == leader for a in agents)
    for agent, report in zip(agents, reports):
        if agent.worker.address == leader:  # it gathered everyone
            assert report.failed == [] and len(report.merged) == 2 and report.rows_copied == 0
        else:  # the others adopted its rows
            assert report.failed == [] and report.merged == [leader] and report.rows_copied > 0
    expected = expected_tables(agents)
    for agent in agents:
        for name, table in agent.replica.tables.items():
            torch.testing.assert_close(table.double(), expected[name], rtol=0, atol=1e-5)
    assert_bit_identical([a.replica for a in agents])
    assert service(s).jobs["job"].final_done()
    assert all(not served(w) for w in workers)  # after the job, replicas are no longer served
    await c.scheduler.antdt_sync_stop(job="job")
    assert "job" not in service(s).jobs


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=90)
async def test_the_final_round_sends_the_rows_trained_not_the_tables(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    """Tables of 20,000 rows of which the agents train 40: the final round leaves the replicas
    bit-identical, and the tensor bytes that cross it (the leader's pulls, each member's mask of
    changed rows, the rows the leader sends back) are those of the rows trained and the dense
    parameters, far below the model that a whole-state copy sent to each member."""
    await start_service(c, s, workers, group_size=2, max_wait_s=0.05)
    agents = [Agent(w, seed=i, rows=20_000, hot=40) for i, w in enumerate(workers)]
    reports = await run_agents(agents, min_merges=2)
    assert_bit_identical([a.replica for a in agents])
    expected = expected_tables(agents)
    for name, table in agents[0].replica.tables.items():
        torch.testing.assert_close(table.double(), expected[name], rtol=0, atol=1e-5)
    trained = sum(int((sum(a.total[name] for a in agents) != 0).any(1).sum())
                  for name in expected)
    assert 0 < trained <= 2 * 40  # of the 40,000 rows
    dense_bytes = tensor_bytes(agents[0].replica.dense)
    model_bytes = tensor_bytes(agents[0].replica.tables.values()) + dense_bytes
    leader = min(w.address for w in workers)
    for agent, report in zip(agents, reports):
        if agent.worker.address == leader:
            assert report.bytes_sent == 0 and 2 * dense_bytes <= report.bytes_received
        else:  # ids (int64) and float32 values of the rows trained, the dense parameters
            assert report.rows_copied == trained
            assert report.bytes_received == trained * (8 + DIM * 4) + dense_bytes
            assert report.bytes_sent == (2 * 20_000 + 7) // 8  # the mask: one bit a row
    crossed = sum(r.bytes_received + r.bytes_sent for r in reports)
    assert crossed < (len(agents) - 1) * model_bytes / 20


@pytest.mark.skipif(not kernel_collapses(), reason="the kernel moves no memory to huge pages")
@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_the_sync_thread_moves_the_replica_onto_huge_pages_between_rounds(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    """A replica's tables are only marked for huge pages when it is made (moving them then held
    up every job's start); its background thread moves them between rounds while training goes
    on, and the final round still leaves the replicas bit-identical."""
    await start_service(c, s, workers, group_size=2, max_wait_s=5.0)
    # 35 MB tables: above glibc's largest mmap threshold, so in fresh memory of 4 KB pages
    agents = [Agent(w, seed=i, rows=2_200_000, hot=40) for i, w in enumerate(workers)]
    assert not any(on_huge_pages(t) for a in agents for t in a.replica.tables.values())

    def moved() -> bool:
        return all(on_huge_pages(t) for a in agents for t in a.replica.tables.values())

    loop = asyncio.get_running_loop()
    job = functools.partial(Agent.run, min_merges=2, together=threading.Barrier(2),
                            until=moved, period=SyncPeriod(seconds=0.05))
    with ThreadPoolExecutor(len(agents)) as pool:
        reports = await asyncio.gather(*[loop.run_in_executor(pool, job, a) for a in agents])
    assert all(r is not None and r.failed == [] for r in reports)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_a_group_that_forms_once_training_ended_is_left_to_the_final_round(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """A finishes training while its thread waits at the scheduler for a partner; the group
    that B's ask then forms is not exchanged by A (the final round, next, subsumes it), while B
    still pulls from A; the final round leaves both bit-identical."""
    await c.register_plugin(SyncService(poll_s=3600.0))  # an ask is held until a group forms
    ok(await c.scheduler.antdt_sync_start(job="job", workers=[a.address, b.address],
                                          group_size=2, max_wait_s=3600.0))
    agents = [Agent(w, seed=i) for i, w in enumerate((a, b))]
    loop = asyncio.get_running_loop()
    syncs = []
    for agent in agents:
        agent.sync = BackgroundSync(agent.replica, "job", worker=agent.worker,
                                    period=SyncPeriod(seconds=3600.0), rpc_timeout_s=10.0)
        syncs.append(agent.sync)
        await loop.run_in_executor(None, agent.sync.start)
        for _ in range(3):
            agent.step()
    first, second = syncs
    first.hurry()
    await until(lambda: service(s).jobs["job"].state(a.address) is MemberState.READY,
                "A's thread to wait for a partner")
    finishing = loop.run_in_executor(None, first.finish, 30.0)
    # finish() told the thread, which still waits for a group
    await until(first._stop.is_set, "A's finish to tell its thread")
    second.hurry()
    await until(lambda: second.exchanges == 1, "B to exchange with A's group")
    reports = await asyncio.gather(finishing, loop.run_in_executor(None, second.finish, 30.0))
    assert first.exchanges == 1 and second.exchanges == 2  # A: the final round alone
    assert all(r.failed == [] for r in reports)
    assert_bit_identical([agent.replica for agent in agents])
    expected = expected_tables(agents)
    for name, table in agents[1].replica.tables.items():
        torch.testing.assert_close(table.double(), expected[name], rtol=0, atol=1e-5)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_hurry_starts_a_round_before_the_period_ends(c: Client, s: Scheduler,
                                                          *workers: Worker) -> None:
    agents, reports = await run_pair(c, s, workers, min_merges=1,
                                     period=SyncPeriod(seconds=3600.0), hurry=True)
    # an hour-long period: every background exchange was a hurried one
    assert all(a.sync is not None and a.sync.exchanges >= 2 for a in agents)
    assert all(r is not None and r.failed == [] for r in reports)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_a_period_in_batches_starts_rounds_as_batches_are_trained(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    agents, reports = await run_pair(c, s, workers, min_merges=2, period=SyncPeriod(batches=3))
    # no period in seconds and no hurry: only finished batches started the background rounds
    assert all(a.sync is not None and a.sync.exchanges >= 3 for a in agents)
    assert all(r is not None and r.failed == [] for r in reports)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_a_period_in_peer_batches_starts_a_round_every_period_batches_with_one_peer(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    agents, reports = await run_pair(c, s, workers, min_merges=6,
                                     period=SyncPeriod(peer_batches=4), max_staleness=1)
    timeout = config.seconds("antdt.sync.max-wait")
    for agent in agents:
        assert agent.sync is not None and agent.sync.staleness.limit == 4
        # one peer: a round every 4 of its own batches (the final round and a regular one the
        # partner may have put it in on its way there come on top)
        assert 6 <= agent.sync.exchanges <= len(agent.starts) // 4 + 2
        # training ran up to the period's 4 batches plus the bound's 1 past its newest round
        # before it waited (or the wait ran out: a partner that had not started yet)
        assert all(lag <= 4 or waited >= timeout for lag, waited in agent.starts)
    assert all(r is not None and r.failed == [] for r in reports)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=90)
async def test_training_waits_while_its_replica_is_too_far_ahead_of_its_rounds(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    agents, reports = await run_pair(c, s, workers, min_merges=5, period=SyncPeriod(batches=1),
                                     max_staleness=0)
    timeout = config.seconds("antdt.sync.max-wait")
    for agent in agents:
        assert agent.sync is not None
        # bound 0: every step began with all earlier batches in a finished round, unless the
        # wait ran out (a partner that had not started yet)
        assert all(lag == 0 or waited >= timeout for lag, waited in agent.starts)
        assert sum(waited for _, waited in agent.starts) == pytest.approx(agent.sync.waited_s)
        assert agent.sync.waited_s > 0
    assert all(r is not None and r.failed == [] for r in reports)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=90)
async def test_a_dead_worker_leaves_and_its_synced_offset_is_safe(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    await start_service(c, s, workers, group_size=3, max_wait_s=0.05)
    agents = [Agent(w, seed=i) for i, w in enumerate(workers)]
    dying, survivors = agents[0], agents[1:]
    published: list[LogEntry] = []
    publish = dying.replica.log.publish

    def recording_publish(rows_offset: int, exact: bool = False) -> LogEntry | None:
        entry = publish(rows_offset, exact)
        if entry is not None:
            published.append(entry)
        return entry

    dying.replica.log.publish = recording_publish  # type: ignore[method-assign]
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(3) as pool:
        death = loop.run_in_executor(pool, functools.partial(dying.run, 2, die=True))
        together = threading.Barrier(len(survivors))
        lives = [loop.run_in_executor(pool, functools.partial(a.run, 4, together))
                 for a in survivors]
        assert await death is None
        await workers[0].close()
        reports = [r for r in await asyncio.gather(*lives) if r is not None]
    assert workers[0].address not in service(s).jobs["job"].members()
    assert [r.merged for r in reports] == [[survivors[1].worker.address],
                                           [survivors[0].worker.address]]
    # the dead worker contributed before dying, but no ledger counted any of its rows synced
    # (this job has none): every survivor took its entries out again and holds initial + every
    # survivor's deltas, nothing of the dead one's
    applied = [agent.replica.log.applied_seq(workers[0].address) for agent in survivors]
    assert max(applied) > 0 and published
    assert service(s).jobs["job"].departed() == {workers[0].address: 0}
    space = survivors[0].replica.log.space  # the tables end to end, as entries address them
    expected = torch.cat([initial_tables()[name].double() + sum(a.total[name] for a in survivors)
                          for name in space.tables])
    for agent in survivors:
        for name, part in space.split(expected).items():
            torch.testing.assert_close(agent.replica.tables[name].double(), part, rtol=0,
                                       atol=1e-5)
    # the dead worker's offset is never more than every survivor applied
    synced = dying.replica.synced_offset()
    assert synced <= (published[min(applied) - 1].rows_offset if min(applied) else 0)
    assert_bit_identical([agent.replica for agent in survivors])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=90)
async def test_a_worker_joins_a_running_job_and_all_end_identical(
        c: Client, s: Scheduler, *workers: Worker) -> None:
    first = workers[:2]
    await start_service(c, s, first, group_size=3, max_wait_s=0.05)
    agents = [Agent(w, seed=i) for i, w in enumerate(workers)]
    warm, joined = threading.Event(), threading.Event()
    loop = asyncio.get_running_loop()
    with ThreadPoolExecutor(3) as pool:
        runs = [loop.run_in_executor(pool, functools.partial(
            agent.run, 4, until=joined.is_set, ready=warm.set if i == 0 else None))
            for i, agent in enumerate(agents[:2])]
        assert await loop.run_in_executor(pool, warm.wait, 30)
        # by now the first two dropped entries: the newcomer cannot start from scratch
        assert agents[0].replica.log.synced_offset() > 0
        joiner = loop.run_in_executor(pool, functools.partial(agents[2].run, 2, join=True,
                                                              ready=joined.set))
        reports = await asyncio.gather(*runs, joiner)
    assert agents[2].peer in {w.address for w in first}
    assert service(s).jobs["job"].members() == sorted(w.address for w in workers)
    leader = min(w.address for w in workers)  # it gathered everyone, the others adopted its rows
    others = sorted(w.address for w in workers if w.address != leader)
    for agent, report in zip(agents, reports):
        assert report is not None and report.failed == []
        assert report.merged == (others if agent.worker.address == leader else [leader])
    # no pull ever failed: every source kept what the joiner needed after its snapshot
    assert [a.sync.peers_failed for a in agents if a.sync is not None] == [0, 0, 0]
    expected = expected_tables(agents)
    for name, table in agents[2].replica.tables.items():
        torch.testing.assert_close(table.double(), expected[name], rtol=0, atol=1e-5)
    assert_bit_identical([a.replica for a in agents])


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)])
async def test_defaults_come_from_dask_config(c: Client, s: Scheduler, a: Worker) -> None:
    with dask.config.set({"antdt.sync.period": "20ms", "antdt.sync.rpc-timeout": "7s",
                          "antdt.sync.poll": "3s", "antdt.sync.group-size": 3,
                          "antdt.sync.max-wait": "100ms"}):
        await c.register_plugin(SyncService())
        await c.scheduler.antdt_sync_start(job="job", workers=[a.address])
        sync = BackgroundSync(ReplicaSync(a.address, initial_dense(), initial_tables()), "job",
                              worker=a)
    assert service(s).poll_s == 3.0
    assert (service(s).jobs["job"].group_size, service(s).jobs["job"].max_wait_s) == (3, 0.1)
    assert (sync.period, sync.rpc_timeout_s) == (SyncPeriod(seconds=0.02), 7.0)


def test_a_bad_period_in_dask_config_names_the_key() -> None:
    replica = ReplicaSync("tcp://127.0.0.1:1", initial_dense(), initial_tables())
    with dask.config.set({"antdt.sync.period": "0s"}), pytest.raises(
            ConfigError, match=r"dask config antdt.sync.period: expected seconds > 0 .*found '0s'"):
        BackgroundSync(replica, "job")
