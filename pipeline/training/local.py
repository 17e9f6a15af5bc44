"""The single-process reference trainer (`antdt train JOB --local`).

Every distributed mode is compared against this path: same reader, same :class:`TrainStep`,
same evaluation. It reads top to bottom: validate the data, train the epochs, evaluate, log.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
import time
from dataclasses import dataclass, replace
from types import TracebackType
from typing import TYPE_CHECKING, Iterator, Mapping

import numpy as np
from torchrec.datasets.utils import Batch

from antdt.device import FROZEN_HEAP, prepare_process
from antdt.prefetch import Prefetcher
from data.files import RowGroup, expand, row_groups
from data.reader import ShardReader
from data.schema import Schema
from data.validate import validate
from models.evaluate import evaluate
from models.shards import read_full_state
from models.train_step import TrainStep
from pipeline.job.config import JobConfig
from pipeline.job.phases import Phases
from pipeline.job.report import JobSummary, ProgressSink, oracle_auc

if TYPE_CHECKING:
    from pipeline.tracking.tracking import Tracker

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class PreparedData:
    """What the validator let through, and what it set aside."""

    schema: Schema
    train: list[RowGroup]
    validation: list[RowGroup]
    quarantined_rows: int
    quarantine: list[tuple[str, int | None, str]]


def prepare_data(job: JobConfig) -> PreparedData:
    """Expand the job's paths and validate every file before any training starts.

    With ``on_bad_data: fail`` the first report with problems raises a ``DataError`` listing
    each of them; with ``quarantine`` the bad row groups (or whole files) are set aside and
    their rows counted, never dropped silently.
    """
    schema = Schema.from_yaml(job.data.schema)
    train_files = expand(list(job.data.train))
    validation_files = expand(list(job.data.validation))
    report = validate(train_files + validation_files, schema)
    if job.data.on_bad_data == "fail":
        report.raise_if_bad()
    bad = report.bad_units()
    bad_files = {path for path, group, _ in bad if group is None}
    bad_groups = {(path, group) for path, group, _ in bad if group is not None}
    for path, group, reason in bad:
        where = f"{path}" if group is None else f"{path} row group {group}"
        logger.warning("quarantined %s: %s", where, reason)

    def usable(files: list[str]) -> list[RowGroup]:
        readable = [f for f in files if f not in bad_files]
        return [g for g in row_groups(readable) if (g.path, g.index) not in bad_groups]

    train = usable(train_files)
    validation = usable(validation_files)
    return PreparedData(schema=schema, train=train, validation=validation,
                        quarantined_rows=report.bad_rows, quarantine=bad)


def iterate_batches(reader: ShardReader, groups: list[RowGroup], batch_size: int) -> Iterator[Batch]:
    """Every row of ``groups`` in order, in batches of ``batch_size`` (the last of each group
    may be shorter)."""
    for group in groups:
        yield from reader.batches(group.path, group.index, 0, group.num_rows, batch_size)


def epoch_order(groups: list[RowGroup], seed: int, epoch: int) -> list[RowGroup]:
    """The row groups of one epoch in a shuffled order, reproducible from (seed, epoch)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(groups))
    return [groups[i] for i in order]


class OpeningRun:
    """A local job's MLflow run, opened in a thread while its training starts (the data window
    tagged as training starts to read the files; the config, the schema): MLflow's import, its
    store's first connection and what logging the model will need
    (:mod:`pipeline.tracking.warm`), about two seconds of Python, overlap the first batches,
    which run torch's kernels. Their metrics wait until the run is open; an error
    opening it stops the training at the next metrics step. The run ends with the block
    (``FAILED`` if it raises)."""

    def __init__(self, job: JobConfig, schema: Schema, tags: Mapping[str, str],
                 run_name: str | None) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="antdt-run")
        self._opening = self._pool.submit(self._open, job, schema, tags, run_name)
        self._waiting: list[tuple[int, Mapping[str, float]]] = []

    @staticmethod
    def _open(job: JobConfig, schema: Schema, tags: Mapping[str, str],
              run_name: str | None) -> Tracker:
        from pipeline.tracking.registry import data_window
        from pipeline.tracking.tracking import Tracker

        # the run records what ran: this process, not the job file's mode and workers
        tracked = replace(job, train=replace(job.train, mode="local", workers=1))
        tracker = Tracker.start(tracked, mode="local", run_name=run_name,
                                tags={**data_window(job.data).tags(), **tags})
        tracker.artifact_yaml(schema.to_dict(), "schema.yaml")
        importlib.import_module("pipeline.tracking.warm")  # logging the model needs it later
        return tracker

    def metrics(self, values: Mapping[str, float], step: int) -> None:
        """One step's metrics, logged as soon as the run is open."""
        if not self._opening.done():
            self._waiting.append((step, values))
            return
        tracker = self.opened()
        tracker.metrics(values, step=step)

    def opened(self) -> Tracker:
        """The run, once open, with the metrics that waited for it logged."""
        tracker = self._opening.result()
        if self._waiting:
            tracker.steps(self._waiting)
            self._waiting.clear()
        return tracker

    def __enter__(self) -> OpeningRun:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._pool.shutdown()
        if self._opening.exception() is None:
            self._opening.result().__exit__(exc_type, exc, tb)


