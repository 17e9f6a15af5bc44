"""`antdt bench checkpoint`: what checkpoints cost.

Two parts, each with its baseline in the same run:

* **throughput**: the default job (``jobs/synthetic.yaml``) trained with ``checkpoint_every``
  (default ``30s``) and without checkpoints, on one LocalCluster, repeats interleaved after a
  warm-up run that also measures this machine's samples/s: the epochs are chosen so that one
  job trains for about ``--target-s`` seconds (a 30 s interval needs jobs of a few intervals),
  unless ``--epochs`` fixes them (a run whose size must not depend on the machine's speed).
  Reported: median samples/s each way, their ratio, checkpoints written per job.
* **size and write time**: the job's model and one with tables ``--scale`` times larger,
  built in this process: bytes of ``model.pt``, seconds to copy the state out of the model
  (training waits for this part) and to serialise and write it (fsync'ed; training goes on), and
  the physical limit: writing as many random bytes to the same disk (fsync'ed); the ratio is
  the checkpoint's write throughput over the disk's.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from typing import Any

import click
import torch

from antdt.jobs import JobClient, checkpoints
from data.schema import Schema
from pipeline.bench import emit, median_of
from pipeline.bench.jobs import SET_HELP, default_job, echo, with_train
from pipeline.job.config import JobConfig
from pipeline.training.cluster import job_spec
from pipeline.training.local_cluster import connect
from pipeline.training.following import outcome
from pipeline.training.local import prepare_data
from pipeline.training.recipes import TrainerRecipe

REPEATS_PER_SIZE = 3


def trained(jobs: JobClient, job: JobConfig) -> tuple[float, int]:
    """Train ``job`` on the cluster: its samples/s and the checkpoints its master wrote."""
    record = jobs.follow(jobs.submit(job_spec(job))["job"]["job_id"])
    summary = outcome(record)
    return summary.samples_per_s, int(record["checkpoints"]["written"])


def throughput(job: JobConfig, workers: int, every: str, target_s: float, epochs: int | None,
               repeats: int, folder: str, quiet: bool) -> dict[str, Any]:
    """Samples/s with checkpoints every ``every`` and without, over jobs of ``epochs`` epochs
    (None: as many as train for about ``target_s`` at the warm-up's samples/s)."""
    rows = job_spec(job).plan.rows
    with connect(workers) as client, JobClient(client) as jobs:
        rate, _ = trained(jobs, with_train(job, epochs=1))
        if epochs is None:
            epochs = max(1, round(target_s * rate / rows))
        echo(f"warm-up: {rate:,.0f} samples/s; jobs of {epochs} epoch(s) of {rows:,} rows",
             quiet)
        ways = {"none": with_train(job, epochs=epochs),
                "checkpoints": with_train(job, epochs=epochs, checkpoint_dir=folder,
                                          checkpoint_every=every)}
        runs: dict[str, list[float]] = {way: [] for way in ways}
        written: list[int] = []
        for repeat in range(repeats):
            for way, variant in ways.items():
                samples_per_s, count = trained(jobs, variant)
                runs[way].append(samples_per_s)
                if way == "checkpoints":
                    written.append(count)
                echo(f"repeat {repeat}: {way} {samples_per_s:,.0f} samples/s"
                     + f", {count} checkpoint(s)" * (way == "checkpoints"), quiet)
    none, with_checkpoints = median_of(runs["none"]), median_of(runs["checkpoints"])
    return {"every": every, "epochs": epochs, "rows": rows * epochs, "runs": runs,
            "checkpoints_per_job": written, "samples_per_s_none": none,
            "samples_per_s_checkpoints": with_checkpoints,
            "samples_per_s_ratio": with_checkpoints / none}


def scaled(schema: Schema, factor: int) -> Schema:
    raw = schema.to_dict()
    for feature in raw["sparse"]:
        feature["num_embeddings"] *= factor
    return Schema.from_dict(raw)


def size_and_time(job: JobConfig, schema: Schema, folder: str) -> dict[str, float]:
    """One model's checkpoint: bytes, copy and write seconds (medians), the disk's seconds for
    as many bytes, and the write's share of the disk's throughput."""
    trainer = TrainerRecipe(schema, job.model, job.train.optim, job.train.seed)(
        torch.device("cpu"))
    copies, writes, disk = [], [], []
    size = 0
    for repeat in range(REPEATS_PER_SIZE):
        started = time.perf_counter()
        state = trainer.checkpoint_state()
        copied = time.perf_counter()
        size = checkpoints.save_model(os.path.join(folder, f"model-{repeat}.pt"),
                                      state)["bytes"]
        copies.append(copied - started)
        writes.append(time.perf_counter() - copied)
        noise = os.urandom(size)
        started = time.perf_counter()
        checkpoints.write(os.path.join(folder, f"noise-{repeat}"), noise)
        disk.append(time.perf_counter() - started)
        del state, noise
    write_s, disk_s = median_of(writes), median_of(disk)
    return {"bytes": size, "copy_s": median_of(copies), "write_s": write_s, "disk_s": disk_s,
            "write_vs_disk": disk_s / write_s if write_s > 0 else math.nan}


@click.command("checkpoint")
@click.option("--job", "job_path", default="jobs/synthetic.yaml", show_default=True)
@click.option("--every", default="30s", show_default=True,
              help="checkpoint_every of the checkpointing runs (rows, or a duration).")
@click.option("--target-s", type=click.FloatRange(min=1), default=90.0, show_default=True,
              help="About how long one job trains (its epochs are chosen to fit).")
@click.option("--epochs", type=click.IntRange(min=1), default=None,
              help="Epochs of one job, instead of those that fit --target-s.")
@click.option("--workers", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=2, show_default=True)
@click.option("--scale", type=click.IntRange(min=2), default=10, show_default=True,
              help="How many times larger the tables of the second size are.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help=SET_HELP)
@click.option("--json", "as_json", is_flag=True)
def command(job_path: str, every: str, target_s: float, epochs: int | None, workers: int,
            repeats: int, scale: int, overrides: tuple[str, ...], as_json: bool) -> None:
    """Samples/s with checkpoints against none, in one run; a checkpoint's size and write time
    for the job's model and for tables --scale times larger, against the disk's speed."""
    job = default_job(job_path, overrides)
    schema = prepare_data(job).schema
    with tempfile.TemporaryDirectory(prefix="antdt-bench-checkpoint-", dir=".") as folder:
        sizes = {"default": size_and_time(job, schema, folder),
                 f"tables_x{scale}": size_and_time(job, scaled(schema, scale), folder)}
        for name, figures in sizes.items():
            echo(f"{name}: {figures['bytes'] / 1e6:,.1f} MB, copy {figures['copy_s']:.3f}s, "
                 f"write {figures['write_s']:.2f}s (disk {figures['disk_s']:.2f}s)", as_json)
        result: dict[str, Any] = {
            "benchmark": "checkpoint", "workers": workers, "repeats": repeats,
            **throughput(job, workers, every, target_s, epochs, repeats, folder, as_json),
            "sizes": sizes}
    result["ok"] = result["samples_per_s_ratio"] >= 0.95
    emit(result, as_json)
