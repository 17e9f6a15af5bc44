"""A training job on a Dask cluster, from the application's side: the spec it hands AntDT's
master (:mod:`antdt.jobs`), and submit-and-follow. ``antdt train`` (a LocalCluster it starts),
``antdt submit`` (a long-lived cluster), the benchmarks and the Airflow DAG all go through here::

    validate the data, here (a bad file is refused before anything starts on the cluster)
      ─► job_spec: the plan (row groups, sizes, epochs, sync period, sharding, faults, the
         memory a replica needs) and the code (the trainer and reader recipes, the tracking
         hooks), with the tracking URI as it resolves here
      ─► JobClient.submit (an existing job id attaches instead) ─► follow: progress from the
         job's record ─► the summary the hooks returned

The job's control runs on the cluster's scheduler, its heavy work in tasks on the workers: a
client that goes away (``--no-wait``, a killed process, Ctrl-C) leaves the job running.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import posixpath
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from distributed.security import Security

from antdt import config
from antdt.errors import CheckpointError, DataError
from antdt.jobs import JobClient, JobCode, JobPlan, JobSpec, checkpoints
from antdt.jobs.checkpoints import Manifest
from antdt.sharding import QuarantineSpec
from antdt.sync.replica import held_bytes
from data.files import RowGroup, expand, row_groups
from data.schema import Schema
from models.config import ModelConfig, OptimConfig
from models.train_step import model_bytes
from pipeline.job.config import JobConfig
from pipeline.job.report import JobSummary, ProgressSink
from pipeline.tracking.init_from import warm_start
from pipeline.tracking.tracking import experiment, resolved_uri
from pipeline.tracking.uris import redact, store_modules
from pipeline.training.following import follow, outcome
from pipeline.training.hooks import RankingHooks
from pipeline.training.local import PreparedData, prepare_data
from pipeline.training.local_cluster import connect, worker_modules
from pipeline.training.recipes import ReaderRecipe, ShardedTrainerRecipe, TrainerRecipe

logger = logging.getLogger(__name__)


# ---- the spec ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LedgerPlan:
    """What the sharding service is told: every training row group (bad ones included, so
    their rows are counted) and the bad units of the training files."""

    row_groups: list[tuple[str, int, int]]
    quarantine: list[QuarantineSpec]


def ledger_plan(job: JobConfig, data: PreparedData) -> LedgerPlan:
    """Row groups and quarantine of ``job``'s training files for the job's ledger.

    The validator's bad units of the training files become the ledger's quarantine: a bad row
    group by itself, a bad file with every row group its footer lists (none when it has no
    readable footer: the ledger then records the file with 0 rows).
    """
    train_files = set(expand(list(job.data.train)))
    quarantine: list[QuarantineSpec] = [(p, g, r) for p, g, r in data.quarantine
                                        if p in train_files]
    bad_files = {p for p, g, _ in quarantine if g is None}
    bad_groups = {(p, g) for p, g, _ in quarantine if g is not None}
    extra: list[RowGroup] = []
    for path in sorted({p for p, _, _ in quarantine}):
        try:
            listed = row_groups([path])
        except DataError:
            continue  # no readable footer: the ledger records the file with 0 rows
        extra.extend(g for g in listed if path in bad_files or (path, g.index) in bad_groups)
    groups = [(g.path, g.index, g.num_rows) for g in [*data.train, *extra]]
    return LedgerPlan(groups, quarantine)


def fingerprint(job: JobConfig, schema: Schema, row_groups: Sequence[tuple[str, int, int]]
                ) -> dict[str, str]:
    """What a job resumed from a checkpoint must keep (keys as in the job file): its training
    row groups, schema, model shape, optimiser kinds, and what the ledger was built with.
    Learning rates, workers and the sync period may change."""
    def short(value: object) -> str:
        return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]

    train = job.train
    files = {path for path, _, _ in row_groups}
    rows = sum(n for _, _, n in row_groups)
    return {
        "data.train": f"{len(files)} files, {rows:,} rows, digest {short(list(row_groups))}",
        "data.schema": f"digest {short(schema.to_dict())}",
        **{f"model.{key}": str(value) for key, value in job.model.to_dict().items()},
        "train.epochs": str(train.epochs), "train.batch_size": str(train.batch_size),
        "train.shard_rows": str(train.shard_rows), "train.seed": str(train.seed),
        "train.sparse_optimizer": train.optim.sparse_optimizer,
        "train.dense_optimizer": train.optim.dense_optimizer,
    }


def replica_bytes(schema: Schema, model: ModelConfig, optim: OptimConfig) -> int:
    """The memory every worker holds in the async mode, computed without building the tables:
    a full training step of the model (:func:`models.train_step.model_bytes`) and what the
    replica's sync keeps beside it (:func:`antdt.sync.replica.held_bytes`: the base copy of the
    tables, above all). The job's master refuses the job when a worker's memory limit is
    smaller (:meth:`antdt.jobs.JobPlan.check_memory`)."""
    size = model_bytes(schema, model, optim)
    rows = sum(f.num_embeddings for f in schema.sparse)
    return size.total + held_bytes(rows, size.tables, size.dense)


def tables_plan(job: JobConfig, schema: Schema) -> dict[str, Any] | None:
    """The plan's ``tables`` (:meth:`antdt.jobs.JobPlan.sharded_tables`): how the async mode
    would shard the tables, placed ``sharded`` or ``auto`` (``model.tables``); None when they
    are replicated."""
    if job.model.tables == "replicated":
        return None
    optim = job.train.optim
    size = model_bytes(schema, job.model, optim)
    return {"placement": job.model.tables, "bytes": size.tables + size.sparse_state,
            "total_rows": sum(f.num_embeddings for f in schema.sparse),
            "dim": job.model.embedding_dim, "optimizer": optim.sparse_optimizer,
            "lr": optim.sparse_lr, "eps": optim.eps,
            "buckets_per_worker": int(config.number("antdt.tables.buckets-per-worker", low=1,
                                                    integer=True)),
            "bucket_rows": int(config.number("antdt.tables.bucket-rows", low=1, integer=True)),
            "max_inflight": int(config.number("antdt.tables.max-inflight", low=1,
                                              integer=True))}


def resume_point(job: JobConfig, spec: JobSpec, ref: str,
                 warn: Callable[[str], None] = logger.warning) -> Manifest:
    """The checkpoint ``--resume ref`` names (a job id under the job's ``train.checkpoint_dir``,
    a job's checkpoint folder or one checkpoint), newer torn or corrupt ones skipped with
    ``warn``; refused when the job had finished or when ``spec`` changes what the checkpoint
    fixed (the message names the key)."""
    manifest = checkpoints.resolve(ref, job.train.checkpoint_dir, warn)
    note = checkpoints.read_note(posixpath.dirname(manifest.path))
    if note is not None and note.get("job_id") == manifest.job_id \
            and note.get("state") == "finished":
        run = (note.get("run") or {}).get("run_id")
        raise CheckpointError(f"--resume {ref}: job {manifest.job_id} finished; its model is in "
                              f"MLflow run {run}")
    checkpoints.check_fingerprint(manifest, spec.plan.fingerprint)
    return manifest


def resumed(spec: JobSpec, manifest: Manifest) -> JobSpec:
    """``spec`` starting from the checkpoint ``manifest``."""
    return dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, resume=manifest.path))


def job_spec(job: JobConfig, data: PreparedData | None = None, *,
             deadline_s: float | None = None, workers: int | None = None,
             run_tags: Mapping[str, str] | None = None, run_name: str | None = None) -> JobSpec:
    """What AntDT's master runs for ``job`` (validated here first unless ``data`` is given).
    ``deadline_s``: stop the job if training takes longer (benchmarks' baselines that never
    finish); ``workers``: train on that many of the cluster's workers, the least busy (default:
    every worker); ``run_tags``, ``run_name``: what its MLflow run starts with (besides what
    ``train.init_from`` records, :mod:`pipeline.tracking.init_from`)."""
    data = data if data is not None else prepare_data(job)
    plan = ledger_plan(job, data)
    train = job.train
    uri = resolved_uri(job)
    init, init_tags = warm_start(job, data.schema, uri)
    hooks = RankingHooks(job, data.schema, data.validation,
                         example=(data.validation or data.train)[0], tracking_uri=uri,
                         experiment_id=experiment(uri, job.mlflow.experiment),
                         quarantine=[(p, g, r) for p, g, r in plan.quarantine],
                         run_tags={**init_tags, **(run_tags or {})}, run_name=run_name)
    faults = {f.worker: {"slowdown": f.slowdown, "hang_after_rows": f.hang_after_rows,
                         "crash_after_rows": f.crash_after_rows,
                         "slow_for_rows": f.slow_for_rows, "pause_until": f.pause_until,
                         "pause_after_rows": f.pause_after_rows} for f in job.faults}
    return JobSpec(
        JobPlan(name=job.name, row_groups=plan.row_groups, batch_rows=train.batch_size,
                shard_rows=train.shard_rows,
                mode="sync" if train.mode == "sync" else "async",
                adaptive_batch=train.adaptive_batch, epochs=train.epochs, seed=train.seed,
                sync_period=str(train.sync_period), sharding=train.sharding,
                threads=train.threads, quarantine=list(plan.quarantine), faults=faults,
                deadline_s=deadline_s, workers=workers,
                min_batches_per_worker=train.min_batches_per_worker,
                preload=["pipeline.training.recipes", *store_modules(uri)],
                tags={"experiment": job.mlflow.experiment, "tracking_uri": redact(uri)},
                checkpoint_dir=train.checkpoint_dir, checkpoint_every=train.checkpoint_every,
                checkpoint_keep=train.checkpoint_keep,
                fingerprint=fingerprint(job, data.schema, plan.row_groups),
                replica_bytes=None if train.mode == "sync" else replica_bytes(
                    data.schema, job.model, train.optim),
                tables=None if train.mode == "sync" else tables_plan(job, data.schema)),
        JobCode.of((ShardedTrainerRecipe if train.mode == "sync" else TrainerRecipe)(
                       data.schema, job.model, train.optim, train.seed, init),
                   ReaderRecipe(data.schema, train.threads), hooks))


# ---- submit and follow -------------------------------------------------------------------------


def run(job: JobConfig, *, workers: int | None = None, scheduler: str | None = None,
        security: Security | None = None, progress: ProgressSink | None = None,
        job_id: str | None = None, deadline_s: float | None = None,
        resume: str | None = None) -> dict[str, Any]:
    """Submit ``job`` to the cluster at ``scheduler`` (or to a new LocalCluster of ``workers``,
    default ``train.workers``) and follow it to its end; its final record. ``resume``: start
    from that checkpoint (:func:`resume_point`), as the job that wrote it."""
    data = prepare_data(job)  # fail on bad data before anything starts on a cluster
    spec = job_spec(job, data, deadline_s=deadline_s)
    if resume is not None:
        manifest = resume_point(job, spec, resume)
        spec, job_id = resumed(spec, manifest), manifest.job_id
    local = None
    if scheduler is None:  # no process started for a worker the job would leave idle
        asked = workers or job.train.workers
        spec = dataclasses.replace(spec, plan=dataclasses.replace(spec.plan, workers=asked))
        local, _ = spec.plan.fitted_workers(asked)
    with connect(local, scheduler, security=security, preload=worker_modules(job)) as client, \
            JobClient(client) as jobs:
        submitted = jobs.submit(spec, job_id=job_id)
        return follow(jobs, submitted["job"]["job_id"], progress)


def train_async(job: JobConfig, *, workers: int | None = None, scheduler: str | None = None,
                security: Security | None = None, progress: ProgressSink | None = None,
                job_id: str | None = None, resume: str | None = None) -> JobSummary:
    """:func:`run`, then the job's summary; :class:`JobFailed` or :class:`JobCancelled` when it
    did not finish."""
    return outcome(run(job, workers=workers, scheduler=scheduler, security=security,
                       progress=progress, job_id=job_id, resume=resume))
