"""`antdt bench train`: our training path against a plain TorchRec loop, one torch thread each.

Ours is what ``antdt train --local`` runs: the reader feeding :class:`TrainStep` through a
prefetch thread. The baseline is the textbook loop over batches already in memory, on a model
built the same way (same fused embeddings, same optimizers). Repeats are interleaved.
"""

from __future__ import annotations

import tempfile
import time

import click
import torch
from torchrec.datasets.utils import Batch

from antdt.device import prepare_process
from antdt.prefetch import Prefetcher
from data.files import expand, row_groups
from data.reader import ShardReader
from data.synth import generate
from models.config import ModelConfig, OptimConfig
from models.ranking import build_model
from models.train_step import TrainStep
from pipeline.bench import emit, median_of
from pipeline.training.local import iterate_batches


def plain_torchrec_pass(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        batches: list[Batch]) -> float:
    """Samples/s of the plain loop: forward, BCE loss, backward, dense step."""
    loss_fn = torch.nn.BCEWithLogitsLoss()
    start = time.perf_counter()
    for batch in batches:
        logits = model(batch.dense_features, batch.sparse_features)
        loss = loss_fn(logits, batch.labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return sum(int(b.labels.shape[0]) for b in batches) / (time.perf_counter() - start)


def framework_pass(step: TrainStep, reader: ShardReader, groups: list, batch_size: int) -> float:
    """Samples/s of ``TrainStep`` fed from Parquet by the reader through a prefetch thread."""
    rows = 0
    start = time.perf_counter()
    with Prefetcher(iterate_batches(reader, groups, batch_size)) as batches:
        for batch in batches:
            step.step(batch)
            rows += int(batch.labels.shape[0])
    return rows / (time.perf_counter() - start)


@click.command("train")
@click.option("--rows", type=click.IntRange(min=1), default=196_608, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=4096, show_default=True)
@click.option("--arch", type=click.Choice(["dlrm", "dcn"]), default="dlrm", show_default=True)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def command(rows: int, batch_size: int, arch: str, repeats: int, as_json: bool) -> None:
    """TrainStep fed by the reader versus a plain in-memory TorchRec loop (target ratio >= 0.9)."""
    prepare_process(1)
    model_cfg = ModelConfig(arch=arch)  # type: ignore[arg-type]
    optim_cfg = OptimConfig()
    with tempfile.TemporaryDirectory(prefix="antdt-bench-train-") as tmp:
        schema = generate(tmp, rows=rows, days=1, seed=0, files_per_day=1).schema
        groups = row_groups(expand(tmp))
        reader = ShardReader(schema)
        in_memory = list(iterate_batches(reader, groups, batch_size))
        step = TrainStep(schema, model_cfg, optim_cfg, seed=0)
        model = build_model(schema, model_cfg, optim_cfg, torch.device("cpu"))
        optimizer = torch.optim.Adam(
            [p for p in model.parameters() if p.requires_grad], lr=optim_cfg.dense_lr)
        plain_torchrec_pass(model, optimizer, in_memory[:2])
        ours, baseline = [], []
        for _ in range(repeats):
            baseline.append(plain_torchrec_pass(model, optimizer, in_memory))
            ours.append(framework_pass(step, ShardReader(schema), groups, batch_size))
    framework = median_of(ours)
    plain = median_of(baseline)
    emit({"framework_samples_per_s": round(framework), "torchrec_loop_samples_per_s": round(plain),
          "ratio": round(framework / plain, 3), "arch": arch, "rows": rows,
          "batch_size": batch_size, "repeats": repeats, "torch_threads": 1}, as_json)
