"""`antdt bench sharding`: the shard ledger at scale, and the same operations over Dask RPC.

Ledger: ``--shards`` shards (1,000 files x row groups x 10 shards each), ``--workers``
simulated workers taking turns; each turn is one operation - a lease when the worker holds none,
else a commit of the next batch (synced at once), which returns the next claim. Every 16th
operation is timed on its own for the p50/p99. Memory is traced (tracemalloc) while building the
ledger and giving every worker a lease, and reported per shard.

RPC: a LocalCluster (in-process workers) with the :class:`~antdt.sharding.service.ShardingService`
and the job service; a client leases and commits batch by batch through the scheduler, one round
trip per operation. Measured twice, on two clusters: alone, and while a thread scrapes the
scheduler's ``/metrics`` (Dask's series and the ``dask_antdt_*`` ones) at once and then every
second, as Prometheus would: the ratio is what watching costs the scheduler's RPC.

Job pages: what a view of a job's page costs the scheduler's event loop when the job had
``--view-leases`` leases (a long synchronous job has a million): a job's journal is fed that
many leases on ``--view-workers`` workers (a start and an end event each, read every 10,000
events as the master's ticks read them), then the part of a view that grows with the job's
history (:meth:`~antdt.jobs.journal.Journal.page_spans` sorted with the open leases, the
timeline's marks, the journal's record) is timed on its own, and the timeline's SVG (drawn off
the event loop) beside it.

Sync groups: the scheduler's other per-batch call, a sync group ask
(:meth:`~antdt.sync.SyncScheduler.ready`), by the same ``--workers`` in groups of 4, each ask
from a random worker 1 ms after the one before; every 16th ask is timed on its own.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import click
import numpy as np
from distributed import Client, LocalCluster

from antdt.jobs.journal import Journal
from antdt.jobs.placement import Slot
from antdt.jobs.service import JobService
from antdt.sharding import Claim, Lease, RowGroup, ShardLedger
from antdt.sharding.service import ShardingService, register_job
from antdt.sync import SyncScheduler
from antdt.watch.timeline import timeline_svg
from pipeline.bench import emit

SHARDS_PER_GROUP = 10
GROUPS_PER_FILE = 100


def dataset(shards: int, shard_rows: int) -> list[RowGroup]:
    """Row groups of ``SHARDS_PER_GROUP`` full shards each, ``GROUPS_PER_FILE`` per file."""
    groups = -(-shards // SHARDS_PER_GROUP)
    return [(f"s3://bench/part-{g // GROUPS_PER_FILE:05d}.parquet", g % GROUPS_PER_FILE,
             SHARDS_PER_GROUP * shard_rows) for g in range(groups)]


def ledger_memory(groups: list[RowGroup], shard_rows: int, batch_rows: int,
                  workers: int) -> tuple[int, int]:
    """(traced bytes, shards) of a fresh ledger with one live lease per worker."""
    tracemalloc.start()
    try:
        ledger = ShardLedger(groups, shard_rows=shard_rows, batch_rows=batch_rows,
                             clock=time.monotonic)
        for w in range(workers):
            ledger.lease(f"w{w}")
        current, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return current, ledger.num_shards


def ledger_throughput(groups: list[RowGroup], shard_rows: int, batch_rows: int, workers: int,
                      ops: int) -> dict[str, float]:
    """Ops/s and per-op latency of lease + commit with ``workers`` taking turns, over at most
    ``ops`` operations: the run ends early (and says how many it did) when every shard is done."""
    ledger = ShardLedger(groups, shard_rows=shard_rows, batch_rows=batch_rows,
                         clock=time.monotonic)
    names = [f"w{w}" for w in range(workers)]
    held: list[Lease | None] = [None] * workers
    offsets = [0] * workers
    claims = [0] * workers
    samples = []
    clock = time.perf_counter_ns
    done = 0
    start = time.perf_counter()
    for op in range(ops):
        w = op % workers
        timed = op % 16 == 0
        t0 = clock() if timed else 0
        lease = held[w]
        if lease is None:
            reply = ledger.lease(names[w])
            if not isinstance(reply, Lease):
                break
            held[w], offsets[w], claims[w] = reply, reply.start, reply.claim_stop
        else:
            answer = ledger.commit(lease.lease_id, lease.token, claims[w], claims[w])
            if isinstance(answer, Claim):
                offsets[w], claims[w] = claims[w], answer.stop
            else:
                held[w] = None
        if timed:
            samples.append(clock() - t0)
        done += 1
    elapsed = time.perf_counter() - start
    micros = np.asarray(samples) / 1000
    ledger.check_invariants()
    return {"ops": done, "ops_per_s": done / elapsed, "us_per_op_p50": float(np.percentile(micros, 50)),
            "us_per_op_p99": float(np.percentile(micros, 99))}


def group_throughput(workers: int, asks: int, seed: int = 0) -> dict[str, float]:
    """Asks/s and per-ask latency of :meth:`SyncScheduler.ready` with ``workers`` members in
    groups of up to 4, each ask from a random member that trained 0-100 rows since its last."""
    rng = np.random.default_rng(seed)
    names = [f"w{w}" for w in range(workers)]
    scheduler = SyncScheduler(group_size=4, max_wait_s=0.5)
    for name in names:
        scheduler.join(name)
    progress = dict.fromkeys(names, 0)
    callers, steps = rng.integers(0, workers, asks), rng.integers(0, 101, asks)
    samples = []
    clock = time.perf_counter_ns
    start = time.perf_counter()
    for ask in range(asks):
        name = names[callers[ask]]
        progress[name] += int(steps[ask])
        timed = ask % 16 == 0
        t0 = clock() if timed else 0
        scheduler.ready(name, progress[name], now=ask * 0.001)
        if timed:
            samples.append(clock() - t0)
    elapsed = time.perf_counter() - start
    micros = np.asarray(samples) / 1000
    return {"asks_per_s": asks / elapsed, "us_per_ask_p50": float(np.percentile(micros, 50)),
            "us_per_ask_p99": float(np.percentile(micros, 99))}


def view_cost(leases: int, workers: int, views: int = 20) -> dict[str, float]:
    """Milliseconds a job page's view spends on the event loop (the median of ``views``) and
    drawing its timeline (off the loop) after ``leases`` leases of 64 rows on ``workers``
    workers, each 4 ms long; the longest tick that read 10,000 events meanwhile; the bars
    drawn and whether their rows add up to every lease's."""
    now = [1000.0]
    journal = Journal("bench", lambda: now[0], lambda: None, log_length=100)
    slots = [Slot(f"tcp://10.0.0.{w}:9000", w, join=False, started=0.0) for w in range(workers)]
    journal.began(now[0])
    journal.read_ledger({**{f"rows_{k}": 0 for k in ("expected", "done", "trained", "todo",
                                                     "leased", "lost", "retrained",
                                                     "quarantined")},
                         "epoch": 0, "epochs": 1, "rows_done_by_epoch": [0],
                         "leases_granted": 0, "leases_revoked": 0, "leases_split": 0})
    longest_tick = 0.0
    for lease in range(leases):
        worker = slots[lease % workers].worker
        start = 1000.0 + lease * 0.001
        journal.received({"kind": "lease", "phase": "start", "worker": worker,
                          "lease_id": lease, "time": start})
        journal.received({"kind": "lease", "phase": "end", "worker": worker, "lease_id": lease,
                          "time": start + 0.004, "start": start, "rows": 64,
                          "outcome": "finished"})
        if lease % 5000 == 4999 or lease == leases - 1:
            now[0] = start + 0.004
            tick = time.perf_counter()
            journal.read_events(slots, {})
            longest_tick = max(longest_tick, time.perf_counter() - tick)
    on_loop, drawing = [], []
    for _ in range(views):
        start = time.perf_counter()
        spans = journal.page_spans(slots)
        spans.sort(key=lambda span: span["end"])
        marks = journal.marks(slots, 2000)
        journal.record(slots)
        on_loop.append(time.perf_counter() - start)
        start = time.perf_counter()
        timeline_svg([s.label for s in slots], spans, marks, now[0] - 1000.0)
        drawing.append(time.perf_counter() - start)
    return {"ms_per_view_on_loop": 1000 * float(np.median(on_loop)),
            "ms_per_view_drawn": 1000 * float(np.median(drawing)),
            "ms_longest_tick": 1000 * longest_tick, "bars": len(spans),
            "rows_exact": sum(s["rows"] for s in spans) == 64 * leases}


