"""The synchronous mode's plain parts: the step header the ranks all-reduce, the split of a
global batch, a rank's leases and the batches it reads ahead, the scheduler's rendezvous, and
the measure of a rank's own time on a real gloo
group of spawned ranks (the step loop itself runs in
tests/pipeline/training/test_sync_mode.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
import torch.distributed as dist
from distributed import Scheduler, Worker
from distributed.comm import get_address_host
from distributed.utils_test import gen_cluster

from antdt.agent.modes.sync_master import Rendezvous, SyncMaster
from antdt.agent.modes.sync_steps import (Header, ReadAhead, Span, StepRows, own_seconds,
                                          step_rows)
from antdt.sharding import Claim, CommitReply, Finished, Lease, shares
from ranks import Ranks
from sharded_ranks import wait_in_a_collective
from waits import bounded

TICK_S = 0.02
"""What a thread's own seconds may trail its CPU seconds by: the kernel adds the running
thread's time to its schedstat at scheduler ticks (and switches), the CPU clock at once."""


def test_own_seconds_count_computing_not_waiting() -> None:
    """A thread's own seconds hold the CPU time it computed (0.2 s, counted by the CPU clock,
    not the wall clock: the same work on a loaded machine); a thread blocked on an event all
    that time, from before the computing began (it says so first) to its end, adds next to
    none of it. Counted by wall time, the blocked thread would have as much."""
    ready, computed = threading.Event(), threading.Event()
    blocked: list[float] = []

    def wait() -> None:
        began = own_seconds()
        ready.set()
        computed.wait()
        blocked.append(own_seconds() - began)

    waiter = threading.Thread(target=wait, name="blocked", daemon=True)
    waiter.start()
    bounded.until(ready.is_set, "the blocked thread's start")
    own_began, cpu_began = own_seconds(), time.thread_time()
    while time.thread_time() - cpu_began < 0.2:
        pass
    cpu = time.thread_time() - cpu_began
    own = own_seconds() - own_began
    computed.set()
    bounded.until(lambda: blocked, "the blocked thread's end")
    assert own >= cpu - TICK_S, (own, cpu)
    assert blocked[0] < cpu / 4, (blocked, cpu)


@pytest.mark.slow
def test_a_rank_waiting_for_its_peer_in_a_collective_is_not_busy() -> None:
    """Rank 1 computes 0.5 s of CPU time before an all-reduce, and rank 0 waits for it there
    all that time (as a rank with a small local batch waits for the busiest inside a step;
    rank 1 begins once rank 0 said it goes in): rank 0's own time, which the step loop reports
    to the controller, holds a small part of it, rank 1's all of it, however slowly a loaded
    machine runs either. Measured by wall time, every rank of a step would look as slow as
    the busiest, and a slow rank's local batch would shrink without end."""
    with Ranks(2) as ranks:
        (own0, _), (own1, cpu1) = ranks.run(wait_in_a_collective, 0.5)
    assert cpu1 >= 0.5 and own1 >= cpu1 - TICK_S, (own1, cpu1)
    assert own0 < cpu1 / 4, (own0, cpu1)


def test_the_header_summed_over_ranks_says_what_each_rank_put_in() -> None:
    ranks = [Header(3) for _ in range(3)]
    ranks[0].set(0, rows=100, sizes=[120, 100, 80], checkpoint=False, over=False,
                 cancelled=False)
    ranks[1].set(1, rows=0, sizes=None, checkpoint=True, over=True, cancelled=False)
    ranks[2].set(2, rows=7, sizes=None, checkpoint=True, over=False, cancelled=True)
    summed = Header(3)
    summed.values = torch.stack([h.values for h in ranks]).sum(0)  # what all_reduce(SUM) gives
    assert summed.rows() == [100, 0, 7]
    assert summed.sizes() == [120, 100, 80]
    assert summed.checkpoint_by() == 1  # the first asking rank gathers the checkpoint
    assert (summed.over(), summed.cancelled()) == (1, 1)
    ranks[0].set(0, rows=5, sizes=None, checkpoint=False, over=False, cancelled=False)
    assert ranks[0].sizes() is None and ranks[0].checkpoint_by() is None
    assert ranks[0].rows() == [5, 0, 0]  # set() clears the previous step's values