def start_from_init(job: JobConfig, schema: Schema, step: TrainStep) -> dict[str, str]:
    """Start ``step`` from ``train.init_from`` (MLflow imported only then: a local job opens
    its run while it trains); the tags its run records."""
    if job.train.init_from is None:
        return {}
    from pipeline.tracking.init_from import warm_start
    from pipeline.tracking.tracking import resolved_uri

    init, tags = warm_start(job, schema, resolved_uri(job))
    if init is not None:
        step.warm_start(read_full_state(init.folder, init.files) if init.layout == "parts"
                        else init.read())
    return tags


def train_local(job: JobConfig, progress: ProgressSink | None = None, *,
                tags: Mapping[str, str] | None = None, run_name: str | None = None,
                phases: Phases | None = None) -> JobSummary:
    """Train ``job`` in this process, evaluate it, and track it in MLflow (a run named
    ``run_name``, with ``tags`` besides antdt's own, and its data window's); register the
    model when the job names a registered model (:mod:`pipeline.tracking.registry`). The
    summary's ``phases`` are ``phases`` (the command's, from its start; by default this
    process's) marked at each step."""
    phases = phases if phases is not None else Phases()
    started = time.perf_counter()
    prepare_process(job.train.threads)
    data = prepare_data(job)
    total_rows = sum(g.num_rows for g in data.train) * job.train.epochs
    logger.info("training on %d rows (%d row groups x %d epochs), validating on %d rows",
                total_rows, len(data.train), job.train.epochs,
                sum(g.num_rows for g in data.validation))
    if progress is not None:
        progress.total(total_rows)
    step = TrainStep(data.schema, job.model, job.train.optim, seed=job.train.seed)
    init_tags = start_from_init(job, data.schema, step)
    reader = ShardReader(data.schema)
    with OpeningRun(job, data.schema, {**init_tags, **(tags or {})}, run_name) as run:
        phases.mark("prepare")
        rows, steps, train_s = 0, 0, 0.0
        window_loss, window_start = 0.0, time.perf_counter()
        with FROZEN_HEAP:
            for epoch in range(job.train.epochs):
                groups = epoch_order(data.train, job.train.seed, epoch)
                epoch_start = time.perf_counter()
                with Prefetcher(iterate_batches(reader, groups, job.train.batch_size)) as batches:
                    for batch in batches:
                        window_loss += step.step(batch)
                        n = int(batch.labels.shape[0])
                        rows += n
                        steps += 1
                        if progress is not None:
                            progress.advance(n)
                        if steps % job.train.log_every == 0:
                            now = time.perf_counter()
                            run.metrics({"train.loss": window_loss / job.train.log_every,
                                             "train.samples_per_s":
                                                 job.train.log_every * job.train.batch_size
                                                 / max(now - window_start, 1e-9),
                                             "train.rows_trained": rows}, step=steps)
                            window_loss, window_start = 0.0, now
                train_s += time.perf_counter() - epoch_start
        phases.mark("training")
        tracker = run.opened()
        from pipeline.tracking.registry import logging_model

        with logging_model(tracker, step, data.schema, job,
                           example=(data.validation or data.train)[0]) as registered:
            metrics = evaluate(step.predict, iterate_batches(reader, data.validation,
                                                             job.train.batch_size))
            phases.mark("evaluate")
            summary = JobSummary(
                run_id=tracker.run_id, mode="local", workers=1,
                auc=metrics["auc"], logloss=metrics["logloss"],
                oracle_auc=oracle_auc(job.data.schema, [g.path for g in data.validation]),
                rows_trained=rows, rows_lost=0, rows_retrained=0,
                rows_quarantined=data.quarantined_rows,
                wall_s=time.perf_counter() - started, train_s=train_s,
                samples_per_s=rows / max(train_s, 1e-9),
                tracking_uri=tracker.tracking_uri, experiment_id=tracker.experiment_id,
            )
            tracker.summary(summary.metrics())
            phases.mark("metrics")
            summary = registered(summary)
    phases.mark("model")
    return replace(summary, phases=phases.report(train_s))