@contextmanager
def scraping(dashboard: str, every_s: float | None) -> Iterator[list[float]]:
    """While inside: fetch ``/metrics`` of the scheduler whose dashboard is ``dashboard`` at
    once and then every ``every_s`` (None: never), in a thread; yields the seconds each fetch
    took, filled in as they end. A fetch that fails is raised on the way out."""
    took: list[float] = []
    failed: list[OSError] = []
    stop = threading.Event()
    url = "/".join(dashboard.split("/")[:3]) + "/metrics"

    def scrape() -> None:
        while True:
            start = time.perf_counter()
            try:
                with urllib.request.urlopen(url, timeout=30) as response:
                    response.read()
            except OSError as exc:
                failed.append(exc)
                return
            took.append(time.perf_counter() - start)
            if stop.wait(every_s):
                return

    thread = threading.Thread(target=scrape, name="bench-scrape", daemon=True)
    if every_s is not None:
        thread.start()
    try:
        yield took
    finally:
        stop.set()
        if every_s is not None:
            thread.join()
    if failed:
        raise failed[0]


def rpc_throughput(ops: int, shard_rows: int, batch_rows: int,
                   scrape_every_s: float | None = None) -> tuple[float, list[float]]:
    """Lease + commit operations per second through a LocalCluster's scheduler, and the
    seconds of each scrape of its ``/metrics`` every ``scrape_every_s`` meanwhile (None: no
    scrape)."""
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=False,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        client.register_plugin(ShardingService())
        client.register_plugin(JobService())
        groups = dataset(max(1, ops), shard_rows)
        register_job(client, "bench", groups, shard_rows=shard_rows, batch_rows=batch_rows)
        worker = next(iter(client.sync(client.scheduler.identity, n_workers=-1)["workers"]))
        lease_op, commit_op = client.scheduler.antdt_lease, client.scheduler.antdt_commit
        lease: dict | None = None
        claim = 0
        with scraping(cluster.dashboard_link, scrape_every_s) as scrapes:
            start = time.perf_counter()
            for _ in range(ops):
                if lease is None:
                    reply = client.sync(lease_op, job="bench", worker=worker, wait_s=0)
                    lease, claim = reply["lease"], reply["lease"]["claim_stop"]
                    continue
                reply = client.sync(commit_op, job="bench", commits=[{
                    "lease_id": lease["lease_id"], "token": lease["token"], "offset": claim,
                    "synced_offset": claim}])
                answer = reply["replies"][0]
                if answer["kind"] == "claim":
                    claim = answer["stop"]
                else:
                    lease = None
            rate = ops / (time.perf_counter() - start)
        return rate, scrapes