@pytest.mark.parametrize(("weights", "total", "parts"), [
    ([1.0, 1.0, 1.0, 0.25], 64, [20, 19, 19, 6]),
    ([3.0, 1.0], 8, [6, 2]),
    ([0.0, 0.0], 5, [3, 2]),           # no evidence: an even split
    ([1.0, 1e-9], 10, [9, 1]),         # every rank keeps at least one row
])
def test_a_global_batch_splits_by_weight_and_sums_exactly(weights: list[float], total: int,
                                                          parts: list[int]) -> None:
    assert shares(weights, total) == parts
    assert sum(shares(weights, total)) == total


def test_a_global_batch_smaller_than_the_ranks_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot split 2 rows among 3 ranks"):
        shares([1.0, 1.0, 1.0], 2)


@pytest.mark.parametrize(("sizes", "offered", "rows"), [
    ([256, 256], [300, 4096], [256, 256]),                 # enough everywhere: the local batches
    ([5, 1364, 1364, 1363], [40, 4, 7, 10904], [15, 4, 7, 4070]),  # two leases end at once
    ([100, 300, 300], [0, 1000, 1000], [0, 350, 350]),     # a rank without a lease: even
    ([100, 300, 300], [0, 320, 1000], [0, 320, 380]),      # a rank's room runs out: the next
    ([5, 1364, 1364, 1363], [40, 0, 0, 0], [40, 0, 0, 0]),  # the last rows: what is left
    ([3, 3], [0, 0], [0, 0]),
])
def test_a_step_trains_the_global_batch_while_the_ranks_offer_it(
        sizes: list[int], offered: list[int], rows: list[int]) -> None:
    """A rank short of its local batch does not make the step smaller: its peers with more on
    offer take its rows, in proportion to their local batches, each within its offer."""
    assert step_rows(sizes, offered) == rows
    assert sum(rows) == min(sum(sizes), sum(offered))
    assert all(0 <= r <= o for r, o in zip(rows, offered))


def _listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


