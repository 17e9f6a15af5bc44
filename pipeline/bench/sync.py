"""`antdt bench sync`: what one round of the async mode's model sync costs a worker, per device.

Two replicas (:class:`~antdt.sync.ReplicaSync`) of a model shaped like the synthetic job's
(``--tables`` embedding tables whose categories span 10 to ``--categories`` geometrically, each
table twice its categories' rows, all in one storage as a fused collection keeps them; and
``--dense`` dense parameters) train between rounds the way a worker does: each batch changes the
rows its ids hit (``--batch-size`` ids per table, Zipf-like with ``--exponent``, as the
synthetic data draws its categories) and marks them (:meth:`~antdt.sync.ReplicaSync.touch`).
Every ``--period`` batches both replicas run a round's replica work: the cut (publish the
deltas, snapshot the dense part: the training thread does it between two steps), the serve
(the payload a peer pulls), the wire (the payload as a pull's reply carries it: to host memory
from a GPU, into the message's frames and back out of them, as between two workers) and the
merge (apply the peer's deltas, average the dense part: the training thread waits for it under
the replica lock). At the end, training ended: one more round (its deltas exact, rounding
errors included) and the job's final copy: one replica adopts the other's changed rows, and the
two must then be equal bit for bit.

Rounds repeat for ``--target-s`` seconds per device and delta dtype (rounds, not rows: machines
differ 3x). Reported per device and ``--delta-dtype`` (``antdt.sync.delta-dtype``): the median
milliseconds of each part, the rows and bytes a round's pull carries; each part's ratio on the
GPU over the CPU with ``--device cpu,cuda`` (the CPU always runs first: the baseline of the same
run), and bfloat16's over float32's with both dtypes (the default; float32 first).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import click
import numpy as np
import torch

from distributed.protocol import dumps, loads

from antdt.sync import PeerPayload, ReplicaSync
from antdt.sync.replica import DELTA_DTYPES
from antdt.sync.wire import msg_to_payload, payload_to_msg
from data.zipf import zipf_ranks
from pipeline.bench import emit, median_of

T = TypeVar("T")

PARTS = ("cut", "serve", "wire", "merge")
"""The parts of a round, timed each."""


class Worker:
    """One replica and the model it trains: tables of ``2 * categories[i]`` rows end to end in
    one storage and ``dense`` parameters, changed by :meth:`train_batch` as a step would."""

    def __init__(self, name: str, peer: str, device: torch.device, delta_dtype: torch.dtype,
                 categories: list[int], dim: int, dense: int, exponent: float,
                 seed: int) -> None:
        torch.manual_seed(0)  # every replica starts from the same model
        starts = np.cumsum([0, *(2 * c for c in categories)]).tolist()
        self.storage = (torch.randn(starts[-1], dim) * 0.01).to(device)
        self.dense = [(torch.randn(dense) * 0.01).to(device)]
        self.tables = {f"t{i}": (c, starts[i]) for i, c in enumerate(categories)}
        self.replica = ReplicaSync(
            name, self.dense, {t: self.storage[start:start + 2 * c]
                               for t, (c, start) in self.tables.items()}, peers=[peer],
            delta_dtype=delta_dtype)
        self.exponent = exponent
        self.rng = np.random.default_rng(seed)
        self.trained = 0

    def train_batch(self, batch_size: int) -> None:
        """Change the rows a batch's ids hit (an update each) and the dense part; mark them."""
        device = self.storage.device
        touched = {t: torch.from_numpy(zipf_ranks(self.rng, batch_size, c, self.exponent))
                   .to(device) for t, (c, _) in self.tables.items()}
        update = torch.full((batch_size, self.storage.shape[1]), 1e-3, device=device)
        with self.replica.lock.training():
            for table, ids in touched.items():
                self.storage.index_add_(0, ids + self.tables[table][1], update)
            self.dense[0].add_(1e-4)
        self.trained += batch_size
        self.replica.touch(touched, self.trained)


