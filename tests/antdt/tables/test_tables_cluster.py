"""The sharded tables on a real Dask cluster (in-process workers): pushes from trainers on every
worker counted exactly once while hosts leave, join and refuse, with a model that counts (SGD
with rate 1 and gradient -1: a row grows by 1 each time a push touches it)."""

from __future__ import annotations

import asyncio
import tempfile
from collections import Counter
from collections.abc import Sequence

import torch
from distributed import Client, Scheduler, Worker
from distributed.utils_test import gen_cluster

from antdt.tables.client import TableClient
from antdt.tables.service import PLUGIN_NAME, TablesService, TablesSpec
from antdt.tables.serving import PLUGIN_NAME as WORKER_PLUGIN

ROWS = 1000
SPEC = TablesSpec(total_rows=ROWS, dim=2, optimizer="sgd", lr=1.0, eps=1e-8,
                  buckets_per_worker=6, max_inflight=2, bucket_rows=1)


def zeros(start: int, stop: int) -> tuple[torch.Tensor, None]:
    return torch.zeros(stop - start, SPEC.dim), None


def save_part(folder: str, index: int, count: int,
              parts: list[tuple[int, torch.Tensor, torch.Tensor]]) -> tuple[str, dict[str, int]]:
    """A part as ``torch.save`` of its buckets (the application writes models.shards files)."""
    name = f"part-{index}-of-{count}.pt"
    torch.save(parts, f"{folder}/{name}")
    return name, {"buckets": len(parts)}


def load_parts(folder: str, names: Sequence[str]) -> torch.Tensor:
    weights = torch.full((ROWS, SPEC.dim), float("nan"))
    for name in names:
        for start, part, _ in torch.load(f"{folder}/{name}"):
            weights[start:start + part.shape[0]] = part
    return weights


async def open_tables(s: Scheduler, workers: Sequence[Worker], job: str = "j") -> TablesService:
    service: TablesService = s.plugins[PLUGIN_NAME]
    placed = service.start_job(job, [w.address for w in workers], SPEC)
    for w in workers:
        plugin = w.plugins[WORKER_PLUGIN]
        plugin.open(job, zeros, save_part)
        plugin.create(job, SPEC.to_wire(placed.size), placed, w.address)
    return service


class Trainer:
    """Pushes batches of random rows from one worker (in a thread: the client blocks)."""

    def __init__(self, worker: Worker, seed: int, job: str = "j") -> None:
        self.client = TableClient(job, worker, SPEC.max_inflight, timeout_s=30)
        self.rng = torch.Generator().manual_seed(seed)
        self.counts: Counter[int] = Counter()
        self.seq = self.offset = 0

    def batch(self) -> None:
        ids = torch.unique(torch.randint(0, ROWS, (50,), generator=self.rng))
        self.client.room()
        rows = self.client.pull(ids)
        assert rows.shape == (ids.shape[0], SPEC.dim)
        self.seq += 1
        self.offset += 10
        self.client.push(self.seq, self.offset, ids, -torch.ones(ids.shape[0], SPEC.dim))
        self.counts.update(ids.tolist())

    def run(self, batches: int) -> None:
        for _ in range(batches):
            self.batch()
        self.client.drain()