@gen_cluster(nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_the_rendezvous_ranks_workers_by_address_and_forms_generations(
        s: Scheduler, a: Worker, b: Worker) -> None:
    """Asked through the workers' own comms to the scheduler, as a rank asks."""
    rendezvous = Rendezvous()
    s.handlers["antdt_sync_rank"] = rendezvous.rank
    master = SyncMaster(rendezvous)
    first_worker, second_worker = sorted([a.address, b.address])
    master.start("j", [second_worker, first_worker])
    first = await a.scheduler.antdt_sync_rank(job="j", worker=second_worker)
    assert first["status"] == "OK" and first["rank"] == 1
    assert list(first["workers"]) == [first_worker, second_worker] and first["port"] > 0
    master.restart("j", [second_worker, "tcp://127.0.0.1:1"])
    again = await a.scheduler.antdt_sync_rank(job="j", worker=second_worker)
    assert again["rank"] == 1 and again["prefix"] != first["prefix"]  # a new group's keys
    assert again["port"] == first["port"]  # the job's one store
    gone = await a.scheduler.antdt_sync_rank(job="j", worker=first_worker)
    assert gone["status"] == "error" and f"{first_worker} is not in job 'j'" in gone["message"]
    rendezvous.forget("j")
    unknown = await a.scheduler.antdt_sync_rank(job="j", worker=second_worker)
    assert unknown["status"] == "error" and "no synchronous group" in unknown["message"]
    assert not master.accepts_joiners("j") and master.regroups


@gen_cluster(nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_a_jobs_store_listens_on_the_schedulers_address_under_a_random_prefix(
        s: Scheduler, a: Worker, b: Worker) -> None:
    """The store is not Dask's comm (no TLS, no authentication): it listens on the interface
    the scheduler listens on, not on every one, one store per job, closed with the job, and a
    group's keys are under a prefix nobody can derive from the job's id or the group's token."""
    rendezvous = Rendezvous()
    s.handlers["antdt_sync_rank"] = rendezvous.rank
    master = SyncMaster(rendezvous)
    master.start("job-1", [a.address])
    master.start("job-2", [b.address])
    one = await a.scheduler.antdt_sync_rank(job="job-1", worker=a.address)
    two = await b.scheduler.antdt_sync_rank(job="job-2", worker=b.address)
    assert one["host"] == two["host"] == get_address_host(s.address) == "127.0.0.1"
    assert _listening(one["port"]) == {"127.0.0.1"}  # not 0.0.0.0 nor ::
    assert _listening(two["port"]) == {"127.0.0.1"} and one["port"] != two["port"]
    for reply, job in ((one, "job-1"), (two, "job-2")):
        assert job not in reply["prefix"] and reply["token"] not in reply["prefix"]
        assert len(reply["prefix"].rsplit("/", 1)[1]) == 32  # 128 random bits
    assert one["prefix"].rsplit("/", 1)[1] != two["prefix"].rsplit("/", 1)[1]

    # a rank meets its group in the store the reply names, under the prefix it names
    rank = dist.PrefixStore(one["prefix"], dist.TCPStore(one["host"], one["port"]))
    rank.set("rank0", "here")
    server = rendezvous.stores["job-1"]
    assert server.get(f"{one['prefix']}/rank0") == b"here"
    assert rendezvous.stores["job-2"].num_keys() < server.num_keys()  # job-2's store holds none
    del rank, server  # the test lets go of the store too

    rendezvous.forget("job-1")
    assert _listening(one["port"]) == set()  # the job's store closed with it
    assert _listening(two["port"]) == {"127.0.0.1"}
    rendezvous.forget("job-2")


def _lease(lease_id: int, stop: int) -> Lease:
    return Lease(lease_id, "t", "tcp://a:1", 0, f"part-{lease_id}", 0, 0, stop, stop)


class _Shards:
    """The shard client a rank's rows use, over a list of leases: commits answered locally."""

    def __init__(self, leases: list[Lease]) -> None:
        self.leases = leases
        self.held: list[Lease] = []

    def poll_lease(self, wait_s: float, max_rows: int, ahead: bool) -> Lease | None:
        self.held.append(self.leases.pop(0))
        return self.held[-1]

    def commit(self, offset: int, stats: Any = None, claim_ahead: int = 0) -> CommitReply:
        lease = self.held[0]
        if offset == lease.stop:
            self.held.pop(0)
            return Finished(lease.lease_id, lease.stop, True)
        return Claim(lease.lease_id, lease.stop)


def test_the_next_lease_is_asked_a_step_early_so_the_step_before_reads_its_front() -> None:
    """With less than two local batches left in its lease a rank asks for the next, and the
    rows that follow a step's, as the leases go on, are the next step's rows exactly."""
    first, second = _lease(1, 10), _lease(2, 10)
    shards = _Shards([first, second])
    rows = StepRows(SimpleNamespace(  # type: ignore[arg-type]
        shards=shards, rows=0, event=lambda msg: None,
        faults=SimpleNamespace(pause_due=lambda rows: False)))
    assert rows.offer(4, idle=False) == 10 and rows.ahead is None  # 10 rows: two steps' more
    spans = rows.take(4)
    assert rows.following(spans, 4) == [(first, 4, 8)]
    rows.trained(spans, 0.0, 4, 0.0)
    assert rows.offer(4, idle=False) == 6 + 10 and rows.ahead == second  # 6 rows left
    spans = rows.take(4)
    guessed = rows.following(spans, 4)
    assert guessed == [(first, 8, 10), (second, 0, 2)]
    rows.trained(spans, 0.0, 4, 0.0)
    assert rows.offer(4, idle=False) == 2 + 10
    assert rows.take(4) == guessed
    assert rows.following([(second, 6, 10)], 4) == []  # no lease known past it


def test_a_batch_read_ahead_is_used_only_for_the_rows_it_holds_all_read_in_one_thread() -> None:
    calls: list[tuple[str, list[Span]]] = []

    def read(spans: Sequence[Span]) -> str:
        calls.append((threading.current_thread().name, list(spans)))
        return f"batch of {[(start, stop) for _, start, stop in spans]}"

    lease = _lease(1, 100)
    reads = ReadAhead(read)
    try:
        reads.read_ahead([(lease, 0, 4)])
        assert reads.batch([(lease, 0, 4)]) == "batch of [(0, 4)]"
        reads.read_ahead([(lease, 4, 8)])  # a guess the step does not take
        assert reads.batch([(lease, 4, 6)]) == "batch of [(4, 6)]"
        assert reads.batch([(lease, 6, 8)]) == "batch of [(6, 8)]"  # nothing read ahead
    finally:
        reads.close()
    assert [spans for _, spans in calls] == [[(lease, 0, 4)], [(lease, 4, 8)], [(lease, 4, 6)],
                                             [(lease, 6, 8)]]
    assert {name.split("_")[0] for name, _ in calls} == {"antdt-sync-read"}