def timed(device: torch.device, call: Callable[[], T]) -> tuple[T, float]:
    """``call()`` and its seconds, the device's queued work included."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    result = call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - began


def over_wire(payload: PeerPayload) -> tuple[PeerPayload, int]:
    """The payload as a peer receives it (host memory, through a message's frames) and the
    frames' bytes."""
    frames = dumps(payload_to_msg(payload))
    return msg_to_payload(loads(frames)), sum(memoryview(f).nbytes for f in frames)


def measure(device: torch.device, delta_dtype: torch.dtype, *, categories: list[int], dim: int,
            dense: int, exponent: float, batch_size: int, period: int,
            target_s: float) -> dict[str, Any]:
    """Rounds between two replicas on ``device`` for ``target_s`` seconds (see the module)."""
    a = Worker("a", "b", device, delta_dtype, categories, dim, dense, exponent, seed=1)
    b = Worker("b", "a", device, delta_dtype, categories, dim, dense, exponent, seed=2)
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    carried: list[int] = []
    sent: list[int] = []
    began = time.perf_counter()
    rounds = 0
    while rounds < 3 or time.perf_counter() - began < target_s:
        rounds += 1
        for _ in range(period):
            a.train_batch(batch_size)
            b.train_batch(batch_size)
        for worker in (a, b):  # each cuts at its period's end, between two steps
            times["cut"].append(timed(device, worker.replica.cut)[1])
        for me, peer in ((a, b), (b, a)):  # then the round: each pulls the other and merges
            own = me.replica.prepare(rounds)
            payload, serve_s = timed(device, lambda: peer.replica.serve(
                me.replica.worker, rounds, me.replica.log.applied_seq(peer.replica.worker)))
            (payload, nbytes), wire_s = timed(device, lambda: over_wire(payload))
            _, merge_s = timed(device, lambda: me.replica.merge(rounds, own, [payload]))
            for part, seconds in (("serve", serve_s), ("wire", wire_s), ("merge", merge_s)):
                times[part].append(seconds)
            carried.append(sum(len(e.ids) for e in payload.entries))
            sent.append(nbytes)
    for worker in (a, b):  # training ended: an exact round, then the final copy
        worker.replica.drop_cut()
    for me, peer in ((a, b), (b, a)):
        own = me.replica.prepare(rounds + 1)
        me.replica.merge(rounds + 1, own, [over_wire(peer.replica.serve(
            me.replica.worker, rounds + 1, me.replica.log.applied_seq(peer.replica.worker)))[0]])
    changed = a.replica.changed_rows()
    leader_rows, serve_rows_s = timed(device, lambda: b.replica.serve_rows(changed))
    copied, adopt_s = timed(device, lambda: a.replica.adopt_rows(leader_rows))
    identical = bool(torch.equal(a.storage, b.storage)
                     and all(torch.equal(x, y) for x, y in zip(a.dense, b.dense)))
    return {"rounds": rounds, "rows_per_round": round(median_of(carried)),
            "bytes_per_round": round(median_of(sent)),
            "ms": {part: round_ms(median_of(times[part])) for part in PARTS},
            "round_ms": round_ms(sum(median_of(times[part]) for part in PARTS)),
            "final_copy_ms": round_ms(serve_rows_s + adopt_s), "final_rows": copied,
            "identical": identical}


def round_ms(seconds: float) -> float:
    """Seconds as milliseconds, to the microsecond."""
    return round(seconds * 1e3, 3)


@click.command("sync")
@click.option("--device", "devices", default="cpu", show_default=True,
              help="Comma-separated devices: cpu, cuda (the CPU always runs, first).")
@click.option("--target-s", type=click.FloatRange(min=0.1), default=5.0, show_default=True,
              help="Seconds of rounds per device.")
@click.option("--tables", type=click.IntRange(min=1), default=26, show_default=True)
@click.option("--categories", type=click.IntRange(min=10), default=100_000, show_default=True,
              help="The largest table's categories (the synthetic data's default).")
@click.option("--exponent", type=click.FloatRange(min=1.01), default=1.175, show_default=True,
              help="Zipf exponent of the ids (the synthetic data draws 1.05 to 1.3).")
@click.option("--dim", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--dense", type=click.IntRange(min=1), default=57_361, show_default=True,
              help="Dense parameters (the default DLRM's).")
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--period", type=click.IntRange(min=1), default=4, show_default=True,
              help="Batches between rounds (the default period with 2 workers).")
@click.option("--delta-dtype", "dtypes", default="float32,bfloat16", show_default=True,
              help=f"Comma-separated dtypes the deltas travel in: {', '.join(DELTA_DTYPES)}.")
@click.option("--json", "as_json", is_flag=True)
def command(devices: str, target_s: float, tables: int, categories: int, exponent: float,
            dim: int, dense: int, batch_size: int, period: int, dtypes: str,
            as_json: bool) -> None:
    """Milliseconds and bytes of one sync round's replica work (cut, serve, wire, merge) per
    device and delta dtype."""
    wanted = ["cpu", *(d for d in (d.strip() for d in devices.split(",")) if d and d != "cpu")]
    for name in wanted:
        if name == "cuda" and not torch.cuda.is_available():
            raise click.BadParameter("cuda: this machine has no usable GPU", param_hint="--device")
        if name not in ("cpu", "cuda"):
            raise click.BadParameter(f"{name!r}: expected cpu or cuda", param_hint="--device")
    kinds = [d.strip() for d in dtypes.split(",") if d.strip()]
    for kind in kinds:
        if kind not in DELTA_DTYPES:
            raise click.BadParameter(f"{kind!r}: expected one of {', '.join(DELTA_DTYPES)}",
                                     param_hint="--delta-dtype")
    sizes = np.geomspace(10, categories, tables).round().astype(int).tolist()
    results = {name: {kind: measure(torch.device(name), DELTA_DTYPES[kind], categories=sizes,
                                    dim=dim, dense=dense, exponent=exponent,
                                    batch_size=batch_size, period=period, target_s=target_s)
                      for kind in kinds}
               for name in wanted}
    out: dict[str, Any] = {"devices": results, "tables": tables, "categories": categories,
                           "rows": 2 * sum(sizes), "dim": dim, "dense": dense,
                           "exponent": exponent, "batch_size": batch_size, "period": period,
                           "target_s": target_s}
    if "cuda" in results:
        out["cuda_over_cpu"] = {kind: ratios(results["cuda"][kind], results["cpu"][kind])
                                for kind in kinds}
    if {"float32", "bfloat16"} <= set(kinds):
        out["bfloat16_over_float32"] = {
            name: {**ratios(by_kind["bfloat16"], by_kind["float32"]),
                   "bytes": round(by_kind["bfloat16"]["bytes_per_round"]
                                  / max(by_kind["float32"]["bytes_per_round"], 1), 3)}
            for name, by_kind in results.items()}
    emit(out, as_json)


def ratios(new: dict[str, Any], old: dict[str, Any]) -> dict[str, float]:
    """Each part's and the whole round's milliseconds in ``new`` over ``old``."""
    out = {part: round(new["ms"][part] / max(old["ms"][part], 1e-9), 3) for part in PARTS}
    out["round"] = round(new["round_ms"] / max(old["round_ms"], 1e-9), 3)
    return out