@click.command("sharding")
@click.option("--workers", type=click.IntRange(min=1), default=10_000, show_default=True)
@click.option("--shards", type=click.IntRange(min=1), default=1_000_000, show_default=True)
@click.option("--ops", type=click.IntRange(min=16), default=1_000_000, show_default=True,
              help="ledger operations (leases + commits) to time")
@click.option("--rpc-ops", type=click.IntRange(min=1), default=3000, show_default=True)
@click.option("--group-asks", type=click.IntRange(min=16), default=100_000, show_default=True,
              help="sync group asks to time")
@click.option("--view-leases", type=click.IntRange(min=1), default=1_000_000, show_default=True,
              help="leases of the job whose page view is timed")
@click.option("--view-workers", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--shard-rows", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--batch-rows", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(workers: int, shards: int, ops: int, rpc_ops: int, group_asks: int,
            view_leases: int, view_workers: int, shard_rows: int, batch_rows: int,
            as_json: bool) -> None:
    """Shard ledger throughput, latency and memory at scale; lease/commit over Dask RPC, alone
    and with a scrape of the scheduler's /metrics every second; sync group asks at scale; the
    event loop's time per job page view after a million leases."""
    groups = dataset(shards, shard_rows)
    traced, num_shards = ledger_memory(groups, shard_rows, batch_rows, workers)
    start = time.perf_counter()
    speed = ledger_throughput(groups, shard_rows, batch_rows, workers, ops)
    ledger_s = time.perf_counter() - start
    rpc_ops_per_s, _ = rpc_throughput(rpc_ops, shard_rows, batch_rows)
    scraped_ops_per_s, scrapes = rpc_throughput(rpc_ops, shard_rows, batch_rows,
                                                scrape_every_s=1.0)
    groups_speed = group_throughput(workers, group_asks)
    view = view_cost(view_leases, view_workers)
    emit({"workers": workers, "shards": num_shards, "ops": int(speed["ops"]),
          "ops_per_s": round(speed["ops_per_s"]),
          "us_per_op_p50": round(speed["us_per_op_p50"], 2),
          "us_per_op_p99": round(speed["us_per_op_p99"], 2),
          "bytes_per_shard": round(traced / num_shards, 1),
          "ledger_seconds": round(ledger_s, 2),
          "rpc_ops": rpc_ops, "rpc_ops_per_s": round(rpc_ops_per_s),
          "rpc_ops_per_s_scraped": round(scraped_ops_per_s),
          "rpc_scraped_ratio": round(scraped_ops_per_s / rpc_ops_per_s, 3),
          "scrapes": len(scrapes), "ms_per_scrape": round(1000 * sum(scrapes) / len(scrapes), 1),
          "group_asks": group_asks, "group_asks_per_s": round(groups_speed["asks_per_s"]),
          "us_per_group_ask_p50": round(groups_speed["us_per_ask_p50"], 2),
          "us_per_group_ask_p99": round(groups_speed["us_per_ask_p99"], 2),
          "view_leases": view_leases, "view_bars": view["bars"],
          "view_rows_exact": view["rows_exact"],
          "ms_per_view_on_loop": round(view["ms_per_view_on_loop"], 2),
          "ms_per_view_drawn": round(view["ms_per_view_drawn"], 1),
          "ms_longest_event_tick": round(view["ms_longest_tick"], 1)}, as_json)