def expected(trainers: Sequence[Trainer]) -> torch.Tensor:
    want = torch.zeros(ROWS)
    for t in trainers:
        for row, n in t.counts.items():
            want[row] += n
    return want


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=120)
async def test_pushes_count_once_while_a_host_leaves_and_backups_take_over(
        c: Client, s: Scheduler, a: Worker, b: Worker, w: Worker) -> None:
    """...and the tables written in parts by their hosts hold the same rows."""
    await c.register_plugin(TablesService())
    service = await open_tables(s, [a, b, w])
    trainers = [Trainer(a, 1), Trainer(b, 2)]
    await asyncio.gather(*(asyncio.to_thread(t.run, 20) for t in trainers))
    before = service.maps["j"]
    assert w.address in before.primary
    await w.close()  # a host that trains nothing leaves: its backups serve its buckets
    await service.settled("j")
    after = service.maps["j"]
    assert w.address not in after.workers() and after.epoch > before.epoch
    assert all(p != q for p, q in zip(after.primary, after.backup))
    assert None not in after.backup  # every bucket has a backup again
    await asyncio.gather(*(asyncio.to_thread(t.run, 20) for t in trainers))
    synced = {t.client.trainer: t.offset for t in trainers}
    weights, _ = await asyncio.to_thread(trainers[0].client.committed, synced)
    assert torch.equal(weights[:, 0], expected(trainers))
    assert service.moves["j"] >= 1
    with tempfile.TemporaryDirectory() as tmp:
        files = await asyncio.to_thread(trainers[1].client.write, tmp, synced)
        assert len(files) == after.buckets  # a part a bucket, each written by its primary
        assert torch.equal(load_parts(tmp, list(files)), weights)


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_a_retried_push_is_applied_once(c: Client, s: Scheduler, a: Worker,
                                              b: Worker) -> None:
    await c.register_plugin(TablesService())
    await open_tables(s, [a, b])
    t = Trainer(a, 3)
    await asyncio.to_thread(t.run, 3)
    ids = torch.arange(0, ROWS, 7)
    for _ in range(3):  # the same batch sent three times (a timed-out push, retried)
        t.client.push(99, 1000, ids, -torch.ones(ids.shape[0], SPEC.dim))
    await asyncio.to_thread(t.client.drain)
    t.counts.update(ids.tolist())
    weights, _ = await asyncio.to_thread(t.client.committed, {t.client.trainer: 1000})
    assert torch.equal(weights[:, 0], expected([t]))


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_a_departed_trainers_unsynced_pushes_are_taken_out_and_refused(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    await c.register_plugin(TablesService())
    service = await open_tables(s, [a, b])
    stays, leaves = Trainer(a, 4), Trainer(b, 5)
    await asyncio.to_thread(stays.run, 5)
    await asyncio.to_thread(leaves.run, 5)  # offsets 10..50
    synced_part = Counter(leaves.counts)
    await asyncio.to_thread(leaves.run, 5)  # offsets 60..100: past what the ledger counts
    departed = leaves.client.trainer
    await service._change("j", lambda m: (type(m)(**{**m.__dict__, "epoch": m.epoch + 1,
                                                       "departed": {departed: 50}}), []))
    await service.settled("j")
    refused = await asyncio.to_thread(_push_refused, leaves)
    assert "left the job" in refused
    weights, _ = await asyncio.to_thread(stays.client.committed,
                                         {stays.client.trainer: stays.offset, departed: 50})
    leaves.counts = synced_part
    assert torch.equal(weights[:, 0], expected([stays, leaves]))


def _push_refused(t: Trainer) -> str:
    try:
        t.run(1)
    except Exception as exc:  # the fenced trainer's push fails
        return str(exc)
    return "accepted"


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 2, timeout=120)
async def test_a_trainer_waits_while_k_pushes_are_unacknowledged(
        c: Client, s: Scheduler, a: Worker, b: Worker) -> None:
    """The host's pushes are held (its handler waits for a gate): the trainer sends K batches,
    then its next step waits in ``room`` until the held pushes are applied."""
    await c.register_plugin(TablesService())
    await open_tables(s, [b])  # every bucket on b, so that every push goes there
    gate = asyncio.Event()
    push = b.handlers["antdt_tables_push"]

    async def held(**kwargs: object) -> object:
        await gate.wait()
        return await push(**kwargs)

    b.handlers["antdt_tables_push"] = held
    t = Trainer(a, 6)
    await asyncio.to_thread(lambda: [t.batch() for _ in range(SPEC.max_inflight)])
    waiting = asyncio.ensure_future(asyncio.to_thread(t.batch))
    done, _ = await asyncio.wait({waiting}, timeout=0.5)
    assert not done and t.client.acked_rows(t.offset) == 0  # K in flight: the next one waits
    gate.set()
    await waiting
    await asyncio.to_thread(t.client.drain)
    assert t.client.waited_s > 0 and t.client.acked_rows(t.offset) == t.offset


@gen_cluster(client=True, nthreads=[("127.0.0.1", 1)] * 3, timeout=120,
             config={"antdt.tables.report-interval": "10ms", "antdt.tables.slow-reports": 2,
                     "antdt.tables.slow-floor": "1ms"})
async def test_a_slow_host_hands_its_primaries_to_their_backups(
        c: Client, s: Scheduler, a: Worker, b: Worker, w: Worker) -> None:
    """w answers every pull 50 ms late (an injected fault): the trainers' reports find it slow
    and the scheduler hands its primaries over to their backups while the trainers push on,
    every push counted once."""
    await c.register_plugin(TablesService())
    service = await open_tables(s, [a, b, w])
    assert service.maps["j"].held(w.address)[0]
    pull = w.handlers["antdt_tables_pull"]

    async def late(**kwargs: object) -> object:
        await asyncio.sleep(0.05)
        return await pull(**kwargs)

    w.handlers["antdt_tables_pull"] = late
    trainers = [Trainer(a, 7), Trainer(b, 8)]

    def until_moved(t: Trainer) -> None:
        for _ in range(400):  # a bound only: the move comes after a few reports
            t.batch()
            if service.moved_off["j"] and not service.maps["j"].held(w.address)[0]:
                break
        t.client.drain()

    await asyncio.gather(*(asyncio.to_thread(until_moved, t) for t in trainers))
    (moved,) = service.moved_off["j"]
    assert moved["host"] == w.address and moved["pull_ms"] > 3 * moved["others_ms"]
    await service.settled("j")
    placed = service.maps["j"]
    assert not placed.held(w.address)[0] and placed.held(w.address)[1]  # now only a backup
    synced = {t.client.trainer: t.offset for t in trainers}
    weights, _ = await asyncio.to_thread(trainers[0].client.committed, synced)
    assert torch.equal(weights[:, 0], expected(trainers))
